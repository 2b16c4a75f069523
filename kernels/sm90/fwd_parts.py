"""Argument bundles and named barriers of the Hopper forward kernel (kernels/sm90/fwd.py).

Split out of the kernel module to keep it readable: frozen dataclasses that group what the device
methods pass around (so none takes more than ~12 parameters), and the barrier ids as an IntEnum.
"""

import enum
from dataclasses import dataclass

import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32

from ..common.block_info import BlockInfo
from ..common.mask import AttentionMask
from ..common.softmax import OnlineSoftmax
from ..common.tile_scheduler import TileHandoff, TileScheduler


WG_THREADS = 128  # threads of a warpgroup


class NamedBarrierFwd(enum.IntEnum):
    """Hardware named barriers of the forward kernel (id 0 is ``__syncthreads``)."""

    EPILOGUE = 1  # all MMA threads (CTA-wide epilogue): sQ no longer read by any WGMMA / sO complete
    WARP_SCHEDULER_WG1 = 2  # ping-pong: MMA warpgroup k waits on id WARP_SCHEDULER_WG1 + k
    WARP_SCHEDULER_WG2 = 3
    WARP_SCHEDULER_WG3 = 4
    # skip_zero_pv: MMA warpgroup k's vote on its block's P (bar.red.or) on id ZERO_BLOCK_WG1 + k (5, 6, 7)
    ZERO_BLOCK_WG1 = 5
    # (8-10 are free: the dynamic scheduler's tile handoff uses mbarriers, tile_scheduler.py)
    # Warpgroup-local epilogue, warpgroup k on id + k: its rows of sO are free / written (11, 12, 13)
    EPILOGUE_WG1 = 11


def ring_state(state: pipeline.PipelineState, ring_offset, kv_stages: int) -> pipeline.PipelineState:
    """Spanning tiles: the K/V pipelines' state (``kv_stages`` stages, barrier and stage index) of a
    ring-local state whose ring starts at stage ``ring_offset`` (the phase is the ring's own)."""
    return pipeline.PipelineState(kv_stages, state.count, state.index + ring_offset, state.phase)


@dataclass(frozen=True)
class TileCoord:
    """This CTA's query tile, its sequence's lengths and the key blocks it visits
    (``n_block_min <= n < n_block_max``)."""

    m_block: Int32
    seqlen_q: Int32
    seqlen_k: Int32
    n_block_min: Int32
    n_block_max: Int32


@dataclass(frozen=True)
class TileWalk:
    """What both roles need to walk this CTA's tiles and find each one's sequence and key blocks."""

    scheduler: TileScheduler
    block_info: BlockInfo
    seqlen_args: tuple  # (mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK), each may be None
    num_batch: Int32
    qhead_per_kvhead: Int32
    seqlen_q_static: Int32  # dense seqlen_q | varlen total_q
    seqlen_k_static: Int32  # dense seqlen_k | varlen total_k
    handoff: TileHandoff | None  # dynamic scheduler only
    # skip_decayed_blocks: (batch, nheads, m_blocks) int32, each tile's first key block that may hold a nonzero P
    live_blocks: cute.Tensor | None = None


@dataclass(frozen=True)
class TmaAtoms:
    """TMA copy atoms; ``o`` is None when O is stored with predicated stores (varlen)."""

    q: cute.CopyAtom
    k: cute.CopyAtom
    v: cute.CopyAtom
    o: cute.CopyAtom | None
    # has_gate: into K's stages, 1-D boxes of the bias (fp32), or with the bias in the QK^T GEMM
    # (``fwd_budget.gate_in_gemm``) K's extra k16 slice (tile_n, GATE_K)
    gate: cute.CopyAtom | None = None


@dataclass(frozen=True)
class Pipelines:
    q: pipeline.PipelineTmaAsync
    k: pipeline.PipelineTmaAsync
    v: pipeline.PipelineTmaAsync
    # FP8 only: the transposing warps -> MMA warps, V^T in K-major smem (kernels/sm90/fwd_fp8.py)
    vt: pipeline.PipelineAsync | None = None


@dataclass(frozen=True)
class MmaParts:
    """One MMA thread's WGMMA fragments (descriptors for smem operands) and accumulator."""

    tiled_mma_qk: cute.TiledMma
    tiled_mma_pv: cute.TiledMma
    thr_mma_qk: cute.ThrMma  # this thread's slice (coordinates for masking)
    tSrQ: cute.Tensor
    tSrK: cute.Tensor  # (MMA, MMA_N, MMA_K, stage)
    tOrVt: cute.Tensor  # (MMA, MMA_N, MMA_K, stage)
    tOrP: cute.Tensor  # 16-bit A fragment of P
    acc_O: cute.Tensor
    # has_gate with the bias in the QK^T GEMM (``fwd_budget.gate_in_gemm``): its extra k16 slice (ones
    # x the key bias's 16-bit parts), A from sQx, B (MMA, MMA_N, 1, stage) from sKx; else None.
    tSrQx: cute.Tensor | None = None
    tSrKx: cute.Tensor | None = None


@dataclass(frozen=True)
class BlockStep:
    """What one key-block step needs besides the block index and its compile-time mask flags.

    ``softcap_scale`` is None unless softcap is compiled in.
    """

    mma: MmaParts
    pipeline_k: pipeline.PipelineTmaAsync
    pipeline_v: pipeline.PipelineTmaAsync
    softmax: OnlineSoftmax
    mask: AttentionMask
    m_block: Int32
    wg_idx: Int32  # MMA warpgroup index, 0-based
    softcap_scale: Float32 | None
    # Spanning tiles: the first stage of this warpgroup's K/V ring in the pipelines (ring B's is
    # num_stages) and the pipelines' stage count; None: one ring, states index the stages as is.
    ring_offset: Int32 | None = None
    kv_stages: int = 0
    # Spanning tiles over two (batch, head) pairs (None: a tile of one pair): the other ring's first
    # stage and its stage count minus this ring's; each block's stage of it is waited for and released
    # unread, so every warpgroup consumes every stage of both rings in order.
    other_offset: Int32 | None = None
    other_delta: Int32 | None = None
    # This tile's stage of the Q ring (None: one Q buffer, sQ has no stage mode).
    q_stage: Int32 | None = None
    # has_gate, in the scores' units: the bias of each K stage's keys, (box, K stages) fp32 in smem
    # (this (sequence, head)'s: the producer loads it with K); else None.
    gate: cute.Tensor | None = None
    # has_gate with varlen keys: the offset of the block's first key in its box (fwd_load ``_gate_view``);
    # dense: None (offset 0).
    gate_shift: Int32 | None = None
    # FP8 block scales: this (batch, kv head)'s k and v descales per key block (each (n_blocks,)); else None.
    kv_scales: tuple[cute.Tensor, cute.Tensor] | None = None

    def kv(self, state: pipeline.PipelineState) -> pipeline.PipelineState:
        """The pipeline state (barrier and stage index) of a ring-local K/V state."""
        if self.ring_offset is None:
            return state
        return ring_state(state, self.ring_offset, self.kv_stages)

    def other(self, state: pipeline.PipelineState) -> pipeline.PipelineState:
        """The pipeline state of the other ring's stage for the same block as ring-local ``state``."""
        ring_stages = self.kv_stages // 2
        count = state.count + self.other_delta
        return pipeline.PipelineState(
            self.kv_stages, count, count % ring_stages + self.other_offset, (count // ring_stages) % 2
        )
