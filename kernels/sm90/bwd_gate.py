"""The gate's pieces of the Hopper backward (``FlashBwdSm90(has_gate=True)``, ``flashattn_hopper/gate.py``).

Gated log-decay adds ``G_i - G_j`` to every score. ``G_i`` is folded into the LSE the kernel is given,
so the kernel sees a bias per (query head, key), ``-G_j / scale`` in the scores' units (the forward's
``mGate``): ``P^T = exp2((S^T + bias_j) * scale_log2 - LSE)``. The gate's gradient needs two sums of
dS^T (the gradient of the scaled score), taken from its 16-bit values (the dK / dQ GEMMs' operand; from
the fp32 tile, live beside P^T and the in-flight dV, ptxas serialized every WGMMA), summed in fp32:
per key (``sum_i dS_ij``, d(-G_j)) and per query (``sum_j dS_ij``, dG_i). In the transposed score tile a thread holds two key rows and ``tile_m / 4``
query columns (the WGMMA C layout: row ``16 * warp + lane / 4 (+ 8)``, column ``8 * g + 2 * (lane % 4)
+ e``):

- key sums: each thread adds its columns into two registers over all m_blocks; the quad's four lanes
  finish the row at the end (``store_key_sums``), one plain store per key (a CTA owns its keys).
- query sums: each thread adds its two rows per column; then, in chunks of 4 columns, lane bits 4 and
  8 split the chunk (each lane keeps one column) and bit 16 adds the rest: every warp's 16 key rows
  summed, one column per chunk on half its lanes (``stage_sums``, 4 shuffles per chunk); each warp
  writes its row of the block's smem slot beside sdQ (two slots by block parity), and the dQ writer
  warp adds the 8 rows in a fixed order and reduce-adds them into the fp32 per-query sum
  (``add_query_sums``), under the same DQ_FULL / DQ_EMPTY handshake (and deterministic turns) as dQ.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..common.bwd_utils import elem_pointer
from ..common.utils import acc_rows_cols, transpose_view

NUM_MMA_WARPS = 8  # two MMA warpgroups: one smem row of query sums per warp
_CHUNK = 4  # query columns reduced together


@cute.jit
def load_key_bias(mGate_cur: cute.Tensor, tScS_mn: cute.Tensor, n_block: Int32, tile_n: cutlass.Constexpr[int],
                  seqlen_k: Int32) -> cute.Tensor:
    """The bias of this thread's key rows (registers, one per row); rows past ``seqlen_k`` read the
    last key's (their scores are masked to -inf first)."""
    num_rows = cute.size(tScS_mn.shape[0])
    key_bias = cute.make_rmem_tensor((num_rows,), Float32)
    for r in cutlass.range_constexpr(num_rows):
        key = n_block * tile_n + tScS_mn[r, 0][0]
        key_bias[r] = mGate_cur[cutlass.max(cutlass.min(key, seqlen_k - 1), 0)]
    return key_bias


@cute.jit
def stage_sums(acc_dS: cute.Tensor, key_sums: cute.Tensor | None, sQuerySums: cute.Tensor | None, slot: Int32,
               mma_warp: Int32, tile_m: cutlass.Constexpr[int]):
    """From this block's dS^T (16-bit, summed in fp32): adds each key row's sum into ``key_sums`` (None:
    gate_key_mma's WGMMA takes them), and writes this warp's query sums (its 16 key rows) into its row of smem
    slot ``slot`` (``(NUM_MMA_WARPS * tile_m, 2)`` fp32; None: gate_query_mma's WGMMA takes them)."""
    acc_mn = acc_rows_cols(acc_dS)
    num_rows = cute.size(acc_mn.shape[0])
    num_cols = cute.size(acc_mn.shape[1])
    if const_expr(key_sums is not None):
        for r in cutlass.range_constexpr(num_rows):
            row = acc_mn[r, 0].to(Float32)
            for c in cutlass.range_constexpr(1, num_cols):
                row = row + acc_mn[r, c].to(Float32)
            key_sums[r] = key_sums[r] + row
    if const_expr(sQuerySums is not None):
        stage_query_columns(acc_mn, sQuerySums, slot, mma_warp, tile_m)


