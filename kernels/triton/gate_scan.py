"""``G = cumsum(g)`` of the gated forward for short dense sequences, in one Triton launch
(``flashattn_hopper/gate.py`` ``cumulative``).

Purpose: the gated call's ``G`` from the log forget gates ``g`` ``(batch, seqlen, nheads)`` (heads
innermost, as the API takes them), written as ``(batch, nheads, seqlen)`` fp32 rows (``G`` is their
transposed view: the layout the kernels' bias rows and the LSE use). ``torch.cumsum`` over the
transposed view costs a transposing copy and a scan, ~29 us of GPU time at 16k tokens x 32 heads on an
H100, about 14 % of a 1k-key gated forward (perf/NOTES.md sessions 26-27). One program per (head block,
batch entry) walks its sequence in ``BLOCK_S``-key chunks: ``tl.cumsum`` within a chunk plus the running
sum of the chunks before it. The walk is sequential, so ``gate.py`` takes this path only for short
sequences (a long one with few heads and batch entries would leave most SMs idle); session 27's fully
parallel two-pass scan cost two launches, more host time than it saved on host-bound calls.

Precision: fp32 throughout, as the torch scan (within a chunk ``tl.cumsum``'s tree, across chunks one
running sum per head).

Triton, not the CuTe DSL: a bandwidth pass, no tensor cores (as ``gate_slice.py``).
"""

import triton
import triton.language as tl


# (lengths and strides vary per call: one compiled variant, not one per divisibility class)
@triton.jit(do_not_specialize=["seqlen", "nheads", "stride_b", "stride_s", "stride_h"])
def gate_cumsum_kernel(g_ptr, out_ptr, seqlen, nheads, stride_b, stride_s, stride_h,
                       BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (head block, batch entry): ``out[b, h, s]`` = the sum of ``g[b, :s + 1, h]`` (fp32)."""
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    b = tl.program_id(1).to(tl.int64)
    carry = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for s0 in range(0, seqlen, BLOCK_S):
        keys = s0 + tl.arange(0, BLOCK_S)
        inside = (keys < seqlen)[:, None] & (heads < nheads)[None, :]
        x = tl.load(g_ptr + b * stride_b + keys[:, None].to(tl.int64) * stride_s + heads[None, :] * stride_h,
                    mask=inside, other=0.0).to(tl.float32)
        y = tl.cumsum(x, axis=0) + carry[None, :]
        tl.store(out_ptr + (b * nheads + heads[None, :]) * seqlen + keys[:, None], y, mask=inside)
        carry += tl.sum(x, axis=0)
