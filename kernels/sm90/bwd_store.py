"""dQ writer and dK/dV epilogues of the Hopper backward (``sm90/bwd.py``): ``FlashBwdSm90Store``.

Purpose: the backward kernel's store roles, split from its loop by role: the MMA threads' dQ staging
into sdQ and the hand-off to the dQ writer warp (``dq_staging``, ``dq_to_smem``), the writer's bulk
reduce-adds into the fp32 accumulator with the deterministic turns (``store_dq``), and the dK/dV
epilogues (``epilogue_mha``: 16-bit rows; ``epilogue_gqa``: fp32 sums of a KV head's query heads).
The named barriers they share with the loop are defined here (``NamedBarrierBwd``).
"""

import enum

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warp

from . import bwd_gate
from ..common.block_info import BlockInfo
from ..common.bwd_utils import (
    bulk_reduce_add_f32, elem_pointer, fragment_accum, red_add_tile, semaphore_signal, semaphore_wait,
)
from ..common.seqlen import SeqlenInfo
from ..common.sm90_utils import store_rows_predicated
from ..common.utils import convert_to_16bit

_WG_THREADS = 128


class NamedBarrierBwd(enum.IntEnum):
    """Hardware named barriers of the backward kernel (id 0 is ``__syncthreads``)."""

    DS_READY = 1  # all MMA threads: this block's dS (every warpgroup's keys) is in smem
    SEMAPHORE = 2  # all MMA threads: deterministic turns (common/bwd_utils.py)
    EPILOGUE = 3  # all MMA threads: no WGMMA reads sK/sV any more
    EPILOGUE_WG1 = 4  # warpgroup k on id + k: its rows of the dK/dV staging tile are written
    DQ_FULL = 6  # warpgroup k on id + k (and the writer): its half of this m_block's dQ is in sdQ
    DQ_WRITER = 8  # the dQ writer warp alone: deterministic turns
    DQ_EMPTY = 9  # warpgroup k on id + k (and the writer): the reduce-add of its half has read sdQ
    PP_DS = 11  # pingpong: id + 2 * (block parity) + k: warpgroup k's dS^T of the block is in smem and its dQ of the
    # block before has read sdSt (k arrives at its block's end, the other warpgroup waits before its next store)
    PP_START = 15  # pingpong: warpgroup 0 has formed its first dS^T (warpgroup 1 starts its loop half a block late)
    DS_FREE = 11  # bwd_wide96.py (never in ping-pong): all MMA threads: both warpgroups' dQ has read sdSt's dS^T


