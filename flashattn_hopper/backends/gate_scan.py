"""The dense gated forward's inputs by one CuTe DSL kernel (``kernels/common/gate_scan.py``): ``G = cumsum(g)`` in
the LSE's layout, the keys' bias rows ``-G / softmax_scale`` and, where the forward key takes it, K's extra k16
slice, in one launch through TVM-FFI (a few us of host time) instead of torch's transposing scan, a division
and a Triton launch. ``gate.GatedAttnFunc`` runs it for dense calls (``gate.scanned_gate``), its backward
then taking g's gradient as the reverse cumsum of dG by a second kernel (``kernels/common/gate_scan_grad.py``,
``scan_gradient``) from the in-kernel backward's dS sums. Both have a varlen mode for packed self-attention, the sums
restarting per sequence (``scan_varlen``, ``scan_gradient_varlen``; ``gate.SCAN_KERNEL_VARLEN``)."""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import Any

import torch

from .. import configs
from ..jit import KernelKey
from .common import DTYPE_NAMES, compile_cache, cutlass_dtype, fake_bshd, fake_f32, ffi_compile


# The kernel's CTA: 8 warps of 4 keys (a lane per head), so 32-key chunks: 512 CTAs at 16k tokens (4 keys per warp
# against 8: -17 % at 16k tokens x 32 heads, the same at 16 heads; perf/NOTES.md session 37).
SCAN_WARPS = 8
SCAN_KEYS_PER_WARP = 4
SCAN_CHUNK = SCAN_WARPS * SCAN_KEYS_PER_WARP


@dataclass(frozen=True)
class GateScanKey(KernelKey):
    slice_dtype: str = ""  # "" (G and bias rows only) or the forward's 16-bit dtype (K's k16 slice too)
    varlen: bool = False  # packed sequences (batch 1, the sums restarting at each cu_seqlens start)
    pdl: bool = False  # the passes chained by programmatic dependent launch (configs.fwd_gate_pdl)


@dataclass(frozen=True)
class GateScanGradKey(KernelKey):
    grad_dtype: str = "fp32"  # g's dtype: dg's
    varlen: bool = False  # packed sequences (batch 1, the sums restarting at each sequence's end)


def scan_keys(arch: str) -> list[KernelKey]:
    """The forward kernel's two variants (the slice only in bf16: fp16 is the same code) and the gradient's fp32 one
    (the 16-bit outputs differ in the final conversion only), and each kernel's varlen mode, for precompile and the
    CPU tier."""
    pdl = configs.fwd_gate_pdl(arch)
    return [GateScanKey(kernel="gate_scan", arch=arch, slice_dtype="", pdl=pdl),
            GateScanKey(kernel="gate_scan", arch=arch, slice_dtype="bf16", pdl=pdl),
            GateScanGradKey(kernel="gate_scan_grad", arch=arch, grad_dtype="fp32"),
            GateScanKey(kernel="gate_scan", arch=arch, slice_dtype="", varlen=True, pdl=pdl),
            GateScanGradKey(kernel="gate_scan_grad", arch=arch, grad_dtype="fp32", varlen=True)]


