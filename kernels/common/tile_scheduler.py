"""Which output tiles ``(m_block, head, batch)`` a CTA computes, and in what order.

Purpose: one 1-D tile index space over every query tile of a launch, walked in one of three ways:
- one tile per CTA (``persistent=False``): a grid of ``num_tiles`` CTAs, handed out in index
  order by the hardware block scheduler as SMs free up;
- static persistent: at most one CTA per SM, CTA ``c`` takes tiles ``c, c + G, c + 2G, ...``
  (``G`` = grid size). Right when every tile costs the same (no causal/local mask);
- dynamic persistent: CTA ``c`` starts with tile ``c``, then takes ``G + atomicAdd(counter, 1)``:
  the hardware's greedy order without its per-CTA prologue, for causal/local tiles whose costs
  differ. The counter is zero at launch and the launch leaves it at zero (its last fetch resets
  it), so the host zeroes a counter once, not with a memset before every launch.
Persistent CTAs (FA3 section 3.1) pay the prologue (barrier init, descriptor prefetch) once and
overlap the next tile's loads with this tile's epilogue.

Index order: ``m_block`` fastest, then head, then batch, so CTAs running together share one
(batch, head)'s K/V in L2. With ``longest_first`` (causal/local, where tiles near the bottom see
the most keys) the (batch, head) pairs are cut into sections of ``heads_per_section`` pairs whose
K/V fit in L2 together (``section_heads``: 16 MiB, at most 16 pairs); within a section the order is
m_block slowest, bottom-up, and head fastest (FA3's L2 swizzle). Greedy CTAs then take every
section's longest tiles first. Head by head, the last head's longest tiles start with only that
head's work left to hide them behind (modelled 5-14 % past the ideal finish at hdim 128-256 and
2k-8k; sections measured -0.5..+9 % there on H100, 2026-11-21, perf/NOTES.md "Session 9"); sorting
across all heads loses 5-15 % (H200, 2026-11-21: K/V of 132 heads at once no longer fit in L2).

Clusters (``cluster_m > 1``, dense only): the CTAs of a cluster (consecutive in x) walk one index
sequence in lockstep, an index naming a group of ``cluster_m`` adjacent m_blocks of one (batch, head),
of which CTA rank ``r`` takes the ``r``-th; they then share every K/V block (TMA multicast). The
last group of an odd count holds an m_block past the end: its CTA loads and computes with the
others (zero-filled Q) and stores nothing (the TMA store clips it, LSE stores are row-predicated).

Spanning tiles (``blocks_per_tile = k > 1``, dense and unmasked): an index names ``k`` consecutive
m_blocks of the flat ``(batch, head, m_block)`` order (m_block fastest), which may run on into the
next head: the kernel's ``k`` MMA warpgroups each take one of them, so no warpgroup computes rows
past its sequence's end unless the launch has no block left (its last index). ``coords`` then maps
one m_block's flat index, not a tile index.

Varlen: ``num_batch = 1`` and ``num_m_blocks`` an upper bound of tiles over all sequences; the
kernel maps the ``m_block`` it gets to ``(sequence, m_block)`` with ``seqlen.varlen_tile_coord``.

Dynamic handoff: one producer warp fetches the next index and publishes it through a shared
memory slot guarded by a one-stage mbarrier pipeline (``full``: lane 0 stored the index and
arrived, a release; ``empty``: every consumer thread read it and arrived, its own read released
by its own arrive). A consumer waits only for ``full`` (an acquire), never for another consumer,
so warpgroups that run out of phase (ping-pong) stay so from tile to tile; the producer's next
publish waits for every consumer's ``empty`` arrival. Each role carries its pipeline state across
tiles. (Named barriers, ``bar.arrive`` by the producer and ``bar.sync`` by the consumers, order
the same accesses by the PTX memory model, but compute-sanitizer's racecheck reported the read as
racing with the write whenever the producer arrived before the consumers, e.g. on a varlen CTA
whose tile lies past the last sequence; mbarriers are what racecheck, the TMA pipelines and we
all reason with, so the sanitizer stays a usable signal.)

Constraints: ``num_tiles < 2**31``; every thread of a CTA walks the same tile sequence.

Paper: FlashAttention-3 (Shah et al., 2024) section 3.1 (persistent kernels, tile scheduling);
design doc ``fa3_cute_design.md`` 1.11 (tile schedulers).
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32


def section_heads(
    seqlen_k: Int32, kv_bytes_per_key: int, qhead_per_kvhead: Int32, l2_bytes: int, max_pairs: int = 16
) -> Int32:
    """(batch, head) pairs per longest-first section: as many as have their K and V (``seqlen_k``
    keys of ``kv_bytes_per_key`` bytes, K's row plus V's) in ``l2_bytes`` at once, counting the
    ``qhead_per_kvhead`` query heads that read one KV head (GQA) as one; at least one KV head's
    query heads, at most ``max_pairs`` rounded down to whole KV heads (and never below one). A
    head's tiles are a section's width apart in the order, so its K/V must stay in L2 that long:
    short sequences, whose K/V would allow 32-256 pairs, measured 2-13 % slower with them than
    head by head (H100, 2026-11-21, perf/NOTES.md "Session 9"); 16 pairs still balance the CTAs."""
    keys_in_l2 = l2_bytes // kv_bytes_per_key
    kv_heads = cutlass.max(keys_in_l2 // cutlass.max(seqlen_k, 1), 1)
    max_kv_heads = cutlass.max(max_pairs // qhead_per_kvhead, 1)
    return cutlass.min(kv_heads, max_kv_heads) * qhead_per_kvhead


@dataclass(frozen=True)
class TileHandoff:
    """The dynamic scheduler's producer -> consumers handoff: a shared-memory slot and a one-stage
    ``PipelineAsync`` (producer: one thread, lane 0 of the producer warp; consumers: every thread
    that reads the slot, each arriving on ``empty`` once per read)."""

    sNextTile: cute.Tensor  # (1,) Int32 in shared memory
    pipe: pipeline.PipelineAsync

    @staticmethod
    def create(sNextTile: cute.Tensor, mbar_ptr: cute.Pointer, num_consumer_threads: int) -> "TileHandoff":
        """``mbar_ptr``: two mbarriers (full, empty) in shared memory. Initialised without a sync:
        the caller's pipeline init fence and CTA barrier publish them with its other pipelines."""
        pipe = pipeline.PipelineAsync.create(
            num_stages=1,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, num_consumer_threads),
            barrier_storage=mbar_ptr, defer_sync=True,
        )
        return TileHandoff(sNextTile, pipe)

    @staticmethod
    def producer_state() -> pipeline.PipelineState:
        """The producer's state before its first publish (the slot starts empty)."""
        return pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)

    @staticmethod
    def consumer_state() -> pipeline.PipelineState:
        return pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)


