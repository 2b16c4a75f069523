"""The gate's scans in Triton: ``G = cumsum(g)`` along each dense sequence, and dg's reverse cumsum
(``flashattn_hopper/gate.py`` ``cumulative``).

Purpose: the gated call's ``G`` from the log forget gates ``g`` ``(batch, seqlen, nheads)`` (heads
innermost, as the API takes them), written as ``(batch, nheads, seqlen)`` fp32 rows (the layout the kernels'
bias rows and the LSE use: ``G`` is its transposed view). ``torch.cumsum`` over that transposed view took
~29 us of GPU time at 16k tokens x 32 heads on an H100, whatever the batch (a transposing copy and a scan),
about 14 % of a 1k-key gated forward. Two passes, each fully parallel over (chunk of keys, head block,
batch): ``chunk_sums_kernel`` sums each chunk of ``CHUNK`` keys per head; ``scan_kernel`` adds to a chunk's own
cumsum (``tl.cumsum`` along the keys) the sum of the chunks before it (``REVERSE``: after it, for dg).

Precision: fp32 throughout, as the torch scan: within a chunk ``tl.cumsum``'s tree, across chunks a sum
of at most ``ceil(seqlen / CHUNK)`` chunk sums.

Triton, not the CuTe DSL: two bandwidth passes, no tensor cores (as ``fp8_quantize.py``).
"""

import triton
import triton.language as tl


@triton.jit
def chunk_sums_kernel(x_ptr, sums_ptr, seqlen, nheads, num_chunks, stride_xb, stride_xs, stride_xh,
                      CHUNK: tl.constexpr, BLOCK_H: tl.constexpr):
    """``sums[b, h, c]`` = the sum of x's keys ``c CHUNK ..`` of head h (fp32)."""
    c = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    b = tl.program_id(2).to(tl.int64)
    keys = c * CHUNK + tl.arange(0, CHUNK)
    inside = (keys < seqlen)[:, None] & (heads < nheads)[None, :]
    x = tl.load(x_ptr + b * stride_xb + keys[:, None].to(tl.int64) * stride_xs + heads[None, :] * stride_xh,
                mask=inside, other=0.0).to(tl.float32)
    tl.store(sums_ptr + (b * nheads + heads) * num_chunks + c, tl.sum(x, axis=0), mask=heads < nheads)


@triton.jit
def scan_kernel(x_ptr, sums_ptr, y_ptr, seqlen, nheads, num_chunks, stride_xb, stride_xs, stride_xh,
                CHUNK: tl.constexpr, BLOCK_H: tl.constexpr, CHUNKS_POW2: tl.constexpr, REVERSE: tl.constexpr):
    """``y[b, h, s]`` = the sum of x's keys ``<= s`` (``REVERSE``: ``>= s``) of head h: this chunk's own
    scan plus the chunk sums before (after) it."""
    c = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    b = tl.program_id(2).to(tl.int64)
    chunks = tl.arange(0, CHUNKS_POW2)
    if REVERSE:
        earlier = (chunks > c) & (chunks < num_chunks)
    else:
        earlier = chunks < c
    sums = tl.load(sums_ptr + (b * nheads + heads[None, :]) * num_chunks + chunks[:, None],
                   mask=earlier[:, None] & (heads < nheads)[None, :], other=0.0)
    carry = tl.sum(sums, axis=0)
    keys = c * CHUNK + tl.arange(0, CHUNK)
    inside = (keys < seqlen)[:, None] & (heads < nheads)[None, :]
    x = tl.load(x_ptr + b * stride_xb + keys[:, None].to(tl.int64) * stride_xs + heads[None, :] * stride_xh,
                mask=inside, other=0.0).to(tl.float32)
    y = tl.cumsum(x, axis=0, reverse=REVERSE) + carry[None, :]
    tl.store(y_ptr + (b * nheads + heads[None, :]) * seqlen + keys[:, None], y, mask=inside)
