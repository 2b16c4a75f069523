"""The gated Hopper forward's and backward's live-block tables in Triton (``flashattn_hopper/backends/gate_blocks.py``).

Purpose: ``configs.FWD_SM90_GATE_SKIP_DECAYED`` starts each tile of a gated forward at its first key block that
can hold a nonzero P, by a Cauchy-Schwarz bound on q, k and the keys' bias (``gate_blocks.py``'s docstring). Its
torch build took ~30 small ops per call: ~650 us of host time on the H100 machine, which made every gated call
host-bound (perf/NOTES.md session 40). Here it is two launches:

- ``block_norms_kernel``: per (row block, head, batch entry) the largest 2-norm of the block's rows, of q (tiles
  of ``TILE_M`` query rows, every query head) and of k (blocks of ``TILE_N`` keys, every KV head) in one grid.
- ``live_table_kernel``: per (tile, query head, batch entry) the head's largest key norm (over its KV head's
  blocks), the tile's smallest reference-key bias, then the leading key blocks whose bound stays below
  ``-MARGIN`` in log2 units, counted until the first that does not.

The backward's mirror (``BWD_SM90_GATE_SKIP_DECAYED``, causal) is two launches too: ``block_norms_kernel`` with
``WITH_REF`` (each tile's smallest reference-key bias beside its norm), then ``live_rows_kernel``: per (key block,
query head, batch entry) one past the last tile whose bound is not below ``-MARGIN``.

The same bound and comparisons as the torch build (fp32), so the tables agree but for norms that round apart at
a block's boundary (the margin covers either count).

Layouts: q ``(batch, seqlen_q, nheads, head_dim)``, k ``(batch, seqlen_k, nheads_k, head_dim)`` with unit
stride in head_dim; bias ``(batch, nheads, seqlen_k)`` fp32, any strides; norms ``(batch, heads, blocks)``
fp32 and the table ``(batch, nheads, m_blocks)`` int32, contiguous.

Triton, not the CuTe DSL: reductions over rows, no tensor cores, no compile-key plumbing (as
``gate_slice.py``).
"""

import triton
import triton.language as tl


# (q's and k's strides stay specialized: their divisibility by 16 lets the rows' loads take 16-byte vectors; without
# it every element was its own 2-byte load, ~90 us for 16k tokens x 16 heads of 128 on an H100, NOTES session 41)
@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "m_blocks", "n_blocks", "nheads_k", "stride_bb",
                               "stride_bh", "stride_bs"])
def block_norms_kernel(
    q_ptr, k_ptr, q_norm_ptr, k_norm_ptr, seqlen_q, seqlen_k, m_blocks, n_blocks, nheads_k,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, bias_ptr, ref_ptr, stride_bb, stride_bh,
    stride_bs, cu_ptr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, TILE_M: tl.constexpr, TILE_N: tl.constexpr, CHUNK: tl.constexpr,
    WITH_REF: tl.constexpr, TILE_M_PAD: tl.constexpr, VARLEN: tl.constexpr,
):
    """Program (block, head, batch): q's tile ``block`` of head ``head`` where both exist, and k's key block
    ``block`` of KV head ``head`` where both exist (grid: the larger block count by the query heads). ``WITH_REF``
    (causal): also the tile's smallest reference-key bias (each row's own key) into ``ref`` ``(batch, nheads,
    m_blocks)``, +inf where no row has one."""
    blk = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    nheads = tl.num_programs(1)
    start, seqlen_q, seqlen_k = _sequence(cu_ptr, b, seqlen_q, seqlen_k, VARLEN)
    q_ptr += b * stride_qb + start * stride_qs
    k_ptr += b * stride_kb + start * stride_ks
    bias_ptr += b * stride_bb + start * stride_bs
    if blk < m_blocks:
        q_norm = _largest_row_norm(q_ptr + head.to(tl.int64) * stride_qh, blk, seqlen_q, stride_qs,
                                   HEAD_DIM, D_PAD, TILE_M, CHUNK)
        tl.store(q_norm_ptr + (b * nheads + head) * m_blocks + blk, q_norm)
        if WITH_REF:
            rows = blk * TILE_M + tl.arange(0, TILE_M_PAD)
            ref = rows + (seqlen_k - seqlen_q)
            has_ref = (tl.arange(0, TILE_M_PAD) < TILE_M) & (rows < seqlen_q) & (ref >= 0) & (ref < seqlen_k)
            bias_row = bias_ptr + head.to(tl.int64) * stride_bh
            ref_bias = tl.load(bias_row + ref.to(tl.int64) * stride_bs, mask=has_ref, other=float("inf"))
            tl.store(ref_ptr + (b * nheads + head) * m_blocks + blk, tl.min(ref_bias, axis=0))
    if (blk < n_blocks) & (head < nheads_k):
        k_norm = _largest_row_norm(k_ptr + head.to(tl.int64) * stride_kh, blk, seqlen_k, stride_ks,
                                   HEAD_DIM, D_PAD, TILE_N, CHUNK)
        tl.store(k_norm_ptr + (b * nheads_k + head) * n_blocks + blk, k_norm)


