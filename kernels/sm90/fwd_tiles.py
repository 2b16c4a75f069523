"""Tile walk of the Hopper forward kernel (kernels/sm90/fwd.py): the scheduler and each tile's work.

Split out of the kernel module by role (STYLE: files under ~900 lines). ``FwdSm90Tiles`` is a mixin of
``FlashFwdSm90``; it reads the kernel's static configuration (``tile_m``, ``tile_n``, ``head_dim``,
``head_dim_v``, ``dtype``, ``num_mma_wg``, ``is_causal``, ``is_local``, ``persistent``, ``cluster_m``,
``section_l2_mb``, ``span_heads``, ``dynamic_schedule``) from ``self``. Both roles (load, MMA) call
``tile_work``, or ``span_pairs`` (the producer) and ``span_tile_work`` built on it (the MMA
warpgroups), and so agree on every tile.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from ..common.seqlen import SeqlenInfo, num_varlen_tiles_upper_bound, varlen_tile_coord
from ..common.tile_scheduler import TileScheduler, section_heads
from .fwd_parts import TileCoord, TileWalk


class FwdSm90Tiles:
    def _scheduler(
        self, mQ: cute.Tensor, mK: cute.Tensor, num_batch: Int32, varlen_q: bool,
        mTileCounter: cute.Tensor | None,
    ) -> TileScheduler:
        """Dense: ``ceil(seqlen_q / tile_m)`` tiles per (batch, head). Varlen: an upper bound of
        tiles over all sequences per head (``num_batch`` of the scheduler is 1). Causal/local:
        sections of heads sized by L2, counting a varlen call's mean key length."""
        if const_expr(varlen_q):
            num_m_blocks = num_varlen_tiles_upper_bound(mQ.shape[0], num_batch, self.tile_m)
            scheduler_batch = Int32(1)
        elif const_expr(self.span_heads):
            # Spanning tiles: the scheduler counts 64-row blocks, num_mma_wg of them per tile.
            num_m_blocks = (cute.size(mQ, mode=[0]) + 63) // 64
            scheduler_batch = num_batch
        else:
            num_m_blocks = (cute.size(mQ, mode=[0]) + (self.tile_m - 1)) // self.tile_m
            scheduler_batch = num_batch
        longest_first = self.is_causal or self.is_local
        heads_per_section = None
        if const_expr(longest_first):
            heads_per_section = Int32(1)
            if const_expr(self.section_l2_mb > 0):
                # mK's rows: seqlen_k, or (varlen) the keys of all num_batch sequences; mQ's head
                # mode counts KV heads when packed (pack_gqa), so the ratio is then 1.
                seqlen_k = cute.size(mK, mode=[0]) // (num_batch if const_expr(len(mK.shape) == 3) else 1)
                heads_per_section = section_heads(
                    seqlen_k, (self.head_dim + self.head_dim_v) * self.dtype.width // 8,
                    mQ.shape[2] // mK.shape[2], self.section_l2_mb * 2**20,
                )
        return TileScheduler.create(
            num_m_blocks, mQ.shape[2], scheduler_batch, self.persistent, longest_first=longest_first,
            mTileCounter=mTileCounter if const_expr(self.dynamic_schedule) else None,
            cluster_m=self.cluster_m, heads_per_section=heads_per_section,
            blocks_per_tile=self.num_mma_wg if const_expr(self.span_heads) else 1,
        )

    @cute.jit
    def tile_work(self, walk: TileWalk, tile_idx: Int32):
        """``(has_tile, batch_idx, head_idx, seqlen, tile)`` of tile ``tile_idx``; varlen tiles past
        the last sequence's have none (``has_tile`` is a compile-time True when dense)."""
        m_block, head_idx, batch_idx = walk.scheduler.coords(tile_idx)
        has_tile = True
        mCuSeqlensQ, _, mSeqUsedQ, _ = walk.seqlen_args
        if const_expr(mCuSeqlensQ is not None):
            # Every warp scans cu_seqlens_q and reaches the same (batch, m_block): CTA-uniform.
            batch_idx, m_block = varlen_tile_coord(
                m_block, walk.num_batch, self.tile_m, mCuSeqlensQ, mSeqUsedQ
            )
            has_tile = batch_idx >= 0
        seqlen = SeqlenInfo.create(
            cutlass.max(batch_idx, 0), walk.seqlen_q_static, walk.seqlen_k_static, *walk.seqlen_args
        )
        n_block_min, n_block_max = walk.block_info.n_block_min_max(
            seqlen.seqlen_q, seqlen.seqlen_k, m_block
        )
        if const_expr(walk.live_blocks is not None):
            # (skip_decayed_blocks: the blocks before hold only exact zeros of P; the producer and the MMA
            # warpgroups read the same entry, so their block counts agree; packed: batch_idx is the sequence, -1
            # past the last one's tiles, where the entry goes unused)
            entry_b = batch_idx if const_expr(mCuSeqlensQ is None) else cutlass.max(batch_idx, 0)
            n_block_min = cutlass.max(n_block_min, walk.live_blocks[entry_b, head_idx, m_block])
        tile = TileCoord(m_block, seqlen.seqlen_q, seqlen.seqlen_k, n_block_min, n_block_max)
        return has_tile, batch_idx, head_idx, seqlen, tile

    @cute.jit
    def span_pairs(self, walk: TileWalk, tile_idx: Int32):
        """Spanning tile ``tile_idx``: ``(first_block, last_block, bh_first, bh_last)``, its first
        flat 64-row block, the launch's last block, and the flat (batch, head) pair of its first and
        of its last block (the last clamped to the launch's last block). The launcher spans only
        when a head has >= num_mma_wg - 1 blocks, so ``bh_last - bh_first`` is 0 or 1."""
        sched = walk.scheduler
        first_block = tile_idx * self.num_mma_wg
        last_block = sched.num_blocks - 1
        bh_first = first_block // sched.num_m_blocks
        bh_last = cutlass.min(first_block + self.num_mma_wg - 1, last_block) // sched.num_m_blocks
        return first_block, last_block, bh_first, bh_last

    @cute.jit
    def span_tile_work(self, walk: TileWalk, tile_idx: Int32, wg_idx: Int32):
        """Spanning tile ``tile_idx``, warpgroup ``wg_idx``: ``(in_range, batch_idx, head_idx,
        m_block, ring_b, mixed, seqlen, tile)``. ``m_block`` counts 64-row blocks; a block index
        past the launch's last repeats the last (``in_range`` False: computed, not stored).
        ``ring_b`` (0/1): this block's (batch, head) is not the tile's first (its K/V come through
        ring B); ``mixed`` (0/1): the tile's last block's is not (``span_pairs``)."""
        sched = walk.scheduler
        first_block, last_block, bh_first, bh_last = self.span_pairs(walk, tile_idx)
        block = first_block + wg_idx
        m_block, head_idx, batch_idx = sched.coords(cutlass.min(block, last_block))
        ring_b = batch_idx * sched.num_heads + head_idx - bh_first
        seqlen = SeqlenInfo.create(batch_idx, walk.seqlen_q_static, walk.seqlen_k_static, *walk.seqlen_args)
        n_block_min, n_block_max = walk.block_info.n_block_min_max(seqlen.seqlen_q, seqlen.seqlen_k, Int32(0))
        tile = TileCoord(Int32(0), seqlen.seqlen_q, seqlen.seqlen_k, n_block_min, n_block_max)
        return block <= last_block, batch_idx, head_idx, m_block, ring_b, bh_last - bh_first, seqlen, tile

