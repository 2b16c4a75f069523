"""Backward preprocess: ``dPsum = rowsum(dO * O)``, ``LSE_log2``, and a zeroed ``dQaccum``.

Purpose: the per-row quantities the main backward kernel (``bwd.py``) reads for every key
block, computed once (design doc 2.2), in fp32:
- ``dPsum[i] = sum_d dO[i, d] * O[i, d]`` (the ``D_i`` of ``dS = P * (dP - D)``);
- ``LSE_log2[i] = LSE[i] * log2(e)`` so that ``P = exp2(S * scale_log2 - LSE_log2)`` is one FFMA
  and one MUFU.EX2; a row whose LSE is ``-inf`` (it sees no key) stores 0 (its scores are all
  masked, so P = 0 either way and no ``inf - inf`` arises); padding rows past ``seqlen_q`` store
  ``+inf`` and ``dPsum = 0``, so ``P = 0`` and ``dS = 0`` there (pitfall 19);
- ``dQaccum`` set to zero over the padded rows, ready for the main kernel's reduce-adds (or, for the sm90
  kernel's ``dq_claim``, which zeroes each tile itself, the tiles' claim states ``mdQ_state`` set to 0);
- with ``sink_grad`` (a learnable sink per head, ``flashattn_hopper/sinks.py``): each warp's part of the
  sink's gradient ``d sink_h = -sum_i exp(sink_h - LSE_i) * dPsum_i`` over its rows (LSE the sinked
  one), one fp32 value per warp in ``mdSinkParts``; the host sums the parts (a fixed order: bitwise
  stable, no atomics), where torch's four passes over the rows took ~17 us at 16k tokens.

Constraints: O/dO ``(batch, seqlen_q, nheads, head_dim_v)`` 16-bit with 16-byte rows and aligned
strides; LSE fp32 ``(batch, nheads, seqlen_q)``; scratch shapes per ``common/bwd_utils.py``
(``seqlen_q_padded`` a multiple of ``tile_m``; dQaccum rows ``head_dim`` wide, q's). Varlen (``cu_seqlens_q`` given): O/dO
``(total_q, nheads, head_dim_v)``, LSE ``(nheads, total_q)``, scratch ``(1, nheads, rows)`` at the
per-sequence padded offsets; the grid covers an upper bound of tiles and each CTA finds its
``(sequence, m_block)`` (``common/seqlen.py``). One CTA per ``tile_m`` padded rows, plain
128-bit loads: this kernel is bandwidth-bound and reads O and dO exactly once.

Paper: FlashAttention-2 (Dao, 2023), Algorithm 2 line 4 (``D_i = rowsum(dO_i * O_i)``).
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .bwd_utils import (
    SEQ_PAD, accum_tile, copy_threads_per_row, scratch_offset, scratch_tile_reason,
    tiled_copy_16b,
)
from .seqlen import SeqlenInfo, num_varlen_tiles_upper_bound, varlen_tile_coord
from .utils import LOG2_E, assume_strides_aligned, select_head, select_modes


class FlashBwdPreprocess:
    """Grid ``(seqlen_q_padded / tile_m, nheads, batch)``; threads row-major over 16-byte chunks.

    Each thread loads its chunks of O and dO (rows past ``seqlen_q`` stay zero), multiplies in
    fp32, and the ``head_dim / 8`` threads of a row finish the sum with butterfly shuffles; the
    thread holding column 0 writes the row's ``dPsum`` and ``LSE_log2``. The CTA then stores
    zeros over its ``tile_m x head_dim`` slice of ``dQaccum``.
    """

    def __init__(self, dtype: type[cutlass.Numeric], head_dim: int, tile_m: int = SEQ_PAD,
                 num_threads: int = 128, head_dim_v: int | None = None, pdl: bool = False,
                 sink_grad: bool = False, state_tile_m: int = 0):
        """``head_dim``: dQaccum's (q's); ``head_dim_v``: O and dO's (None: ``head_dim``). ``pdl``
        (sm_90 only): launched as a programmatic dependent of the stream's previous kernel, it waits
        for that one before reading O, dO and LSE, and lets the main kernel launch once its loads
        are issued (the main kernel waits for its outputs: ``configs.bwd_pdl``). ``sink_grad``: the
        sink's gradient parts too (``mSinkLogits``, ``mdSinkParts``). ``state_tile_m`` > 0 (the sm90 main
        kernel's ``dq_claim``, whose tiles of that many rows are zeroed by the first CTA to claim them): dQaccum
        is left as it is and the tiles' claim states (``mdQ_state``) are zeroed instead."""
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        reason = self.can_implement(dtype, head_dim, tile_m, num_threads, head_dim_v)
        if state_tile_m and (tile_m % state_tile_m or state_tile_m % 8):
            reason = f"state_tile_m ({state_tile_m}) must be a multiple of 8 that divides tile_m ({tile_m})"
        if reason is not None:
            raise ValueError(f"FlashBwdPreprocess cannot implement this config: {reason}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.tile_m = tile_m
        self.num_threads = num_threads
        self.pdl = pdl
        self.sink_grad = sink_grad
        self.state_tile_m = state_tile_m

    @staticmethod
    def can_implement(dtype, head_dim, tile_m, num_threads, head_dim_v=None) -> str | None:
        return scratch_tile_reason(
            dtype, head_dim if head_dim_v is None else head_dim_v, tile_m, num_threads, 8, "16-byte"
        ) or scratch_tile_reason(dtype, head_dim, tile_m, num_threads, 4, "16-byte fp32")

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,  # (batch, seqlen_q, nheads, head_dim_v) | varlen (total_q, nheads, head_dim_v)
        mdO: cute.Tensor,  # like mO
        mLSE: cute.Tensor,  # (batch, nheads, seqlen_q) | varlen (nheads, total_q) fp32, natural log
        mLSE_log2: cute.Tensor,  # (batch | 1, nheads, seqlen_q_padded) fp32, output
        mdPsum: cute.Tensor,  # (batch | 1, nheads, seqlen_q_padded) fp32, output
        mdQaccum: cute.Tensor,  # (batch | 1, nheads, seqlen_q_padded * head_dim) fp32, output (zeros)
        mCuSeqlensQ: cute.Tensor | None,  # (batch + 1,) int32
        mSeqUsedQ: cute.Tensor | None,  # (batch,) int32
        mSinkLogits: cute.Tensor | None,  # sink_grad only: (nheads,) fp32, natural log
        # sink_grad only: (batch | 1, nheads, grid_x * warps) fp32, output: warp w of the CTA at grid
        # x index bx writes slot bx * warps + w (varlen CTAs past the last sequence write nothing)
        mdSinkParts: cute.Tensor | None,
        # state_tile_m > 0: (batch | 1, nheads, seqlen_q_padded / state_tile_m) int32, output (zeros); else None
        mdQ_state: cute.Tensor | None,
        stream: cuda.CUstream,
    ):
        if const_expr((mdQ_state is not None) != (self.state_tile_m > 0)):
            raise TypeError("mdQ_state is given exactly with state_tile_m")
        if const_expr(not (mO.element_type == mdO.element_type == self.dtype)):
            raise TypeError(f"O and dO must be {self.dtype}")
        for t in (mLSE, mLSE_log2, mdPsum, mdQaccum):
            if const_expr(t.element_type != Float32):
                raise TypeError("LSE, LSE_log2, dPsum and dQaccum must be Float32")
        if const_expr((mSinkLogits is not None) != self.sink_grad or (mdSinkParts is not None) != self.sink_grad):
            raise TypeError("mSinkLogits and mdSinkParts must be given exactly when sink_grad")
        varlen = const_expr(mCuSeqlensQ is not None)
        # (s, d, h[, b]) and LSE (s, h[, b])
        mO, mdO = [
            select_modes(assume_strides_aligned(t), [0, 2, 1] if varlen else [1, 3, 2, 0])
            for t in (mO, mdO)
        ]
        mLSE = select_modes(mLSE, [1, 0] if varlen else [2, 1, 0])
        mdQaccum = assume_strides_aligned(mdQaccum)
        if const_expr(varlen):
            num_batch = mCuSeqlensQ.shape[0] - 1
            grid = [num_varlen_tiles_upper_bound(mO.shape[0], num_batch, self.tile_m), mO.shape[2], 1]
        else:
            num_batch = mO.shape[3]
            grid = [mLSE_log2.shape[2] // self.tile_m, mO.shape[2], num_batch]
        self.kernel(
            mO, mdO, mLSE, mLSE_log2, mdPsum, mdQaccum, num_batch, mCuSeqlensQ, mSeqUsedQ, mSinkLogits, mdSinkParts,
            mdQ_state,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(
        self,
        mO: cute.Tensor,  # (seqlen_q, head_dim_v, nheads[, batch])
        mdO: cute.Tensor,  # (seqlen_q, head_dim_v, nheads[, batch])
        mLSE: cute.Tensor,  # (seqlen_q, nheads[, batch])
        mLSE_log2: cute.Tensor,  # (batch | 1, nheads, seqlen_q_padded)
        mdPsum: cute.Tensor,  # (batch | 1, nheads, seqlen_q_padded)
        mdQaccum: cute.Tensor,  # (batch | 1, nheads, seqlen_q_padded * head_dim)
        num_batch: Int32,
        mCuSeqlensQ: cute.Tensor | None,
        mSeqUsedQ: cute.Tensor | None,
        mSinkLogits: cute.Tensor | None,
        mdSinkParts: cute.Tensor | None,
        mdQ_state: cute.Tensor | None,
    ):
        block_x, head_idx, block_z = cute.arch.block_idx()
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()  # O, dO and LSE are the previous kernels' outputs
        if const_expr(mCuSeqlensQ is not None):
            batch_idx, m_block = varlen_tile_coord(
                block_x, num_batch, self.tile_m, mCuSeqlensQ, mSeqUsedQ
            )
            if batch_idx >= 0:
                self.row_block(
                    mO, mdO, mLSE, mLSE_log2, mdPsum, mdQaccum, mCuSeqlensQ, mSeqUsedQ, m_block,
                    head_idx, batch_idx, mSinkLogits, mdSinkParts, block_x, mdQ_state,
                )
        else:
            self.row_block(
                mO, mdO, mLSE, mLSE_log2, mdPsum, mdQaccum, mCuSeqlensQ, mSeqUsedQ, block_x,
                head_idx, block_z, mSinkLogits, mdSinkParts, block_x, mdQ_state,
            )

    @cute.jit
    def row_block(
        self,
        mO: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mLSE_log2: cute.Tensor,
        mdPsum: cute.Tensor,
        mdQaccum: cute.Tensor,
        mCuSeqlensQ: cute.Tensor | None,
        mSeqUsedQ: cute.Tensor | None,
        m_block: Int32,
        head_idx: Int32,
        batch_idx: Int32,
        mSinkLogits: cute.Tensor | None,
        mdSinkParts: cute.Tensor | None,
        block_x: Int32,
        mdQ_state: cute.Tensor | None = None,
    ):
        """The ``tile_m`` padded rows ``m_block`` of one (sequence, head); ``block_x``: the CTA's grid
        index (its slots in ``mdSinkParts``)."""
        tidx, _, _ = cute.arch.thread_idx()
        seqlen = SeqlenInfo.create(batch_idx, mO.shape[0], Int32(0), mCuSeqlensQ, None, mSeqUsedQ)
        seqlen_q = seqlen.seqlen_q
        varlen = const_expr(mCuSeqlensQ is not None)
        pad_offset = scratch_offset(seqlen.offset_q, batch_idx) if const_expr(varlen) else Int32(0)
        scratch_b = Int32(0) if const_expr(varlen) else batch_idx
        mO_cur = seqlen.q_view(select_head(mO, head_idx, 2), batch_idx)
        mdO_cur = seqlen.q_view(select_head(mdO, head_idx, 2), batch_idx)
        mLSE_cur = seqlen.q_view(select_head(mLSE, head_idx, 1), batch_idx)

        tiled_copy = tiled_copy_16b(self.dtype, self.num_threads, self.head_dim_v, is_async=False)
        thr_copy = tiled_copy.get_slice(tidx)
        tile = (self.tile_m, self.head_dim_v)
        tOgO = thr_copy.partition_S(cute.local_tile(mO_cur, tile, (m_block, 0)))
        tOgdO = thr_copy.partition_S(cute.local_tile(mdO_cur, tile, (m_block, 0)))
        cO = cute.make_identity_tensor(tile)
        tOcO = thr_copy.partition_S(cO)
        t0OcO = tiled_copy.get_slice(0).partition_S(cO)

        rO = cute.make_fragment_like(tOgO)
        rdO = cute.make_fragment_like(tOgdO)
        rO.fill(0.0)
        rdO.fill(0.0)
        row_bound = seqlen_q - m_block * self.tile_m - tOcO[0][0]
        for m in cutlass.range_constexpr(cute.size(tOgO.shape[1])):
            if t0OcO[0, m, 0][0] < row_bound:
                cute.copy(tiled_copy, tOgO[None, m, None], rO[None, m, None])
                cute.copy(tiled_copy, tOgdO[None, m, None], rdO[None, m, None])

        # The rows' LSE, loaded beside O and dO by the thread holding column 0: read after each
        # row's shuffles, the loads were issued one row at a time, each a full memory latency
        # (16 in sequence per thread at head dim 128).
        num_rows = cute.size(tOgO.shape[1])
        rLSE = cute.make_rmem_tensor((num_rows,), Float32)
        rLSE.fill(0.0)
        if tOcO[0][1] == 0:
            for m in cutlass.range_constexpr(num_rows):
                if t0OcO[0, m, 0][0] < row_bound:
                    rLSE[m] = mLSE_cur[m_block * self.tile_m + tOcO[0, m, 0][0]]

        if const_expr(self.pdl):
            # The loads are issued: the main kernel may launch (its prologue and K/V loads overlap
            # this kernel's tail; it waits for our outputs before reading them).
            cute.arch.griddepcontrol_launch_dependents()
        prod = cute.make_rmem_tensor_like(rO, Float32)
        prod.store(rO.load().to(Float32) * rdO.load().to(Float32))
        threads_per_row = copy_threads_per_row(self.head_dim_v, 8, self.num_threads)
        mLSE_log2_cur = mLSE_log2[scratch_b, head_idx, None]
        mdPsum_cur = mdPsum[scratch_b, head_idx, None]
        sink_log2 = Float32(0.0)
        sink_part = Float32(0.0)  # (this thread's rows' share of -d sink, kept by column-0 threads)
        if const_expr(self.sink_grad):
            sink_log2 = mSinkLogits[head_idx] * LOG2_E
        for m in cutlass.range_constexpr(num_rows):
            prod_row = prod[None, m, None]
            dot = Float32(0.0)
            for i in cutlass.range_constexpr(cute.size(prod_row)):
                dot += prod_row[i]
            dot = cute.arch.warp_reduction_sum(dot, threads_in_group=threads_per_row)
            row = m_block * self.tile_m + tOcO[0, m, 0][0]
            if tOcO[0][1] == 0:
                lse_log2 = Float32.inf
                dpsum = Float32(0.0)
                if row < seqlen_q:
                    lse = rLSE[m]
                    lse_log2 = lse * LOG2_E if lse != -Float32.inf else Float32(0.0)
                    dpsum = dot
                    if const_expr(self.sink_grad):
                        # (a sink of -inf, or a row whose sinked LSE is -inf: no share, never NaN)
                        if sink_log2 != -Float32.inf and lse != -Float32.inf:
                            sink_part -= cute.math.exp2(sink_log2 - lse * LOG2_E) * dot
                mLSE_log2_cur[pad_offset + row] = lse_log2
                mdPsum_cur[pad_offset + row] = dpsum
        if const_expr(self.sink_grad):
            # Each warp's rows' sum, one slot per warp: the host adds the slots in a fixed order.
            warp_sum = cute.arch.warp_reduction_sum(sink_part, threads_in_group=32)
            warps = self.num_threads // 32
            if cute.arch.lane_idx() == 0:
                mdSinkParts[scratch_b, head_idx, block_x * warps + cute.arch.warp_idx()] = warp_sum

        if const_expr(self.state_tile_m > 0):
            # (dq_claim) the claim states of the main kernel's tiles in these rows: 0, never claimed
            per_block = self.tile_m // self.state_tile_m
            if tidx < per_block:
                mdQ_state[scratch_b, head_idx, (pad_offset // self.tile_m + m_block) * per_block + tidx] = Int32(0)
        else:
            copy_f32 = tiled_copy_16b(Float32, self.num_threads, self.head_dim, is_async=False)
            gdQaccum = accum_tile(
                mdQaccum[scratch_b, head_idx, None], self.tile_m, self.head_dim,
                pad_offset // self.tile_m + m_block,
            )
            tQgQaccum = copy_f32.get_slice(tidx).partition_D(gdQaccum)
            zeros = cute.make_fragment_like(tQgQaccum)
            zeros.fill(0.0)
            cute.copy(copy_f32, zeros, tQgQaccum)
