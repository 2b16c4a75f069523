"""Hopper (sm90) helpers: smem layouts for TMA + WGMMA, the WGMMA issue protocol, and the view of
an S accumulator as the register A operand of the P.V WGMMA.

Purpose: the small pieces the sm90 kernels need and the DSL does not ship in this form (plus
``store_rows_predicated``, the varlen O store).
- ``make_smem_layout_sm90``: a row-major (K-major) tile, optionally staged, built from the widest
  WGMMA swizzle atom (128/64/32 B) the row holds. The same layout is legal for TMA (the DSL splits
  a row wider than one swizzle span into several TMA boxes) and for WGMMA descriptors; the
  transposed view of a V tile (``utils.transpose_view``) is the MN-major B operand of P.V.
- ``wgmma``: ``warpgroup.fence`` -> one MMA per 16-deep k slice -> ``commit_group`` ->
  optional ``wait_group``. A fresh MMA atom per call, because its ACCUMULATE field is mutated
  (re-using one atom across calls trips an MLIR dominance error; design doc 1.5).
- ``acc_to_frag_a_sm90``: the m64nNk16 C fragment ``((2, 2, N/8), MMA_M, MMA_N)`` re-grouped as
  the k16 A fragment ``((2, 2, 2), MMA_M, (N/16, MMA_N))``: two neighbouring 8-column groups of C
  hold, per thread, exactly the values the A operand of one k16 slice expects (design doc 1.5).

Constraints: 16-bit inputs with fp32 accumulators; N/8 even for the A-fragment view.

Paper: FlashAttention-3 (Shah et al., 2024) section 3.1 (WGMMA with P kept in registers).
"""

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as hopper_helpers
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum


def make_smem_layout_sm90(
    dtype: type[cutlass.Numeric], rows: int, cols: int, stages: int | None = None, atom_cols: int | None = None
) -> cute.ComposedLayout:
    """Swizzled ``(rows, cols[, stages])`` smem layout, ``cols`` contiguous (K-major). The swizzle is
    the widest whose atom divides ``atom_cols`` (default ``cols``): a narrower one lets a WGMMA read
    column slices of that width as MN-major operands."""
    atom = warpgroup.make_smem_layout_atom(
        hopper_helpers.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, atom_cols or cols), dtype
    )
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), (0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))


def same_smem_atom(dtype: type[cutlass.Numeric], cols_a: int, cols_b: int) -> bool:
    """Whether ``make_smem_layout_sm90`` tiles rows of ``cols_a`` and of ``cols_b`` elements with the
    same swizzle atom (then a narrower view of one buffer keeps each row where the wider one has it)."""

    def atom(cols: int):
        return hopper_helpers.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols)

    return atom(cols_a) == atom(cols_b)


