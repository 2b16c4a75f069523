"""Launcher of the Ampere FA2 forward (kernels/fwd_sm80.py): key, compile, launch.

Dense and varlen (packed ``(total, h, d)``) layouts, causal / sliding-window / softcap, GQA/MQA.
Head dims are zero-padded in Python up to a row of ``configs.FWD_SM80_TILES`` (``head_dim_v``
separately, so 192/128 runs natively). Nothing here reads device memory: ``cu_seqlens``,
``seqused`` and a tensor ``max_seqlen`` stay on the GPU (the kernel's grid is an upper bound).
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
class FwdKey(KernelKey):
    dtype: str
    head_dim: int
    head_dim_v: int
    tile_m: int
    tile_n: int
    num_threads: int
    num_stages: int
    causal: bool
    local: bool = False
    softcap: bool = False
    varlen: bool = False  # cu_seqlens_q and cu_seqlens_k given
    seqused_q: bool = False
    seqused_k: bool = False


def _kernel_head_dims(tiles: dict, head_dim: int, head_dim_v: int) -> tuple[int, int] | None:
    """(qk, v) kernel head dims: the table row holding both, and the smallest row holding v."""
    hdim = configs.kernel_head_dim(tiles, head_dim, head_dim_v)
    if hdim is None:
        return None
    return hdim, min(d for d in tiles if d >= head_dim_v)


class FwdSm80:
    """FA2-style forward: cp.async + ldmatrix + mma.sync, warps split along the query rows."""

    backend = "sm80"
    kind = "fwd_sm80"
    tiles = configs.FWD_SM80_TILES

    def can_implement(self, p: AttnProblem) -> str | None:
        if _kernel_head_dims(self.tiles, p.head_dim, p.head_dim_v) is None:
            return (
                f"head dims ({p.head_dim}, {p.head_dim_v}) are not implemented on the sm80 backend; "
                f"supported: head dims up to {max(self.tiles)}"
            )
        if p.head_dim_v > p.head_dim:
            return f"head_dim_v ({p.head_dim_v}) > head_dim ({p.head_dim}) is not implemented on the sm80 backend"
        if p.softcap < 0.0:
            return f"softcap must be >= 0 (0 disables it), got {p.softcap}"
        if p.nheads > MAX_GRID_YZ:
            return f"nheads ({p.nheads}) must be <= {MAX_GRID_YZ} (CUDA grid y limit)"
        if not p.is_varlen and p.batch > MAX_GRID_YZ:
            return f"batch ({p.batch}) must be <= {MAX_GRID_YZ} (CUDA grid z limit); use the varlen API"
        if max(p.seqlen_q, p.seqlen_k) >= UNBOUNDED_WINDOW:
            return f"seqlen_q/seqlen_k ({p.seqlen_q}, {p.seqlen_k}) must be < 2**30 on the sm80 backend"
        return None

    def key(self, p: AttnProblem, arch: str, varlen: VarlenArgs | None = None) -> FwdKey:
        dims = _kernel_head_dims(self.tiles, p.head_dim, p.head_dim_v)
        assert dims is not None, "can_implement() must accept the problem first"
        causal, local = mask_flags(p)
        return self._key(
            arch, DTYPE_NAMES[p.dtype], *dims, causal=causal, local=local, softcap=p.softcap > 0.0,
            varlen=varlen is not None,
            seqused_q=varlen is not None and varlen.seqused_q is not None,
            seqused_k=varlen is not None and varlen.seqused_k is not None,
        )

    def _key(self, arch: str, dtype: str, hdim: int, hdim_v: int, **flags: bool) -> FwdKey:
        tile = self.tiles[hdim]
        if hdim in configs.FWD_SM80_FEATURE_TILES and any(flags.get(f, False) for f in ("local", "softcap", "varlen")):
            tile = configs.FWD_SM80_FEATURE_TILES[hdim]
        return FwdKey(
            kernel=self.kind, arch=arch, dtype=dtype, head_dim=hdim, head_dim_v=hdim_v, tile_m=tile.tile_m,
            tile_n=tile.tile_n, num_threads=tile.num_threads, num_stages=tile.num_stages, **flags,
        )

    def all_keys(self, arch: str) -> list[FwdKey]:
        """The variants users hit, for precompile and the compile-only tests (58 per arch). Rarer
        combinations (local + varlen, fp16 local/softcap, seqused, other v head dims) compile on first use."""
        dims = [(d, d) for d in self.tiles] + ([(192, 128)] if 192 in self.tiles and 128 in self.tiles else [])
        keys = []
        for hdim, hdim_v in dims:
            for dtype in ("bf16", "fp16"):
                for varlen in (False, True):
                    for causal in (False, True):
                        keys.append(self._key(arch, dtype, hdim, hdim_v, causal=causal, varlen=varlen))
            keys.append(self._key(arch, "bf16", hdim, hdim_v, causal=False, local=True))
            if hdim in (128, 256) and hdim == hdim_v:  # softcap models (Gemma 2: 256; Grok: 128)
                for causal in (False, True):
                    keys.append(self._key(arch, "bf16", hdim, hdim_v, causal=causal, softcap=True))
        return keys

    def compile(self, key: FwdKey, options: str | None = None) -> Any:
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_tensor

        from ..kernels.fwd_sm80 import FlashFwdSm80

        dtype = cutlass_dtype(key.dtype)
        kernel = FlashFwdSm80(
            dtype, key.head_dim, key.head_dim_v, key.tile_m, key.tile_n, key.num_threads, key.causal,
            is_local=key.local, has_softcap=key.softcap, num_stages=key.num_stages,
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
        q_k, k_k = (kernel_ready(pad_head_dim(t, key.head_dim)) for t in (q, k))
        v_k = kernel_ready(pad_head_dim(v, key.head_dim_v))
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