@triton.jit
def _sequence(cu_ptr, b, seqlen_q, seqlen_k, VARLEN: tl.constexpr):
    """``(first row, seqlen_q, seqlen_k)`` of batch entry ``b``: packed self-attention's sequence ``b`` (its
    ``cu_seqlens`` for queries and keys alike), else row 0 and the dense lengths."""
    if VARLEN:
        start = tl.load(cu_ptr + b)
        length = tl.load(cu_ptr + b + 1) - start
        return start.to(tl.int64), length, length
    else:
        return tl.zeros((), dtype=tl.int64), seqlen_q, seqlen_k


@triton.jit
def _largest_row_norm(rows_base, blk, seqlen, stride_s, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                      TILE: tl.constexpr, CHUNK: tl.constexpr):
    """The largest fp32 2-norm of the ``TILE`` rows of block ``blk`` (rows past ``seqlen``: none), ``CHUNK`` rows
    at a time; ``rows_base``: row 0 of this (batch, head)."""
    cols = tl.arange(0, D_PAD)
    best = tl.zeros((CHUNK,), dtype=tl.float32)
    for r0 in range(0, TILE, CHUNK):
        rows = blk * TILE + r0 + tl.arange(0, CHUNK)
        inside = (rows < seqlen) & (r0 + tl.arange(0, CHUNK) < TILE)
        x = tl.load(rows_base + rows[:, None].to(tl.int64) * stride_s + cols[None, :],
                    mask=inside[:, None] & (cols < HEAD_DIM)[None, :], other=0.0).to(tl.float32)
        best = tl.maximum(best, tl.sum(x * x, axis=1))
    return tl.sqrt_rn(tl.max(best, axis=0))


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "m_blocks", "n_blocks", "group", "stride_bb",
                               "stride_bh", "stride_bs"])
def live_table_kernel(
    q_norm_ptr, k_norm_ptr, bias_ptr, out_ptr, seqlen_q, seqlen_k, m_blocks, n_blocks, group,
    stride_bb, stride_bh, stride_bs, scale_log2, cu_ptr,
    CAUSAL: tl.constexpr, TILE_M: tl.constexpr, TILE_M_PAD: tl.constexpr, TILE_N: tl.constexpr,
    TILE_N_PAD: tl.constexpr, BLOCK_K: tl.constexpr, MARGIN: tl.constexpr, VARLEN: tl.constexpr,
):
    """Program (tile, query head, batch): the tile's count of leading key blocks with only zeros of P."""
    mb = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    nheads = tl.num_programs(1)
    start, seqlen_q, seqlen_k = _sequence(cu_ptr, b, seqlen_q, seqlen_k, VARLEN)
    seq_n_blocks = (seqlen_k + TILE_N - 1) // TILE_N  # (this sequence's; the table rows hold n_blocks)
    q_max = tl.load(q_norm_ptr + (b * nheads + head) * m_blocks + mb)
    k_max = _largest_key_norm(k_norm_ptr + (b * (nheads // group) + head // group) * n_blocks, seq_n_blocks,
                              BLOCK_K)
    bias_row = bias_ptr + b * stride_bb + start * stride_bs + head.to(tl.int64) * stride_bh
    rows = mb * TILE_M + tl.arange(0, TILE_M_PAD)
    if CAUSAL:
        ref = rows + (seqlen_k - seqlen_q)  # (each row's own key, bottom-right aligned)
    else:
        ref = tl.zeros((TILE_M_PAD,), dtype=tl.int32) + (seqlen_k - 1)
    has_ref = (tl.arange(0, TILE_M_PAD) < TILE_M) & (rows < seqlen_q) & (ref >= 0) & (ref < seqlen_k)
    ref_bias = tl.min(tl.load(bias_row + ref.to(tl.int64) * stride_bs, mask=has_ref, other=float("inf")), axis=0)
    span = 2 * q_max * k_max
    keys = tl.arange(0, TILE_N_PAD)
    in_block = keys < TILE_N
    count = tl.zeros((), dtype=tl.int32)
    stop = tl.zeros((), dtype=tl.int32) + seq_n_blocks
    while count < stop:
        key = count * TILE_N + keys
        block_bias = tl.max(tl.load(bias_row + key.to(tl.int64) * stride_bs, mask=in_block & (key < seqlen_k),
                                    other=float("-inf")), axis=0)
        zero = (span + block_bias - ref_bias) * scale_log2 < -MARGIN  # (NaN compares False: the block stays)
        stop = tl.where(zero, stop, count)
        count = tl.where(zero, count + 1, count)
    tl.store(out_ptr + (b * nheads + head) * m_blocks + mb, count)


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "m_blocks", "n_blocks", "group", "stride_bb", "stride_bh",
                               "stride_bs"])
