"""Launcher of the Hopper FA3 forward (kernels/fwd_sm90.py): key, compile, launch.

Head dims are served by the smallest row of ``configs.FWD_SM90_TILES`` that holds them (inputs are
zero-padded in Python, the output sliced back). Varlen, sliding windows and softcap are refused with
a reason, so automatic dispatch on Hopper falls back to the sm80 kernels for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import configs
from ..jit import KernelKey, compile_cache, target_arch
from ..validate import AttnProblem
from .common import (
    DTYPE_NAMES, MAX_GRID_YZ, VarlenArgs, current_stream, cutlass_dtype, empty_result, fake_bshd, fake_f32,
    kernel_ready, pad_head_dim, to_cute,
)


@dataclass(frozen=True)
class FwdSm90Key(KernelKey):
    dtype: str
    head_dim: int
    head_dim_v: int
    tile_m: int
    tile_n: int
    causal: bool
    intra_wg_overlap: bool
    pingpong: bool


class FwdSm90:
    """FA3 forward: TMA + WGMMA, producer warp + MMA warpgroups, intra-WG overlap, ping-pong."""

    backend = "sm90"
    kind = "fwd_sm90"
    tiles = configs.FWD_SM90_TILES

    def can_implement(self, p: AttnProblem) -> str | None:
        if configs.kernel_head_dim(self.tiles, p.head_dim, p.head_dim_v) is None:
            return (
                f"head dims ({p.head_dim}, {p.head_dim_v}) are not implemented on the sm90 backend; "
                f"supported: head dims up to {max(self.tiles)}"
            )
        if p.is_varlen:
            return "varlen (cu_seqlens_q/cu_seqlens_k) is not implemented yet on the sm90 backend"
        if p.is_local and not (p.causal and p.window_left < 0):
            return "window_size (sliding-window attention) is not implemented yet on the sm90 backend"
        if p.softcap != 0.0:
            return "softcap is not implemented yet on the sm90 backend"
        if p.nheads > MAX_GRID_YZ or p.batch > MAX_GRID_YZ:
            return f"nheads ({p.nheads}) and batch ({p.batch}) must each be <= {MAX_GRID_YZ} (CUDA grid y/z limit)"
        return None

    def _key(self, arch: str, dtype: str, hdim: int, causal: bool) -> FwdSm90Key:
        tile = self.tiles[hdim]
        return FwdSm90Key(
            kernel=self.kind, arch=arch, dtype=dtype, head_dim=hdim, head_dim_v=hdim, tile_m=tile.tile_m,
            tile_n=tile.tile_n, causal=causal, intra_wg_overlap=tile.intra_wg_overlap, pingpong=tile.pingpong,
        )

    def key(self, p: AttnProblem, arch: str) -> FwdSm90Key:
        hdim = configs.kernel_head_dim(self.tiles, p.head_dim, p.head_dim_v)
        assert hdim is not None, "can_implement() must accept the problem first"
        return self._key(arch, DTYPE_NAMES[p.dtype], hdim, p.causal)

    def all_keys(self, arch: str) -> list[FwdSm90Key]:
        """Every variant, for precompile and the compile-only tests (sm_90a only: WGMMA/TMA)."""
        if not arch.startswith("sm_90"):
            return []
        return [
            self._key(arch, dtype, hdim, causal)
            for hdim in self.tiles for dtype in ("bf16", "fp16") for causal in (False, True)
        ]

    def compile(self, key: FwdSm90Key, options: str | None = None) -> Any:
        import cutlass
        import cutlass.cute as cute

        from ..kernels.fwd_sm90 import FlashFwdSm90

        dtype = cutlass_dtype(key.dtype)
        kernel = FlashFwdSm90(
            dtype, key.head_dim, key.head_dim_v, key.tile_m, key.tile_n, key.causal,
            intra_wg_overlap=key.intra_wg_overlap, pingpong=key.pingpong,
        )
        b, s_q, s_k, h, h_k, d, d_v = (cute.sym_int() for _ in range(7))
        fakes = (
            fake_bshd(dtype, b, s_q, h, d), fake_bshd(dtype, b, s_k, h_k, d), fake_bshd(dtype, b, s_k, h_k, d_v),
            fake_bshd(dtype, b, s_q, h, d_v), fake_f32((b, h, s_q)),
        )
        kwargs = {"options": options} if options else {}
        return cute.compile(kernel, *fakes, cutlass.Float32(1.0), cute.runtime.make_fake_stream(), **kwargs)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnProblem, varlen: VarlenArgs | None,
        out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``out``/``lse`` (internal: tests pass NaN-poisoned buffers) must be contiguous, with the
        kernel's padded head dim."""
        if p.batch == 0 or p.seqlen_q == 0 or p.seqlen_k == 0 or p.nheads == 0:
            return empty_result(q, p)
        key = self.key(p, target_arch())
        compiled = compile_cache.get(key, self.compile)
        q_k, k_k, v_k = (kernel_ready(pad_head_dim(t, key.head_dim)) for t in (q, k, v))
        if out is None:
            out = torch.empty(p.batch, p.seqlen_q, p.nheads, key.head_dim_v, dtype=q.dtype, device=q.device)
        if lse is None:
            lse = torch.empty(p.batch, p.nheads, p.seqlen_q, dtype=torch.float32, device=q.device)
        with torch.cuda.device(q.device):
            compiled(*(to_cute(t) for t in (q_k, k_k, v_k, out, lse)), p.softmax_scale, current_stream(q.device))
        if key.head_dim_v != p.head_dim_v:
            out = out[..., : p.head_dim_v]
        return out, lse
