"""The MMA warpgroups' m_block loop of the Hopper backward (``sm90/bwd.py``): ``FlashBwdSm90Loop``.

Purpose: split from the kernel class by role (as ``bwd_store.py``): per m_block, each MMA warpgroup's S^T and
dP^T GEMMs, the exp2 pass (P^T), dS^T, and the dV / dQ / dK GEMMs with dS^T's smem hand-off and dQ's to the
writer warp (``mma``); the score coordinates and mask (``score_coords_and_mask``); P^T and dS^T in registers
(``probs``, ``ds_from_probs``, ``probs_and_ds`` with softcap, shared with ``bwd_wide.py``). The kernel class
(``FlashBwdSm90``) holds the configuration this mixin reads (tiles, flags, barriers' thread counts).
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Uint32, const_expr
from cutlass.cute.nvgpu import warp, warpgroup

from . import bwd_gate
from .bwd_store import _WG_THREADS, NamedBarrierBwd
from ..common.mask import AttentionMask
from ..common.seqlen import SeqlenInfo
from ..common.sm90_utils import acc_to_frag_a_sm90, wgmma
from ..common.softmax import apply_softcap
from ..common.utils import acc_rows_cols, convert_to_16bit, mul_b16x2, transpose_view


TRACE_BLOCK = 4  # (trace) the first of the two traced blocks of each CTA's loop
TRACE_CTA_BASE = 128  # (trace) where ``store_cta_span`` starts: after 2 CTAs x 2 warpgroups x 2 blocks x 16 points
_TRACE_POINTS = 16  # 0-7 along the block (``perf/trace_bwd.py``), 8 Q landed, 9 dO landed, 10-15 finer points


class FlashBwdSm90Loop:
    """The MMA warpgroups' loop of ``FlashBwdSm90`` (a mixin: the kernel class holds the configuration)."""

    @cute.jit
    def mma(
        self,
        sQ, sK, sV, sdO, sdSt, sLSE, sdPsum, sdQ,
        pipe_kv: pipeline.PipelineTmaAsync,
        pipe_q: pipeline.PipelineTmaAsync,
        pipe_do: pipeline.PipelineTmaAsync,
        seqlen: SeqlenInfo,
        n_block: Int32,
        m_block_min: Int32,
        m_block_max: Int32,
        scale_log2: Float32,
        softcap_scale: Float32 | None,
        window_left: Int32,
        window_right: Int32,
        sQuerySums: cute.Tensor,
        gate: cute.Tensor | None,
        dgk: cute.Tensor | None,
        trace_out: cute.Tensor | None = None,
        m_iter_end: Int32 | None = None,
        sOnes: cute.Tensor | None = None,
        sOnesN: cute.Tensor | None = None,
    ):
        """The m_block loop of both MMA warpgroups; returns (acc_dK, acc_dV, tiled_mma_dkv[, (K/V landed, loop done)
        %globaltimer stamps: trace only]). ``gate``
        and ``dgk`` (has_gate): this sequence and query head's key bias and per-key dS sums. ``trace_out``
        (trace): where ``store_stamps`` puts the clocks. ``m_iter_end`` (gqa_loop): the virtual end of the loop over
        the KV head's query heads' blocks in turn (``block_head``; only the masks read the real m_block). ``sOnes``
        (gate_key_mma) / ``sOnesN`` (gate_query_mma): the B tiles of ones of the per-key / per-query sums' WGMMAs."""
        tidx = cute.arch.thread_idx()[0] - _WG_THREADS
        wg_idx = cute.arch.make_warp_uniform(tidx // _WG_THREADS)
        tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq = self._tiled_mmas()
        wg_sdp = tiled_mma_sdp.get_slice(wg_idx * _WG_THREADS)
        wg_dkv = tiled_mma_dkv.get_slice(wg_idx * _WG_THREADS)
        wg_dq = tiled_mma_dq.get_slice(wg_idx * _WG_THREADS)
        thr_sdp = tiled_mma_sdp.get_slice(tidx)
        d = self.head_dim
        tSrK, tSrQ, tdPrV, tdPrdO = self.sdp_operands(wg_sdp, sQ, sK, sV, sdO)
        tdVrdOt = wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose_view(sdO)))
        tdKrQt = wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose_view(sQ)))
        tdVrP = wg_dkv.make_fragment_A(wg_dkv.partition_shape_A((self.tile_n, self.tile_m)))
        tdKrdS = wg_dkv.make_fragment_A(wg_dkv.partition_shape_A((self.tile_n, self.tile_m)))
        if const_expr(self.dq_transposed):  # dQ^T = K^T dS^T: the same two views, roles swapped
            tdQrKt = wg_dq.make_fragment_A(wg_dq.partition_A(transpose_view(sK)))
            tdQrdS = wg_dq.make_fragment_B(wg_dq.partition_B(transpose_view(sdSt)))
        else:
            tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(transpose_view(sdSt)))
            tdQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(transpose_view(sK)))
        acc_dK = cute.make_rmem_tensor(tiled_mma_dkv.partition_shape_C((self.tile_n, d)), Float32)
        acc_dV = cute.make_rmem_tensor(tiled_mma_dkv.partition_shape_C((self.tile_n, d)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)
        # dS^T (16-bit, C layout) -> sdSt with stmatrix, as the forward stores O.
        r2s_dS = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype),
            tiled_mma_sdp,
        ).get_slice(tidx)
        tdSsdS = r2s_dS.partition_D(sdSt)
        tScS_mn, mask = self.score_coords_and_mask(thr_sdp, seqlen, window_left, window_right)
        tdQsdQ = self.dq_staging(sdQ, tidx)
        key_bias = key_sums = None
        if const_expr(self.has_gate):
            key_bias = bwd_gate.load_key_bias(gate, tScS_mn, n_block, self.tile_n, seqlen.seqlen_k)
            key_sums = cute.make_rmem_tensor(key_bias.shape, Float32)
            key_sums.fill(0.0)
        tiled_mma_ks = acc_ks = tKSrOnes = None
        if const_expr(self.gate_key_mma):  # (the ones are visible to WGMMA by the first DS_READY barrier)
            tiled_mma_ks = self._tiled_mma_key_sums()
            tKSrOnes = bwd_gate.ones_operand(tiled_mma_ks, sOnes, wg_idx * _WG_THREADS, tidx)
            acc_ks = cute.make_rmem_tensor(tiled_mma_ks.partition_shape_C((self.tile_n, 8)), Float32)
            acc_ks.fill(0.0)
        tiled_mma_qs = tQSrdS = tQSrOnes = tQScQ = None
        qs_issuer = wg_idx >= 0  # (tile_m 128: both warpgroups, their own rows)
        if const_expr(self.gate_query_mma):
            tiled_mma_qs = self._tiled_mma_query_sums()
            if const_expr(self.tile_m == 64):
                qs_issuer = wg_idx == 0
            tQSrdS, tQSrOnes, tQScQ = bwd_gate.query_sums_operands(tiled_mma_qs, sdSt, sOnesN, sQuerySums, tidx,
                                                                   self.tile_m)

        self.wait_kv(pipe_kv, m_block_min, m_block_max)
        kv_landed = cute.arch.globaltimer_lo() if const_expr(self.trace) else None
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        stamps = None
        if const_expr(self.trace):
            stamps = cute.make_rmem_tensor((2 * _TRACE_POINTS,), Int32)
            stamps.fill(0)
        if const_expr(self.pingpong):
            if wg_idx == 1 and m_block_min < m_block_max:  # (start half a block behind warpgroup 0)
                cute.arch.barrier(barrier_id=int(NamedBarrierBwd.PP_START), number_of_threads=self.num_mma_threads)
        m_loop_end = m_iter_end if const_expr(self.gqa_loop) else m_block_max
        for m_block in cutlass.range(m_block_min, m_loop_end, unroll=1):
            m_mask = m_block  # (the real query block: the masks')
            if const_expr(self.gqa_loop):
                m_mask = self.block_head(m_block, m_block_min, m_block_max, m_iter_end, Int32(0))[0]
            stage = state.index
            ds_stage = (m_block - m_block_min) % 2
            self.stamp(stamps, m_block - m_block_min, 0)
            acc_S, acc_dP = self.issue_s_dp(tiled_mma_sdp, tSrK, tSrQ, tdPrV, tdPrdO, pipe_q, pipe_do, state, stage,
                                            stamps, m_block - m_block_min)
            if const_expr(self.has_softcap):
                self.probs_and_ds(
                    acc_S, acc_dP, sLSE, sdPsum, tScS_mn, stage, mask, thr_sdp, m_mask, n_block, scale_log2,
                    softcap_scale,
                )
                # dV += P^T dO with P^T straight from registers.
                tdVrP.store(acc_to_frag_a_sm90(convert_to_16bit(acc_S, self.dtype)).load())
                wgmma(tiled_mma_dkv, acc_dV, tdVrP, tdVrdOt[None, None, None, stage], zero_init=False, wg_wait=-1)
            else:
                warpgroup.wait_group(1)  # S^T has landed
                self.stamp(stamps, m_block - m_block_min, 1)
                self.probs(acc_S, sLSE, tScS_mn, stage, mask, thr_sdp, m_mask, n_block, scale_log2, key_bias)
                rP = convert_to_16bit(acc_S, self.dtype)
                tdVrP.store(acc_to_frag_a_sm90(rP).load())
                self.stamp(stamps, m_block - m_block_min, 2)
                # dS^T before dV is issued (FA4's order): dV then runs under the dS^T store and the
                # DS_READY barrier. Issued before the dP^T wait instead (session 21), it kept every
                # exp2 above that wait but measured 2-5 % slower at hdim 128 (session 24).
                warpgroup.wait_group(0)  # dP^T has landed
                self.stamp(stamps, m_block - m_block_min, 3)
                if const_expr(self.ds_packed):
                    rdS = self.ds16_from_probs16(rP, acc_dP, sdPsum, tScS_mn, stage)
                else:
                    self.ds_from_probs(rP if const_expr(self.ds_from_p16) else acc_S, acc_dP, sdPsum, tScS_mn, stage)
                if const_expr(not self.dv_after_sums):
                    wgmma(tiled_mma_dkv, acc_dV, tdVrP, tdVrdOt[None, None, None, stage], zero_init=False, wg_wait=-1)
                self.stamp(stamps, m_block - m_block_min, 15)
            if const_expr(self.has_softcap or not self.ds_packed):
                rdS = convert_to_16bit(acc_dP, self.dtype)
            if const_expr(self.has_gate):
                # From the 16-bit dS^T (the fp32 one beside P^T serialized every WGMMA: ptxas C7512),
                # staged at once; two slots by block parity, as sdSt: the writer read block j's
                # before the DQ_EMPTY this block's dq_to_smem(j + 1) waited for.
                if const_expr(not (self.gate_key_mma and self.gate_query_mma)):
                    bwd_gate.stage_sums(rdS, None if const_expr(self.gate_key_mma) else key_sums,
                                        None if const_expr(self.gate_query_mma) else sQuerySums, ds_stage,
                                        tidx // 32, self.tile_m)
                if const_expr(self.dv_after_sums):
                    wgmma(tiled_mma_dkv, acc_dV, tdVrP, tdVrdOt[None, None, None, stage], zero_init=False, wg_wait=-1)
            if const_expr(self.pingpong):
                self.pingpong_tail(rdS, r2s_dS, tdSsdS, tdKrdS, tdKrQt, tdQrdS, tdQrKt, tdQsdQ, tiled_mma_dkv, tiled_mma_dq,
                                   acc_dK, pipe_q, pipe_do, state, stage, m_block - m_block_min, wg_idx, stamps)
            else:
                self.stamp(stamps, m_block - m_block_min, 10)
                cute.copy(r2s_dS, r2s_dS.retile(rdS), tdSsdS[None, None, None, ds_stage])
                tdKrdS.store(acc_to_frag_a_sm90(rdS).load())
                self.stamp(stamps, m_block - m_block_min, 11)
                # Every warpgroup's dS^T is in smem and visible to the async proxy (WGMMA); dV runs meanwhile.
                cute.arch.fence_view_async_shared()
                self.stamp(stamps, m_block - m_block_min, 4)
                cute.arch.barrier(barrier_id=int(NamedBarrierBwd.DS_READY), number_of_threads=self.num_mma_threads)
                self.stamp(stamps, m_block - m_block_min, 5)
                # dQ before dK: groups complete in issue order, so dQ's registers can go to sdQ while dK runs.
                if const_expr(self.dq_transposed):
                    acc_dQ = cute.make_rmem_tensor(tiled_mma_dq.partition_shape_C((d, self.tile_m)), Float32)
                    wgmma(tiled_mma_dq, acc_dQ, tdQrKt, tdQrdS[None, None, None, ds_stage], zero_init=True, wg_wait=-1)
                else:
                    acc_dQ = cute.make_rmem_tensor(tiled_mma_dq.partition_shape_C((self.tile_m, d)), Float32)
                    wgmma(tiled_mma_dq, acc_dQ, tdQrdS[None, None, None, ds_stage], tdQrKt, zero_init=True, wg_wait=-1)
                self.stamp(stamps, m_block - m_block_min, 14)
                acc_qs = None
                if const_expr(self.gate_query_mma):  # (before dK, as the key sums: dK's wait covers both)
                    acc_qs = cute.make_rmem_tensor(tiled_mma_qs.partition_shape_C((self.tile_m, 8)), Float32)
                    if qs_issuer:
                        wgmma(tiled_mma_qs, acc_qs, tQSrdS[None, None, None, ds_stage], tQSrOnes, zero_init=True,
                              wg_wait=-1)
                if const_expr(self.gate_key_mma):  # (before dK: dK's wait below then covers it too)
                    wgmma(tiled_mma_ks, acc_ks, tdKrdS, tKSrOnes, zero_init=False, wg_wait=-1)
                wgmma(tiled_mma_dkv, acc_dK, tdKrdS, tdKrQt[None, None, None, stage], zero_init=False, wg_wait=1)
                if const_expr(self.gate_query_mma):  # (into this block's slot, before dq_to_smem tells the writer)
                    if qs_issuer:
                        bwd_gate.stage_query_sums(acc_qs, tQScQ, sQuerySums, ds_stage)
                self.stamp(stamps, m_block - m_block_min, 6)
                pipe_do.consumer_release(state)  # dP^T and dV have read dO
                self.dq_to_smem(acc_dQ, tdQsdQ, m_block > m_block_min, stamps, m_block - m_block_min)
                warpgroup.wait_group(0)  # dK has read Q and dS^T's registers
                self.stamp(stamps, m_block - m_block_min, 7)
                pipe_q.consumer_release(state)
            state.advance()
        if const_expr(self.pingpong):
            if m_block_min < m_block_max:  # the last block's dQ, once the other warpgroup's dS^T of it is in smem
                last = m_loop_end - 1 - m_block_min
                cute.arch.barrier(barrier_id=int(NamedBarrierBwd.PP_DS) + 2 * (last % 2) + 1 - wg_idx,
                                  number_of_threads=self.num_mma_threads)
                acc_dQ = cute.make_rmem_tensor(tiled_mma_dq.partition_shape_C((self.tile_m, d)), Float32)
                wgmma(tiled_mma_dq, acc_dQ, tdQrdS[None, None, None, last % 2], tdQrKt, zero_init=True, wg_wait=0)
                self.dq_to_smem(acc_dQ, tdQsdQ, last > 0)
        times = ()
        if const_expr(self.trace):
            self.store_stamps(stamps, tidx, wg_idx, trace_out)
            times = ((kv_landed, cute.arch.globaltimer_lo()),)
        if const_expr(self.gate_key_mma):  # (every lane of a quad holds its rows' whole sums)
            bwd_gate.store_key_sums(bwd_gate.key_sums_of(acc_ks), tScS_mn, dgk, n_block, self.tile_n,
                                    seqlen.seqlen_k, reduced=True)
        elif const_expr(self.has_gate):
            bwd_gate.store_key_sums(key_sums, tScS_mn, dgk, n_block, self.tile_n, seqlen.seqlen_k)
        return (acc_dK, acc_dV, tiled_mma_dkv, *times)

    @cute.jit
    def pingpong_tail(self, rdS, r2s_dS, tdSsdS, tdKrdS, tdKrQt, tdQrdS, tdQrKt, tdQsdQ, tiled_mma_dkv, tiled_mma_dq,
                      acc_dK, pipe_q, pipe_do, state, stage: Int32, block: Int32, wg_idx: Int32, stamps):
        """(pingpong) A block's end after dV's issue: dS^T to sdSt once the other warpgroup has read the stage (and
        stored its dS^T of the block before), dK, the *previous* block's dQ (both warpgroups' dS^T of it are in
        smem), then this warpgroup's arrival. No barrier ties the warpgroups within a block, so one's exp2 / dS^T
        pass can run under the other's GEMMs (FA3's ping-pong); dQ lags one block, flushed after the loop."""
        ds_stage = block % 2
        if block > 0:  # the other's dS^T(block - 1) stored and its dQ(block - 2) done reading this stage
            cute.arch.barrier(barrier_id=int(NamedBarrierBwd.PP_DS) + 2 * (1 - ds_stage) + 1 - wg_idx,
                              number_of_threads=self.num_mma_threads)
        self.stamp(stamps, block, 10)
        cute.copy(r2s_dS, r2s_dS.retile(rdS), tdSsdS[None, None, None, ds_stage])
        tdKrdS.store(acc_to_frag_a_sm90(rdS).load())
        self.stamp(stamps, block, 11)
        cute.arch.fence_view_async_shared()
        self.stamp(stamps, block, 4)
        if block == 0 and wg_idx == 0:
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrierBwd.PP_START), number_of_threads=self.num_mma_threads)
        wgmma(tiled_mma_dkv, acc_dK, tdKrdS, tdKrQt[None, None, None, stage], zero_init=False, wg_wait=-1)
        # (issued on the first block too, reading the other stage's garbage, discarded: a WGMMA on one path only
        # makes its accumulator a copy on the other, and ptxas serializes every WGMMA; nobody writes that stage
        # before this warpgroup's arrival below)
        acc_dQ = cute.make_rmem_tensor(tiled_mma_dq.partition_shape_C((self.tile_m, self.head_dim)), Float32)
        wgmma(tiled_mma_dq, acc_dQ, tdQrdS[None, None, None, 1 - ds_stage], tdQrKt, zero_init=True, wg_wait=-1)
        self.stamp(stamps, block, 14)
        warpgroup.wait_group(0)  # dV, dK (and dQ) done: dO, Q and the other stage of sdSt are read
        self.stamp(stamps, block, 6)
        cute.arch.barrier_arrive(barrier_id=int(NamedBarrierBwd.PP_DS) + 2 * ds_stage + wg_idx,
                                 number_of_threads=self.num_mma_threads)
        pipe_do.consumer_release(state)
        pipe_q.consumer_release(state)
        if block > 0:
            self.dq_to_smem(acc_dQ, tdQsdQ, block > 1, stamps, block)
        self.stamp(stamps, block, 7)

    @cute.jit
    def stamp(self, stamps, block: Int32, point: cutlass.Constexpr[int]):
        """(trace) clock() at ``point`` of this CTA's blocks TRACE_BLOCK and TRACE_BLOCK + 1."""
        if const_expr(self.trace):
            if block == TRACE_BLOCK:
                stamps[point] = cute.arch.clock()
            if block == TRACE_BLOCK + 1:
                stamps[_TRACE_POINTS + point] = cute.arch.clock()

    @cute.jit
    def store_stamps(self, stamps, tidx: Int32, wg_idx: Int32, trace_out: cute.Tensor):
        """(trace) The first two CTAs' warpgroup leaders store their 2 x ``_TRACE_POINTS`` raw clocks into
        ``trace_out`` (int32, ``(cta * 2 + warpgroup) * 2 * _TRACE_POINTS + i``; ``perf/trace_bwd.py`` reads them).
        Stored, not printed: a ``printf`` is a function call, across which ptxas serializes every WGMMA of the
        kernel (C7510), which made the traces of sessions 29-31 time a serialized kernel."""
        bx, by, bz = cute.arch.block_idx()
        if tidx % _WG_THREADS == 0 and bx < 2 and by == 0 and bz == 0:
            base = (bx * 2 + wg_idx) * (2 * _TRACE_POINTS)
            for i in cutlass.range_constexpr(2 * _TRACE_POINTS):
                trace_out[base + i] = stamps[i]

    @cute.jit
    def store_cta_span(self, trace_out: cute.Tensor, cta_times, tidx: Int32, num_blocks: Int32):
        """(trace) Every CTA's (SM, m_blocks, entry, K/V landed, loop done, epilogue done): %smid, the block count and
        the low 32 bits of %globaltimer (ns) at the kernel's entry, past ``wait_kv``, after the m_block loop (the
        ping-pong flush included) and after this MMA warpgroup's epilogue, at ``TRACE_CTA_BASE + 6 * linear CTA``
        (``perf/trace_bwd.py``: the per-CTA fixed cost against the per-block one, and where it goes)."""
        if tidx == 0:
            bx, by, bz = cute.arch.block_idx()
            gx, gy, _ = cute.arch.grid_dim()
            base = TRACE_CTA_BASE + 6 * (bx + gx * (by + gy * bz))
            trace_out[base] = Int32(cute.arch.smid())
            trace_out[base + 1] = num_blocks
            for i in cutlass.range_constexpr(3):
                trace_out[base + 2 + i] = Int32(cta_times[i])
            trace_out[base + 5] = Int32(cute.arch.globaltimer_lo())

    def sdp_operands(self, wg_sdp, sQ, sK, sV, sdO):
        """``(tSrK, tSrQ, tdPrV, tdPrdO)``: this warpgroup's smem operands of S^T = K Q^T and dP^T = V dO^T (shared
        with ``bwd_wide.py``)."""
        return (wg_sdp.make_fragment_A(wg_sdp.partition_A(sK)), wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ)),
                wg_sdp.make_fragment_A(wg_sdp.partition_A(sV)), wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO)))

    @cute.jit
    def wait_kv(self, pipe_kv: pipeline.PipelineTmaAsync, m_block_min: Int32, m_block_max: Int32):
        """K and V landed, where the CTA has blocks (the producer loads them only then)."""
        if m_block_min < m_block_max:
            pipe_kv.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))

    @cute.jit
    def issue_s_dp(self, tiled_mma_sdp, tSrK, tSrQ, tdPrV, tdPrdO, pipe_q: pipeline.PipelineTmaAsync,
                   pipe_do: pipeline.PipelineTmaAsync, state, stage: Int32, stamps=None, block: Int32 | None = None):
        """``(acc_S, acc_dP)``: S^T = K Q^T and dP^T = V dO^T of Q/dO ring stage ``stage`` issued, each after its
        TMA landed (``state``); not waited for (shared with ``bwd_wide.py``)."""
        pipe_q.consumer_wait(state, pipe_q.consumer_try_wait(state))
        if const_expr(stamps is not None):
            self.stamp(stamps, block, 8)
        acc_S = cute.make_rmem_tensor(tiled_mma_sdp.partition_shape_C((self.tile_n, self.tile_m)), Float32)
        wgmma(tiled_mma_sdp, acc_S, tSrK, tSrQ[None, None, None, stage], zero_init=True, wg_wait=-1)
        pipe_do.consumer_wait(state, pipe_do.consumer_try_wait(state))
        if const_expr(stamps is not None):
            self.stamp(stamps, block, 9)
        acc_dP = cute.make_rmem_tensor(tiled_mma_sdp.partition_shape_C((self.tile_n, self.tile_m)), Float32)
        wgmma(tiled_mma_sdp, acc_dP, tdPrV, tdPrdO[None, None, None, stage], zero_init=True, wg_wait=-1)
        return acc_S, acc_dP

    @cute.jit
    def score_coords_and_mask(self, thr_sdp, seqlen: SeqlenInfo, window_left: Int32, window_right: Int32,
                              queries_on_rows: cutlass.Constexpr[bool] = False):
        """``(tScS_mn, mask)``: the (key, query) coordinates of each of this thread's S^T values (the
        query column picks LSE / dPsum and the mask) and this sequence's mask; ``queries_on_rows``: the
        (query, key) coordinates of S's values instead (``bwd_wide96.py``)."""
        cSt = cute.make_identity_tensor((self.tile_m, self.tile_n) if queries_on_rows else (self.tile_n, self.tile_m))
        tScS_mn = acc_rows_cols(thr_sdp.partition_C(cSt))
        window_l = window_left if const_expr(self.is_local) else None
        window_r = window_right if const_expr(self.is_local) else None
        mask = AttentionMask(self.tile_m, self.tile_n, seqlen.seqlen_q, seqlen.seqlen_k, window_l, window_r)
        return tScS_mn, mask

    @cute.jit
    def probs_and_ds(self, acc_S, acc_dP, sLSE, sdPsum, tScS_mn, stage: Int32, mask: AttentionMask,
                     thr_sdp, m_block: Int32, n_block: Int32, scale_log2: Float32, softcap_scale: Float32 | None):
        """S^T and dP^T issued (in that order), not yet waited for: waits for each, then in place
        S^T -> P^T = exp2(S^T * scale_log2 - LSE) (softcap, masks) and dP^T -> dS^T = P^T (dP^T -
        dPsum) [* tanh']. ``tScS_mn``: each thread value's (key, query) coordinates; ``stage``: the
        Q/dO ring stage whose LSE and dPsum to read (shared with bwd_wide.py)."""
        acc_S_mn = acc_rows_cols(acc_S)
        num_rows = cute.size(acc_S_mn.shape[0])
        num_cols = cute.size(acc_S_mn.shape[1])
        warpgroup.wait_group(1)  # S^T has landed
        acc_dP_mn = acc_rows_cols(acc_dP)
        if const_expr(softcap_scale is not None):
            # S = tanh(x * scale / softcap); dS_x = dS_s * (1 - tanh^2), folded into dP - dPsum
            # before the mask (a masked score's P is 0, so its factor does not matter). One
            # per-column value live per pass: one pass holding LSE and dPsum spilled at hdim 128.
            apply_softcap(acc_S, softcap_scale)
            warpgroup.wait_group(0)  # dP^T has landed
            for c in cutlass.range_constexpr(num_cols):
                dpsum = sdPsum[tScS_mn[0, c][1], stage]
                for r in cutlass.range_constexpr(num_rows):
                    t = acc_S_mn[r, c]
                    acc_dP_mn[r, c] = (acc_dP_mn[r, c] - dpsum) * (Float32(1.0) - t * t)
        self.probs(acc_S, sLSE, tScS_mn, stage, mask, thr_sdp, m_block, n_block, scale_log2)
        if const_expr(softcap_scale is None):
            warpgroup.wait_group(0)  # dP^T has landed
            self.ds_from_probs(acc_S, acc_dP, sdPsum, tScS_mn, stage)
        else:
            for i in cutlass.range_constexpr(cute.size(acc_dP)):
                acc_dP[i] = acc_dP[i] * acc_S[i]

    @cute.jit
    def probs(self, acc_S, sLSE, tScS_mn, stage: Int32, mask: AttentionMask, thr_sdp, m_block: Int32,
              n_block: Int32, scale_log2: Float32, key_bias: cute.Tensor | None = None):
        """S^T (landed) -> P^T = exp2(S^T * scale_log2 - LSE) in place, masked. LSE and dPsum of a
        column (query) are read from smem where they are used, not held in registers across the
        block (16 + 16 values per thread at tile_m 64). ``key_bias`` (has_gate): added to each row's
        scores before the scale, as the forward adds it."""
        if mask.block_needs_mask(m_block, n_block, self.is_causal, self.is_local):
            mask.apply_transposed(acc_S, thr_sdp, m_block, n_block, self.is_causal, self.is_local)
        acc_S_mn = acc_rows_cols(acc_S)
        for c in cutlass.range_constexpr(cute.size(acc_S_mn.shape[1])):
            lse = sLSE[tScS_mn[0, c][1], stage]
            for r in cutlass.range_constexpr(cute.size(acc_S_mn.shape[0])):
                score = acc_S_mn[r, c]
                if const_expr(key_bias is not None):
                    score = score + key_bias[r]
                acc_S_mn[r, c] = cute.math.exp2(score * scale_log2 - lse, fastmath=True)

    @cute.jit
    def ds_from_probs(self, acc_S, acc_dP, sdPsum, tScS_mn, stage: Int32):
        """dP^T (landed) -> dS^T = P^T (dP^T - dPsum) in place (``acc_S`` holds P^T, fp32 or 16-bit)."""
        acc_S_mn, acc_dP_mn = acc_rows_cols(acc_S), acc_rows_cols(acc_dP)
        for c in cutlass.range_constexpr(cute.size(acc_dP_mn.shape[1])):
            dpsum = sdPsum[tScS_mn[0, c][1], stage]
            for r in cutlass.range_constexpr(cute.size(acc_dP_mn.shape[0])):
                p = acc_S_mn[r, c]
                if const_expr(acc_S.element_type != Float32):
                    p = p.to(Float32)
                acc_dP_mn[r, c] = p * (acc_dP_mn[r, c] - dpsum)

    @cute.jit
    def ds16_from_probs16(self, rP, acc_dP, sdPsum, tScS_mn, stage: Int32):
        """dP^T (landed) -> 16-bit dS^T = P^T (dP^T - dPsum) (returned; ``acc_dP`` keeps the fp32 difference): the
        difference in fp32, rounded to 16 bits in pairs, times the 16-bit P^T ``rP`` pair by pair (HMUL2), so that
        P^T is never widened back to fp32. Two roundings where ``ds_from_probs`` has one; PyTorch's own 16-bit
        backward rounds dP^T itself before the difference."""
        acc_dP_mn = acc_rows_cols(acc_dP)
        for c in cutlass.range_constexpr(cute.size(acc_dP_mn.shape[1])):
            dpsum = sdPsum[tScS_mn[0, c][1], stage]
            for r in cutlass.range_constexpr(cute.size(acc_dP_mn.shape[0])):
                acc_dP_mn[r, c] = acc_dP_mn[r, c] - dpsum
        rdS = convert_to_16bit(acc_dP, self.dtype)
        ds_pairs, p_pairs = cute.recast_tensor(rdS, Uint32), cute.recast_tensor(rP, Uint32)
        for i in cutlass.range_constexpr(cute.size(ds_pairs)):
            ds_pairs[i] = mul_b16x2(ds_pairs[i], p_pairs[i], self.dtype)
        return rdS
