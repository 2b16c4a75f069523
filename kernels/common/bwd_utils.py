"""Pieces the three backward kernels share: scratch-buffer padding, row-major fp32 accumulator
tiles, 16-byte tiled copies, fp32 reduce-adds and the semaphores of the deterministic mode.

Purpose: the preprocess, main and postprocess kernels of the backward (design doc 2.1-2.9) talk
through fp32 scratch buffers; they must agree on one padding rule and one layout:
- ``LSE_log2`` and ``dPsum``: ``(batch, nheads, seqlen_q_padded)``;
- ``dQaccum``: ``(batch, nheads, seqlen_q_padded * head_dim)``; per head, m_block ``i`` owns
  ``[i * tile_m * head_dim, (i + 1) * tile_m * head_dim)`` in the MMA-fragment order of the
  main kernel's dQ tiled MMA (``fragment_accum``), ``vec`` values per thread side by side (4 on
  sm_90: ``red.add.v4.f32``; 1 on sm_80): the per-m_block ``red.add`` of a warp then covers
  ``128 * vec`` contiguous bytes instead of 8 rows x 32 bytes in row-major order; the
  postprocess rebuilds the same tiled MMA and ``vec`` to undo the order. The sm90 kernels use
  the same order for their WGMMA dQ (``tiled_mma_dq_sm90``, vec 4): the MMA threads store it to
  smem with conflict-free 128-bit stores and one ``bulk_reduce_add_f32`` adds the whole tile;
- GQA ``dKaccum``/``dVaccum``: ``(batch, nheads_k, seqlen_k_padded * head_dim)``, row-major
  ``(seqlen_k_padded, head_dim)`` per head (added once per CTA, so order matters little);
with ``*_padded = round_up(seqlen, SEQ_PAD)`` (design doc pitfall 22). Varlen: the batch mode
has extent 1 and sequence ``b`` starts at the padded row ``scratch_offset(cu_seqlens[b], b)``
(a multiple of ``SEQ_PAD``; sequences never overlap, each keeps ``round_up(seqlen, SEQ_PAD)``
rows), the buffers hold ``round_up(total + batch * SEQ_PAD, SEQ_PAD)`` rows; the deterministic
semaphores use the same offsets divided by the tile.

Deterministic mode (design doc 2.9): an int32 semaphore per (batch, head, block) holds whose turn
it is; a CTA waits (thread 0 spins with ``ld.acquire.gpu``, then a CTA barrier) until the value
equals its turn, adds its contribution, and passes the turn on (every thread ``fence.acq_rel.gpu``,
a CTA barrier, then thread 0's ``red.add``). A fixed order of fp32 additions gives bitwise-equal results.
Waiting is deadlock-free as long as every CTA waits only for CTAs with a lower linear block index
(those were dispatched first): the callers order turns that way.

Constraints: 16-bit inputs, fp32 scratch; ``head_dim`` a multiple of 16.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm, vector
from cutlass.cutlass_dsl import dsl_user_op

# Every scratch buffer pads its sequence length to a multiple of this; tiles must divide it.
SEQ_PAD = 128


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def scratch_offset(offset: Int32, batch_idx: Int32) -> Int32:
    """First scratch row of a varlen sequence whose packed rows start at ``offset``."""
    return (offset + batch_idx * SEQ_PAD) // SEQ_PAD * SEQ_PAD


def copy_threads_per_row(cols: int, elems: int, num_threads: int) -> int:
    """Threads sharing a row in ``tiled_copy_16b``: all of the row's ``elems``-wide chunks when
    their number is a power of two (a warp covers whole rows), else the largest power of two
    <= 8 dividing it (rows of 96 or 192 16-bit elements: each thread takes several chunks)."""
    chunks = cols // elems
    if chunks & (chunks - 1) == 0 and chunks <= num_threads:
        return chunks
    return next(t for t in (8, 4, 2, 1) if chunks % t == 0)


def scratch_tile_reason(dtype, head_dim: int, tile_m: int, num_threads: int, elems: int, chunk: str,
                        pad: int = SEQ_PAD) -> str | None:
    """``can_implement`` of the pre/postprocess kernels: None, or why ``num_threads`` threads copying
    ``elems``-wide chunks cannot walk a ``tile_m x head_dim`` tile of the padded scratch buffers (rows
    padded to multiples of ``pad``: ``SEQ_PAD``, or 640 for the dense-only tile_m 80)."""
    if dtype not in (cutlass.BFloat16, cutlass.Float16):
        return f"dtype must be BFloat16 or Float16, got {dtype}"
    if head_dim % 16 != 0 or not 16 <= head_dim <= 256:
        return f"head_dim must be a multiple of 16 in [16, 256], got {head_dim}"
    if pad % tile_m != 0:
        return f"tile_m ({tile_m}) must divide the scratch padding {pad}"
    threads_per_row = copy_threads_per_row(head_dim, elems, num_threads)
    if num_threads % threads_per_row or tile_m % (num_threads // threads_per_row):
        return f"{num_threads} threads do not tile {tile_m} x {head_dim} in {chunk} chunks"
    return None


@cute.jit
def m_block_min_max(
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    n_block: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    is_causal: cutlass.Constexpr[bool],
    is_local: cutlass.Constexpr[bool],
    window_left: Int32,
    window_right: Int32,
):
    """``(m_block_min, m_block_max)``: the query blocks that see some key of ``n_block``.

    Transpose of ``BlockInfo.n_block_min_max`` (same bottom-right rule, same tile-extreme
    conservatism, so ``m`` is in this range iff ``n_block`` is in m's range): the first row to
    see the block's first key is ``n_block * tile_n - offset - window_right``; the last row to
    see its last key is ``(n_block + 1) * tile_n - 1 - offset + window_left`` (offset =
    ``seqlen_k - seqlen_q``; causal: right = 0, no left bound). Floor divisions; may be empty.
    """
    m_block_max = (seqlen_q + (tile_m - 1)) // tile_m
    m_block_min = Int32(0)
    if cutlass.const_expr(is_causal or is_local):
        right = window_right if cutlass.const_expr(is_local) else Int32(0)
        first_row = n_block * tile_n + seqlen_q - seqlen_k - right
        m_block_min = cutlass.max(first_row // tile_m, Int32(0))
    if cutlass.const_expr(is_local):
        last_row = (n_block + 1) * tile_n - 1 + seqlen_q - seqlen_k + window_left
        m_block_max = cutlass.min(m_block_max, last_row // tile_m + 1)
    return m_block_min, m_block_max


@cute.jit
def elem_pointer(t: cute.Tensor, i):
    """Pointer to element ``i`` (a linear index into the tensor's shape) of ``t``."""
    return t.iterator + cute.crd2idx(i, t.layout)


def accum_tile(m_accum_head: cute.Tensor, rows: int, cols: int, block: Int32) -> cute.Tensor:
    """The ``(rows, cols)`` row-major fp32 tile ``block`` of one head's flat accumulator.

    The layout is static (stride ``cols``), so per-element offsets are immediates.
    """
    base = m_accum_head.iterator + block * (rows * cols)
    # The buffer is 16-byte aligned and a tile is a multiple of 16 bytes: say so, for 128-bit
    # copies (the flat view lost the alignment through its dynamic strides).
    base = cute.make_ptr(cutlass.Float32, base.toint(), base.memspace, assumed_align=16)
    return cute.make_tensor(base, cute.make_layout((rows, cols), stride=(cols, 1)))


def fragment_accum(m_accum_head: cute.Tensor, tile_elems: int, num_threads: int, block: Int32,
                   tidx: Int32, vec: int = 1) -> cute.Tensor:
    """This thread's flat view of accumulator tile ``block`` in MMA-fragment order.

    Element ``i`` of a thread's accumulator fragment lives at
    ``((i // vec) * num_threads + tidx) * vec + i % vec`` of the tile: ``vec`` consecutive fragment
    values per thread side by side (one ``red.add.v{vec}``), and one instruction of a warp covers
    ``128 * vec`` contiguous bytes instead of 8 rows x 32 bytes in row-major order. Producer (main
    kernel) and consumer (postprocess) must enumerate the fragment of the same tiled MMA
    (``tiled_mma_sm80``, or on sm90 ``tiled_mma_dq_sm90``) with the same ``vec``; the sm90 kernels also
    stage their dQ in smem in this order (``m_accum_head`` an smem tensor, ``block`` 0).
    """
    if tile_elems % (num_threads * vec) != 0:
        raise ValueError(f"a {tile_elems}-value tile does not split into {vec}-value groups of {num_threads} threads")
    base = m_accum_head.iterator + block * tile_elems + tidx * vec
    base = cute.make_ptr(cutlass.Float32, base.toint(), base.memspace, assumed_align=4 * vec)
    layout = cute.make_layout((vec, tile_elems // (num_threads * vec)), stride=(1, num_threads * vec))
    return cute.make_tensor(base, layout)


def tiled_mma_sm80(dtype: type[cutlass.Numeric], num_warps: int, atom_m: int) -> cute.TiledMma:
    """``mma.sync.m16n8k16`` with warps ``atom_m x (num_warps / atom_m)``; N and K permuted to 16
    so B loads are ``ldmatrix.x4``. Shared by the main kernel and the dQ postprocess."""
    from cutlass.cute.nvgpu import warp

    atom_n = num_warps // atom_m
    return cute.make_tiled_mma(
        warp.MmaF16BF16Op(dtype, cutlass.Float32, (16, 8, 16)),
        (atom_m, atom_n, 1),
        permutation_mnk=(atom_m * 16, atom_n * 16, 16),
    )


def tiled_mma_dq_sm90(dtype: type[cutlass.Numeric], head_dim: int, split_rows: bool, num_wg: int = 2) -> cute.TiledMma:
    """The sm90 backward's dQ WGMMA (A = dS from smem, M-major; B = K^T, MN-major): the warpgroups
    split the dQ tile by rows (64 each: ``tile_m = 64 * num_wg``) or by head-dim columns (``tile_m``
    64). Shared by the main kernels (sm90/bwd.py, bwd_wide.py) and the postprocess that undoes its
    fragment order."""
    import cutlass.utils.hopper_helpers as hopper_helpers

    mn_major = cute.nvgpu.OperandMajorMode.MN
    atom, cols = ((num_wg, 1, 1), head_dim) if split_rows else ((1, num_wg, 1), head_dim // num_wg)
    return hopper_helpers.make_trivial_tiled_mma(
        dtype, dtype, mn_major, mn_major, cutlass.Float32, atom_layout_mnk=atom, tiler_mn=(64, cols),
    )


def tiled_mma_dqt_sm90(dtype: type[cutlass.Numeric], tile_m: int, num_wg: int = 2) -> cute.TiledMma:
    """The sm90 backward's dQ^T WGMMA at tile_m 80 (``sm90/bwd.py`` ``dq_transposed``): dQ^T = K^T dS^T,
    M = head_dim (64 per warpgroup: ``head_dim = 64 * num_wg``), N = ``tile_m`` queries, A = K^T and B =
    dS^T both MN-major views. Shared with the postprocess that transposes its fragment back."""
    import cutlass.utils.hopper_helpers as hopper_helpers

    mn_major = cute.nvgpu.OperandMajorMode.MN
    return hopper_helpers.make_trivial_tiled_mma(
        dtype, dtype, mn_major, mn_major, cutlass.Float32, atom_layout_mnk=(num_wg, 1, 1), tiler_mn=(64, tile_m),
    )


@dsl_user_op
def bulk_reduce_add_f32(dst: cute.Pointer, src: cute.Pointer, num_bytes: int, *, loc=None, ip=None) -> None:
    """``cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32``: the TMA unit adds ``num_bytes``
    of contiguous fp32 from smem ``src`` into gmem ``dst`` (16-byte aligned, ``num_bytes`` a multiple
    of 16). One thread issues it and owns its bulk group (commit / wait as for a TMA store); the DSL
    has the tensor form only (``CopyReduceBulkTensorTileS2GOp``), which needs a row-major box."""
    llvm.inline_asm(
        None,
        [dst.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip), src.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip)],
        f"cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], {num_bytes};",
        "l,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


def tiled_copy_16b(
    dtype: type[cutlass.Numeric], num_threads: int, cols: int, is_async: bool, copy_bits: int = 128
) -> cute.TiledCopy:
    """``copy_bits`` per thread per copy, threads row-major over the chunks of a row.

    ``copy_threads_per_row`` threads share a row: a warp covers whole rows or whole 64/128-byte
    row segments (coalesced) and, with the swizzled smem atoms, distinct banks.
    """
    from cutlass.cute.nvgpu import cpasync

    elems = copy_bits // dtype.width
    if cols % elems != 0:
        raise ValueError(f"rows of {cols} elements do not split into {copy_bits}-bit chunks")
    threads_per_row = copy_threads_per_row(cols, elems, num_threads)
    if num_threads % threads_per_row:
        raise ValueError(f"{num_threads} threads cannot cover rows of {threads_per_row} chunks")
    op = (
        cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL)
        if is_async
        else cute.nvgpu.CopyUniversalOp()
    )
    atom = cute.make_copy_atom(op, dtype, num_bits_per_copy=copy_bits)
    thr_layout = cute.make_ordered_layout(
        (num_threads // threads_per_row, threads_per_row), order=(1, 0)
    )
    return cute.make_tiled_copy_tv(atom, thr_layout, cute.make_layout((1, elems)))


@cute.jit
def red_add_tile(acc: cute.Tensor, gacc: cute.Tensor, vec: cutlass.Constexpr[int] = 1):
    """``gacc[i] += acc[i]`` for every element, with ``red.relaxed.gpu.global.add[.v{vec}].f32``.

    ``gacc`` is a gmem view indexed like the register tensor ``acc`` (its MMA partition, or a
    ``fragment_accum``); with ``vec`` > 1 elements ``vec * j .. vec * j + vec - 1`` of ``gacc``
    must be contiguous and ``4 * vec``-byte aligned (a ``fragment_accum`` of that ``vec``): one
    instruction adds them (a quarter of the load-store queue entries at ``vec`` 4; sm_90).
    Pitfall 27: the DSL needs an explicit ``sem``/``scope``.
    """
    if cutlass.const_expr(cute.size(acc) % vec != 0):
        raise ValueError(f"{cute.size(acc)} values do not split into reduce-adds of {vec}")
    if cutlass.const_expr(vec == 1):
        for i in cutlass.range_constexpr(cute.size(acc)):
            cute.arch.red(
                elem_pointer(gacc, i), acc[i], op="add", dtype=cutlass.Float32, sem="relaxed",
                scope="gpu",
            )
    else:
        vec_type = ir.VectorType.get([vec], cutlass.Float32.mlir_type)
        for j in cutlass.range_constexpr(cute.size(acc) // vec):
            values = vector.from_elements(vec_type, [acc[j * vec + e].ir_value() for e in range(vec)])
            cute.arch.red(
                elem_pointer(gacc, j * vec), values, op="add", dtype=cutlass.Float32, sem="relaxed",
                scope="gpu",
            )


def _group_barrier(barrier_id: int, num_threads: int | None) -> None:
    """The CTA barrier, or named barrier ``barrier_id`` over ``num_threads`` threads (warp-specialised
    kernels: only the threads that add take part)."""
    if num_threads is None:
        cute.arch.barrier()
    else:
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)


@cute.jit
def semaphore_wait(sem: cute.Tensor, idx, turn: Int32, tidx: Int32,
                   barrier_id: cutlass.Constexpr[int] = 0, num_threads: cutlass.Constexpr = None):
    """Block the CTA (or the ``num_threads`` threads of named barrier ``barrier_id``, ``tidx``
    counted among them) until ``sem[idx] == turn``."""
    if tidx == 0:
        ptr = elem_pointer(sem, idx)
        val = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")
        while val != turn:
            val = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")
    _group_barrier(barrier_id, num_threads)


@cute.jit
def semaphore_signal(sem: cute.Tensor, idx, tidx: Int32,
                     barrier_id: cutlass.Constexpr[int] = 0, num_threads: cutlass.Constexpr = None,
                     fence_after_barrier: cutlass.Constexpr[bool] = False):
    """Pass the turn on once every thread's prior global reduce-adds are done: each thread's fence
    (a fence waits for its own warp's adds only), then a CTA (group) barrier, then thread 0's count.
    ``fence_after_barrier``: thread 0 fences again before counting, for adds issued by another
    thread of the group (a TMA reduce from a lane the DSL elected, not necessarily lane 0)."""
    cute.arch.fence_acq_rel_gpu()
    _group_barrier(barrier_id, num_threads)
    if tidx == 0:
        if cutlass.const_expr(fence_after_barrier):
            cute.arch.fence_acq_rel_gpu()
        cute.arch.red(
            elem_pointer(sem, idx), Int32(1), op="add", dtype=Int32, sem="relaxed", scope="gpu"
        )