class FlashBwdSm90Store:
    """Store roles of ``FlashBwdSm90`` (a mixin: the kernel class holds the configuration)."""

    # ------------------------------------------------------------------ dQ

    def dq_staging(self, sdQ, tidx: Int32):
        """This thread's view of sdQ: its dQ fragment in the MMA-fragment order of ``bwd_utils``
        (``fragment_accum``, 4 values side by side) within its warpgroup's part of the tile, which the
        postprocess undoes (``wg_blocks``). A warp's 128-bit store covers 512 contiguous bytes (4
        wavefronts, no bank conflicts; the C layout's 64-bit stores into a swizzled row-major tile took
        4 wavefronts for 256 bytes), and the writer adds each warpgroup's part with one bulk reduce."""
        wg_idx = cute.arch.make_warp_uniform(tidx // _WG_THREADS)
        return fragment_accum(sdQ, self.tile_m * self.head_dim // self.num_mma_wg, _WG_THREADS, wg_idx,
                              tidx % _WG_THREADS, 4)

    @cute.jit
    def dq_to_smem(self, acc_dQ, tdQsdQ, after_first: cutlass.Boolean, stamps=None, block: Int32 | None = None):
        """This block's dQ -> sdQ once the writer's last reduce-add has read it (``after_first``:
        there was one), then tell the writer. (``stamps``, ``block``: the trace's points 12, 13.)"""
        wg_idx = cute.arch.make_warp_uniform((cute.arch.thread_idx()[0] - _WG_THREADS) // _WG_THREADS)
        if after_first:
            cute.arch.barrier(barrier_id=int(NamedBarrierBwd.DQ_EMPTY) + wg_idx, number_of_threads=self.dq_sync_threads)
        if const_expr(stamps is not None):
            self.stamp(stamps, block, 12)
        cute.autovec_copy(cute.make_tensor(acc_dQ.iterator, cute.make_layout(tdQsdQ.shape)), tdQsdQ)
        if const_expr(stamps is not None):
            self.stamp(stamps, block, 13)
        cute.arch.fence_view_async_shared()  # generic-proxy stores -> the TMA unit's reads
        cute.arch.barrier_arrive(barrier_id=int(NamedBarrierBwd.DQ_FULL) + wg_idx, number_of_threads=self.dq_sync_threads)

    @cute.jit
    def store_dq(self, sdQ, mdQaccum: cute.Tensor, mdQ_sem: cute.Tensor, seqlen: SeqlenInfo, n_block: Int32,
                 m_block_min: Int32, m_block_max: Int32, block_offset: Int32, window_left: Int32,
                 window_right: Int32, sQuerySums: cute.Tensor, dgq: cute.Tensor | None,
                 m_iter_end: Int32 | None = None, head_first: Int32 | None = None):
        """dQ writer warp: per m_block, wait for the MMA warpgroups' dQ tile in sdQ, reduce-add it into
        the fp32 accumulator's tile with one bulk add (lane 0), and hand sdQ back once the TMA unit
        has read it. Deterministic: the adds of a query block go in key-block turns (ascending
        n_block, descending for causal/local), each turn's add complete in L2 before the next may
        start; only this warp waits, the MMA warpgroups run on into the next block.

        ``mdQaccum``: (seqlen_q_padded * head_dim,) of this (batch, head); ``mdQ_sem``:
        (num_m_blocks_padded,) of this (batch, head). ``dgq`` (has_gate): this sequence and head's
        per-query dS sums, which take the slot's sums in the same step (and turn). ``gqa_loop``: ``mdQaccum`` and
        ``mdQ_sem`` of every query head of this (batch), the blocks of heads ``head_first``... in turn up to the
        virtual ``m_iter_end`` (``block_head``)."""
        lane = cute.arch.lane_idx()
        cute.arch.griddepcontrol_wait()  # the preprocess zeroed dQaccum (``load``'s wait)
        tile_elems = self.tile_m * self.head_dim
        half = tile_elems // self.num_mma_wg  # each warpgroup's part of sdQ (``dq_staging``)
        window_l = window_left if const_expr(self.is_local) else None
        window_r = window_right if const_expr(self.is_local) else None
        block_info = BlockInfo(self.tile_m, self.tile_n, self.is_causal, self.is_local, window_l, window_r)
        # (dq_claim) what the claim of the next block's tile found, made a block ahead (``claim_dq_tile``)
        next_claim = Int32(0)
        m_loop_end = m_iter_end if const_expr(self.gqa_loop) else m_block_max
        for m_virtual in cutlass.range(m_block_min, m_loop_end, unroll=1):
            m_block, mdQacc, mdQsem = m_virtual, mdQaccum, mdQ_sem
            if const_expr(self.gqa_loop):
                m_block, head = self.block_head(m_virtual, m_block_min, m_block_max, m_iter_end, head_first)
                mdQacc, mdQsem = mdQaccum[head, None], mdQ_sem[head, None]
            q_block = block_offset + m_block
            if m_virtual > m_block_min:
                # Hand each warpgroup its part back once the previous block's add of it has read it
                # (bulk groups complete in order: part k's before part k + 1's).
                for wg in cutlass.range_constexpr(self.num_mma_wg):
                    if lane == 0:
                        cute.arch.cp_async_bulk_wait_group(self.num_mma_wg - 1 - wg, read=True)
                    cute.arch.sync_warp()
                    cute.arch.barrier_arrive(barrier_id=int(NamedBarrierBwd.DQ_EMPTY) + wg,
                                             number_of_threads=self.dq_sync_threads)
            if const_expr(self.deterministic):
                turn = n_block
                if const_expr(self.is_causal or self.is_local):
                    _, n_block_max = block_info.n_block_min_max(seqlen.seqlen_q, seqlen.seqlen_k, m_block)
                    turn = n_block_max - 1 - n_block
                semaphore_wait(mdQsem, q_block, turn, lane, int(NamedBarrierBwd.DQ_WRITER), 32)
            if const_expr(self.dq_claim):
                # The tile is zero before the adds: claimed now on the first block, a block ahead after it.
                # The next block's claim is made here, under the wait for this block's dQ (at the block's end it
                # held the next DQ_EMPTY hand-back for a CAS's round trip).
                claim = next_claim
                if m_block == m_block_min:
                    claim = self.claim_dq_tile(mdQacc, mdQsem, q_block, lane)
                if m_block + 1 < m_block_max:
                    # (non-causal CTAs of a head reach each tile together: claimed and zeroed a block ahead, the
                    # tile is ready when they arrive, where a claim on arrival kept all but one waiting)
                    next_claim = self.claim_dq_tile(mdQacc, mdQsem, q_block + 1, lane)
                self.wait_dq_tile(mdQsem, q_block, claim, lane)
            # Each warpgroup's part as soon as it lands; one lane issues the adds and owns their bulk
            # groups (commit and waits are per thread).
            for wg in cutlass.range_constexpr(self.num_mma_wg):
                cute.arch.barrier(barrier_id=int(NamedBarrierBwd.DQ_FULL) + wg, number_of_threads=self.dq_sync_threads)
                if lane == 0:
                    bulk_reduce_add_f32(mdQacc.iterator + q_block * tile_elems + wg * half, sdQ.iterator + wg * half,
                                        half * 4)
                    cute.arch.cp_async_bulk_commit_group()
            if const_expr(self.has_gate):
                bwd_gate.add_query_sums(sQuerySums, (m_block - m_block_min) % 2, dgq, m_block, self.tile_m,
                                        seqlen.seqlen_q)
            cute.arch.sync_warp()
            if const_expr(self.deterministic):
                # The MMA warpgroups store their next dQ while this warp waits for the adds to land
                # and for the next block's turn.
                if lane == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=False)  # the adds are done in L2
                    cute.arch.fence_proxy("async.global")
                cute.arch.sync_warp()
                semaphore_signal(
                    mdQsem, q_block, lane, int(NamedBarrierBwd.DQ_WRITER), 32, fence_after_barrier=True
                )
        if lane == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # the last adds have read sdQ before the CTA exits

    @cute.jit
    def claim_dq_tile(self, mdQaccum: cute.Tensor, mdQ_state: cute.Tensor, q_block: Int32, lane: Int32) -> Int32:
        """(dq_claim) Claim dQaccum's tile ``q_block``, which the preprocess did not zero; returns what the claim
        found (every lane). Its state (0 never claimed, 1 being zeroed, 2 zeroed) moves 0 -> 1 by one CAS
        (acquire): the claimant's 32 lanes store the zeros (128-bit stores, 512 contiguous bytes per warp store),
        fence, and lane 0 stores 2 (release), and it returns 2; a CTA that found 1 waits for 2 in
        ``wait_dq_tile`` (the claimant waits on nothing in between, so no deadlock). (The postprocess reads a
        tile still at 0 as zeros.)"""
        state_ptr = elem_pointer(mdQ_state, q_block)
        prev = Int32(2)
        if lane == 0:
            prev = cute.arch.atomic_cas(state_ptr, cmp=Int32(0), val=Int32(1), sem="acquire", scope="gpu")
        prev = cute.arch.shuffle_sync(prev, 0)
        if prev == 0:
            mine = fragment_accum(mdQaccum, self.tile_m * self.head_dim, 32, q_block, lane, 4)
            zeros = cute.make_rmem_tensor((4,), Float32)
            zeros.fill(0.0)
            for i in cutlass.range(cute.size(mine, mode=[1]), unroll=8):
                cute.autovec_copy(zeros, mine[None, i])
            cute.arch.fence_acq_rel_gpu()  # (each lane's stores, before lane 0's release below)
            cute.arch.sync_warp()
            if lane == 0:
                cute.arch.store(state_ptr, Int32(2), sem="release", scope="gpu")
            prev = Int32(2)
        return prev

    @cute.jit
    def wait_dq_tile(self, mdQ_state: cute.Tensor, q_block: Int32, claim: Int32, lane: Int32):
        """(dq_claim) Tile ``q_block`` is zero before this CTA's adds: ``claim`` (``claim_dq_tile``'s result) 1
        waits for its claimant's release (acquire); then a proxy fence orders the zeros (generic proxy, ours or
        acquired) before the TMA unit's adds (async proxy)."""
        if claim == 1:
            self.await_zeroed(mdQ_state, q_block, lane)
        cute.arch.fence_proxy("async.global")

    @cute.jit
    def await_zeroed(self, mdQ_state: cute.Tensor, q_block: Int32, lane: Int32):
        """(dq_claim) Lane 0 spins (acquire loads) until another CTA's claimant has released tile ``q_block``'s
        zeros (state 2); the warp then goes on together."""
        if lane == 0:
            state_ptr = elem_pointer(mdQ_state, q_block)
            state = cute.arch.load(state_ptr, Int32, sem="acquire", scope="gpu")
            while state != 2:
                state = cute.arch.load(state_ptr, Int32, sem="acquire", scope="gpu")
        cute.arch.sync_warp()

    # ------------------------------------------------------------------ epilogues

    @cute.jit
    def epilogue_mha(self, acc_dK, acc_dV, dk_scale: Float32, mdK_cur, mdV_cur, sK, sV,
                     tiled_mma_dkv: cute.TiledMma, tidx: Int32, n_block: Int32, seqlen_k: Int32):
        """dK * scale, dV -> 16-bit -> sK / sV (stmatrix; every WGMMA is done reading them) ->
        each warpgroup stores its 64 rows below ``seqlen_k`` with 128-bit stores."""
        acc_dK.store(acc_dK.load() * dk_scale)
        rdK = convert_to_16bit(acc_dK, self.dtype)
        rdV = convert_to_16bit(acc_dV, self.dtype)
        cute.arch.barrier(barrier_id=int(NamedBarrierBwd.EPILOGUE), number_of_threads=self.num_mma_threads)
        r2s = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype),
            tiled_mma_dkv,
        ).get_slice(tidx)
        cute.copy(r2s, r2s.retile(rdK), r2s.partition_D(sK))
        cute.copy(r2s, r2s.retile(rdV), r2s.partition_D(sV))
        wg_idx = cute.arch.make_warp_uniform(tidx // _WG_THREADS)
        cute.arch.barrier(barrier_id=int(NamedBarrierBwd.EPILOGUE_WG1) + wg_idx, number_of_threads=_WG_THREADS)
        rows = (64, self.head_dim)
        row0 = n_block * self.tile_n + wg_idx * 64
        wg_block = n_block * (self.tile_n // 64) + wg_idx
        for sX, mX in ((sK, mdK_cur), (sV, mdV_cur)):
            store_rows_predicated(
                cute.local_tile(sX, rows, (wg_idx, 0)), cute.local_tile(mX, rows, (wg_block, 0)),
                tidx % _WG_THREADS, seqlen_k - row0, self.dtype, _WG_THREADS,
            )

    @cute.jit
    def epilogue_gqa(self, acc_dK, acc_dV, mdKaccum, mdVaccum, mdKV_sem, tiled_mma_dkv: cute.TiledMma,
                     tidx: Int32, k_block: Int32, head_in_group: Int32, deterministic: Int32, staging: tuple,
                     num_keys: None = None):
        """Reduce-add this query head's fp32 dK (unscaled) and dV into its KV head's sums.

        The sums are in MMA-fragment order per warpgroup (``fragment_accum`` over its 128 threads,
        4 values side by side; tile ``2 * k_block + warpgroup`` of 64 rows; the postprocess's
        ``wg_blocks`` undoes it). Default: each warpgroup stages both fragments in smem
        (``staging``: dV's and dK's flat fp32 regions, one 64-row tile per warpgroup each; 128-bit
        stores) and one thread adds each with one bulk reduce, where 64 ``red.v2`` per thread into
        row-major sums took 8 sectors each and held the CTA's exit. Deterministic: ``red.v4`` from
        registers in the KV head's turns (``mdKV_sem``). (``num_keys``: bwd_wide96.py's.)"""
        wg_idx = cute.arch.make_warp_uniform(tidx // _WG_THREADS)
        wg_tidx = tidx % _WG_THREADS
        wg_elems = 64 * self.head_dim
        block = k_block * (self.tile_n // 64) + wg_idx
        if const_expr(self.deterministic):
            semaphore_wait(mdKV_sem, k_block, head_in_group, tidx, int(NamedBarrierBwd.SEMAPHORE), self.num_mma_threads)
            red_add_tile(acc_dV, fragment_accum(mdVaccum, wg_elems, _WG_THREADS, block, wg_tidx, 4), 4)
            red_add_tile(acc_dK, fragment_accum(mdKaccum, wg_elems, _WG_THREADS, block, wg_tidx, 4), 4)
            semaphore_signal(mdKV_sem, k_block, tidx, int(NamedBarrierBwd.SEMAPHORE), self.num_mma_threads)
        else:
            cute.arch.barrier(barrier_id=int(NamedBarrierBwd.EPILOGUE), number_of_threads=self.num_mma_threads)
            for acc, sX in ((acc_dV, staging[0]), (acc_dK, staging[1])):
                tXsX = fragment_accum(sX, wg_elems, _WG_THREADS, wg_idx, wg_tidx, 4)
                cute.autovec_copy(cute.make_tensor(acc.iterator, cute.make_layout(tXsX.shape)), tXsX)
            cute.arch.fence_view_async_shared()  # generic-proxy stores -> the TMA unit's reads
            cute.arch.barrier(barrier_id=int(NamedBarrierBwd.EPILOGUE_WG1) + wg_idx, number_of_threads=_WG_THREADS)
            if wg_tidx == 0:
                for mX, sX in ((mdVaccum, staging[0]), (mdKaccum, staging[1])):
                    bulk_reduce_add_f32(mX.iterator + block * wg_elems, sX.iterator + wg_idx * wg_elems, wg_elems * 4)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)  # smem is read before the CTA exits
