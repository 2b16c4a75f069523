"""Backward postprocess: an fp32 gradient accumulator, times a scale, to the 16-bit gradient.

Purpose: the last step of the backward (design doc 2.8): ``dQ = dQaccum * softmax_scale`` and,
for GQA/MQA, ``dK = dKaccum * softmax_scale`` and ``dV = dVaccum`` (the main kernel adds the
contributions of every query head sharing a KV head into those fp32 buffers), converted to
bf16/fp16 in the user layout ``(batch, seqlen, nheads, head_dim)``.

Constraints: the accumulator is ``(batch, nheads, seqlen_padded * head_dim)`` fp32
(``common/bwd_utils.py``); the output has 16-byte rows and strides. Two layouts:
- row-major ``(seqlen_padded, head_dim)`` per head (GQA dK/dV sums of the sm80 and wide sm90 kernels;
  no ``atom_m``, no ``wgmma_split``): an
  elementwise kernel, 128-bit fp32 loads, one FMUL and a paired cvt per two values, 64-bit stores;
- MMA-fragment order per ``tile_m`` rows (dQ, and the sm90 kernel's GQA dK/dV sums; ``atom_m``
  given, or ``wgmma_split``): the CTA rebuilds the main kernel's dQ tiled MMA (sm80: same ``tile_m``,
  ``num_threads``, ``atom_m``; sm90: ``bwd_utils.tiled_mma_dq_sm90`` over 256 threads, warpgroups
  splitting ``"rows"`` or ``"cols"``, or the ``"transposed"`` dQ^T of tile_m 80; the dK/dV WGMMA has
  the ``"rows"`` C layout), loads its fragment with coalesced loads, and writes 16-bit rows through a
  swizzled smem tile (128-bit stores). With ``wg_blocks`` (every sm90 accumulator) each warpgroup's
  part of a tile is a fragment block of its own (the sm90 kernel hands them over separately).

Varlen (``cu_seqlens`` given): the output is ``(total, nheads, head_dim)``, the accumulator
``(1, nheads, rows * head_dim)`` at the per-sequence padded offsets (``bwd_utils``); the grid
covers an upper bound of tiles and each CTA finds its ``(sequence, block)``. Rows past the
sequence's length (``seqused`` if given) are not written.

Paper: FlashAttention-2 (Dao, 2023), Algorithm 2 (dQ accumulated in fp32 across key blocks).
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from cutlass.memory import SmemAllocator

from .bwd_utils import (
    SEQ_PAD, accum_tile, fragment_accum, scratch_offset, scratch_tile_reason, tiled_copy_16b,
    tiled_mma_dq_sm90, tiled_mma_dqt_sm90, tiled_mma_sm80,
)
from .seqlen import SeqlenInfo, num_varlen_tiles_upper_bound, varlen_tile_coord
from .utils import (
    assume_strides_aligned, convert_to_16bit, select_head, select_modes, smem_layout_atom_sm80, transpose_view,
)


class FlashBwdPostprocess:
    """Grid ``(ceil(seqlen / tile_m), nheads, batch)``.

    Row-major mode: each thread converts 4 values per copy. Fragment mode (``atom_m`` or ``wgmma_split``): each
    thread converts its dQ-MMA fragment of the tile (laid out ``fragment_accum(..., vec)``, as
    the main kernel reduce-added it), stages it in smem, then stores rows.
    """

    def __init__(self, dtype: type[cutlass.Numeric], head_dim: int, tile_m: int = 64,
                 num_threads: int = 128, atom_m: int | None = None, vec: int = 1, wgmma_split: str | None = None,
                 wg_blocks: bool = False, pdl: bool = False, dq_claimed: bool = False):
        reason = self.can_implement(dtype, head_dim, tile_m, num_threads, 640 if wgmma_split == "transposed" else SEQ_PAD)
        fragment = atom_m is not None or wgmma_split is not None
        if vec not in (1, 4) or (vec != 1 and not fragment):
            reason = f"vec must be 1, or 4 in fragment mode (atom_m or wgmma_split given), got {vec}"
        split_tile_m = {"rows": 128, "cols": 64, "transposed": 80}
        if wgmma_split is not None and (
            atom_m is not None or wgmma_split not in split_tile_m or num_threads != 256 or vec != 4
            or tile_m != split_tile_m[wgmma_split] or (wgmma_split == "transposed" and head_dim != 128)
        ):
            reason = (f"wgmma_split ({wgmma_split!r}) is 'rows' (tile_m 128), 'cols' (tile_m 64) or 'transposed' "
                      f"(tile_m 80, head_dim 128), with 256 threads, vec 4 and no atom_m; got tile_m {tile_m}, "
                      f"head_dim {head_dim}, {num_threads} threads, vec {vec}, atom_m {atom_m}")
        if wg_blocks and wgmma_split is None:
            reason = "wg_blocks (each warpgroup's part of a tile a fragment block) needs an sm90 wgmma_split"
        if dq_claimed and not wg_blocks:
            reason = "dq_claimed is the sm90 main kernel's dQ accumulator (wg_blocks)"
        if reason is not None:
            raise ValueError(f"FlashBwdPostprocess cannot implement this config: {reason}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.tile_m = tile_m
        self.num_threads = num_threads
        self.atom_m = atom_m
        self.vec = vec  # fp32 values per dQ reduce-add of the main kernel (its dq_red_vec)
        # sm90 main kernel's dQ WGMMA: warpgroups along "rows" or "cols", or "transposed": dQ^T
        # (``bwd_utils.tiled_mma_dqt_sm90``, warpgroups along head_dim), written back transposed
        self.wgmma_split = wgmma_split
        self.fragment = fragment
        # sm90 accumulators (dQ, whose parts the writer adds per warpgroup, and the GQA dK/dV sums of
        # ``epilogue_gqa``): each warpgroup's part of a tile is a fragment block of its own (128
        # threads), not one block over both warpgroups' 256 threads.
        self.wg_blocks = wg_blocks
        # sm_90 (``configs.bwd_pdl``): launched as a programmatic dependent of the main kernel, waiting
        # in the kernel for its accumulator, so the launch overlaps the main kernel's last CTAs.
        self.pdl = pdl
        # The sm90 main kernel's ``dq_claim``: the accumulator was not zeroed beforehand; a tile whose state
        # (``mState``, one int32 per tile, 0 = never claimed) is 0 received no contribution and reads as 0.
        self.dq_claimed = dq_claimed

    @staticmethod
    def can_implement(dtype, head_dim, tile_m, num_threads, pad: int = SEQ_PAD) -> str | None:
        return scratch_tile_reason(dtype, head_dim, tile_m, num_threads, 4, "4-value", pad)

    @cute.jit
    def __call__(
        self,
        mAccum: cute.Tensor,  # (batch | 1, nheads, seqlen_padded * head_dim) fp32
        mOut: cute.Tensor,  # (batch, seqlen, nheads, head_dim) | varlen (total, nheads, head_dim)
        scale: Float32,
        mCuSeqlens: cute.Tensor | None,  # (batch + 1,) int32
        mSeqUsed: cute.Tensor | None,  # (batch,) int32
        mState: cute.Tensor | None,  # dq_claimed: (batch | 1, nheads, seqlen_padded / tile_m) int32; else None
        stream: cuda.CUstream,
    ):
        if const_expr(mAccum.element_type != Float32 or mOut.element_type != self.dtype):
            raise TypeError(f"the accumulator must be Float32 and the output {self.dtype}")
        if const_expr((mState is not None) != self.dq_claimed):
            raise TypeError("mState is given exactly with dq_claimed")
        varlen = const_expr(mCuSeqlens is not None)
        if const_expr(varlen and self.wgmma_split == "transposed"):
            raise TypeError("the transposed dQ (tile_m 80) is dense only: varlen scratch pads sequences to 128 rows")
        mAccum = assume_strides_aligned(mAccum)
        # (s, d, h[, b])
        mOut = select_modes(assume_strides_aligned(mOut), [0, 2, 1] if varlen else [1, 3, 2, 0])
        if const_expr(varlen):
            num_batch = mCuSeqlens.shape[0] - 1
            grid = [num_varlen_tiles_upper_bound(mOut.shape[0], num_batch, self.tile_m), mOut.shape[2], 1]
        else:
            num_batch = mOut.shape[3]
            grid = [(mOut.shape[0] + (self.tile_m - 1)) // self.tile_m, mOut.shape[2], num_batch]
        sO_layout = self._smem_layout()

        @cute.struct
        class SharedStorage:
            sO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sO_layout)], 1024]

        self.kernel(mAccum, mOut, scale, num_batch, mCuSeqlens, mSeqUsed, mState, SharedStorage).launch(
            grid=grid, block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes() if const_expr(self.fragment) else 0,
            stream=stream,
            use_pdl=self.pdl,
        )

    def _smem_layout(self):
        if const_expr(self.wgmma_split != "transposed" and self.wgmma_split is not None and self.head_dim % 128 != 0):
            # (the WGMMA C layout's 96-column halves of a 192-wide row across 64-column swizzle atoms
            # abort the DSL's copy partitioning, DSL 4.8.1: plain rows there; a minor kernel. hdim 64's
            # rows too, as verified on the GPU, though its 64 columns would take the swizzle (its 32-bit
            # stores into plain rows conflict 8 ways; untested swizzled for lack of device time))
            return cute.make_ordered_layout((self.tile_m, self.head_dim), order=(1, 0))
        atom = smem_layout_atom_sm80(self.dtype, self.head_dim)
        return cute.tile_to_shape(atom, (self.tile_m, self.head_dim), (0, 1))

    @cute.kernel
    def kernel(
        self,
        mAccum: cute.Tensor,  # (batch | 1, nheads, seqlen_padded * head_dim)
        mOut: cute.Tensor,  # (seqlen, head_dim, nheads[, batch])
        scale: Float32,
        num_batch: Int32,
        mCuSeqlens: cute.Tensor | None,
        mSeqUsed: cute.Tensor | None,
        mState: cute.Tensor | None,
        SharedStorage: cutlass.Constexpr,
    ):
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()  # the main kernel's accumulator is complete
        block_x, head_idx, block_z = cute.arch.block_idx()
        if const_expr(mCuSeqlens is not None):
            batch_idx, m_block = varlen_tile_coord(
                block_x, num_batch, self.tile_m, mCuSeqlens, mSeqUsed
            )
            if batch_idx >= 0:
                self.tile(mAccum, mOut, scale, mCuSeqlens, mSeqUsed, SharedStorage, m_block,
                          head_idx, batch_idx, mState)
        else:
            self.tile(mAccum, mOut, scale, mCuSeqlens, mSeqUsed, SharedStorage, block_x,
                      head_idx, block_z, mState)

    @cute.jit
    def tile(
        self,
        mAccum: cute.Tensor,
        mOut: cute.Tensor,
        scale: Float32,
        mCuSeqlens: cute.Tensor | None,
        mSeqUsed: cute.Tensor | None,
        SharedStorage: cutlass.Constexpr,
        m_block: Int32,
        head_idx: Int32,
        batch_idx: Int32,
        mState: cute.Tensor | None = None,
    ):
        """Rows ``m_block * tile_m ..`` of one (sequence, head): scale, convert, store."""
        seqlen_info = SeqlenInfo.create(batch_idx, mOut.shape[0], Int32(0), mCuSeqlens, None, mSeqUsed)
        varlen = const_expr(mCuSeqlens is not None)
        pad_offset = scratch_offset(seqlen_info.offset_q, batch_idx) if const_expr(varlen) else Int32(0)
        mAccum_cur = mAccum[Int32(0) if const_expr(varlen) else batch_idx, head_idx, None]
        mOut_cur = seqlen_info.q_view(select_head(mOut, head_idx, 2), batch_idx)
        block = pad_offset // self.tile_m + m_block
        if const_expr(not self.fragment):
            self.tile_row_major(mAccum_cur, mOut_cur, scale, m_block, block, seqlen_info.seqlen_q)
        else:
            claimed = None
            if const_expr(self.dq_claimed):
                claimed = mState[Int32(0) if const_expr(varlen) else batch_idx, head_idx, block] != 0
            self.tile_fragment(
                mAccum_cur, mOut_cur, scale, SharedStorage, m_block, block, seqlen_info.seqlen_q, claimed
            )

    @cute.jit
    def tile_row_major(
        self,
        mAccum_cur: cute.Tensor,  # (seqlen_padded * head_dim,) of this (sequence, head)
        mOut_cur: cute.Tensor,  # (seqlen, head_dim)
        scale: Float32,
        m_block: Int32,
        block: Int32,  # m_block's tile in the accumulator
        seqlen: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        tile = (self.tile_m, self.head_dim)
        # Same thread/value layout for both copies: 4 values per thread per copy.
        copy_f32 = tiled_copy_16b(Float32, self.num_threads, self.head_dim, is_async=False)
        copy_out = tiled_copy_16b(
            self.dtype, self.num_threads, self.head_dim, is_async=False, copy_bits=64
        )
        gAccum = accum_tile(mAccum_cur, self.tile_m, self.head_dim, block)
        tAgA = copy_f32.get_slice(tidx).partition_S(gAccum)
        rA = cute.make_fragment_like(tAgA)
        cute.copy(copy_f32, tAgA, rA)
        rA.store(rA.load() * scale)
        rOut = convert_to_16bit(rA, self.dtype)

        thr_out = copy_out.get_slice(tidx)
        tOgO = thr_out.partition_D(cute.local_tile(mOut_cur, tile, (m_block, 0)))
        cO = cute.make_identity_tensor(tile)
        tOcO = thr_out.partition_D(cO)
        t0OcO = copy_out.get_slice(0).partition_D(cO)
        row_bound = seqlen - m_block * self.tile_m - tOcO[0][0]
        for m in cutlass.range_constexpr(cute.size(tOgO.shape[1])):
            if t0OcO[0, m, 0][0] < row_bound:
                cute.copy(copy_out, rOut[None, m, None], tOgO[None, m, None])

    @cute.jit
    def tile_fragment(
        self,
        mAccum_cur: cute.Tensor,  # (seqlen_padded * head_dim,), fragment order per tile
        mOut_cur: cute.Tensor,  # (seqlen, head_dim)
        scale: Float32,
        SharedStorage: cutlass.Constexpr,
        m_block: Int32,
        block: Int32,
        seqlen: Int32,
        claimed: cutlass.Boolean | None = None,
    ):
        """``claimed`` (dq_claimed): whether any contribution reached the tile (else it reads as zeros: never
        zeroed, it holds whatever the buffer held)."""
        tidx, _, _ = cute.arch.thread_idx()
        tile = (self.tile_m, self.head_dim)

        transposed = const_expr(self.wgmma_split == "transposed")
        if const_expr(transposed):
            tiled_mma = tiled_mma_dqt_sm90(self.dtype, self.tile_m)
        elif const_expr(self.wgmma_split is not None):
            tiled_mma = tiled_mma_dq_sm90(self.dtype, self.head_dim, self.wgmma_split == "rows")
        else:
            tiled_mma = tiled_mma_sm80(self.dtype, self.num_threads // 32, self.atom_m)
        acc_tile = (self.head_dim, self.tile_m) if const_expr(transposed) else tile
        acc = cute.make_rmem_tensor(tiled_mma.get_slice(tidx).partition_shape_C(acc_tile), Float32)
        if const_expr(self.wg_blocks):
            wg_threads = self.num_threads // 2
            gAcc = fragment_accum(
                mAccum_cur, self.tile_m * self.head_dim // 2, wg_threads, block * 2 + tidx // wg_threads,
                tidx % wg_threads, self.vec,
            )
        else:
            gAcc = fragment_accum(
                mAccum_cur, self.tile_m * self.head_dim, self.num_threads, block, tidx, self.vec,
            )
        if const_expr(claimed is None):
            for i in cutlass.range_constexpr(cute.size(acc)):
                acc[i] = gAcc[i] * scale
        else:
            acc.fill(0.0)
            if claimed:
                for i in cutlass.range_constexpr(cute.size(acc)):
                    acc[i] = gAcc[i] * scale
        rO = convert_to_16bit(acc, self.dtype)

        storage = SmemAllocator().allocate(SharedStorage)
        sO = storage.sO.get_tensor(self._smem_layout())
        if const_expr(transposed):
            # dQ^T's fragment (head_dim x queries) into the (queries, head_dim) rows: stmatrix.trans puts
            # each thread's pair of adjacent queries into two rows (16-bit stores there conflicted 32 ways
            # and cost ~150 us per call at 16k tokens).
            r2s = cute.make_tiled_copy_C(
                cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype),
                tiled_mma,
            ).get_slice(tidx)
            cute.copy(r2s, r2s.retile(rO), r2s.partition_D(transpose_view(sO)))
        else:
            r2s = cute.make_tiled_copy_C(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32), tiled_mma,
            ).get_slice(tidx)
            cute.copy(r2s, r2s.retile(rO), r2s.partition_D(sO))
        cute.arch.barrier()

        tiled_copy = tiled_copy_16b(self.dtype, self.num_threads, self.head_dim, is_async=False)
        thr_copy = tiled_copy.get_slice(tidx)
        tOsO = thr_copy.partition_S(sO)
        tOrO = cute.make_fragment_like(tOsO, self.dtype)
        cute.autovec_copy(tOsO, tOrO)
        tOgO = thr_copy.partition_D(cute.local_tile(mOut_cur, tile, (m_block, 0)))
        cO = cute.make_identity_tensor(tile)
        tOcO = thr_copy.partition_S(cO)
        t0OcO = tiled_copy.get_slice(0).partition_S(cO)
        row_bound = seqlen - m_block * self.tile_m - tOcO[0][0]
        for m in cutlass.range_constexpr(cute.size(tOrO.shape[1])):
            if t0OcO[0, m, 0][0] < row_bound:
                cute.copy(tiled_copy, tOrO[None, m, None], tOgO[None, m, None])