def live_rows_kernel(
    q_norm_ptr, k_norm_ptr, ref_ptr, bias_ptr, out_ptr, seqlen_q, seqlen_k, m_blocks, n_blocks, group,
    stride_bb, stride_bh, stride_bs, scale_log2, cu_ptr,
    TILE_M: tl.constexpr, TILE_N: tl.constexpr, TILE_N_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr, MARGIN: tl.constexpr, VARLEN: tl.constexpr,
):
    """Program (key block, query head, batch), causal: one past the last query tile whose bound on the block's P
    stays at or above ``-MARGIN`` (0: none), the tiles scanned from the last down ``BLOCK_M`` at a time."""
    nb = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    nheads = tl.num_programs(1)
    start, seqlen_q, seqlen_k = _sequence(cu_ptr, b, seqlen_q, seqlen_k, VARLEN)
    k_top = _largest_key_norm(k_norm_ptr + (b * (nheads // group) + head // group) * n_blocks,
                              (seqlen_k + TILE_N - 1) // TILE_N, BLOCK_K)
    keys = nb * TILE_N + tl.arange(0, TILE_N_PAD)
    bias_row = bias_ptr + b * stride_bb + start * stride_bs + head.to(tl.int64) * stride_bh
    block_bias = tl.max(tl.load(bias_row + keys.to(tl.int64) * stride_bs,
                                mask=(tl.arange(0, TILE_N_PAD) < TILE_N) & (keys < seqlen_k), other=float("-inf")),
                        axis=0)
    tiles_row = (b * nheads + head) * m_blocks
    end = tl.zeros((), dtype=tl.int32)
    top = tl.zeros((), dtype=tl.int32) + (seqlen_q + TILE_M - 1) // TILE_M  # (this sequence's tiles, a chunk a time)
    while (end == 0) & (top > 0):
        m = top - 1 - tl.arange(0, BLOCK_M)
        inside = m >= 0
        q_max = tl.load(q_norm_ptr + tiles_row + m, mask=inside, other=0.0)
        ref_bias = tl.load(ref_ptr + tiles_row + m, mask=inside, other=float("inf"))
        zero = (2 * q_max * k_top + block_bias - ref_bias) * scale_log2 < -MARGIN  # (NaN compares False: live)
        end = tl.max(tl.where(inside & (zero == 0), m + 1, 0), axis=0)
        top -= BLOCK_M
    tl.store(out_ptr + (b * nheads + head) * n_blocks + nb, end)


@triton.jit
def _largest_key_norm(k_row, seq_n_blocks, BLOCK_K: tl.constexpr):
    """The largest of a KV head's first ``seq_n_blocks`` key-block norms (``k_row``: its row of the norms)."""
    k_max = tl.zeros((BLOCK_K,), dtype=tl.float32)
    j0 = tl.zeros((), dtype=tl.int32)
    while j0 < seq_n_blocks:  # (a while, not a range over a runtime bound: Triton 3.6's interpreter refuses that)
        j = j0 + tl.arange(0, BLOCK_K)
        k_max = tl.maximum(k_max, tl.load(k_row + j, mask=j < seq_n_blocks, other=0.0))
        j0 += BLOCK_K
    return tl.max(k_max, axis=0)
