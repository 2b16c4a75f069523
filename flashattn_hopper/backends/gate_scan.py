"""The gate's dense ``G = cumsum(g)`` by the Triton scan (``kernels/triton/gate_scan.py``), differentiable.

``gate.cumulative`` takes it for eager dense CUDA calls where Triton imports (``applies``); its backward
(dg = the reverse cumsum of dG) is the same scan reversed. Elsewhere (torch.compile, CPU, varlen, very
long sequences) ``torch.cumsum`` stays.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

_CHUNK_MIN = 256  # keys per chunk (grows with seqlen so a program sums at most _MAX_CHUNKS chunk sums)
_MAX_CHUNKS = 64
_MAX_SEQLEN = _MAX_CHUNKS * 1024  # longer sequences: torch.cumsum (a chunk's tile would not fit registers)
_BLOCK_H = 16


@functools.lru_cache(maxsize=1)
def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def applies(log_decay: torch.Tensor) -> bool:
    """Whether the Triton scan serves this dense ``(batch, seqlen, nheads)`` ``log_decay``."""
    batch, seqlen, nheads = log_decay.shape
    return (
        log_decay.is_cuda and not torch.compiler.is_compiling() and _has_triton()
        and 0 < seqlen <= _MAX_SEQLEN and 0 < batch <= 65535 and 0 < nheads
    )


def _scan(x: torch.Tensor, reverse: bool) -> torch.Tensor:
    """``(batch, nheads, seqlen)`` fp32: the (reverse) cumsum of ``x`` ``(batch, seqlen, nheads)`` along seqlen."""
    from ..kernels.triton.gate_scan import chunk_sums_kernel, scan_kernel

    batch, seqlen, nheads = x.shape
    chunk = max(_CHUNK_MIN, 1 << max(-(-seqlen // _MAX_CHUNKS) - 1, 0).bit_length())
    num_chunks = -(-seqlen // chunk)
    sums = torch.empty(batch, nheads, num_chunks, dtype=torch.float32, device=x.device)
    y = torch.empty(batch, nheads, seqlen, dtype=torch.float32, device=x.device)
    grid = (num_chunks, -(-nheads // _BLOCK_H), batch)
    strides = (x.stride(0), x.stride(1), x.stride(2))
    chunk_sums_kernel[grid](x, sums, seqlen, nheads, num_chunks, *strides, CHUNK=chunk, BLOCK_H=_BLOCK_H)
    scan_kernel[grid](x, sums, y, seqlen, nheads, num_chunks, *strides, CHUNK=chunk, BLOCK_H=_BLOCK_H,
                      CHUNKS_POW2=1 << max(num_chunks - 1, 0).bit_length(), REVERSE=reverse)
    return y


class GateCumsum(torch.autograd.Function):
    """``G = cumsum(g)`` fp32 along the sequence axis of dense ``g`` ``(batch, seqlen, nheads)``, returned as
    the ``(batch, seqlen, nheads)`` view of ``(batch, nheads, seqlen)`` rows (``torch.cumsum`` over the
    transposed view gave the same layout); backward: dg = the reverse cumsum of dG, in g's dtype."""

    @staticmethod
    def forward(ctx: Any, log_decay: torch.Tensor) -> torch.Tensor:
        ctx.dtype = log_decay.dtype
        return _scan(log_decay, reverse=False).transpose(1, 2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _scan(grad, reverse=True).transpose(1, 2).to(ctx.dtype)
