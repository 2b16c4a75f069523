"""``G = cumsum(g)`` of dense gated calls, and its gradient's reverse cumsum, in one Triton launch each
(``flashattn_hopper/gate.py`` ``_DenseCumsum``).

Purpose: a dense gated call's ``G`` from the log forget gates ``g`` ``(batch, seqlen, nheads)`` (heads innermost,
as the API takes them) written as ``(batch, nheads, seqlen)`` fp32 rows (the layout of the kernels' bias rows and
of the LSE; ``G`` is their transposed view), and in the backward ``dg`` = the reverse cumsum of ``dG`` along the
sequence. ``torch.cumsum`` over the transposed view costs a transposing copy and a scan (~24 us of GPU at 16k
tokens x 32 heads on an H100, perf/NOTES.md session 28), the reverse one a flip, a scan and a flip.

Each program takes one chunk of ``BLOCK_S`` keys of ``BLOCK_H`` heads of one batch entry: its carry is the sum
of every chunk before it (after it, ``REVERSE``), read again by this program, then ``tl.cumsum`` within the
chunk. No program waits for another (session 28's one-program-per-sequence walk was sequential, so it served
only short sequences; session 27's two-pass scan cost two launches); the re-reads are ``chunks / 2`` times the
input on average, which ``gate.py`` bounds by widening ``BLOCK_S`` for long sequences (they hit L2: the input
is 4 bytes per key and head).

Precision: fp32; the carry sums whole chunks (tree order) where torch's scan runs along the sequence: the two
differ by fp32 rounding of the running sums (``tests/test_gate.py``), zeros stay exactly zero.

Triton, not the CuTe DSL: a bandwidth pass, no tensor cores (as ``gate_slice.py``).
"""

import triton
import triton.language as tl


# (lengths and strides vary per call: one compiled variant, not one per divisibility class)
@triton.jit(do_not_specialize=["seqlen", "nheads", "in_sb", "in_ss", "in_sh", "out_sb", "out_ss", "out_sh"])
def gate_scan_kernel(
    g_ptr, out_ptr, seqlen, nheads, in_sb, in_ss, in_sh, out_sb, out_ss, out_sh,
    REVERSE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Program (key chunk, head block, batch entry): ``out[b, s, h]`` = the fp32 sum of ``g[b, :s + 1, h]``
    (``REVERSE``: of ``g[b, s:, h]``); both tensors addressed by their (batch, seq, head) strides."""
    chunk = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    b = tl.program_id(2).to(tl.int64)
    rows = tl.arange(0, BLOCK_S)
    head_ok = (heads < nheads)[None, :]
    g_base = g_ptr + b * in_sb + heads[None, :].to(tl.int64) * in_sh
    carry = tl.zeros((BLOCK_H,), dtype=tl.float32)
    if REVERSE:
        first, last = chunk + 1, tl.cdiv(seqlen, BLOCK_S)
    else:
        first, last = 0, chunk
    for other in range(first, last):
        keys = other * BLOCK_S + rows
        x = tl.load(g_base + keys[:, None].to(tl.int64) * in_ss, mask=(keys < seqlen)[:, None] & head_ok,
                    other=0.0).to(tl.float32)
        carry += tl.sum(x, axis=0)
    keys = chunk * BLOCK_S + rows
    inside = (keys < seqlen)[:, None] & head_ok
    x = tl.load(g_base + keys[:, None].to(tl.int64) * in_ss, mask=inside, other=0.0).to(tl.float32)
    y = tl.cumsum(x, axis=0, reverse=REVERSE) + carry[None, :]
    tl.store(out_ptr + b * out_sb + heads[None, :].to(tl.int64) * out_sh + keys[:, None].to(tl.int64) * out_ss,
             y.to(out_ptr.dtype.element_ty), mask=inside)
