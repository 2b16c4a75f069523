"""K's extra k16 slice of the gated Hopper forward in Triton (``flashattn_hopper/backends/sm90_fwd.py``
``gate_k_slice``).

Purpose: the gated forward takes the keys' bias ``-G_j / softmax_scale`` through the QK^T GEMM as one more
k16 slice of K (``kernels/sm90/fwd.py`` ``gate_in_gemm``): per (key, query head) ``PARTS`` 16-bit values, each
the rest of the ones before it rounded to nearest (their sum is the fp32 bias to ~24 bits), then zeros to 16
columns. The torch build took six strided ops over the 32-byte rows on every gated call (H100, 2026-11-26,
perf/NOTES.md session 27: 4k-key gated forwards -5.9 % wall with this kernel instead). This is one pass:
each program reads a (keys x heads) tile of the fp32 bias rows and writes the tile's whole slice rows, bit
for bit the torch build (the same round-to-nearest conversions and fp32 subtractions in the same order).

Layouts: bias ``(batch, nheads, seqlen_k)`` fp32 with any strides (varlen: batch 1, ``(nheads, total_k)``
viewed so); out ``(batch, seqlen_k, nheads, SLICE)`` contiguous, fp16 or bf16.

Triton, not the CuTe DSL: an elementwise pass, no tensor cores, no compile-key plumbing (as
``fp8_quantize.py``).
"""

import triton
import triton.language as tl


# (lengths and strides vary per call, varlen's total_k above all: one compiled variant, not one per
# divisibility class)
@triton.jit(do_not_specialize=["seqlen", "nheads", "stride_bb", "stride_bh", "stride_bs"])
def gate_slice_kernel(
    bias_ptr, out_ptr, seqlen, nheads, stride_bb, stride_bh, stride_bs,
    PARTS: tl.constexpr, SLICE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Program (key block, head block, batch): keys ``BLOCK_S`` x heads ``BLOCK_H`` of one batch entry."""
    s0 = tl.program_id(0) * BLOCK_S
    h0 = tl.program_id(1) * BLOCK_H
    b = tl.program_id(2).to(tl.int64)
    keys = s0 + tl.arange(0, BLOCK_S)
    heads = h0 + tl.arange(0, BLOCK_H)
    inside = (keys < seqlen)[:, None] & (heads < nheads)[None, :]
    rest = tl.load(bias_ptr + b * stride_bb + heads[None, :].to(tl.int64) * stride_bh
                   + keys[:, None].to(tl.int64) * stride_bs, mask=inside, other=0.0)
    column = tl.arange(0, SLICE)[None, None, :]
    row = tl.zeros((BLOCK_S, BLOCK_H, SLICE), dtype=tl.float32)
    for i in tl.static_range(PARTS):
        part = rest.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne").to(tl.float32)  # (exact in fp32)
        row = tl.where(column == i, part[:, :, None], row)
        rest = rest - part
    offsets = ((b * seqlen + keys[:, None, None].to(tl.int64)) * nheads + heads[None, :, None]) * SLICE + column
    tl.store(out_ptr + offsets, row.to(out_ptr.dtype.element_ty), mask=inside[:, :, None])
