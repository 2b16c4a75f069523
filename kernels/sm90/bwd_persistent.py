"""Persistent tile walk of the Hopper backward (``sm90/bwd.py``, ``persistent``): ``FlashBwdSm90Persistent``.

Purpose: at most one CTA per SM, each taking key blocks ``(n_block, head, batch)`` from a dynamic tile counter
(``common/tile_scheduler.py``: the first tile is the CTA's index, the next ``grid + atomicAdd``) instead of one
CTA per key block. A non-persistent CTA pays 4.3-5.8 us of fixed cost per key block on an H100 (launch, barrier
init, K/V's first load, the epilogue's drain; perf/NOTES.md session 32), ~30-43 % of a 512-1k causal kernel.
Persistent, the prologue is paid once per SM, and the next tile's first Q/dO stages and its K/V load under this
tile's epilogue: K/V's stage is released at the tile's last GEMM, and the epilogue stages dK / dV through sdSt
(``staging_views``) instead of sK / sV. (Staged through sK / sV, released after the epilogue, the walk measured
flat: K/V's load latency, 1.3-3.4 us under load, stayed exposed; perf/NOTES.md session 33.)

Roles (each walks the same tile sequence; the producer warp fetches the next index and publishes it through
``TileHandoff``, whose consumers are the MMA threads and the dQ writer's lanes):

    | role        | per tile                                                                         |
    | producer    | [first tile, or one without blocks: K/V first] Q/dO/LSE/dPsum of each m_block     |
    |             | into the ring (state carried across tiles); K/V after the first block's, once    |
    |             | the previous tile's last GEMM released their stage; fetch + publish the next tile|
    | dQ writer   | its m_blocks' reduce-adds, sdQ's hand-back counted over the CTA's lifetime       |
    | MMA (x2)    | wait K/V (every tile: the producer loads them even without blocks), zeroed dK/dV,|
    |             | the m_block loop (ring state carried), release K/V's stage, the epilogue through |
    |             | sdSt, a barrier of both warpgroups before the next tile's dS^T stores            |

    Pipelines across tiles: pipeline_kv's one stage flips phase per tile (producer acquire waits for the 8 MMA
    warps' release after their last GEMM); pipeline_q / pipeline_do keep one ring state per role for the CTA's
    whole life; the DQ_EMPTY / DQ_FULL named barriers count blocks over the CTA's life (``blocks_before``).

Timeline of one SM (two tiles)::

    producer  |K V|Q0 Q1 ...........Qn|Q0'|K' V'|Q1' ...
    MMA       |   |blk0 blk1 ... blkn |rel|epilogue (sdSt)|blk0' ...
    writer    |        dQ0  dQ1 ... dQn |             dQ0' ...

Scope: dense, MHA, non-deterministic, no gate, tile_n 128 (the table's keys; ``FlashBwdSm90``'s
constructor refuses the rest). GQA stages its fp32 dK/dV sums in sQ | sdO, which the next tile's Q/dO would
overwrite; deterministic CTAs take turns per key block; varlen maps its grid through ``varlen_tile_coord``.

Paper: FlashAttention-3 (Shah et al., 2024) section 3.1 (persistent kernels); design doc ``fa3_cute_design.md``
1.11 (tile schedulers) and section 2.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr

from ..common.bwd_utils import m_block_min_max
from ..common.seqlen import SeqlenInfo
from ..common.sm90_utils import make_smem_layout_sm90
from ..common.tile_scheduler import TileHandoff, TileScheduler
from ..common.utils import opaque_i32, select_head
from .bwd_store import _WG_THREADS, NamedBarrierBwd


class FlashBwdSm90Persistent:
    """The persistent roles of ``FlashBwdSm90`` (a mixin: the kernel class holds the configuration)."""

    @cute.jit
    def tile_rows(self, scheduler: TileScheduler, tile_idx: Int32, seqlen_q_static: Int32, seqlen_k_static: Int32,
                  window_left: Int32, window_right: Int32):
        """``(n_block, head_idx, batch_idx, seqlen, m_block_min, m_block_max)`` of tile ``tile_idx`` (the
        scheduler's "m_block" is the key block here); every role computes the same."""
        n_block, head_idx, batch_idx = scheduler.coords(tile_idx)
        seqlen = SeqlenInfo.create(batch_idx, seqlen_q_static, seqlen_k_static, None, None, None, None)
        m_block_min, m_block_max = m_block_min_max(
            self.tile_m, self.tile_n, n_block, seqlen.seqlen_q, seqlen.seqlen_k, self.is_causal, self.is_local,
            window_left, window_right,
        )
        return n_block, head_idx, batch_idx, seqlen, m_block_min, m_block_max

    def staging_views(self, sdSt_storage) -> tuple:
        """``(dK's, dV's)`` epilogue staging tiles, sK-shaped views of sdSt's buffer (free once the tile's last
        dQ GEMM has read it): both where they fit (hdim 64: 2 x 16 KB of 64 KB), else one for both in turn (hdim
        128: 32 KB; ``epilogue_mha`` with ``sV`` None)."""
        sdSt_elems = 2 * self.tile_n * self.tile_m  # (``_smem_layouts``: pds_stages = 2)
        if const_expr(2 * self.tile_n * self.head_dim <= sdSt_elems):
            both = make_smem_layout_sm90(self.dtype, self.tile_n, self.head_dim, 2)
            views = sdSt_storage.get_tensor(both.outer, swizzle=both.inner)
            return views[None, None, 0], views[None, None, 1]
        one = make_smem_layout_sm90(self.dtype, self.tile_n, self.head_dim)
        return sdSt_storage.get_tensor(one.outer, swizzle=one.inner), None

    @cute.jit
    def load_persistent(self, tensors, smem, atoms, pipe_kv, pipe_q, pipe_do, scheduler: TileScheduler,
                        handoff: TileHandoff, seqlens: tuple, qhead_per_kvhead: Int32):
        """Producer warp (all 32 lanes): every tile of the CTA. ``tensors``: (mQ, mK, mV, mdO, mLSE, mdPsum) TMA
        coordinates; ``smem``: (sQ, sK, sV, sdO, sLSE, sdPsum); ``seqlens``: (seqlen_q_static, seqlen_k_static,
        window_left, window_right)."""
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        handoff_state = handoff.producer_state()
        tiles_done = Int32(0)
        tile_idx = scheduler.first_tile()
        while tile_idx < scheduler.num_tiles:
            n_block, head_idx, batch_idx, seqlen, m_block_min, m_block_max = self.tile_rows(
                scheduler, tile_idx, *seqlens
            )
            kv, q_do = self.load_partitions(*tensors, *smem, atoms, seqlen, batch_idx, head_idx,
                                            head_idx // qhead_per_kvhead, batch_idx, n_block)
            # K/V first on the CTA's first tile (issued before the preprocess is waited for, as the one-tile
            # kernel does) and on a tile without blocks; else after the first block's Q/dO, whose ring stage is
            # free before the epilogue releases K/V's.
            kv_first = tiles_done == 0 or m_block_min >= m_block_max
            if kv_first:
                self.load_kv(kv, atoms, pipe_kv, kv_state)
                kv_state.advance()
            if tiles_done == 0:
                cute.arch.griddepcontrol_wait()  # LSE_log2, dPsum (``load``'s wait)
            for m_block in cutlass.range(m_block_min, m_block_max, unroll=1):
                self.load_q_do(q_do, atoms, pipe_q, pipe_do, state, m_block, Int32(0))
                state.advance()
                if m_block == m_block_min and not kv_first:
                    self.load_kv(kv, atoms, pipe_kv, kv_state)
                    kv_state.advance()
            tiles_done += 1
            tile_idx, handoff_state = scheduler.next_tile_producer(tile_idx, handoff, handoff_state)

    @cute.jit
    def store_dq_persistent(self, sdQ, mdQaccum: cute.Tensor, mdQ_sem: cute.Tensor, scheduler: TileScheduler,
                            handoff: TileHandoff, seqlens: tuple, sQuerySums: cute.Tensor):
        """dQ writer warp: ``store_dq`` of every tile of the CTA, then the wait for its last adds' smem reads."""
        handoff_state = handoff.consumer_state()
        blocks_before = Int32(0)
        tile_idx = scheduler.first_tile()
        while tile_idx < scheduler.num_tiles:
            n_block, head_idx, batch_idx, seqlen, m_block_min, m_block_max = self.tile_rows(
                scheduler, tile_idx, *seqlens
            )
            self.store_dq(
                sdQ, mdQaccum[batch_idx, head_idx, None], mdQ_sem[batch_idx, head_idx, None], seqlen, n_block,
                m_block_min, m_block_max, Int32(0), seqlens[2], seqlens[3], sQuerySums, None, blocks_before,
            )
            blocks_before += m_block_max - m_block_min
            tile_idx, handoff_state = scheduler.next_tile_consumer(tile_idx, handoff, handoff_state)
        if cute.arch.lane_idx() == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # the last adds have read sdQ before the CTA exits

    @cute.jit
    def mma_persistent(self, smem, sdSt, sdQ, sQuerySums, pipe_kv, pipe_q, pipe_do, scheduler: TileScheduler,
                       handoff: TileHandoff, seqlens: tuple, scale_log2: Float32, softcap_scale: Float32 | None,
                       softmax_scale: Float32, mdK: cute.Tensor, mdV: cute.Tensor, qhead_per_kvhead: Int32,
                       staging: tuple, trace_out: cute.Tensor | None = None):
        """MMA warpgroups: for every tile of the CTA the m_block loop (``mma``), K/V's stage released to the
        producer as soon as the last GEMM has read it, then the MHA epilogue through ``staging`` (sK-shaped views of
        sdSt, ``staging_views``), under which the next tile's K/V land. ``trace_out`` (trace): the clocks' and
        every tile's span's buffer (``bwd_loop.py`` ``store_stamps``, ``store_cta_span``)."""
        sQ, sK, sV, sdO, sLSE, sdPsum = smem
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        blocks_before = Int32(0)
        # K/V's stage and the handoff's slot turn once per tile: their consumer states are the tile count's
        # (fewer registers live across the m_block loop: three per carried state spilled at hdim 128).
        tiles_done = Int32(0)
        tile_idx = scheduler.first_tile()
        while tile_idx < scheduler.num_tiles:
            kv_state = pipeline.PipelineState(1, tiles_done, Int32(0), tiles_done % 2)
            n_block, head_idx, batch_idx, seqlen, m_block_min, m_block_max = self.tile_rows(
                scheduler, tile_idx, *seqlens
            )
            tile_start = cute.arch.globaltimer_lo() if const_expr(self.trace) else None
            mma_out = self.mma(
                sQ, sK, sV, sdO, sdSt, sLSE, sdPsum, sdQ, pipe_kv, pipe_q, pipe_do,
                seqlen, n_block, m_block_min, m_block_max, scale_log2, softcap_scale, seqlens[2], seqlens[3],
                sQuerySums, None, None, trace_out, (state, kv_state, blocks_before),
            )
            acc_dK, acc_dV, tiled_mma_dkv = mma_out[:3]
            state = mma_out[-1]
            # Every warp is past its last GEMM (``mma`` ends on a full wait), so no WGMMA reads sK / sV any more:
            # the stage's empty barrier completes once all 8 warps have arrived.
            pipe_kv.consumer_release(kv_state)
            head_idx_kv = head_idx // qhead_per_kvhead
            # (the epilogue's addresses from a thread index computed here, not hoisted out of the tile loop)
            tidx = opaque_i32(cute.arch.thread_idx()[0]) - _WG_THREADS
            self.epilogue_mha(
                acc_dK, acc_dV, softmax_scale,
                seqlen.k_view(select_head(mdK, head_idx_kv, 2), batch_idx),
                seqlen.k_view(select_head(mdV, head_idx_kv, 2), batch_idx),
                staging[0], staging[1], tiled_mma_dkv, tidx, n_block, seqlen.seqlen_k,
            )
            if const_expr(self.trace):
                self.store_cta_span(trace_out, (tile_start, *mma_out[3]), tidx, m_block_max - m_block_min, tile_idx)
            # Every MMA thread's epilogue reads of sdSt are done before the next tile's dS^T stores (other rows of
            # other warpgroups in sdSt's own layout).
            cute.arch.barrier(barrier_id=int(NamedBarrierBwd.EPILOGUE), number_of_threads=self.num_mma_threads)
            blocks_before += m_block_max - m_block_min
            tile_idx, _ = scheduler.next_tile_consumer(
                tile_idx, handoff, pipeline.PipelineState(1, tiles_done, Int32(0), tiles_done % 2)
            )
            tiles_done += 1
