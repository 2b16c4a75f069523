"""Layout, fragment and conversion helpers shared by the attention kernels.

Purpose: the small pieces of CuTe layout algebra every FlashAttention kernel needs and the DSL
does not ship: swizzled shared-memory atoms for ``ldmatrix``/``cp.async`` tiles, a (rows, cols)
view of an MMA accumulator (so softmax can walk rows), the regrouping of an S accumulator into
the A-operand fragment of the P.V GEMM (design doc 1.5 / 3.1), a paired fp32 -> 16-bit
conversion, copy predicates for partial tiles, and the 16-byte stride assumption.

Constraints: 16-bit element types (bf16/fp16) for the smem atoms and conversions; accumulator
helpers accept the sm80 ``mma.sync`` C layout ``((2, 2), MMA_M, MMA_N)`` (the rows/cols view also
accepts the sm90 ``((2, 2, N/8), MMA_M, MMA_N)`` layout).

Paper: FlashAttention-2 (Dao, 2023) section 3.1 keeps P in registers between the two GEMMs; the
register regrouping below is what makes that possible with ``mma.sync.m16n8k16``.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


def assume_strides_aligned(t: cute.Tensor) -> cute.Tensor:
    """Re-state that every non-unit stride is a multiple of 16 bytes.

    The Python layer guarantees it; saying it in the IR lets the DSL prove that each thread's
    16-byte ``cp.async`` / store is aligned even when the compiled tensor type lost the
    divisibility (e.g. a tensor marked dynamic without it). Static strides are left alone.
    """
    elems_per_16b = 128 // t.element_type.width
    strides = tuple(
        s if isinstance(s, int) else cute.assume(s, divby=elems_per_16b) for s in t.stride[:-1]
    )
    layout = cute.make_layout(t.shape, stride=(*strides, t.stride[-1]))
    return cute.make_tensor(t.iterator, layout)


def select_modes(t: cute.Tensor, modes: list[int]) -> cute.Tensor:
    """A view of ``t`` with its modes re-ordered (no data movement)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


def select_head(mX: cute.Tensor, head_idx, mode: int) -> cute.Tensor:
    """Fix mode ``mode`` (the head) of a kernel-side view, keeping the others in order:
    ``(s, d, h[, b])`` with ``mode=2`` or LSE's ``(s, h[, b])`` with ``mode=1``. Works on TMA
    coordinate tensors too."""
    return mX[tuple(head_idx if i == mode else None for i in range(cute.rank(mX)))]


def attention_kernel_views(
    mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
    dtype: type[cutlass.Numeric], varlen_q: bool, varlen_k: bool, o_dtype: type[cutlass.Numeric] | None = None,
) -> tuple[cute.Tensor, cute.Tensor, cute.Tensor, cute.Tensor, cute.Tensor]:
    """The forward kernels' views of the API tensors, after checking their element types.

    Q/K/V/O ``(b, s, h, d)`` (varlen ``(total, h, d)``) become ``(s, d, h[, b])`` with their
    16-byte stride alignment re-stated; LSE ``(b, h, s_q)`` (varlen ``(h, total_q)``) becomes
    ``(s_q, h[, b])``. O is ``o_dtype`` (default: ``dtype``). Sequence first and head dim second is how every tile is cut (design doc 0.2).
    """
    o_dtype = dtype if o_dtype is None else o_dtype
    if not (mQ.element_type == mK.element_type == mV.element_type == dtype and mO.element_type == o_dtype):
        raise TypeError(f"Q/K/V must all be {dtype} and O {o_dtype}")
    if mLSE.element_type != cutlass.Float32:
        raise TypeError("LSE must be Float32")
    mQ, mO = [
        select_modes(assume_strides_aligned(t), [0, 2, 1] if varlen_q else [1, 3, 2, 0]) for t in (mQ, mO)
    ]
    mK, mV = [
        select_modes(assume_strides_aligned(t), [0, 2, 1] if varlen_k else [1, 3, 2, 0]) for t in (mK, mV)
    ]
    mLSE = select_modes(mLSE, [1, 0] if varlen_q else [2, 1, 0])
    return mQ, mK, mV, mO, mLSE