@dataclass(frozen=True)
class TileScheduler:
    num_m_blocks: Int32  # query tiles (with clusters: groups of cluster_m) per (batch, head)
    num_heads: Int32
    num_batch: Int32
    num_tiles: Int32  # indices walked: m_block groups (of cluster_m) x heads x batches
    persistent: bool
    longest_first: bool
    mTileCounter: cute.Tensor | None  # (1,) Int32 in gmem, zero at launch and left zero: dynamic schedule
    cluster_m: int = 1  # CTAs per cluster, each taking one m_block of an index's group
    # longest_first only: (batch, head) pairs per section, 1 <= it <= num_heads * num_batch
    heads_per_section: Int32 | None = None
    blocks_per_tile: int = 1  # > 1: spanning tiles of this many flat m_blocks (one per MMA warpgroup)

    @staticmethod
    def create(
        num_m_blocks: Int32, num_heads: Int32, num_batch: Int32, persistent: bool,
        longest_first: bool, mTileCounter: cute.Tensor | None = None, cluster_m: int = 1,
        heads_per_section: Int32 | None = None, blocks_per_tile: int = 1,
    ) -> "TileScheduler":
        """``heads_per_section`` (longest_first only): (batch, head) pairs whose K/V share L2 at
        once (``section_heads``); clamped here to ``[1, num_heads * num_batch]``.
        ``blocks_per_tile > 1``: spanning tiles (static schedule, no clusters, no sections)."""
        assert cluster_m == 1 or mTileCounter is None, "clusters walk a static schedule"
        assert not longest_first or heads_per_section is not None, "longest_first walks sections"
        assert blocks_per_tile == 1 or (cluster_m == 1 and mTileCounter is None and not longest_first)
        num_groups = (num_m_blocks + (cluster_m - 1)) // cluster_m if cluster_m > 1 else num_m_blocks
        if longest_first:
            heads_per_section = cutlass.max(cutlass.min(heads_per_section, num_heads * num_batch), 1)
        num_tiles = num_groups * num_heads * num_batch
        if blocks_per_tile > 1:
            num_tiles = (num_tiles + (blocks_per_tile - 1)) // blocks_per_tile
        return TileScheduler(
            num_groups, num_heads, num_batch, num_tiles,
            persistent, longest_first, mTileCounter, cluster_m, heads_per_section, blocks_per_tile,
        )

    @property
    def num_blocks(self) -> Int32:
        """m_blocks over every (batch, head): the flat indices ``coords`` accepts."""
        return self.num_m_blocks * self.num_heads * self.num_batch

    def grid_size(self, max_ctas: Int32) -> Int32:
        """CTAs to launch: one per tile, or (persistent) at most ``max_ctas`` (one per SM); a
        multiple of ``cluster_m``."""
        if self.persistent:
            if cutlass.const_expr(self.cluster_m > 1):
                return cutlass.min(self.num_tiles, max_ctas // self.cluster_m) * self.cluster_m
            return cutlass.min(self.num_tiles, max_ctas)
        return self.num_tiles * self.cluster_m

    @property
    def dynamic(self) -> bool:
        return self.persistent and self.mTileCounter is not None

    def first_tile(self) -> Int32:
        if cutlass.const_expr(self.cluster_m > 1):
            return cute.arch.block_idx()[0] // self.cluster_m  # the cluster's index
        return cute.arch.block_idx()[0]

    def _stride(self) -> Int32:
        """Indices between a static persistent CTA's tiles: the number of CTAs (clusters)."""
        if cutlass.const_expr(self.cluster_m > 1):
            return cute.arch.grid_dim()[0] // self.cluster_m
        return cute.arch.grid_dim()[0]

    @cute.jit
    def next_tile_producer(
        self, tile_idx: Int32, handoff: TileHandoff | None, state: pipeline.PipelineState | None
    ):
        """The producer warp's next tile and its advanced handoff state (dynamic: fetched, then
        published to the consumers); the tile is ``>= num_tiles`` when the CTA has none left. All
        32 lanes call it."""
        next_idx = tile_idx + self.num_tiles
        if cutlass.const_expr(self.dynamic):
            fetched = Int32(0)
            if cute.arch.lane_idx() == 0:
                fetched = cute.arch.atomic_add(
                    self.mTileCounter.iterator, Int32(1), sem="relaxed", scope="gpu"
                )
                # A launch fetches exactly num_tiles times (once per tile past each CTA's first,
                # once past the end per CTA; grid <= num_tiles), so the fetch that returns
                # num_tiles - 1 is its last: it zeroes the counter for the next launch.
                if fetched == self.num_tiles - 1:
                    cute.arch.atomic_exch(self.mTileCounter.iterator, Int32(0), sem="relaxed", scope="gpu")
            next_idx = cute.arch.grid_dim()[0] + cute.arch.shuffle_sync(fetched, 0)
            # Every consumer has read the previous index (the first publish does not wait).
            handoff.pipe.producer_acquire(state)
            if cute.arch.lane_idx() == 0:
                handoff.sNextTile[0] = next_idx
                handoff.pipe.producer_commit(state)  # releases this lane's store to the waiters
            state.advance()
        elif cutlass.const_expr(self.persistent):
            next_idx = tile_idx + self._stride()
        return next_idx, state

    @cute.jit
    def next_tile_consumer(
        self, tile_idx: Int32, handoff: TileHandoff | None, state: pipeline.PipelineState | None
    ):
        """A consumer thread's next tile (dynamic: the one the producer published) and its advanced
        handoff state."""
        next_idx = tile_idx + self.num_tiles
        if cutlass.const_expr(self.dynamic):
            handoff.pipe.consumer_wait(state)
            next_idx = handoff.sNextTile[0]
            handoff.pipe.consumer_release(state)  # this thread's read is done (one arrival each)
            state.advance()
        elif cutlass.const_expr(self.persistent):
            next_idx = tile_idx + self._stride()
        return next_idx, state

    @cute.jit
    def coords(self, tile_idx: Int32):
        """``(m_block, head, batch)`` of tile ``tile_idx`` (``0 <= tile_idx < num_tiles``) for this
        CTA (with clusters: the m_block of its rank in the index's group). Spanning tiles: of the
        flat m_block index ``tile_idx`` (``0 <= tile_idx < num_blocks``)."""
        if cutlass.const_expr(self.longest_first):
            # Section s holds pairs [s * H, s * H + h_s), h_s = H except in the last section;
            # within it, index r names m_rank r // h_s (0: the bottom m_block) of pair r % h_s.
            tiles_per_section = self.heads_per_section * self.num_m_blocks
            section = tile_idx // tiles_per_section
            first_bh = section * self.heads_per_section
            rank = tile_idx - section * tiles_per_section
            heads_here = cutlass.min(self.heads_per_section, self.num_heads * self.num_batch - first_bh)
            m_rank = rank // heads_here
            bh = first_bh + rank - m_rank * heads_here
            m_block = self.num_m_blocks - 1 - m_rank
        else:
            bh = tile_idx // self.num_m_blocks
            m_block = tile_idx - bh * self.num_m_blocks
        batch = bh // self.num_heads
        head = bh - batch * self.num_heads
        if cutlass.const_expr(self.cluster_m > 1):
            m_block = m_block * self.cluster_m + cute.arch.block_idx()[0] % self.cluster_m
        return m_block, head, batch