def compile_scan_grad(key: GateScanGradKey, options: str | None = None) -> Any:
    """The TVM-FFI function of ``key``: ``fn(key_sums, query_sums, chunk_sums, dg, seqlen_k - seqlen_q)``."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    from ..kernels.common.gate_scan_grad import GateScanGrad

    def rows(dtype: Any, align: int) -> Any:  # rank 3, last stride 1
        return make_fake_tensor(dtype, (cute.sym_int(), cute.sym_int(), cute.sym_int()),
                                stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=align)

    dg_dtype = cutlass.Float32 if key.grad_dtype == "fp32" else cutlass_dtype(key.grad_dtype)
    kernel = GateScanGrad(warps=SCAN_WARPS, keys_per_warp=SCAN_KEYS_PER_WARP)
    segments = _fake_segments() if key.varlen else (None, None)
    return ffi_compile(kernel, rows(cutlass.Float32, 4), rows(cutlass.Float32, 4), rows(cutlass.Float64, 8),
                       rows(dg_dtype, 2), cutlass.Int32(0), *segments, options=options)


def scan_gradient(key_sums: torch.Tensor, query_sums: torch.Tensor, dtype: torch.dtype, arch: str,
                  segments: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """g's gradient ``(batch, seqlen_k, nheads)`` in ``dtype`` from the backward kernel's dS sums per key
    (``key_sums``, d(-G), ``(batch, nheads, seqlen_k)`` fp32 rows) and per query (``query_sums``, ``(batch, nheads,
    seqlen_q)``): the reverse cumsum of ``query_sums[t - (seqlen_k - seqlen_q)] - key_sums[t]`` along the keys
    (``gate._scan_gradient``'s, in one call of ``kernels/common/gate_scan_grad.py``). ``segments``: ``(cu_seqlens,
    chunk_seq)`` of packed sequences (batch 1; ``scan_gradient_varlen``)."""
    batch, nheads, seqlen_k = key_sums.shape
    dg = torch.empty(batch, seqlen_k, nheads, dtype=dtype, device=key_sums.device)
    if dg.numel() > 0:
        chunk_sums = torch.empty(batch, -(-seqlen_k // SCAN_CHUNK), nheads, dtype=torch.float64, device=dg.device)
        _compiled_grad(arch, dtype, segments is not None)(key_sums, query_sums, chunk_sums, dg,
                                                          seqlen_k - query_sums.shape[-1], *(segments or (None, None)))
    return dg


def compile_scan(key: GateScanKey, options: str | None = None) -> Any:
    """The TVM-FFI function of ``key``: ``fn(g, chunk_sums, G_rows, bias_rows, k_slice | None, 1 / -softmax_scale)``."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    from ..kernels.common.gate_scan import GateScan
    from ..kernels.sm90.fwd_budget import GATE_COLS, GATE_PARTS

    slice_dtype = cutlass_dtype(key.slice_dtype) if key.slice_dtype else None
    b, s, h = (cute.sym_int() for _ in range(3))
    g = make_fake_tensor(cutlass.Float32, (b, s, h), stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)

    def rows() -> Any:  # (batch, nheads, seqlen), rows a TMA reads (``aligned_rows``)
        return fake_f32((cute.sym_int(), cute.sym_int(), cute.sym_int()), stride_divisibility=4)

    sums = make_fake_tensor(cutlass.Float64, (cute.sym_int(), cute.sym_int(), cute.sym_int()),
                            stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=8)
    k_slice = fake_bshd(slice_dtype, cute.sym_int(), cute.sym_int(), cute.sym_int(), GATE_COLS) if slice_dtype else None
    kernel = GateScan(slice_dtype, slice_cols=GATE_COLS, parts=GATE_PARTS, warps=SCAN_WARPS,
                      keys_per_warp=SCAN_KEYS_PER_WARP, pdl=key.pdl)
    segments = _fake_segments() if key.varlen else (None, None)
    return ffi_compile(kernel, g, sums, rows(), rows(), k_slice, cutlass.Float32(-1.0), *segments, options=options)


