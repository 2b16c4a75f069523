"""Launcher of the Hopper FA3 forward (kernels/fwd_sm90.py): key, compile, launch.

Dense and varlen (packed ``(total, h, d)``) layouts, causal / sliding-window / softcap, GQA/MQA. Head
dims are served by the smallest row of ``configs.FWD_SM90_TILES`` that holds them (inputs are
zero-padded in Python, the output sliced back). Nothing here reads device memory: ``cu_seqlens``,
``seqused`` and a tensor ``max_seqlen`` stay on the GPU (the varlen grid is an upper bound).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import configs
from ..jit import KernelKey, compile_cache, target_arch
from ..validate import AttnProblem
from .common import (
    UNBOUNDED_WINDOW, int_ready, int_to_cute, mask_flags, window_args,
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
    local: bool = False
    softcap: bool = False
    varlen: bool = False  # cu_seqlens_q and cu_seqlens_k given
    seqused_q: bool = False
    seqused_k: bool = False


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
        if p.softcap < 0.0:
            return f"softcap must be >= 0 (0 disables it), got {p.softcap}"
        if p.nheads > MAX_GRID_YZ:
            return f"nheads ({p.nheads}) must be <= {MAX_GRID_YZ} (CUDA grid y limit)"
        if not p.is_varlen and p.batch > MAX_GRID_YZ:
            return f"batch ({p.batch}) must be <= {MAX_GRID_YZ} (CUDA grid z limit); use the varlen API"
        if max(p.seqlen_q, p.seqlen_k) >= UNBOUNDED_WINDOW:
            return f"seqlen_q/seqlen_k ({p.seqlen_q}, {p.seqlen_k}) must be < 2**30 on the sm90 backend"
        return None

    def _key(self, arch: str, dtype: str, hdim: int, **flags: bool) -> FwdSm90Key:
        tile = self.tiles[hdim]
        return FwdSm90Key(
            kernel=self.kind, arch=arch, dtype=dtype, head_dim=hdim, head_dim_v=hdim, tile_m=tile.tile_m,
            tile_n=tile.tile_n, intra_wg_overlap=tile.intra_wg_overlap, pingpong=tile.pingpong, **flags,
        )

    def key(self, p: AttnProblem, arch: str, varlen: VarlenArgs | None = None) -> FwdSm90Key:
        hdim = configs.kernel_head_dim(self.tiles, p.head_dim, p.head_dim_v)
        assert hdim is not None, "can_implement() must accept the problem first"
        causal, local = mask_flags(p)
        return self._key(
            arch, DTYPE_NAMES[p.dtype], hdim, causal=causal, local=local, softcap=p.softcap > 0.0,
            varlen=varlen is not None,
            seqused_q=varlen is not None and varlen.seqused_q is not None,
            seqused_k=varlen is not None and varlen.seqused_k is not None,
        )

    def all_keys(self, arch: str) -> list[FwdSm90Key]:
        """The variants users hit, for precompile and the compile-only tests (sm_90a only: WGMMA/TMA):
        bf16/fp16 x head dims x causal x {dense, varlen (64/128/256 only)}, plus bf16 local and
        softcap at 128 (35 keys). Rarer combinations (local/softcap at other head dims or with varlen,
        seqused, varlen at 96/192) compile on first use."""
        if not arch.startswith("sm_90"):
            return []
        keys = [
            self._key(arch, dtype, hdim, causal=causal, varlen=varlen)
            for hdim in self.tiles for dtype in ("bf16", "fp16") for varlen in (False, True)
            for causal in (False, True) if hdim in (64, 128, 256) or not varlen
        ]
        keys.append(self._key(arch, "bf16", 128, causal=False, local=True))
        keys += [self._key(arch, "bf16", 128, causal=causal, softcap=True) for causal in (False, True)]
        return keys

    def compile(self, key: FwdSm90Key, options: str | None = None) -> Any:
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_tensor

        from ..kernels.fwd_sm90 import FlashFwdSm90

        dtype = cutlass_dtype(key.dtype)
        kernel = FlashFwdSm90(
            dtype, key.head_dim, key.head_dim_v, key.tile_m, key.tile_n, key.causal, is_local=key.local,
            has_softcap=key.softcap, intra_wg_overlap=key.intra_wg_overlap, pingpong=key.pingpong,
        )
        h, h_k, d, d_v = (cute.sym_int() for _ in range(4))
        if key.varlen:
            total_q, total_k, b1, b = (cute.sym_int() for _ in range(4))

            def packed(total: Any, heads: Any, dim: Any) -> Any:
                strides = tuple(cute.sym_int64(divisibility=8) for _ in range(2))
                return make_fake_tensor(dtype, (total, heads, dim), stride=(*strides, 1), assumed_align=16)

            def ints(n: Any) -> Any:
                return make_fake_tensor(cutlass.Int32, (n,), stride=(1,), assumed_align=4)

            tensors = (packed(total_q, h, d), packed(total_k, h_k, d), packed(total_k, h_k, d_v),
                       packed(total_q, h, d_v), fake_f32((h, total_q)))
            varlen_tensors = (ints(b1), ints(b1), ints(b) if key.seqused_q else None, ints(b) if key.seqused_k else None)
        else:
            b, s_q, s_k = (cute.sym_int() for _ in range(3))
            tensors = (fake_bshd(dtype, b, s_q, h, d), fake_bshd(dtype, b, s_k, h_k, d), fake_bshd(dtype, b, s_k, h_k, d_v),
                       fake_bshd(dtype, b, s_q, h, d_v), fake_f32((b, h, s_q)))
            varlen_tensors = (None, None, None, None)
        kwargs = {"options": options} if options else {}
        scalars = (cutlass.Float32(1.0), cutlass.Int32(0), cutlass.Int32(0), cutlass.Float32(1.0))
        return cute.compile(kernel, *tensors, *scalars, *varlen_tensors, cute.runtime.make_fake_stream(), **kwargs)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnProblem, varlen: VarlenArgs | None,
        out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``out``/``lse`` (internal: tests pass NaN-poisoned buffers) must be contiguous, with the
        kernel's padded head dim."""
        if p.batch == 0 or p.seqlen_q == 0 or p.seqlen_k == 0 or p.nheads == 0:
            return empty_result(q, p)
        key = self.key(p, target_arch(), varlen)
        compiled = compile_cache.get(key, self.compile)
        q_k, k_k, v_k = (kernel_ready(pad_head_dim(t, key.head_dim)) for t in (q, k, v))
        if key.varlen:
            out_shape, lse_shape = (p.seqlen_q, p.nheads, key.head_dim_v), (p.nheads, p.seqlen_q)
        else:
            out_shape, lse_shape = (p.batch, p.seqlen_q, p.nheads, key.head_dim_v), (p.batch, p.nheads, p.seqlen_q)
        if out is None:
            out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
        if lse is None:
            lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
        if key.seqused_q:  # the kernel writes only rows < seqused_q of each sequence
            out.zero_()
            lse.fill_(float("-inf"))
        window_left, window_right = window_args(p) if key.local else (0, 0)
        softcap = p.softcap if key.softcap else 1.0
        if varlen is not None:
            ints = (varlen.cu_seqlens_q, varlen.cu_seqlens_k, varlen.seqused_q, varlen.seqused_k)
            int_args = tuple(None if t is None else int_to_cute(int_ready(t)) for t in ints)
        else:
            int_args = (None, None, None, None)
        with torch.cuda.device(q.device):
            compiled(
                *(to_cute(t) for t in (q_k, k_k, v_k, out, lse)), p.softmax_scale, window_left, window_right, softcap,
                *int_args, current_stream(q.device),
            )
        if key.head_dim_v != p.head_dim_v:
            out = out[..., : p.head_dim_v]
        return out, lse