@cute.jit
def stage_query_columns(acc_mn: cute.Tensor, sQuerySums: cute.Tensor, slot: Int32, mma_warp: Int32,
                        tile_m: cutlass.Constexpr[int]):
    """``stage_sums``' query half: this warp's query sums (its 16 key rows of dS^T, ``acc_mn`` as (rows,
    columns)) into its row of smem slot ``slot``."""
    num_rows = cute.size(acc_mn.shape[0])
    num_cols = cute.size(acc_mn.shape[1])
    lane = cute.arch.lane_idx()
    # Columns in chunks of 4 (8 partial sums live at once serialized every WGMMA at hdim 128: ptxas
    # C7512): lane bits 4 and 8 split the chunk (each lane keeps one column), bit 16 adds the rest.
    for chunk in cutlass.range_constexpr(num_cols // _CHUNK):
        values = []
        for i in cutlass.range_constexpr(_CHUNK):
            c = chunk * _CHUNK + i
            col = acc_mn[0, c].to(Float32)
            for r in cutlass.range_constexpr(1, num_rows):
                col = col + acc_mn[r, c].to(Float32)
            values.append(col)
        for offset in (4, 8):
            # Lanes with this bit set keep the upper half of the list and send the lower half.
            upper = (lane & offset) != 0
            half = len(values) // 2
            kept = []
            for i in cutlass.range_constexpr(half):
                send = Float32(cutlass.select_(upper, values[i], values[i + half]))
                keep = Float32(cutlass.select_(upper, values[i + half], values[i]))
                kept.append(keep + cute.arch.shuffle_sync_bfly(send, offset=offset))
            values = kept
        total = values[0] + cute.arch.shuffle_sync_bfly(values[0], offset=16)
        if (lane & 16) == 0:
            sQuerySums[mma_warp * tile_m + query_column(lane, chunk), slot] = total


@cute.jit
def query_column(lane: Int32, chunk: cutlass.Constexpr[int]) -> Int32:
    """The query column a lane keeps of chunk ``chunk``: list index ``4 chunk + 2 b4 + b8`` (a thread's
    columns are listed as ``e + 2 g``; ``b*``: the lane's bits), column ``8 g + 2 (lane % 4) + e``."""
    group = 2 * chunk + ((lane >> 2) & 1)
    return 8 * group + 2 * (lane & 3) + ((lane >> 3) & 1)


@cute.jit
def add_query_sums(sQuerySums: cute.Tensor, slot: Int32, mdGq_cur: cute.Tensor, m_block: Int32,
                   tile_m: cutlass.Constexpr[int], seqlen_q: Int32):
    """dQ writer warp: the slot's 8 warp rows summed in a fixed order, ``tile_m / 32`` columns per lane,
    reduce-added into this sequence's per-query sums (rows below ``seqlen_q``)."""
    lane = cute.arch.lane_idx()
    per_lane = tile_m // 32
    for j in cutlass.range_constexpr(per_lane):
        col = lane * per_lane + j
        total = sQuerySums[col, slot]
        for w in cutlass.range_constexpr(1, NUM_MMA_WARPS):
            total = total + sQuerySums[w * tile_m + col, slot]
        row = m_block * tile_m + col
        if row < seqlen_q:
            cute.arch.red(elem_pointer(mdGq_cur, row), total, op="add", dtype=Float32, sem="relaxed", scope="gpu")


@cute.jit
def ones_operand(tiled_mma_ks: cute.TiledMma, sOnes: cute.Tensor, wg_thread: Int32, tidx: Int32) -> cute.Tensor:
    """gate_key_mma: fills the (8, tile_m) smem tile with ones (the MMA threads, each a few elements: any
    swizzle holds the same ones) and returns its B fragment for the per-key sums' WGMMA (the caller's first
    DS_READY barrier, after a fence here, makes the ones visible to it)."""
    flat = cute.make_tensor(sOnes.iterator, cute.make_layout(cute.cosize(sOnes.layout)))
    for i in cutlass.range_constexpr(cute.size(flat) // (2 * 128)):
        flat[i * 2 * 128 + tidx] = sOnes.element_type(1.0)
    cute.arch.fence_view_async_shared()
    wg_ks = tiled_mma_ks.get_slice(wg_thread)
    return wg_ks.make_fragment_B(wg_ks.partition_B(sOnes))


@cute.jit
def query_sums_operands(tiled_mma_qs: cute.TiledMma, sdSt: cute.Tensor, sOnesN: cute.Tensor, sQuerySums: cute.Tensor,
                        tidx: Int32, tile_m: cutlass.Constexpr[int]):
    """gate_query_mma: fills the (8, tile_n) tile of ones, zeroes the rows of warps 1-7 in both ``sQuerySums``
    slots (each block's whole sums go to warp 0's row, ``stage_query_sums``: the dQ writer's 8-row sum is then
    that sum, exactly), and returns ``(A fragments of dS per sdSt stage, B fragment of the ones, the thread's (query,
    column) coordinates of the 64 x 8 or 128 x 8 product)``. The MMA threads' first DS_READY barrier (after the
    fence here) and DQ_FULL handshake make these stores visible to the WGMMA and to the writer."""
    flat = cute.make_tensor(sOnesN.iterator, cute.make_layout(cute.cosize(sOnesN.layout)))
    for i in cutlass.range_constexpr(cute.size(flat) // (2 * 128)):
        flat[i * 2 * 128 + tidx] = sOnesN.element_type(1.0)
    rows = (NUM_MMA_WARPS - 1) * tile_m  # (warps 1-7's rows of a slot)
    for i in cutlass.range_constexpr((2 * rows + 2 * 128 - 1) // (2 * 128)):
        index = i * 2 * 128 + tidx
        if index < 2 * rows:
            sQuerySums[tile_m + index % rows, index // rows] = Float32(0.0)
    cute.arch.fence_view_async_shared()
    thread = tidx if const_expr(tile_m == 128) else tidx % 128  # (tile_m 64: one warpgroup's product)
    wg_qs = tiled_mma_qs.get_slice(thread - thread % 128)
    tQSrdS = wg_qs.make_fragment_A(wg_qs.partition_A(transpose_view(sdSt)))
    tQSrOnes = wg_qs.make_fragment_B(wg_qs.partition_B(sOnesN))
    tQScQ = acc_rows_cols(tiled_mma_qs.get_slice(thread).partition_C(cute.make_identity_tensor((tile_m, 8))))
    return tQSrdS, tQSrOnes, tQScQ


@cute.jit
def stage_query_sums(acc_qs: cute.Tensor, tQScQ: cute.Tensor, sQuerySums: cute.Tensor, slot: Int32):
    """gate_query_mma: each query row's whole sum of this block's dS (the product's column 0, on lane 0 of the
    quad) into warp 0's row of slot ``slot``."""
    acc_mn = acc_rows_cols(acc_qs)
    if (cute.arch.lane_idx() & 3) == 0:
        for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
            sQuerySums[tQScQ[r, 0][0], slot] = acc_mn[r, 0]


@cute.jit
def key_sums_of(acc_ks: cute.Tensor) -> cute.Tensor:
    """gate_key_mma: each of this thread's key rows' sum (its first column of the ones product; the quad's other
    lanes hold the same sums: 0 there, so that ``store_key_sums``' quad adds are exact)."""
    acc_mn = acc_rows_cols(acc_ks)
    lane = cute.arch.lane_idx()
    sums = cute.make_rmem_tensor((cute.size(acc_mn.shape[0]),), Float32)
    for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
        sums[r] = Float32(0.0)
        if (lane & 3) == 0:
            sums[r] = acc_mn[r, 0]
    return sums


@cute.jit
def store_key_sums(key_sums: cute.Tensor, tScS_mn: cute.Tensor, mdGk_cur: cute.Tensor, n_block: Int32,
                   tile_n: cutlass.Constexpr[int], seqlen_k: Int32, reduced: cutlass.Constexpr[bool] = False):
    """Each key row's sum over all query blocks (the quad's four lanes added; ``reduced``: lane 0 of the quad
    holds it already) -> its key's slot (rows below ``seqlen_k``; a key block no query sees stores zeros)."""
    lane = cute.arch.lane_idx()
    for r in cutlass.range_constexpr(cute.size(key_sums)):
        total = key_sums[r]
        if const_expr(not reduced):
            total = total + cute.arch.shuffle_sync_bfly(total, offset=1)
            total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
        key = n_block * tile_n + tScS_mn[r, 0][0]
        if (lane & 3) == 0 and key < seqlen_k:
            mdGk_cur[key] = total