def _fake_segments() -> tuple[Any, Any]:
    """Varlen scans' ``(cu_seqlens, chunk_seq)``: two int32 vectors (``scan_varlen``)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    return tuple(make_fake_tensor(cutlass.Int32, (cute.sym_int(),), stride=(1,), assumed_align=4) for _ in range(2))


def scan(log_decay: torch.Tensor, scale: float, slice_dtype: torch.dtype | None, arch: str,
         segments: tuple[torch.Tensor, torch.Tensor] | None = None
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(G_rows, bias_rows, k_slice)`` of dense ``log_decay`` ``(batch, seqlen_k, nheads)`` (CUDA, any float
    dtype: read as fp32): ``G`` and ``-G / scale`` as ``(batch, nheads, seqlen_k)`` fp32 rows, and K's k16
    slice ``(batch, seqlen_k, nheads, GATE_COLS)`` in ``slice_dtype`` (None: not built); ``arch``: the forward key's.
    ``segments``: ``(cu_seqlens, chunk_seq)`` of packed sequences (batch 1; ``scan_varlen``)."""
    g = log_decay.float()
    if g.stride(-1) != 1:
        g = g.contiguous()
    batch, seqlen, nheads = g.shape
    # G and the bias in one buffer of rows padded to 16 bytes (the forward's TMA reads the bias rows); unbind and
    # narrow rather than indexing (this runs on every dense gated call: a host-bound one at 1k, NOTES session 38)
    padded = -(-seqlen // 4) * 4
    rows = torch.empty(2, batch, nheads, padded, dtype=torch.float32, device=g.device)
    if padded != seqlen:
        rows = rows.narrow(3, 0, seqlen)
    G_rows, bias_rows = rows.unbind(0)
    k_slice = None
    if slice_dtype is not None:
        from ..kernels.sm90.fwd_budget import GATE_COLS

        k_slice = torch.empty(batch, seqlen, nheads, GATE_COLS, dtype=slice_dtype, device=g.device)
    if seqlen > 0 and batch > 0 and nheads > 0:
        chunk_sums = torch.empty(batch, -(-seqlen // SCAN_CHUNK), nheads, dtype=torch.float64, device=g.device)
        _compiled(arch, slice_dtype, segments is not None, configs.fwd_gate_pdl(arch))(
            g, chunk_sums, G_rows, bias_rows, k_slice, _neg_inv_scale(float(scale)), *(segments or (None, None)))
    return G_rows, bias_rows, k_slice


def chunk_sequences(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """The varlen scans' ``chunk_seq``: 1 + the sequence holding each chunk's first key (one searchsorted: the
    kernels walk on from there, a binary search per CTA would be ~17 dependent loads)."""
    starts = torch.arange(0, total, SCAN_CHUNK, dtype=torch.int32, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens, starts, right=True, out_int32=True)


def scan_varlen(log_decay: torch.Tensor, cu_seqlens: torch.Tensor, scale: float, slice_dtype: torch.dtype | None,
                arch: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``scan`` of packed ``log_decay`` ``(total_k, nheads)`` with the cumsum restarting at each ``cu_seqlens`` start
    (int32, CUDA): ``(G_rows, bias_rows, k_slice, chunk_seq)``, the rows ``(nheads, total_k)`` fp32 (16-byte aligned),
    K's slice ``(total_k, nheads, GATE_COLS)`` or None, and ``chunk_sequences`` (for ``scan_gradient_varlen``)."""
    total, nheads = log_decay.shape
    chunk_seq = chunk_sequences(cu_seqlens, total)
    G_rows, bias_rows, k_slice = scan(log_decay[None], scale, slice_dtype, arch, (cu_seqlens, chunk_seq))
    return G_rows[0], bias_rows[0], None if k_slice is None else k_slice[0], chunk_seq


def scan_gradient_varlen(key_sums: torch.Tensor, query_sums: torch.Tensor, cu_seqlens: torch.Tensor,
                         chunk_seq: torch.Tensor, dtype: torch.dtype, arch: str) -> torch.Tensor:
    """``scan_gradient`` of packed self-attention (``(nheads, total)`` sum rows, one ``cu_seqlens`` for queries and
    keys): g's gradient ``(total, nheads)``, the reverse cumsum restarting at each sequence's end."""
    return scan_gradient(key_sums[None], query_sums[None], dtype, arch, (cu_seqlens, chunk_seq))[0]


@functools.lru_cache(maxsize=64)
def _neg_inv_scale(scale: float) -> float:
    """``1 / -scale`` rounded to fp32, as torch's CUDA division by a Python scalar multiplies by it (exactly the fp32
    quotient: fp64's 53 bits rule out double rounding)."""
    return struct.unpack("f", struct.pack("f", 1.0 / struct.unpack("f", struct.pack("f", -scale))[0]))[0]


@functools.lru_cache(maxsize=16)
def _compiled_grad(arch: str, dtype: torch.dtype, varlen: bool = False) -> Any:
    """The compiled gradient scan of a dtype, looked up once per process."""
    key = GateScanGradKey(kernel="gate_scan_grad", arch=arch,
                          grad_dtype="fp32" if dtype == torch.float32 else DTYPE_NAMES[dtype], varlen=varlen)
    return compile_cache.get(key, compile_scan_grad)


@functools.lru_cache(maxsize=16)
def _compiled(arch: str, slice_dtype: torch.dtype | None, varlen: bool = False, pdl: bool = False) -> Any:
    """The compiled scan of a variant, looked up once per process (the compile cache's memory keeps it too)."""
    key = GateScanKey(kernel="gate_scan", arch=arch, slice_dtype=DTYPE_NAMES[slice_dtype] if slice_dtype else "",
                      varlen=varlen, pdl=pdl)
    return compile_cache.get(key, compile_scan)
