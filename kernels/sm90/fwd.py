"""FlashAttention-3 forward kernel for Hopper (sm90): ``FlashFwdSm90``.

Purpose: ``O = softmax(Q K^T * softmax_scale) V`` and the natural-log LSE per query row, bf16/fp16
inputs, fp32 accumulation, optional bottom-right-aligned causal or sliding-window (local) masking,
softcap, GQA/MQA (query head ``h`` reads KV head ``h // (nheads // nheads_k)``, no K/V repeat) and
variable-length (packed) batches, with the three FA3 techniques:
warp specialisation (a TMA producer warp, MMA warpgroups with ``setmaxnreg``), intra-warpgroup
overlap (the softmax of block ``j`` runs while the P.V GEMM of block ``j+1`` is in flight, see the
class timeline) and inter-warpgroup ping-pong (named barriers serialise the GEMM issue of the MMA
warpgroups so one warpgroup's softmax runs under the other's GEMMs).

Constraints:
- Dense: Q/K/V/O ``(batch, seqlen, nheads, head_dim)``, LSE fp32 ``(batch, nheads, seqlen_q)``.
  Varlen (``cu_seqlens_q/k`` given): Q/K/V/O ``(total, nheads, head_dim)``, LSE
  ``(nheads, total_q)``, ``cu_seqlens`` int32 ``(batch + 1,)``, optional ``seqused`` int32
  ``(batch,)``. Unit last stride, other strides multiples of 8 elements, 16-byte-aligned base
  pointers (TMA descriptors need 16-byte strides). All extents dynamic; the runtime head dim
  must equal the compiled one (the launcher zero-pads), multiples of 16 up to 256, ``head_dim_v``
  below q's (192/128) or above it (64/256: sO then has its own buffer).
- Any ``seqlen_q, seqlen_k >= 1`` (varlen: any per-sequence length >= 0): TMA zero-fills rows
  past the tensor, and in a packed tensor reads rows of the next sequence, which the
  ``seqlen_k`` mask of the first key block hides (P = 0 there); Q rows past ``seqlen_q`` are
  computed but never stored. Dense O goes out by TMA (the unit clips rows past the tensor);
  varlen O by row-predicated stores, so no tile writes into the next sequence (FA3's rule,
  design doc pitfall 21). Rows past ``seqused_q`` are not written (the launcher zero-fills).
- ``softmax_scale > 0``, ``softcap > 0`` when compiled in (``common/softmax.py``); window sides
  are runtime ``Int32``, an unbounded side is a huge value (``2**30``); lengths < ``2**30``.

Files by role: this one (configuration, launch, prologue, the MMA warpgroups' tile loop and main loop),
``fwd_steps.py`` (one key block's GEMMs and softmax, the half blocks, ping-pong turns, FP8 hooks),
``fwd_load.py`` (the producer warp's TMA loads), ``fwd_epilogue.py`` (O and LSE out),
``fwd_tiles.py`` (the tile scheduler's setup and each tile's coordinates and key blocks),
``fwd_smem.py`` (shared-memory layouts, storage and byte count, the tiled WGMMAs, the Q ring's
views), ``fwd_parts.py`` (the records and named barriers they share).

Paper: FlashAttention-3 (Shah et al., 2024) sections 3.1 (producer/consumer warp specialisation,
ping-pong scheduling) and 3.2 (intra-warpgroup overlap of softmax and GEMMs); design doc
``fa3_cute_design.md`` sections 1 (1.9 masks, 1.10 epilogue, 1.14 varlen).
"""

import dataclasses

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator

from ..common.block_info import BlockInfo
from ..common.mask import AttentionMask
from ..common.pack_gqa import pack_gqa_view
from ..common.sm90_utils import make_smem_layout_sm90, same_smem_atom
from ..common.softmax import OnlineSoftmax, softcap_scale_log2
from ..common.tile_scheduler import TileHandoff
from ..common.utils import (
    LOG2_E, acc_rows_cols, assume_strides_aligned, attention_kernel_views, select_head, select_modes,
)
from .fwd_epilogue import FwdSm90Epilogue
from .fwd_load import FwdSm90Load
from .fwd_budget import GATE_BOX_SLACK, GATE_COLS, acc_registers, gate_in_gemm, gate_stage_floats
from .fwd_budget import SMEM_CAPACITY as _SMEM_CAPACITY
from .fwd_scores import FwdSm90Scores
from .fwd_smem import FwdSm90Smem
from .fwd_steps import FwdSm90Steps
from .fwd_tiles import FwdSm90Tiles
from .fwd_parts import (
    WG_THREADS as _WG_THREADS, BlockStep, MmaParts, NamedBarrierFwd, Pipelines, TileCoord, TileWalk,
    TmaAtoms,
)

# (producer, MMA warpgroup) registers per thread after setmaxnreg, by number of MMA warpgroups:
# 128 * (producer + sum of MMA) must fit the 64K register file (FA3/FA4's values, design doc 1.1).
_REGISTERS = {1: (56, 256), 2: (24, 240), 3: (32, 160)}
# Lazy rescale: a row's max is renewed only when a block's exceeds it by more than this many
# powers of two (P <= 2**8 otherwise; FA4's threshold).
_LAZY_RESCALE_THRESHOLD = 8.0
# fp32 accumulator registers (S + O) plus the 16-bit P (S / 2) one MMA thread may hold: the
# rest of the budget is operand descriptors, softmax state and addresses (design doc 1.2).
_MAX_ACC_REGS = {1: 216, 2: 216, 3: 128}