def smem_layout_atom_sm80(dtype: type[cutlass.Numeric], cols: int) -> cute.ComposedLayout:
    """Swizzled 8-row smem atom for a row-major tile whose rows hold ``cols`` elements.

    The atom row is the widest of 128/64/32 bytes that divides a tile row. The XOR swizzle moves
    each 16-byte chunk by the row index, so the 8 rows an ``ldmatrix`` phase reads (and the 8
    16-byte chunks a ``cp.async`` row writes) land in distinct banks. 16-byte chunks are never
    split, which keeps 128-bit copies and the column pairs of the MMA C layout contiguous.
    """
    elem_bytes = dtype.width // 8
    row_bytes = cols * elem_bytes
    atom_bytes = next((b for b in (128, 64, 32) if row_bytes % b == 0), 16)
    swizzle_bits = {128: 3, 64: 2, 32: 1, 16: 0}[atom_bytes]
    vec_bits = int(math.log2(16 // elem_bytes))  # log2(elements per 16-byte chunk)
    return cute.make_composed_layout(
        cute.make_swizzle(swizzle_bits, vec_bits, vec_bits),
        0,
        cute.make_ordered_layout((8, atom_bytes // elem_bytes), order=(1, 0)),
    )


def transpose_view(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of an smem tensor (``(rows, cols)`` -> ``(cols, rows)``).

    Used for V: the P.V GEMM wants V as a ``(head_dim_v, tile_n)`` B operand, read with
    ``ldmatrix.trans`` from the same row-major tile the loads wrote.
    """
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


def _acc_rows_cols_layout(acc_layout: cute.Layout) -> cute.Layout:
    """Layout of an accumulator viewed as ``(rows, cols)``.

    The MMA value mode is ``(2 adjacent columns, 2 row halves[, N/8 column groups])``; the view
    pairs the row halves with MMA_M and the columns with MMA_N, so ``view[r, c]`` walks row ``r``
    of this thread. Built by composing the accumulator with an index map over its own shape.
    """
    index = cute.make_layout(acc_layout.shape)  # compact, column-major: coordinate -> index
    shape, stride = index.shape, index.stride
    rows = ((shape[0][1], shape[1]), (stride[0][1], stride[1]))
    cols = (
        (shape[0][0], *shape[0][2:], shape[2]),
        (stride[0][0], *stride[0][2:], stride[2]),
    )
    view = cute.make_layout(
        (rows[0], cols[0], *shape[3:]), stride=(rows[1], cols[1], *stride[3:])
    )
    return cute.composition(acc_layout, view)


def acc_rows_cols(acc: cute.Tensor) -> cute.Tensor:
    """View an MMA accumulator (or its coordinate partition) as ``(rows, cols)`` of one thread."""
    return cute.make_tensor(acc.iterator, _acc_rows_cols_layout(acc.layout))


def acc_to_frag_a_layout_sm80(layout: cute.Layout) -> cute.Layout:
    """Layout of ``acc_to_frag_a_sm80`` (split out so it can be checked on static layouts)."""
    if cute.size(layout.shape[2]) % 2 != 0:
        raise ValueError("P-as-A-operand needs an even number of 8-column accumulator tiles")
    split = cute.logical_divide(layout, (None, None, 2))  # ((2, 2), MMA_M, (2, MMA_N/2))
    return cute.make_layout(
        (
            (split.shape[0][0], split.shape[0][1], split.shape[2][0]),
            split.shape[1],
            split.shape[2][1],
        ),
        stride=(
            (split.stride[0][0], split.stride[0][1], split.stride[2][0]),
            split.stride[1],
            split.stride[2][1],
        ),
    )


def acc_to_frag_a_sm80(acc: cute.Tensor) -> cute.Tensor:
    """View an sm80 C fragment ``((2, 2), MMA_M, MMA_N)`` as an A fragment.

    Result shape ``((2, 2, 2), MMA_M, MMA_N / 2)``.

    ``mma.sync.m16n8k16`` hands each thread, for C, columns ``2t, 2t+1`` of rows ``g`` and ``g+8``
    of an 8-column tile; for A, the same positions of k-columns ``0..7`` then ``8..15``. So two
    neighbouring 8-column C tiles *are* one 16-deep A tile: only the modes are regrouped.
    """
    return cute.make_tensor(acc.iterator, acc_to_frag_a_layout_sm80(acc.layout))


def _b16x2_kind(dtype: type[cutlass.Numeric]) -> str:
    return "bf16x2" if dtype is cutlass.BFloat16 else "f16x2"


def _asm_b32(ptx: str, operands: list, constraints: str) -> Uint32:
    """One 32-bit result of an inline PTX instruction without side effects (so ptxas schedules it freely)."""
    out = llvm.inline_asm(T.i32(), operands, ptx, constraints, has_side_effects=False, is_align_stack=False,
                          asm_dialect=llvm.AsmDialect.AD_ATT)
    return Uint32(out)


@dsl_user_op
def warpgroup_any_positive(value: Float32, barrier_id: Int32, *, loc=None, ip=None) -> Int32:
    """1 in every thread of the calling warpgroup where any of its 128 threads has ``value > 0``, else 0: one
    ``bar.red.or.pred`` on the named barrier ``barrier_id`` (all 128 threads must reach it, converged; a NaN is
    not positive)."""
    out = llvm.inline_asm(
        T.i32(),
        [Float32(value).ir_value(loc=loc, ip=ip), Int32(barrier_id).ir_value(loc=loc, ip=ip)],
        "{\n.reg .pred any_in, any_out;\nsetp.gt.f32 any_in, $1, 0f00000000;\n"
        "bar.red.or.pred any_out, $2, 128, any_in;\nselp.u32 $0, 1, 0, any_out;\n}",
        "=r,f,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )
    return Int32(out)


@dsl_user_op
def cvt_f32x2_to_b16x2(
    lo: Float32, hi: Float32, dtype: type[cutlass.Numeric], *, loc=None, ip=None
) -> Uint32:
    """Round two fp32 values to bf16/fp16 (RN) with one ``cvt.rn.{bf16x2,f16x2}.f32``.

    ``lo`` lands in the low half (the lower address, i.e. the lower column). Written as inline
    PTX without side effects so ptxas can schedule it freely; ``TensorSSA.to`` does not always
    emit the paired form (design doc pitfall 16).
    """
    # PTX packs the first source into the upper half, hence the (hi, lo) operand order.
    return _asm_b32(f"cvt.rn.{_b16x2_kind(dtype)}.f32 $0, $1, $2;",
                    [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)], "=r,f,f")


@dsl_user_op
def mul_b16x2(a: Uint32, b: Uint32, dtype: type[cutlass.Numeric], *, loc=None, ip=None) -> Uint32:
    """Two packed bf16/fp16 products, each rounded once (RN): one ``mul.rn.{bf16x2,f16x2}`` (HMUL2)."""
    return _asm_b32(f"mul.rn.{_b16x2_kind(dtype)} $0, $1, $2;",
                    [Uint32(a).ir_value(loc=loc, ip=ip), Uint32(b).ir_value(loc=loc, ip=ip)], "=r,r,r")


def convert_to_16bit(src: cute.Tensor, dtype: type[cutlass.Numeric]) -> cute.Tensor:
    """fp32 register tensor -> new register tensor of ``dtype`` with the same layout.

    Consecutive register pairs are converted together; for MMA accumulators a pair is two
    adjacent columns of one row, which is exactly a packed 16-bit A-operand register.
    """
    if cute.size(src) % 2 != 0:
        raise ValueError("paired conversion needs an even number of elements")
    dst = cute.make_rmem_tensor_like(src, dtype)
    dst_pairs = cute.recast_tensor(dst, Uint32)
    for i in range(cute.size(src) // 2):
        dst_pairs[i] = cvt_f32x2_to_b16x2(src[2 * i], src[2 * i + 1], dtype)
    return dst


def copy_predicate(
    tXcX: cute.Tensor,
    t0XcX: cute.Tensor,
    row_limit: cutlass.Int32 | None,
    col_limit: int | None,
) -> cute.Tensor:
    """Per-copy predicate for a partitioned ``((VEC, 1), CPY_ROWS, CPY_COLS)`` tile copy.

    ``tXcX``/``t0XcX`` are the identity-tensor partitions of this thread and of thread 0. An
    entry is true iff its row is below ``row_limit`` and its column below ``col_limit`` (either
    may be None: no check). Thread 0's coordinates are compile-time constants, so the compare is
    ``const < limit - my_offset`` with the subtraction done once (design doc 1.9, ``t0ScS``).
    With ``cp.async`` a false predicate becomes a zero-fill (src-size 0), not a skipped copy.
    """
    num_rows = cute.size(tXcX.shape[1])
    num_cols = cute.size(tXcX.shape[2])
    pred = cute.make_rmem_tensor((1, num_rows, num_cols), Boolean)
    row_bound = row_limit - tXcX[0][0] if row_limit is not None else None
    col_bound = col_limit - tXcX[0][1] if col_limit is not None else None
    for m in range(num_rows):
        for k in range(num_cols):
            row_ok = t0XcX[0, m, k][0] < row_bound if row_bound is not None else None
            col_ok = t0XcX[0, m, k][1] < col_bound if col_bound is not None else None
            if row_ok is None:
                pred[0, m, k] = col_ok
            elif col_ok is None:
                pred[0, m, k] = row_ok
            else:
                pred[0, m, k] = row_ok & col_ok
    return pred