def wgmma(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    tCrA: cute.Tensor,
    tCrB: cute.Tensor,
    zero_init: bool,
    wg_wait: int,
    extra: tuple[cute.Tensor, cute.Tensor] | None = None,
) -> None:
    """``acc (+)= A B^T`` over all k slices of ``(MMA, MMA_M|N, MMA_K)`` operand fragments.

    ``zero_init``: the first k slice overwrites ``acc`` (no fill needed). ``wg_wait``: after the
    commit, wait until at most this many WGMMA groups of this warpgroup are in flight; negative:
    return right after the issue (the caller waits later, which is how GEMMs overlap softmax).
    ``extra``: another ``(A, B)`` pair of fragments (other smem buffers, e.g. the gate's k16 slice)
    whose k slices are added in the same commit group.
    """
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    pairs = [(tCrA, tCrB)] + ([extra] if extra is not None else [])
    for frag_a, frag_b in pairs:
        for k in range(cute.size(frag_a.shape[2])):
            cute.gemm(atom, acc, frag_a[None, None, k], frag_b[None, None, k], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if wg_wait >= 0:
        warpgroup.wait_group(wg_wait)


def acc_to_frag_a_layout_sm90(layout: cute.Layout) -> cute.Layout:
    """Layout of ``acc_to_frag_a_sm90`` (split out so it can be checked on static layouts)."""
    if cute.size(layout.shape[0][2]) % 2 != 0:
        raise ValueError("P-as-A-operand needs an even number of 8-column accumulator groups")
    split = cute.logical_divide(layout, ((None, None, 2), None, None))
    # ((2, 2, (2, N/16)), MMA_M, MMA_N): pair the 8-column groups into 16-deep k slices.
    v_shape, v_stride = split.shape[0], split.stride[0]
    return cute.make_layout(
        ((v_shape[0], v_shape[1], v_shape[2][0]), split.shape[1], (v_shape[2][1], split.shape[2])),
        stride=(
            (v_stride[0], v_stride[1], v_stride[2][0]),
            split.stride[1],
            (v_stride[2][1], split.stride[2]),
        ),
    )


def acc_to_frag_a_sm90(acc: cute.Tensor) -> cute.Tensor:
    """View an sm90 C fragment (e.g. P after conversion to 16 bits) as a WGMMA A fragment."""
    return cute.make_tensor(acc.iterator, acc_to_frag_a_layout_sm90(acc.layout))


def acc_to_frag_a_fp8(acc_layout: cute.Layout) -> cute.Layout:
    """The m64nNk16 C fragment layout ``((2, 2, N/8), MMA_M, MMA_N)`` as the 8-bit k32 A fragment
    ``(((2, 2), 2, 2), MMA_M, (N/32, MMA_N))`` (FP8 P.V). An e4m3 A register holds 4 consecutive k
    of one row; per thread, the k32 slice's 16 values are: (column pair, even/odd 8-column group)
    of row r, the same of row r + 8, then the next 16 columns. So A's k ``16h + 4t + q`` is S's
    column ``16h + 8 (q >> 1) + 2t + (q & 1)``: rows match, keys are permuted, and the kernel
    writes V^T in that key order (kernels/sm90/fwd_fp8.py). N must be a multiple of 32."""
    split = cute.logical_divide(acc_layout, ((None, None, 4), None, None))  # ((2, 2, (4, N/32)), M, N)
    (pairs, rows, groups), mma_m, mma_n = split.shape
    (pair_stride, row_stride, group_stride), m_stride, n_stride = split.stride
    return cute.make_layout(
        (((pairs, 2), rows, 2), mma_m, (groups[1], mma_n)),
        stride=(((pair_stride, group_stride[0]), row_stride, group_stride[0] * 2), m_stride, (group_stride[1], n_stride)),
    )


@cute.jit
def store_rows_predicated(
    sO: cute.Tensor,  # (tile_m, head_dim_v) smem tile
    gO: cute.Tensor,  # (tile_m, head_dim_v) gmem tile of the same rows
    tidx: cutlass.Int32,
    num_valid_rows: cutlass.Int32,  # rows of the tile inside the sequence; the rest are not written
    dtype: cutlass.Constexpr,
    num_threads: cutlass.Constexpr,
):
    """sO -> 128-bit loads -> 128-bit gmem stores of the rows below ``num_valid_rows`` only (the
    varlen epilogue: a tile must never write into the next sequence, which a TMA store would).

    Up to 8 threads share a row (one 128-byte swizzle span), so a warp's smem reads hit 4 full rows
    without bank conflicts and its gmem stores are whole 16-byte sectors.
    """
    tile_m, head_dim_v = cute.size(sO.shape[0]), cute.size(sO.shape[1])
    vec = 128 // dtype.width
    threads_per_row = math.gcd(head_dim_v // vec, 8)
    tiled_copy = cute.make_tiled_copy_tv(
        cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128),
        cute.make_ordered_layout((num_threads // threads_per_row, threads_per_row), order=(1, 0)),
        cute.make_layout((1, vec)),
    )
    thr_copy = tiled_copy.get_slice(tidx)
    tOsO = thr_copy.partition_S(sO)
    tOrO = cute.make_fragment_like(tOsO, dtype)
    cute.autovec_copy(tOsO, tOrO)
    tOgO = thr_copy.partition_D(gO)
    cO = cute.make_identity_tensor((tile_m, head_dim_v))
    tOcO = thr_copy.partition_S(cO)
    t0OcO = tiled_copy.get_slice(0).partition_S(cO)
    row_bound = num_valid_rows - tOcO[0][0]
    for m in cutlass.range_constexpr(cute.size(tOrO.shape[1])):
        if t0OcO[0, m, 0][0] < row_bound:
            cute.copy(tiled_copy, tOrO[None, m, None], tOgO[None, m, None])