class FlashFwdSm90(FwdSm90Load, FwdSm90Epilogue, FwdSm90Tiles, FwdSm90Smem, FwdSm90Scores, FwdSm90Steps):
    """FA3 forward on sm90: each CTA computes ``(tile_m, head_dim_v)`` tiles of O.

    Tiles (``common/tile_scheduler.py``): a 1-D index over ``(m_block, head, batch)``, m_block
    fastest; causal/local: over sections of (batch, head) pairs whose K/V fit in ``section_l2_mb``
    MiB of L2 (at most 16 pairs), the bottom m_blocks (the most keys) of a section's pairs first;
    varlen tiles over an upper bound per head, mapped to ``(sequence, m_block)`` by a warp scan of
    ``cu_seqlens_q`` (``common/seqlen.py``). ``persistent``: one CTA per SM walks tiles (static stride, or an
    atomic counter for causal/local), the pipeline states and ping-pong turn carrying over; else
    one CTA per tile. ``pack_gqa = g``: a tile's rows are the g query heads of one KV head
    (``common/pack_gqa.py``). ``span_heads`` (dense, unmasked, unpacked): a tile's MMA warpgroups
    take consecutive 64-row blocks of the flat (batch, head, row block) order, so a tile may end in
    the next (batch, head), whose K/V come through a second ring of stages (ring B); in such a tile
    every warpgroup waits for and releases the other ring's stages unread. ``cluster_m = 2``
    (dense, unmasked, unpacked; the hdim 256 row from seqlen_q 8k, configs.cluster_pays): two CTAs
    of a cluster take adjacent m_blocks, each loads half of every K/V block multicast into both,
    and a K/V stage's empty barrier counts both CTAs' MMA warps. ``128 * (1 + tile_m / 64)`` threads:

        | warpgroup | warps    | registers | role                                             |
        | WG0       | 0        | 24        | producer: TMA loads of Q, K[n], V[n]             |
        | WG0       | 1-3      | 24        | idle (exit after setmaxnreg)                     |
        | WG1..     | 4 each   | 240       | MMA: 64 query rows each, WGMMA + softmax + store |

    Pipelines (mbarriers; producer arrive = one elected ``arrive.expect_tx``, consumer arrive =
    lane 0 of every MMA warp, so the empty count is the number of MMA warps):

        | pipeline   | stages | producer -> consumer        | tx bytes per stage        |
        | pipeline_q | 1      | TMA Q -> every MMA warp     | tile_m * head_dim * 2     |
        | pipeline_k | 2      | TMA K[n] -> every MMA warp  | tile_n * head_dim * 2     |
        | pipeline_v | 2      | TMA V[n] -> every MMA warp  | tile_n * head_dim_v * 2   |
        | handoff    | 1      | next tile index (dynamic schedule): producer lane 0 -> every MMA |
        |            |        | thread, each of which arrives on empty (tile_scheduler.py)       |

    (``span_heads``: K and V have 2 x num_stages stages, ring A's then ring B's; per block the
    producer issues K_a, K_b, then V_a, V_b, the B loads only in tiles over two pairs.)

    Key blocks run right to left (``n_block_max - 1`` down to ``n_block_min``) in up to four
    segments, each with its masking compiled in: the first block (``seqlen_k`` + causal/window
    mask; the only one cut by ``seqlen_k``), blocks that may cross the diagonal / right window
    edge, unmasked blocks, blocks that may cross the left window edge (local only). Blocks
    outside the window are never loaded. Softcap (``tanh``) runs on S before any mask. Per MMA
    warpgroup, with intra-WG overlap::

        first: wait K[n0]; [sync] issue S = Q K^T; [arrive]; wait S; mask; softmax; P = cvt(S)
        step j: wait K[j]; [sync own sched barrier] issue S = Q K[j]^T; wait V[j+1];
                issue O += P V[j+1]; [arrive next WG's barrier]; wait S; release K[j];
                mask; softmax (under the P.V GEMM); wait P.V; release V[j+1];
                P = cvt(S); O *= row_scale
        last:  release Q (sO = sQ: before the next tile's Q instead); wait V[n_min];
               O += P V[n_min]; wait; release V

    and the producer issues ``K[n0], Q, {K[j], V[j+1]}..., V[n_min]`` in that order. The
    scheduler barriers make the warpgroups take turns issuing their GEMM sections, so one
    warpgroup's softmax overlaps the other's tensor-core work (ping-pong). Epilogue, per MMA
    warpgroup on its own 64 rows (``wg_local_epilogue``; the whole tile behind a CTA-wide barrier
    when pack_gqa does not divide 64): finalize (O / row_sum, LSE), 16-bit O into sO with
    ``stmatrix`` (sO aliases sQ unless a persistent kernel has room for its own; a warpgroup
    barrier first guarantees its QK^T WGMMAs have read its rows of sQ / the previous store has
    read sO), LSE from registers, then dense: a TMA store issued by the warpgroup's first warp
    (rows past ``seqlen_q`` are clipped by the TMA unit); varlen: the warpgroup copies 16-byte
    row chunks from sO to gmem, rows past the sequence predicated off. A CTA that sees no key
    (causal/local, or ``seqlen_k = 0``) loads nothing and stores O = 0, LSE = -inf.
    """

    def __init__(
        self,
        dtype: type[cutlass.Numeric],
        head_dim: int,
        head_dim_v: int,
        tile_m: int,
        tile_n: int,
        is_causal: bool,
        is_local: bool = False,
        has_softcap: bool = False,
        intra_wg_overlap: bool = True,
        pingpong: bool = True,
        num_stages: int = 2,
        persistent: bool = False,
        pack_gqa: int = 1,
        wg_local_epilogue: bool = True,
        cluster_m: int = 1,
        section_l2_mb: int = 16,
        span_heads: bool = False,
        lazy_rescale: bool = True,
        q_stages: int = 1,
        has_sink: bool = False,
        has_gate: bool = False,
        gate_slice: bool = False,
        skip_zero_pv: bool = False,
        skip_decayed_blocks: bool = False,
        pdl: bool = False,
    ):
        if (skip_zero_pv or skip_decayed_blocks) and not has_gate:
            raise ValueError("FlashFwdSm90 cannot implement this config: skipping decayed work needs has_gate")
        if skip_decayed_blocks and is_local:
            raise ValueError("FlashFwdSm90 cannot implement this config: skip_decayed_blocks with a local window")
        reason = self.can_implement(
            dtype, head_dim, head_dim_v, tile_m, tile_n, num_stages, is_causal, is_local, pack_gqa,
            cluster_m, span_heads, has_sink, has_gate, has_softcap, gate_slice, **self._implement_options(),
        )
        if reason is not None:
            raise ValueError(f"FlashFwdSm90 cannot implement this config: {reason}")
        self.dtype = dtype
        # O's element type (the FP8 subclass writes bf16 O from e4m3 inputs).
        self.o_dtype = self._out_dtype(dtype)
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.is_causal = is_causal
        self.is_local = is_local
        self.has_softcap = has_softcap
        # A learnable sink per query head joins each row's denominator at finalize (common/softmax.py);
        # its logit is one load per tile from mSinkLogits (a tile's rows are of one head).
        self.has_sink = has_sink
        # Gated log-decay (flashattn_hopper/gate.py): a bias per (query head, key) in each score before
        # the masks and the softmax. With ``gate_slice`` (the launcher's choice: long keys) and head dims
        # up to 128 where it fits (``fwd_budget.gate_in_gemm``): through the tensor cores, the QK^T GEMM taking one more k16 slice, Q's (sQx: ones in its first GATE_PARTS
        # columns, written once) against K's (mGate: the host's -G_j in the scores' units in GATE_PARTS
        # 16-bit parts per key and query head, loaded with each K block into sKx), no add per score
        # (it cost 13 % more instructions at hdim 64). Otherwise: mGate is the fp32 bias (rows 16-byte
        # aligned: TMA boxes of each K block's keys land in K's stage, sGate; varlen boxes start at the
        # 16-byte boundary before the block, fwd_load ``_gate_view``), added per score.
        self.has_gate = has_gate
        # With the gate, a whole key block's P can underflow to 0 (keys decayed by > 2**126 against the row's max):
        # each MMA warpgroup then votes (fwd_steps ``_note_zero_block``) and skips that block's P.V, whose product
        # would add exactly 0 to O (the QK^T GEMM and the softmax still run: they find out).
        self.skip_zero_pv = skip_zero_pv
        # With the gate, the launcher can also bound which key blocks of a tile may hold a nonzero P at all
        # (``mLiveBlocks``: norms of q and k against the decay, backends/gate_blocks.py): producer and MMA
        # warpgroups then start each tile at that block (``tile_work``), so decayed blocks are neither loaded nor
        # computed.
        self.skip_decayed_blocks = skip_decayed_blocks
        # Launched as a programmatic dependent (the gated call's scan, kernels/common/gate_scan.py): the CTAs'
        # launch and prologue overlap the predecessor's tail; every thread waits (``griddepcontrol.wait``) after
        # the pipelines' init, before any role reads or writes global memory.
        self.pdl = pdl
        self.intra_wg_overlap = intra_wg_overlap
        self.num_stages = num_stages
        # A row keeps its softmax max until a block's exceeds it by 2**8, and a warp whose rows all
        # kept theirs skips the O rescale (common/softmax.py): fewer instructions at the power cap.
        self.rescale_threshold = _LAZY_RESCALE_THRESHOLD if lazy_rescale else None
        # Spanning tiles (dense, unmasked): a tile's warpgroups take consecutive 64-row blocks of
        # the flat (batch, head, row block) order, so a tile may end in the next head, whose K/V
        # then stream through a second ring of num_stages K and V stages (ring B; the first head's
        # is ring A). Rows past a sequence's end are then computed only in the launch's last tile
        # (a 192-row tile over 512 rows otherwise computes 576). Every warpgroup consumes every
        # stage of both rings in order (waits for and releases the other ring's unread).
        self.span_heads = span_heads
        self.num_rings = 2 if span_heads else 1
        self.num_mma_wg = tile_m // 64
        self.num_mma_threads = self.num_mma_wg * _WG_THREADS
        self.num_threads = self.num_mma_threads + _WG_THREADS
        self.producer_regs, self.mma_regs = _REGISTERS[self.num_mma_wg]
        # Ping-pong needs two or more MMA warpgroups; FA3/FA4 switch it off above head dim 128
        # (too few registers left for it to pay; design doc 1.8).
        self.pingpong = pingpong and intra_wg_overlap and self.num_mma_wg >= 2 and head_dim <= 128
        elem_bytes = dtype.width // 8
        # Persistent CTAs: one per SM walks tiles (common/tile_scheduler.py). sO gets its own
        # buffer when shared memory has room (hdim <= 128), so the next tile's Q loads during
        # this tile's epilogue and the TMA store's read of sO is waited for only before the
        # next epilogue writes it; else sO is sQ, which the consumers hand to the producer
        # right before each Q they need (after every epilogue so far, with or without keys).
        self.persistent = persistent
        # Pack GQA (common/pack_gqa.py): a tile's rows are the pack_gqa query heads of one KV head.
        self.pack_gqa = pack_gqa
        # Clusters of cluster_m CTAs along M (dense, no mask): the CTAs of a cluster compute
        # adjacent m_blocks of one (batch, head) and each TMA-loads 1/cluster_m of every K/V block,
        # multicast into all of them, so K/V cross the L2 -> SM fabric once per cluster (FA3's
        # ClusterShape). A K/V stage is free only when the consumers of every CTA released it.
        self.cluster_m = cluster_m
        # Causal/local tiles differ in cost: CTAs take the next tile from an atomic counter, in
        # sections of heads whose K/V fit in section_l2_mb MiB, longest first across a section
        # (0: one (batch, head) per section, the order before 2026-11-21 session 9).
        self.dynamic_schedule = persistent and (is_causal or is_local)
        self.section_l2_mb = section_l2_mb
        # A v head dim above q's needs its own sO in any case: sQ's buffer is too small, and a
        # warpgroup's O rows would land on the next warpgroup's Q rows while it may still read them.
        own_sO = persistent or head_dim_v > head_dim or self.o_dtype is not dtype
        # The gate's bias through the QK^T GEMM where its slice fits beside this configuration's buffers
        # (the launcher decides the same way, from the key: it builds the slice or the fp32 rows).
        self.gate_in_gemm = has_gate and gate_slice and gate_in_gemm(
            dtype.width // 8, head_dim, head_dim_v, tile_m, tile_n, num_stages * self.num_rings, own_sO, q_stages
        )
        self.o_aliases_q = not (
            own_sO
            and self._smem_bytes(
                dtype, head_dim, head_dim_v, tile_m, tile_n, num_stages * self.num_rings, True, q_stages, has_gate,
                self.gate_in_gemm,
            )
            <= _SMEM_CAPACITY
        )
        # A ring of q_stages Q buffers: with 2 the next tile's Q loads while this tile still reads
        # its own (short tiles otherwise wait for Q after each tile's last QK^T). Needs the own sO.
        if q_stages not in (1, 2) or (q_stages == 2 and (self.o_aliases_q or not persistent)):
            raise ValueError(
                f"FlashFwdSm90: q_stages {q_stages} needs a persistent kernel with room for its own sO "
                f"and {q_stages} Q buffers"
            )
        self.q_stages = q_stages
        if self.o_aliases_q and head_dim_v > head_dim:
            raise ValueError(
                f"FlashFwdSm90: head_dim_v {head_dim_v} > head_dim {head_dim} needs its own sO, which does "
                f"not fit in shared memory with tile {tile_m}x{tile_n} and {num_stages} stages"
            )
        if self.o_aliases_q and not same_smem_atom(dtype, head_dim, head_dim_v):
            # sO's rows would not sit on the same warpgroup's sQ rows (a different swizzle atom
            # tiles the buffer differently): a warpgroup's O could land on Q another one still reads.
            raise ValueError(
                f"FlashFwdSm90: sO must share sQ's buffer here, but head_dim_v {head_dim_v} has another "
                f"shared-memory swizzle atom than head_dim {head_dim}; pad v to head_dim"
            )
        self.release_q_before_next_q = persistent and self.o_aliases_q
        self.defer_store_wait = persistent and not self.o_aliases_q
        # Each MMA warpgroup stores its own 64 rows of O (its own named barrier and TMA store
        # of a (64, head_dim_v) box) and waits only on the dynamic scheduler's handoff (an
        # mbarrier every warpgroup waits on alone): no barrier spans warpgroups per tile, so the ping-pong phase (one warpgroup
        # half a block ahead) survives tile boundaries. A packed tile splits into per-warpgroup
        # boxes only when pack_gqa divides 64.
        self.wg_local_epilogue = wg_local_epilogue and 64 % pack_gqa == 0
        if span_heads and not (self.wg_local_epilogue and intra_wg_overlap):
            # Each warpgroup stores its own rows; the producer loads in the overlap order (V lags K).
            raise ValueError("FlashFwdSm90: span_heads needs wg_local_epilogue and intra_wg_overlap")
        self.tx_bytes_q = tile_m * head_dim * elem_bytes
        self.tx_bytes_k = tile_n * head_dim * elem_bytes  # (+ 4 tile_n: the gate's bias, dense gated keys)
        self.tx_bytes_v = tile_n * head_dim_v * elem_bytes

    @staticmethod
    def can_implement(
        dtype, head_dim, head_dim_v, tile_m, tile_n, num_stages=2, is_causal=False, is_local=False,
        pack_gqa=1, cluster_m=1, span_heads=False, has_sink=False, has_gate=False, has_softcap=False,
        gate_slice=False,
    ) -> str | None:
        """None if this static config compiles into a correct kernel, else the reason why not."""
        if dtype not in (cutlass.BFloat16, cutlass.Float16):
            return f"dtype must be BFloat16 or Float16, got {dtype}"
        if head_dim % 16 != 0 or not 16 <= head_dim <= 256:
            return f"head_dim must be a multiple of 16 in [16, 256], got {head_dim}"
        if head_dim_v % 16 != 0 or not 16 <= head_dim_v <= 256:
            return f"head_dim_v must be a multiple of 16 in [16, 256], got {head_dim_v}"
        if is_causal and is_local:
            return "is_causal and is_local are exclusive (causal with a window is local, right = 0)"
        if tile_m not in (64, 128, 192):
            return f"tile_m must be 64, 128 or 192 (64 rows per MMA warpgroup), got {tile_m}"
        if tile_n % 16 != 0 or not 16 <= tile_n <= 256:
            return f"tile_n must be a multiple of 16 in [16, 256] (P as k16 A fragments), got {tile_n}"
        if num_stages < 1:
            return f"num_stages must be >= 1, got {num_stages}"
        if pack_gqa < 1 or tile_m % pack_gqa != 0:
            return f"pack_gqa ({pack_gqa}) must divide tile_m ({tile_m}) (a tile holds whole queries)"
        if cluster_m not in (1, 2):
            return f"cluster_m must be 1 or 2, got {cluster_m}"
        if cluster_m > 1 and (is_causal or is_local or pack_gqa > 1):
            # The CTAs of a cluster must visit the same key blocks in the same order.
            return "cluster_m > 1 needs no causal/local mask and no pack_gqa"
        if span_heads and (is_causal or is_local or pack_gqa > 1 or cluster_m > 1 or tile_m < 128):
            # Every warpgroup of a spanning tile must visit the same key blocks in the same order.
            return "span_heads needs no causal/local mask, no pack_gqa, no clusters and tile_m >= 128"
        if has_sink and (pack_gqa > 1 or span_heads):
            # The sink is read per (batch, head) tile: every row of a tile must be of one head.
            return "has_sink needs no pack_gqa and no span_heads (a tile's rows of one head)"
        if has_gate and (pack_gqa > 1 or span_heads or has_softcap or cluster_m > 1):
            # The gate's bias is per query head (a tile's rows of one head) and enters the raw score;
            # it arrives with K's TMA (no multicast).
            return "has_gate needs no pack_gqa, no span_heads, no softcap and no clusters"
        num_wg = tile_m // 64
        acc_regs = acc_registers(tile_m, tile_n, head_dim_v)
        if acc_regs > _MAX_ACC_REGS[num_wg]:
            return (
                f"S + O + P take {acc_regs} registers per MMA thread (> {_MAX_ACC_REGS[num_wg]} "
                f"with {num_wg} MMA warpgroups); use a smaller tile_n"
            )
        rings = 2 if span_heads else 1
        own_sO = head_dim_v > head_dim  # sO cannot share sQ's buffer
        elem = dtype.width // 8
        gate_slice = has_gate and gate_slice and gate_in_gemm(elem, head_dim, head_dim_v, tile_m, tile_n, num_stages * rings, own_sO, 1)
        smem = FlashFwdSm90._smem_bytes(dtype, head_dim, head_dim_v, tile_m, tile_n, num_stages * rings, own_sO,
                                        gate=has_gate, gate_slice=gate_slice)
        if smem > _SMEM_CAPACITY:
            return f"needs {smem} bytes of shared memory, sm90 allows {_SMEM_CAPACITY}"
        return None

    # ------------------------------------------------------------------ host entry point

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, nheads, head_dim) | varlen (total_q, nheads, head_dim)
        mK: cute.Tensor,  # (batch, seqlen_k, nheads_k, head_dim) | varlen (total_k, ...)
        mV: cute.Tensor,  # (batch, seqlen_k, nheads_k, head_dim_v) | varlen (total_k, ...)
        mO: cute.Tensor,  # like mQ with head_dim_v, output
        mLSE: cute.Tensor,  # (batch, nheads, seqlen_q) | varlen (nheads, total_q), fp32 output
        softmax_scale: Float32,
        window_left: Int32,  # local only (else ignored); unbounded: a huge value
        window_right: Int32,  # local only (else ignored); unbounded: a huge value
        softcap: Float32,  # has_softcap only (else ignored)
        max_ctas: Int32,  # persistent only: CTAs to launch at most (the SM count)
        mTileCounter: cute.Tensor | None,  # (1,) int32, zero at launch, left zero: dynamic_schedule only
        mGate: cute.Tensor | None,  # has_gate only: gate_in_gemm: K's extra k16 slice's first columns, (batch,
        #   seqlen_k, nheads, GATE_COLS) | varlen (total_k, nheads, GATE_COLS), 16-bit; else the bias (batch, nheads,
        #   seqlen_k) | varlen (nheads, total_k) fp32
        mDescale: cute.Tensor | None,  # FP8 only, fp32: (3, batch, nheads_k) or per block (3, batch, nheads, blocks)
        mLiveBlocks: cute.Tensor | None,  # skip_decayed_blocks only: (batch, nheads, m_blocks) int32, each tile's
        #   first key block that may hold a nonzero P (the launcher's bound; packed: a row per sequence)
        mSinkLogits: cute.Tensor | None,  # has_sink only: (nheads,) fp32, each query head's sink logit (natural log)
        mCuSeqlensQ: cute.Tensor | None,  # (batch + 1,) int32
        mCuSeqlensK: cute.Tensor | None,  # (batch + 1,) int32
        mSeqUsedQ: cute.Tensor | None,  # (batch,) int32
        mSeqUsedK: cute.Tensor | None,  # (batch,) int32
        stream: cuda.CUstream,
    ):
        varlen_q = const_expr(mCuSeqlensQ is not None)
        varlen_k = const_expr(mCuSeqlensK is not None)
        if const_expr(mQ.element_type is cutlass.Uint8 and self.dtype.width == 8):
            # FP8 inputs arrive as bytes (DLPack's float8 codes vary across torch versions).
            mQ, mK, mV = (cute.recast_tensor(t, self.dtype) for t in (mQ, mK, mV))
        mQ, mK, mV, mO, mLSE = attention_kernel_views(
            mQ, mK, mV, mO, mLSE, self.dtype, varlen_q, varlen_k, self.o_dtype
        )
        if const_expr((mDescale is not None) != (self.o_dtype is not self.dtype)):
            raise TypeError("mDescale must be given exactly for FP8 inputs")
        if const_expr((mGate is not None) != self.has_gate):
            raise TypeError("mGate must be given exactly when has_gate")
        if const_expr((mLiveBlocks is not None) != self.skip_decayed_blocks):
            raise TypeError("mLiveBlocks must be given exactly when skip_decayed_blocks")
        if const_expr((mSinkLogits is not None) != self.has_sink):
            raise TypeError("mSinkLogits must be given exactly when has_sink")
        if const_expr(self.gate_in_gemm):
            if const_expr(mGate.element_type != self.dtype):
                raise TypeError(f"mGate (K's extra k16 slice) must be {self.dtype}")
            # (s_k, GATE_COLS, h[, b]), as K
            mGate = select_modes(assume_strides_aligned(mGate), [0, 2, 1] if varlen_k else [1, 3, 2, 0])
        elif const_expr(mGate is not None):
            mGate = select_modes(mGate, [1, 0] if varlen_k else [2, 1, 0])  # (s_k, h[, b]), as LSE
        qhead_per_kvhead = mQ.shape[2] // mK.shape[2]
        if const_expr(self.cluster_m > 1 and (varlen_q or varlen_k)):
            raise ValueError("cluster_m > 1 is implemented for dense layouts only")
        if const_expr(self.pack_gqa > 1):
            if const_expr(varlen_q):
                raise ValueError("pack_gqa is implemented for dense layouts only")
            mQ, mO = (pack_gqa_view(t, self.pack_gqa, head_mode=2) for t in (mQ, mO))
            mLSE = pack_gqa_view(mLSE, self.pack_gqa, head_mode=1)
            qhead_per_kvhead = 1  # a packed tile's head index is its KV head
        sQ_layout, sK_layout, sV_layout, sO_layout = self._smem_layouts()
        # TMA descriptors over the whole tensors (varlen: over all sequences); a CTA picks its
        # (head[, batch]) and shifts to its sequence at issue time. Boxes past the tensor are
        # zero-filled and still count their full bytes.
        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        # K/V with clusters: each CTA issues its 1/cluster_m share of a block, multicast to all.
        tma_load_kv = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(self.cluster_m > 1) else tma_load
        if const_expr(self.span_heads and (varlen_q or varlen_k)):
            raise ValueError("span_heads is implemented for dense layouts only")
        # Spanning tiles load Q per warpgroup (its 64 rows may belong to another head).
        q_rows = 64 if const_expr(self.span_heads) else self.tile_m
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(
            tma_load, mQ, self._rows_layout(self._q_stage_layout(sQ_layout), self.head_dim, q_rows),
            (q_rows, self.head_dim),
        )
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(
            tma_load_kv, mK, cute.select(sK_layout, mode=[0, 1]), (self.tile_n, self.head_dim),
            self.cluster_m,
        )
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(
            tma_load_kv, mV, cute.select(sV_layout, mode=[0, 1]), (self.tile_n, self.head_dim_v),
            self.cluster_m,
        )
        tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO, self._sO_store_layout(sO_layout),
            (self._o_store_rows(), self.head_dim_v),
        )
        SharedStorage = self._shared_storage(sQ_layout, sK_layout, sV_layout, sO_layout)
        tma_atom_Gate, tma_Gate = None, mGate
        if const_expr(self.gate_in_gemm):  # K's extra k16 slice of each key block (its GATE_COLS), into K's stage
            tma_atom_Gate, tma_Gate = cpasync.make_tiled_tma_atom(
                tma_load, mGate, make_smem_layout_sm90(self.dtype, self.tile_n, GATE_COLS), (self.tile_n, GATE_COLS)
            )
        elif const_expr(self.has_gate):  # 1-D boxes of the bias beside each K block
            # Varlen: a box may start up to 3 keys before the sequence's block, at a 16-byte boundary
            # (an unaligned start raised an illegal instruction on an H200), so it is longer.
            box = self.tile_n + (GATE_BOX_SLACK if const_expr(varlen_k) else 0)
            tma_atom_Gate, tma_Gate = cpasync.make_tiled_tma_atom(tma_load, mGate, cute.make_layout(box), (box,))
        if const_expr(self.has_softcap):
            softcap_scale, scale_log2 = softcap_scale_log2(softmax_scale, softcap)
        else:
            softcap_scale, scale_log2 = Float32(1.0), softmax_scale * LOG2_E
        num_batch = mCuSeqlensQ.shape[0] - 1 if const_expr(varlen_q) else mQ.shape[3]
        scheduler = self._scheduler(mQ, mK, num_batch, varlen_q, mTileCounter)
        cluster = {"cluster": [self.cluster_m, 1, 1]} if const_expr(self.cluster_m > 1) else {}
        self.kernel(
            tma_Q, tma_K, tma_V, mO if const_expr(varlen_q) else tma_O, mLSE,
            tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O, scale_log2, softcap_scale,
            window_left, window_right, qhead_per_kvhead, num_batch,
            mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, mTileCounter, tma_Gate, tma_atom_Gate, mDescale,
            mLiveBlocks, mSinkLogits, SharedStorage,
        ).launch(
            grid=[scheduler.grid_size(max_ctas), 1, 1],
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
            use_pdl=self.pdl,
            **cluster,
        )

    # ------------------------------------------------------------------ device code

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,  # TMA coordinates of (seqlen_q | total_q, head_dim, nheads[, batch])
        mK: cute.Tensor,  # TMA coordinates of (seqlen_k | total_k, head_dim, nheads_k[, batch])
        mV: cute.Tensor,  # TMA coordinates of (seqlen_k | total_k, head_dim_v, nheads_k[, batch])
        mO: cute.Tensor,  # dense: TMA coordinates of (seqlen_q, head_dim_v, nheads, batch);
        #                   varlen: the tensor (total_q, head_dim_v, nheads)
        mLSE: cute.Tensor,  # (seqlen_q, nheads, batch) | varlen (total_q, nheads)
        tma_atom_Q: cute.CopyAtom,
        tma_atom_K: cute.CopyAtom,
        tma_atom_V: cute.CopyAtom,
        tma_atom_O: cute.CopyAtom,
        scale_log2: Float32,
        softcap_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        qhead_per_kvhead: Int32,
        num_batch: Int32,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        mSeqUsedQ: cute.Tensor | None,
        mSeqUsedK: cute.Tensor | None,
        mTileCounter: cute.Tensor | None,
        mGate: cute.Tensor | None,  # has_gate only: TMA coordinates of (s_k, nheads, batch) | (total_k, nheads) fp32
        tma_atom_Gate: cute.CopyAtom | None,  # has_gate only
        mDescale: cute.Tensor | None,  # FP8 only: (3, batch, nheads_k) | per block (3, batch, nheads, blocks)
        mLiveBlocks: cute.Tensor | None,  # skip_decayed_blocks only: (batch, nheads, m_blocks) int32
        mSinkLogits: cute.Tensor | None,  # has_sink only: (nheads,) fp32
        SharedStorage: cutlass.Constexpr,
    ):
        """Prologue once per CTA (pipelines, smem views), then role dispatch; each role walks
        this CTA's tiles in the scheduler's order."""
        varlen_q = const_expr(mCuSeqlensQ is not None)
        gate_tma = const_expr(tma_atom_Gate is not None)  # (K's stages then carry the gate's bias or slice)
        gate_box = self.tile_n + (GATE_BOX_SLACK if const_expr(mCuSeqlensK is not None) else 0)  # (as __call__'s)
        gate_tx = self.tile_n * GATE_COLS * (self.dtype.width // 8) if const_expr(self.gate_in_gemm) else gate_box * 4
        atoms = TmaAtoms(tma_atom_Q, tma_atom_K, tma_atom_V, None if varlen_q else tma_atom_O, tma_atom_Gate)
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (atoms.q, atoms.k, atoms.v, atoms.o, atoms.gate):
                if const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)

        storage = SmemAllocator().allocate(SharedStorage)
        sO_storage = None
        if const_expr(not self.o_aliases_q):
            storage, sO_storage = storage.base, storage.sO
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # PipelineTmaAsync.consumer_release arrives from lane 0 of each warp (pitfall 6); with
        # clusters lane r of each warp arrives on CTA r's barrier, so a K/V stage's empty
        # barrier counts the MMA warps of every CTA of the cluster.
        num_mma_warps = self.num_mma_threads // 32
        cluster_layout = cute.make_layout((1, self.cluster_m, 1, 1))  # (V, M, N, K) of the cluster
        cluster_shape_mn = (self.cluster_m, 1) if const_expr(self.cluster_m > 1) else None
        # (FP8: V's consumers are the warps that transpose it, which feed the MMA warps sVt.)
        v_consumer_warps = num_mma_warps if const_expr(not self.transposes_v) else self.num_transpose_warps
        pipes = Pipelines(
            *(
                pipeline.PipelineTmaAsync.create(
                    num_stages=stages, producer_group=producer,
                    consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, warps * ctas),
                    tx_count=tx, barrier_storage=mbar.data_ptr(), defer_sync=True,
                    cta_layout_vmnk=cluster_layout if const_expr(ctas > 1) else None,
                )
                for stages, tx, mbar, ctas, warps in (
                    (self.q_stages, self.tx_bytes_q, storage.mbar_q, 1, num_mma_warps),
                    (self.num_stages * self.num_rings,
                     self.tx_bytes_k + (gate_tx if gate_tma else 0),
                     storage.mbar_k, self.cluster_m, num_mma_warps),
                    (self.num_stages * self.num_rings, self.tx_bytes_v, storage.mbar_v, self.cluster_m, v_consumer_warps),
                )
            ),
            vt=self._vt_pipeline(storage) if const_expr(self.transposes_v) else None,
        )
        # The dynamic scheduler's tile handoff (mbarriers too: initialised before the fence below).
        handoff = None
        if const_expr(self.dynamic_schedule):
            handoff = TileHandoff.create(
                storage.next_tile.get_tensor(cute.make_layout(1)), storage.mbar_tile.data_ptr(),
                self.num_mma_threads + (self.num_transpose_warps * 32 if const_expr(self.transposes_v) else 0),
            )
        # Clusters: no CTA may arrive on, or multicast into, a peer before its barriers exist.
        pipeline.pipeline_init_arrive(cluster_shape_mn=cluster_shape_mn, is_relaxed=True)

        sQ_layout, sK_layout, sV_layout, sO_layout = self._smem_layouts()
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        # sO: its own buffer, or the front of sQ's (large enough: head_dim_v <= head_dim there)
        sO_buffer = storage.sQ if const_expr(self.o_aliases_q) else sO_storage
        sO = sO_buffer.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        # has_gate: gate_in_gemm: (K's extra slice's TMA coordinates, sKx (tile_n, GATE_K, K stages) of which TMA
        # fills GATE_COLS, sQx (tile_m, GATE_K)); else (mGate's TMA coordinates, the bias of each K stage (box,
        # stages) in smem, each stage's row 128-byte aligned).
        gate = None
        if const_expr(self.gate_in_gemm):
            sQx_layout, sKx_layout = self._gate_layouts()
            gate = (
                mGate, storage.sKx.get_tensor(sKx_layout.outer, swizzle=sKx_layout.inner),
                storage.sQx.get_tensor(sQx_layout.outer, swizzle=sQx_layout.inner),
            )
        elif const_expr(gate_tma):
            stages = self.num_stages * self.num_rings
            gate_rows = cute.make_layout((gate_box, stages), stride=(1, gate_stage_floats(self.tile_n)))
            gate = (mGate, storage.sGate.get_tensor(gate_rows))

        window_l = window_left if const_expr(self.is_local) else None
        window_r = window_right if const_expr(self.is_local) else None
        walk = TileWalk(
            scheduler=self._scheduler(mQ, mK, num_batch, varlen_q, mTileCounter),
            handoff=handoff,
            block_info=BlockInfo(
                self.tile_m, self.tile_n, self.is_causal, self.is_local, window_l, window_r,
                self.pack_gqa,
            ),
            seqlen_args=(mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK),
            num_batch=num_batch,
            qhead_per_kvhead=qhead_per_kvhead,
            seqlen_q_static=mQ.shape[0][1] if const_expr(self.pack_gqa > 1) else mQ.shape[0],
            seqlen_k_static=mK.shape[0],
            live_blocks=mLiveBlocks,
        )
        pipeline.pipeline_init_wait(cluster_shape_mn=cluster_shape_mn)
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()  # (the predecessor's outputs: the gate's slice or rows, G)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.load(mQ, mK, mV, sQ, sK, sV, atoms, pipes, walk, gate)
            if const_expr(self.transposes_v):
                if warp_idx > 0 and warp_idx <= self.num_transpose_warps:
                    self.transpose_v(storage, pipes, walk, warp_idx - 1)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self.mma(
                mO, mLSE, sQ, sK, self._pv_operand(storage, sV), sO, atoms.o,
                pipes, walk, scale_log2, softcap_scale if const_expr(self.has_softcap) else None,
                gate[1:] if const_expr(gate is not None) else None, mDescale, mSinkLogits,
            )

    @cute.jit
    def mma(
        self,
        mO: cute.Tensor,  # dense: TMA coordinates of (seqlen_q, head_dim_v, nheads, batch);
        #                   varlen: the tensor (total_q, head_dim_v, nheads)
        mLSE: cute.Tensor,  # (seqlen_q, nheads, batch) | varlen (total_q, nheads)
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        sO: cute.Tensor,  # sQ itself unless the kernel has its own O buffer
        tma_atom_O: cute.CopyAtom | None,
        pipes: Pipelines,
        walk: TileWalk,
        scale_log2: Float32,
        softcap_scale: Float32 | None,
        gate: tuple | None = None,  # has_gate: gate_in_gemm (sKx, sQx), else (the bias rows (box, K stages),)
        mDescale: cute.Tensor | None = None,
        mSinkLogits: cute.Tensor | None = None,  # has_sink: (nheads,) fp32
    ):
        """MMA warpgroups: for each tile of this CTA, main loop over key blocks, finalize,
        epilogue. Fragments, accumulator registers and pipeline states live across tiles."""
        tidx = cute.arch.thread_idx()[0] - _WG_THREADS  # 0 .. num_mma_threads - 1
        wg_idx = cute.arch.make_warp_uniform(tidx // _WG_THREADS)
        tiled_mma_qk, tiled_mma_pv = self._tiled_mmas()
        # WGMMA fragments are per-warpgroup descriptors: slice by the warpgroup's first thread.
        wg_mma_qk = tiled_mma_qk.get_slice(wg_idx * _WG_THREADS)
        wg_mma_pv = tiled_mma_pv.get_slice(wg_idx * _WG_THREADS)
        acc_O = cute.make_rmem_tensor(
            tiled_mma_pv.partition_shape_C((self.tile_m, self.head_dim_v)), Float32
        )
        mma = MmaParts(
            tiled_mma_qk=tiled_mma_qk,
            tiled_mma_pv=tiled_mma_pv,
            thr_mma_qk=tiled_mma_qk.get_slice(tidx),
            tSrQ=wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ)),
            tSrK=wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK)),
            tOrVt=self._pv_fragment_b(wg_mma_pv, sV),
            tOrP=self._pv_fragment_a(wg_mma_pv),
            acc_O=acc_O,
            tSrQx=wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(gate[1])) if const_expr(self.gate_in_gemm) else None,
            tSrKx=wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(gate[0])) if const_expr(self.gate_in_gemm) else None,
        )
        if const_expr(self.pingpong):
            # The first MMA warpgroup gets the first turn at the tensor cores. Each tile then
            # hands the turn round as many times as every warpgroup takes it, so the token
            # carries over from tile to tile.
            if wg_idx == 0:
                cute.arch.barrier_arrive(
                    barrier_id=int(NamedBarrierFwd.WARP_SCHEDULER_WG1),
                    number_of_threads=2 * _WG_THREADS,
                )
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        # Spanning tiles: K/V stages loaded so far into ring A / ring B (every warpgroup consumes
        # every stage of both, reading only its own ring's), so each knows both rings' states.
        ring_count_a, ring_count_b = Int32(0), Int32(0)
        handoff_state = walk.handoff.consumer_state() if const_expr(self.dynamic_schedule) else None
        tile_idx = walk.scheduler.first_tile()
        while tile_idx < walk.scheduler.num_tiles:
            ring_offset, other_offset, other_delta = None, None, None
            if const_expr(self.span_heads):
                # Every warpgroup computes (one past the last block repeats the last block's
                # rows); only blocks in range are stored.
                has_tile = True
                in_range, batch_idx, head_idx, m_block, ring_b, mixed, seqlen, tile = self.span_tile_work(
                    walk, tile_idx, wg_idx
                )
                row0 = (m_block - wg_idx) * 64
                count = ring_count_a + ring_b * (ring_count_b - ring_count_a)
                kv_state = pipeline.PipelineState(
                    self.num_stages, count, count % self.num_stages, (count // self.num_stages) % 2
                )
                ring_offset = ring_b * self.num_stages
                other_offset = (1 - ring_b) * self.num_stages
                other_delta = (ring_count_b - ring_count_a) * (1 - 2 * ring_b)
            else:
                has_tile, batch_idx, head_idx, seqlen, tile = self.tile_work(walk, tile_idx)
                in_range = True
                row0 = tile.m_block * self.tile_m
            if has_tile:
                acc_O.fill(0.0)
                sink_logit = None
                if const_expr(self.has_sink):  # (loaded at the tile's start, first used at finalize: the load's
                    # latency hides under the key loop)
                    sink_logit = mSinkLogits[head_idx]
                v_descale, kv_scales = None, None
                tile_scale_log2 = scale_log2
                if const_expr(mDescale is not None):  # FP8: q and k descales fold into the scale
                    kv_head = head_idx // walk.qhead_per_kvhead
                    if const_expr(self.block_scales):
                        # (3, batch, nheads, blocks): q's per (head, m_block) here, k's per block in each
                        # step's scale, v's as a bias on each block's scores (O in true units: no descale at finalize)
                        tile_scale_log2 = scale_log2 * mDescale[0, batch_idx, head_idx, tile.m_block]
                        kv_scales = (mDescale[1, batch_idx, kv_head, None], mDescale[2, batch_idx, kv_head, None])
                        if const_expr(self.kv_scale_ratio > 1):  # (key block n reads descale n // ratio)
                            kv_scales = tuple(
                                cute.make_tensor(t.iterator, cute.make_layout((self.kv_scale_ratio, cute.size(t)),
                                                                              stride=(0, t.stride[0])))
                                for t in kv_scales
                            )
                    else:
                        tile_scale_log2 = scale_log2 * mDescale[0, batch_idx, kv_head] * mDescale[1, batch_idx, kv_head]
                        v_descale = mDescale[2, batch_idx, kv_head]
                softmax = OnlineSoftmax(
                    tile_scale_log2, num_rows=cute.size(acc_rows_cols(acc_O).shape[0]),
                    rescale_threshold=self.rescale_threshold, max_offset=self.p_max_offset,
                    block_scales=self.block_scales, track_zero_blocks=self.skip_zero_pv,
                )
                mask = AttentionMask(
                    self.tile_m, self.tile_n, tile.seqlen_q, tile.seqlen_k,
                    walk.block_info.window_left, walk.block_info.window_right, self.pack_gqa,
                )
                step = BlockStep(
                    mma, pipes.k, pipes.v if const_expr(pipes.vt is None) else pipes.vt, softmax, mask, tile.m_block, wg_idx, softcap_scale,
                    ring_offset, self.num_stages * self.num_rings,
                    q_stage=q_state.index if const_expr(self.q_stages > 1) else None,
                    gate=gate[0] if const_expr(self.has_gate and not self.gate_in_gemm) else None,
                    # varlen: where the sequence's first key sits in its 16-byte aligned box (``_gate_view``)
                    gate_shift=seqlen.offset_k % GATE_BOX_SLACK
                    if const_expr(self.has_gate and not self.gate_in_gemm and seqlen.has_cu_seqlens_k) else None,
                    kv_scales=kv_scales,
                )
                has_keys = tile.n_block_max > tile.n_block_min
                if has_keys:
                    if const_expr(self.release_q_before_next_q):
                        # sO is sQ: hand sQ to the producer only now, when every epilogue so
                        # far (tiles without keys write their zeros through sO too) is done;
                        # the producer's first Q load waits for this as well. Order this
                        # warp's generic-proxy smem accesses before the TMA (async-proxy) write.
                        cute.arch.fence_view_async_shared()
                        pipes.q.consumer_release(q_state)
                    pipes.q.consumer_wait(q_state)
                    if const_expr(self.span_heads):
                        # Tiles over two pairs run a main loop that also passes the other ring's
                        # stages; the others run the plain one (no such code in their loop).
                        if mixed > 0:
                            step_mixed = dataclasses.replace(step, other_offset=other_offset, other_delta=other_delta)
                            self.mainloop(step_mixed, pipes.q, q_state, walk.block_info, tile, kv_state.clone())
                        else:
                            self.mainloop(step, pipes.q, q_state, walk.block_info, tile, kv_state.clone())
                    else:
                        kv_state = self.mainloop(step, pipes.q, q_state, walk.block_info, tile, kv_state)
                    if const_expr(self.span_heads):
                        num_blocks = tile.n_block_max - tile.n_block_min
                        ring_count_a = ring_count_a + num_blocks
                        ring_count_b = ring_count_b + mixed * num_blocks
                if const_expr(self.has_sink):
                    o_scale, lse = softmax.finalize(sink_logit * LOG2_E)
                else:
                    o_scale, lse = softmax.finalize()
                if const_expr(v_descale is not None):  # FP8 per tensor: V's descale joins O's row scale
                    for r in cutlass.range_constexpr(cute.size(o_scale)):
                        o_scale[r] = o_scale[r] * v_descale
                softmax.rescale_O(acc_O, o_scale)
                if in_range:
                    self.epilogue(
                        acc_O, lse, seqlen.q_view(select_head(mO, head_idx, 2), batch_idx),
                        seqlen.q_view(select_head(mLSE, head_idx, 1), batch_idx), sO, tiled_mma_pv,
                        tma_atom_O, tidx, wg_idx, row0, tile.seqlen_q * self.pack_gqa,
                    )
                if has_keys:
                    q_state.advance()
            tile_idx, handoff_state = walk.scheduler.next_tile_consumer(tile_idx, walk.handoff, handoff_state)
        if const_expr(self.defer_store_wait and tma_atom_O is not None):
            if self._is_o_storer(tidx):
                cute.arch.cp_async_bulk_wait_group(0, read=True)  # smem outlives the last store

    @cute.jit
    def mainloop(
        self,
        step: BlockStep,
        pipeline_q: pipeline.PipelineTmaAsync,
        q_state: pipeline.PipelineState,
        block_info: BlockInfo,
        tile: TileCoord,
        kv_state: pipeline.PipelineState,
    ):
        """Key blocks right to left in up to four segments, each with its masking compiled in.

        One loop body is the same GEMM/softmax sequence for every block; only the mask differs,
        so the mask flags are compile-time and the unmasked segment carries no masking code.
        (One method: the segment bounds and their loops only make sense together.) Returns the
        K/V consumer state past this tile's blocks.
        """
        seqlen_q, seqlen_k = tile.seqlen_q, tile.seqlen_k
        n_block_first = tile.n_block_max - 1
        # 1. The rightmost block: the only one that can be cut by seqlen_k.
        if const_expr(self.intra_wg_overlap):
            kv_state = self.first_half_block(step, kv_state, n_block_first)
        else:
            kv_state = self.one_block(
                step, kv_state, n_block_first, is_first=True, mask_seqlen=True,
                mask_causal=self.is_causal, mask_local=self.is_local,
            )
        # 2. Blocks that may still cross the diagonal / right window edge.
        n_block_unmasked_end = n_block_first
        if const_expr(self.is_causal or self.is_local):
            n_block_mask_min = block_info.n_block_min_right_mask(
                seqlen_q, seqlen_k, tile.m_block, tile.n_block_min
            )
            n_block_unmasked_end = cutlass.min(n_block_unmasked_end, n_block_mask_min)
            for i in cutlass.range(n_block_first - n_block_unmasked_end, unroll=1):
                kv_state = self.one_block(
                    step, kv_state, n_block_first - 1 - i, is_first=False, mask_seqlen=False,
                    mask_causal=self.is_causal, mask_local=self.is_local,
                )
        # 3. Blocks fully inside the window: no masking code at all.
        n_block_unmasked_begin = tile.n_block_min
        if const_expr(self.is_local):
            n_block_unmasked_begin = cutlass.min(
                block_info.n_block_max_left_mask(
                    seqlen_q, seqlen_k, tile.m_block, tile.n_block_min
                ),
                n_block_unmasked_end,
            )
        for i in cutlass.range(n_block_unmasked_end - n_block_unmasked_begin, unroll=1):
            kv_state = self.one_block(
                step, kv_state, n_block_unmasked_end - 1 - i, is_first=False, mask_seqlen=False,
                mask_causal=False, mask_local=False,
            )
        # 4. Local: blocks that may cross the left window edge.
        if const_expr(self.is_local):
            for i in cutlass.range(n_block_unmasked_begin - tile.n_block_min, unroll=1):
                kv_state = self.one_block(
                    step, kv_state, n_block_unmasked_begin - 1 - i, is_first=False,
                    mask_seqlen=False, mask_causal=False, mask_local=True,
                )
        # Every QK^T of this tile has completed: the producer may load the next tile's Q into
        # sQ under the last P.V and the epilogue (unless sO is sQ: released before the next Q).
        if const_expr(not self.release_q_before_next_q):
            pipeline_q.consumer_release(q_state)
        if const_expr(self.intra_wg_overlap):
            kv_state = self.last_half_block(step, kv_state)
        return kv_state
