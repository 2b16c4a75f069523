"""Launcher of the Ampere FA2 forward (kernels/sm80/fwd.py): key, compile, launch.

Dense and varlen (packed ``(total, h, d)``) layouts, causal / sliding-window / softcap, GQA/MQA.
Head dims are zero-padded in Python up to a row of ``configs.FWD_SM80_TILES`` (``head_dim_v``
separately, so 192/128 and 64/256 run natively, on the wider row's tile). Nothing here reads device memory: ``cu_seqlens``,
``seqused`` and a tensor ``max_seqlen`` stay on the GPU (the kernel's grid is an upper bound).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import configs
from ..jit import KernelKey
from ..validate import AttnProblem
from .common import (
    DTYPE_NAMES, MAX_GRID_YZ, UNBOUNDED_WINDOW, FwdLauncher, VarlenArgs, compile_forward, cutlass_dtype,
    mask_flags,
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
    sink: bool = False  # a learnable sink logit per query head at finalize (``FwdLauncher.forward_with_sink``)


class FwdSm80(FwdLauncher):
    """FA2-style forward: cp.async + ldmatrix + mma.sync, warps split along the query rows."""

    backend = "sm80"
    kind = "fwd_sm80"
    tiles = configs.FWD_SM80_TILES

    def can_implement(self, p: AttnProblem) -> str | None:
        if configs.kernel_head_dims(self.tiles, p.head_dim, p.head_dim_v) is None:
            return (
                f"head dims ({p.head_dim}, {p.head_dim_v}) are not implemented on the sm80 backend; "
                f"supported: head dims up to {max(self.tiles)}"
            )
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
        dims = configs.kernel_head_dims(self.tiles, p.head_dim, p.head_dim_v)
        assert dims is not None, "can_implement() must accept the problem first"
        causal, local = mask_flags(p)
        return self._key(
            arch, DTYPE_NAMES[p.dtype], *dims, causal=causal, local=local, softcap=p.softcap > 0.0,
            varlen=varlen is not None,
            seqused_q=varlen is not None and varlen.seqused_q is not None,
            seqused_k=varlen is not None and varlen.seqused_k is not None,
        )

    def _key(self, arch: str, dtype: str, hdim: int, hdim_v: int, **flags: bool) -> FwdKey:
        row = max(hdim, hdim_v)  # the wider row's tile: its registers hold O at v's width, its smem both
        tile = self.tiles[row]
        if row in configs.FWD_SM80_FEATURE_TILES and any(flags.get(f, False) for f in ("local", "softcap", "varlen")):
            tile = configs.FWD_SM80_FEATURE_TILES[row]
        return FwdKey(
            kernel=self.kind, arch=arch, dtype=dtype, head_dim=hdim, head_dim_v=hdim_v, tile_m=tile.tile_m,
            tile_n=tile.tile_n, num_threads=tile.num_threads, num_stages=tile.num_stages, **flags,
        )

    def all_keys(self, arch: str) -> list[FwdKey]:
        """The variants users hit, for precompile and the compile-only tests (67 per arch). Rarer
        combinations (local + varlen, fp16 local/softcap, seqused, other v head dims) compile on first use."""
        dims = [(d, d) for d in self.tiles] + [(192, 128), (64, 256)]
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
        from ..kernels.sm80.fwd import FlashFwdSm80

        dtype = cutlass_dtype(key.dtype)
        kernel = FlashFwdSm80(
            dtype, key.head_dim, key.head_dim_v, key.tile_m, key.tile_n, key.num_threads, key.causal,
            is_local=key.local, has_softcap=key.softcap, num_stages=key.num_stages, has_sink=key.sink,
        )
        return compile_forward(kernel, dtype, key.varlen, key.seqused_q, key.seqused_k, options)
