"""Producer (load) role of the Hopper forward kernel (kernels/sm90/fwd.py): TMA of Q and the K/V ring.

Split out of the kernel module by role (STYLE: files under ~900 lines). ``FwdSm90Load`` is a mixin of
``FlashFwdSm90``; it reads the kernel's static configuration (``tile_m``, ``tile_n``, ``head_dim``,
``head_dim_v``, ``intra_wg_overlap``, ``release_q_before_next_q``, ``num_stages``, ``cluster_m``,
``span_heads``, ``num_rings``, ``num_mma_wg``) and its ``tile_work`` / ``span_pairs`` from ``self``.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from ..common.seqlen import SeqlenInfo
from ..common.utils import select_head
from .fwd_budget import GATE_BOX_SLACK, GATE_COLS, GATE_K, GATE_PARTS
from .fwd_parts import Pipelines, TileCoord, TileWalk, TmaAtoms, ring_state


class FwdSm90Load:
    @cute.jit
    def load(
        self,
        mQ: cute.Tensor,  # TMA coordinates of (seqlen_q | total_q, head_dim, nheads[, batch])
        mK: cute.Tensor,  # TMA coordinates of (seqlen_k | total_k, head_dim, nheads_k[, batch])
        mV: cute.Tensor,  # TMA coordinates of (seqlen_k | total_k, head_dim_v, nheads_k[, batch])
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        atoms: TmaAtoms,
        pipes: Pipelines,
        walk: TileWalk,
        gate: tuple | None = None,
    ):
        """Producer warp: for each tile of this CTA, TMA Q once and the K/V ring over its key
        blocks in the consumers' order. The pipeline states run on across tiles. ``gate``
        (has_gate): the bias's TMA coordinates ``(s_k | total_k, nheads[, batch])`` and its smem
        stages; each K block's keys' bias goes into K's stage with K's barrier. With the bias in the
        GEMM (``gate_in_gemm``): K's extra k16 slice's coordinates ``(s_k | total_k, GATE_COLS, nheads[,
        batch])``, its stages sKx and sQx, which this warp fills once before its first Q load (sQx, and sKx's
        columns past GATE_COLS, which TMA never writes)."""
        in_gemm = const_expr(gate is not None and self.gate_in_gemm)
        if const_expr(in_gemm):
            self._fill_gate_slices(gate[2], gate[1])
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        if const_expr(self.release_q_before_next_q):
            # sQ is not free at the start: the consumers release it before each Q they need.
            q_state = pipeline.PipelineState(1, Int32(0), Int32(0), Int32(0))
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        kv_state_b = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        handoff_state = walk.handoff.producer_state() if const_expr(walk.handoff is not None) else None
        tile_idx = walk.scheduler.first_tile()
        while tile_idx < walk.scheduler.num_tiles:
            if const_expr(self.span_heads):
                q_state, kv_state, kv_state_b = self.load_span_tile(
                    mQ, mK, mV, sQ, sK, sV, atoms, pipes, walk, tile_idx, q_state, kv_state, kv_state_b
                )
            else:
                has_tile, batch_idx, head_idx, seqlen, tile = self.tile_work(walk, tile_idx)
                if has_tile:
                    if tile.n_block_max > tile.n_block_min:
                        head_idx_kv = head_idx // walk.qhead_per_kvhead
                        # This (batch, head)'s (seqlen, head_dim) views (varlen: shifted to the
                        # sequence). (Assigned, not just passed: the DSL carries a loop's state
                        # through the names the body assigns or calls methods on.)
                        q_state, kv_state = self.load_tile(
                            seqlen.q_view(select_head(mQ, head_idx, 2), batch_idx),
                            seqlen.k_view(select_head(mK, head_idx_kv, 2), batch_idx),
                            seqlen.k_view(select_head(mV, head_idx_kv, 2), batch_idx),
                            sQ, sK, sV, atoms, pipes, tile, q_state, kv_state,
                            None if const_expr(gate is None) else (
                                seqlen.k_view(select_head(gate[0], head_idx, 2), batch_idx)
                                if const_expr(in_gemm) else
                                self._gate_view(select_head(gate[0], head_idx, 1), seqlen, batch_idx),
                                gate[1],
                            ),
                        )
            tile_idx, handoff_state = walk.scheduler.next_tile_producer(tile_idx, walk.handoff, handoff_state)
        if const_expr(self.cluster_m > 1):
            # A peer's consumers arrive on this CTA's empty barriers, and its TMA writes into
            # this CTA's stages: stay until every stage is released by every CTA's consumers
            # (then nothing of the peer's is in flight towards this CTA).
            pipes.k.producer_tail(kv_state.clone())  # (producer_tail advances the state it gets)
            pipes.v.producer_tail(kv_state)

    @cute.jit
    def load_tile(
        self,
        mQ_cur: cute.Tensor,  # TMA coordinates of (seqlen_q, head_dim) of this (batch, head)
        mK_cur: cute.Tensor,  # TMA coordinates of (seqlen_k, head_dim) of this (batch, kv head)
        mV_cur: cute.Tensor,  # TMA coordinates of (seqlen_k, head_dim_v)
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        atoms: TmaAtoms,
        pipes: Pipelines,
        tile: TileCoord,
        q_state: pipeline.PipelineState,
        kv_state: pipeline.PipelineState,
        gate: tuple[cute.Tensor, cute.Tensor] | None = None,
    ):
        """One tile's loads (at least one key block); returns both states advanced past them.
        ``gate``: this (batch, head)'s bias (TMA coordinates, ``_gate_view``) and its smem stages."""
        gQ = cute.local_tile(mQ_cur, (self.tile_m, self.head_dim), (tile.m_block, 0))
        tQsQ, tQgQ = cpasync.tma_partition(
            atoms.q, 0, cute.make_layout(1), cute.group_modes(self._q_buffer(sQ, q_state.index), 0, 2),
            cute.group_modes(gQ, 0, 2),
        )
        tKgK, tKsK, tVgV, tVsV = self._kv_partitions(mK_cur, mV_cur, sK, sV, atoms)
        # One Q buffer: K first: the first QK^T GEMM needs it as much as Q, and Q's bytes then
        # overlap it (persistent: K of this tile may land while the previous tile's epilogue still
        # owns sQ). A ring of Q buffers: Q first, its buffer is free while K's stage may not be yet.
        load_k = (atoms.k, tKgK, tKsK, pipes.k)
        load_v = (atoms.v, tVgV, tVsV, pipes.v)
        k_beside = None  # has_gate: the bias of K's keys (or K's extra k16 slice), into K's stage
        if const_expr(gate is not None and self.gate_in_gemm):
            gG = cute.local_tile(gate[0], (self.tile_n, GATE_COLS), (None, 0))
            tGsG, tGgG = cpasync.tma_partition(
                atoms.gate, 0, cute.make_layout(1), cute.group_modes(self._gate_load_view(gate[1]), 0, 2),
                cute.group_modes(gG, 0, 2),
            )
            k_beside = (atoms.gate, tGgG, tGsG)
        elif const_expr(gate is not None):
            # Block n's box: box keys from n * tile_n of the view (boxes overlap where box > tile_n).
            box = cute.size(gate[1].shape[0])
            num_blocks = (gate[0].shape[0] + (self.tile_n - 1)) // self.tile_n
            gG = cute.composition(gate[0], cute.make_layout((box, num_blocks), stride=(1, self.tile_n)))
            tGsG, tGgG = cpasync.tma_partition(
                atoms.gate, 0, cute.make_layout(1), cute.group_modes(gate[1], 0, 1), cute.group_modes(gG, 0, 1),
            )
            k_beside = (atoms.gate, tGgG, tGsG)
        if const_expr(self.q_stages == 1):
            self._load_kv(*load_k, tile.n_block_max - 1, kv_state, k_beside)
        pipes.q.producer_acquire(q_state)
        cute.copy(atoms.q, tQgQ, tQsQ, tma_bar_ptr=pipes.q.producer_get_barrier(q_state))
        q_state.advance()
        if const_expr(self.q_stages > 1):
            self._load_kv(*load_k, tile.n_block_max - 1, kv_state, k_beside)
        num_rest = tile.n_block_max - 1 - tile.n_block_min
        if const_expr(self.intra_wg_overlap):
            # V lags K by one block: the consumers issue QK^T of block j before P.V of j+1.
            for i in cutlass.range(num_rest, unroll=1):
                n_block_prev = tile.n_block_max - 1 - i
                state_prev = kv_state.clone()
                kv_state.advance()
                self._load_kv(*load_k, n_block_prev - 1, kv_state, k_beside)
                self._load_kv(*load_v, n_block_prev, state_prev)
            self._load_kv(*load_v, tile.n_block_min, kv_state)
        else:
            self._load_kv(*load_v, tile.n_block_max - 1, kv_state)
            for i in cutlass.range(num_rest, unroll=1):
                kv_state.advance()
                self._load_kv(*load_k, tile.n_block_max - 2 - i, kv_state, k_beside)
                self._load_kv(*load_v, tile.n_block_max - 2 - i, kv_state)
        kv_state.advance()
        return q_state, kv_state

    @cute.jit
    def load_span_tile(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        atoms: TmaAtoms,
        pipes: Pipelines,
        walk: TileWalk,
        tile_idx: Int32,
        q_state: pipeline.PipelineState,
        kv_state_a: pipeline.PipelineState,
        kv_state_b: pipeline.PipelineState,
    ):
        """One spanning tile (``span_heads``): each warpgroup's 64 Q rows from its own (batch,
        head), the first pair's K/V through ring A and, when the tile ends in the next pair, that
        pair's through ring B, block by block, V lagging K by one block (the intra-warpgroup
        overlap order; span_heads requires it). Every warpgroup waits for and releases each stage
        of both rings, reading only its own. Returns the three states advanced."""
        sched = walk.scheduler
        num_wg = self.num_mma_wg
        first_block, last_block, bh_first, bh_last = self.span_pairs(walk, tile_idx)
        mixed = bh_last > bh_first
        batch_a, batch_b = bh_first // sched.num_heads, bh_last // sched.num_heads
        head_a, head_b = bh_first - batch_a * sched.num_heads, bh_last - batch_b * sched.num_heads
        seqlen = SeqlenInfo.create(batch_a, walk.seqlen_q_static, walk.seqlen_k_static, *walk.seqlen_args)
        n_block_min, n_block_max = walk.block_info.n_block_min_max(seqlen.seqlen_q, seqlen.seqlen_k, Int32(0))
        if n_block_max > n_block_min:
            qpk = walk.qhead_per_kvhead
            kv_a, kv_b = (
                self._kv_partitions(
                    seqlen.k_view(select_head(mK, head // qpk, 2), batch),
                    seqlen.k_view(select_head(mV, head // qpk, 2), batch), sK, sV, atoms,
                )
                for head, batch in ((head_a, batch_a), (head_b, batch_b))
            )
            ring_b_stage = self.num_stages  # ring B's first stage
            self._load_kv_ring(atoms.k, kv_a[0], kv_a[1], pipes.k, n_block_max - 1, kv_state_a, 0)
            if mixed:
                self._load_kv_ring(atoms.k, kv_b[0], kv_b[1], pipes.k, n_block_max - 1, kv_state_b, ring_b_stage)
            pipes.q.producer_acquire(q_state)
            for w in cutlass.range_constexpr(num_wg):
                m_block, head_idx, batch_idx = sched.coords(cutlass.min(first_block + w, last_block))
                gQ = cute.local_tile(
                    seqlen.q_view(select_head(mQ, head_idx, 2), batch_idx), (64, self.head_dim), (m_block, 0)
                )
                sQ_rows = cute.local_tile(self._q_buffer(sQ, q_state.index), (64, self.head_dim), (w, 0))
                tQsQ, tQgQ = cpasync.tma_partition(
                    atoms.q, 0, cute.make_layout(1), cute.group_modes(sQ_rows, 0, 2), cute.group_modes(gQ, 0, 2)
                )
                cute.copy(atoms.q, tQgQ, tQsQ, tma_bar_ptr=pipes.q.producer_get_barrier(q_state))
            q_state.advance()
            # V lags K by one block (intra-warpgroup overlap), ring B right behind ring A.
            for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
                n_block_prev = n_block_max - 1 - i
                prev_a = kv_state_a.clone()
                kv_state_a.advance()
                self._load_kv_ring(atoms.k, kv_a[0], kv_a[1], pipes.k, n_block_prev - 1, kv_state_a, 0)
                prev_b = kv_state_b.clone()
                if mixed:
                    kv_state_b.advance()
                    self._load_kv_ring(atoms.k, kv_b[0], kv_b[1], pipes.k, n_block_prev - 1, kv_state_b, ring_b_stage)
                self._load_kv_ring(atoms.v, kv_a[2], kv_a[3], pipes.v, n_block_prev, prev_a, 0)
                if mixed:
                    self._load_kv_ring(atoms.v, kv_b[2], kv_b[3], pipes.v, n_block_prev, prev_b, ring_b_stage)
            self._load_kv_ring(atoms.v, kv_a[2], kv_a[3], pipes.v, n_block_min, kv_state_a, 0)
            kv_state_a.advance()
            if mixed:
                self._load_kv_ring(atoms.v, kv_b[2], kv_b[3], pipes.v, n_block_min, kv_state_b, ring_b_stage)
                kv_state_b.advance()
        return q_state, kv_state_a, kv_state_b

    def _kv_partitions(self, mK_cur: cute.Tensor, mV_cur: cute.Tensor, sK, sV, atoms: TmaAtoms):
        """``(tKgK, tKsK, tVgV, tVsV)`` of one (batch, kv head)'s ``(seqlen_k, head_dim)`` views:
        ``((atom, rest), n_block)`` and ``((atom, rest), stage)``; with clusters this CTA's share
        of each block (its rank's slice), multicast to every CTA of the cluster."""
        gK = cute.local_tile(mK_cur, (self.tile_n, self.head_dim), (None, 0))
        gV = cute.local_tile(mV_cur, (self.tile_n, self.head_dim_v), (None, 0))
        kv_cta_layout = cute.make_layout(self.cluster_m)
        kv_rank = cute.arch.block_idx()[0] % self.cluster_m if const_expr(self.cluster_m > 1) else 0
        tKsK, tKgK = cpasync.tma_partition(
            atoms.k, kv_rank, kv_cta_layout, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
        )
        tVsV, tVgV = cpasync.tma_partition(
            atoms.v, kv_rank, kv_cta_layout, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2)
        )
        return tKgK, tKsK, tVgV, tVsV

    @cute.jit
    def _fill_gate_slices(self, sQx: cute.Tensor, sKx: cute.Tensor) -> None:
        """Q's extra k16 slice (``gate_in_gemm``): ones in the first GATE_PARTS columns of every row,
        zeros after (so the QK^T GEMM adds the key bias's parts, ``flashattn_hopper/gate.py``); and zeros in
        every K stage's columns past GATE_COLS, which its TMA loads never write (Q's zeros meet them: they must not
        be a stale NaN). Written once by this warp, then fenced for the WGMMA's async proxy; the consumers first
        read them after waiting for the first Q (and K) stage, which this warp's elected lane arrives on after
        this."""
        lane = cute.arch.lane_idx()
        num_rows = cute.size(sQx.shape[0])
        for i in cutlass.range_constexpr(-(-num_rows // 32)):
            row = i * 32 + lane
            if row < num_rows:
                for c in cutlass.range_constexpr(GATE_K):
                    sQx[row, c] = self.dtype(1.0) if c < GATE_PARTS else self.dtype(0.0)
        num_keys = cute.size(sKx.shape[0])
        for s in cutlass.range_constexpr(cute.size(sKx.shape[2])):
            for i in cutlass.range_constexpr(-(-num_keys // 32)):
                key = i * 32 + lane
                if key < num_keys:
                    for c in cutlass.range_constexpr(GATE_COLS, GATE_K):
                        sKx[key, c, s] = self.dtype(0.0)
        cute.arch.fence_view_async_shared()
        cute.arch.sync_warp()

    @staticmethod
    def _gate_view(mGate_head: cute.Tensor, seqlen: SeqlenInfo, batch_idx: Int32) -> cute.Tensor:
        """The gate bias's TMA coordinates for this sequence: dense, its keys ``(seqlen_k,)``; varlen,
        from the 16-byte boundary at or before its first key (``offset_k`` rounded down to 4 keys: a box
        whose innermost start is not 16-byte aligned raised an illegal instruction), so key j of
        block n sits at ``j + offset_k % 4`` of its box (``BlockStep.gate_shift``)."""
        if const_expr(seqlen.has_cu_seqlens_k):
            return cute.domain_offset((seqlen.offset_k - seqlen.offset_k % GATE_BOX_SLACK,), mGate_head)
        return seqlen.k_view(mGate_head, batch_idx)

    def _load_kv_ring(self, tma_atom, tXgX, tXsX, pipe, n_block: Int32, state, ring_offset: int) -> None:
        """``_load_kv`` into a ring whose stages start at ``ring_offset`` (``state`` is ring-local)."""
        self._load_kv(
            tma_atom, tXgX, tXsX, pipe, n_block, ring_state(state, ring_offset, self.num_stages * self.num_rings)
        )

    def _load_kv(self, tma_atom, tXgX, tXsX, pipe, n_block: Int32, state, beside=None) -> None:
        """Wait for a free stage, expect its bytes (the whole block, whichever CTA sends them),
        issue the TMA of (this CTA's share of) key block ``n_block`` into it; ``beside``: another
        ``(atom, gmem, smem)`` partition (the gate's bias) loaded into the same stage, same barrier."""
        pipe.producer_acquire(state)
        mcast = {"mcast_mask": cutlass.Int16((1 << self.cluster_m) - 1)} if const_expr(self.cluster_m > 1) else {}
        cute.copy(
            tma_atom, tXgX[None, n_block], tXsX[None, state.index],
            tma_bar_ptr=pipe.producer_get_barrier(state), **mcast,
        )
        if const_expr(beside is not None):
            cute.copy(beside[0], beside[1][None, n_block], beside[2][None, state.index],
                      tma_bar_ptr=pipe.producer_get_barrier(state))
