"""FlashAttention-3 backward kernel for Hopper (sm90): ``FlashBwdSm90``.

Purpose: given Q, K, V, dO and the preprocess outputs (``LSE_log2``, ``dPsum``,
``common/bwd_pre.py``), compute dK, dV and accumulate dQ in fp32 (design doc 2.1-2.7) with TMA
loads, WGMMA and warp specialisation:

    S^T  = K Q^T,  P^T = exp2(S^T * scale_log2 - LSE_log2)     dV += P^T dO   (P^T in registers)
    dP^T = V dO^T, dS^T = P^T * (dP^T - dPsum)                 dK += dS^T Q   (dS^T in registers)
    dQaccum += dS K   (dS from smem; fp32 reduce-adds, scaled by the postprocess)

The score GEMMs are computed transposed (keys as the MMA's M, FA3's ``SdP_swapAB``), so each MMA
warpgroup's P^T and dS^T are, register for register, the A operands of its own dV and dK GEMMs:
no smem round trip for P, and dS goes to smem only for the dQ GEMM, which needs all keys.

Constraints: bf16/fp16; Q/K/V/dO ``(batch, seqlen, nheads, head_dim)`` (varlen: ``(total,
nheads, head_dim)`` with ``cu_seqlens_q/k`` and optional ``seqused_q/k``), unit last stride, other
strides multiples of 8 elements, 16-byte aligned bases (TMA); ``head_dim == head_dim_v`` in
{64, 96, 128} (the launcher pads); ``nheads % nheads_k == 0``. Scratch buffers as in
``common/bwd_utils.py`` (``dQaccum`` per m_block in the fragment order of the dQ WGMMA,
``tiled_mma_dq_sm90``; GQA's ``dKaccum``/``dVaccum`` row-major per head; the postprocess undoes
both). Causal (bottom-right), sliding window,
softcap (``dS_x = dS_s * (1 - tanh^2)``, as ``sm80/bwd.py``), GQA/MQA, deterministic dQ and
GQA dK/dV sums (semaphores, ``common/bwd_utils.py``).

The MMA warpgroups' m_block loop is in ``bwd_loop.py`` (``FlashBwdSm90Loop``), the dQ writer's role and the
dK/dV epilogues in ``bwd_store.py`` (``FlashBwdSm90Store``); both are mixins of the kernel class.

Paper: FlashAttention-3 (Shah et al., 2024) section 3 and appendix B (backward); design doc
``fa3_cute_design.md`` section 2.
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as hopper_helpers
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator

from . import bwd_gate
from .bwd_loop import FlashBwdSm90Loop
from .bwd_store import _WG_THREADS, FlashBwdSm90Store
from ..common.bwd_utils import m_block_min_max, scratch_offset, tiled_mma_dq_sm90, tiled_mma_dqt_sm90
from ..common.seqlen import SeqlenInfo, num_varlen_tiles_upper_bound, varlen_tile_coord
from ..common.sm90_utils import make_smem_layout_sm90
from ..common.softmax import softcap_scale_log2
from ..common.utils import LOG2_E, assume_strides_aligned, select_head, select_modes

_SMEM_ALIGN = 1024  # each operand buffer starts on a full period of the 128-byte swizzle
_SMEM_CAPACITY = 227 * 1024
# (producer, MMA warpgroup) registers per thread after setmaxnreg: 128 * (24 + 2 * 240) <= 64K.
_PRODUCER_REGS, _MMA_REGS = 24, 240


def _tma_tiles(atom: cute.CopyAtom, smem: cute.Tensor, gmem: cute.Tensor, rank: int) -> tuple:
    """(smem, gmem) partitions of a non-multicast TMA copy whose tile is the first ``rank`` modes of both."""
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, rank),
                                 cute.group_modes(gmem, 0, rank))


def _stats_stride(tile_m: int) -> int:
    """fp32 slots per Q/dO stage of sLSE / sdPsum: tile_m rounded up to 32, so that every stage's TMA
    destination is 128-byte aligned (tile_m 80's 320-byte stages raised a misaligned address)."""
    return -(-tile_m // 32) * 32


class FlashBwdSm90(FlashBwdSm90Loop, FlashBwdSm90Store):
    """FA3 backward on sm90: one CTA per key block ``(n_block, head, batch)``, 384 threads.

        | warpgroup | warps | registers | role                                                |
        | WG0       | 0     | 24        | producer: TMA of K, V once; Q, LSE, dO, dPsum per m |
        | WG0       | 1     | 24        | dQ writer: bulk reduce-add sdQ -> dQaccum per m     |
        | WG0       | 2-3   | 24        | idle (exit after setmaxnreg)                        |
        | WG1, WG2  | 4 each| 240       | MMA: 64 keys each; S^T, dP^T, dV, dK, dQ; epilogue  |

    Pipelines (mbarriers; producer arrive = one elected ``arrive.expect_tx``, consumer arrive =
    lane 0 of every MMA warp):

        | pipeline    | stages | producer -> consumer            | tx bytes per stage          |
        | pipeline_kv | 1      | TMA K, V -> every MMA warp      | tile_n * (head_dim + head_dim_v) * 2 |
        | pipeline_q  | 2 (1-3)| TMA Q[m], LSE[m] -> MMA warps   | tile_m * head_dim * 2 + 4 * tile_m |
        | pipeline_do | 2 (1-3)| TMA dO[m], dPsum[m] -> MMA warps| tile_m * head_dim_v * 2 + 4 * tile_m |

    Per m_block, each MMA warpgroup (its 64 keys)::

        wait Q; issue S^T = K Q^T; wait dO; issue dP^T = V dO^T; wait S; mask,
        P^T = exp2(S^T * scale_log2 - LSE); wait dP; dS^T = P^T (dP^T - dPsum); issue dV += P^T dO
        (A = P^T registers); dS^T -> sdS[stage] (stmatrix); fence;
        barrier DS_READY (both warpgroups' dS); issue dQ = dS K (this warpgroup's half of
        head_dim, or of the rows); issue dK += dS^T Q (A = dS^T registers); wait dV, dQ;
        release dO; [bar DQ_EMPTY + wg]; dQ -> its part of sdQ; fence; arrive DQ_FULL + wg; wait dK;
        release Q

    With softcap the exp2 pass waits for dP^T first (its tanh' is folded into dP^T - dPsum while S^T
    is live), and dV is issued after dS^T is formed.

    At tile_m 128 (hdim 64; softcap refused) and 80 (``ds_from_p16``), dS^T is formed from the 16-bit
    P^T (fp32 P^T beside both in-flight tiles serialized every WGMMA). With the gate at tile_m 128
    (``dv_after_sums``), dV is issued after the dG sums are staged instead of right after dS^T.

    At tile_m 80 (``dq_transposed``: hdim 128, dense; opt-in, ``backends/sm90_bwd.BWD_SM90_TILE_80``) S^T and dP^T are
    m64n80; after the exp2 pass it waits for dP^T, forms dS^T from the 16-bit P^T (fp32 P^T beside both
    in-flight tiles overflowed the registers), then issues dV; dQ cannot take 80
    rows as a WGMMA's M, so the warpgroups compute dQ^T = K^T dS^T (64 head-dim rows each, N = 80)
    and the postprocess transposes it back (its scratch rows padded to multiples of 640).

    dQ writer warp, per m_block: [after the first: for each warpgroup k, wait until the previous
    block's add of its part has read sdQ, arrive DQ_EMPTY + k]; [wait for this key block's turn];
    for each warpgroup k: bar DQ_FULL + k (its 128 threads and the writer), lane 0 issues one bulk
    reduce-add (``cp.reduce.async.bulk ... add.f32``) of its part of sdQ into the fp32 accumulator's
    tile, each part in the warpgroup's own dQ fragment order (4 values per thread side by side:
    conflict-free 128-bit stores; the postprocess undoes it, ``wg_blocks``) [deterministic: waits
    until both are done in L2 and passes the turn]. The two warpgroups meet once per block
    (DS_READY), not again at the dQ hand-off, and never wait on global memory for dQ nor on the
    turns: each waits only for the TMA unit to have read its part of the previous block's tile.

    sdS has two stages: a warpgroup writes block j+1's dS while the other may still read block
    j's, and cannot reach block j+2 before the other passed DS_READY of j+1 (after its dQ(j)).
    Epilogue: MHA: dK * scale and dV to 16 bits, through sK/sV (stmatrix) to predicated 128-bit
    row stores; GQA: fp32 reduce-adds into the KV head's sums. A block no query sees stores zeros.

    gqa_loop (GQA, not gated; the launcher takes it for unmasked calls and short masked ones, not deterministic):
    one CTA per ``(n_block, KV head, batch)``; every role walks the group's query heads in turn, a virtual m_block
    running over heads x m_blocks (``block_head``): the producer takes each head's Q / dO / LSE / dPsum, the dQ writer
    its accumulator, the MMA loop the real m_block for its masks; dK / dV stay in registers over the heads and leave
    by the MHA epilogue (no fp32 sums, no postprocess). Dense masked grids run in chunks of key blocks
    (``loop_chunks``).

    dq_claim (the table's keys but deterministic / trace, hdim 128 under causal or local masks only): the
    preprocess zeroes the tiles' claim states, not dQaccum; the writer claims each tile a block ahead (a CAS
    on the tile's state in ``mdQ_sem``: 0 free, 1 being zeroed, 2 zeroed), the claimant zeroes it in L2
    (``claim_dq_tile``), others wait for 2; the postprocess reads a never-claimed tile as zeros.

    Launch: a programmatic dependent of the preprocess (``configs.bwd_pdl``): every CTA lets the
    postprocess launch at its start; the producer issues K and V, then waits for the preprocess
    (``griddepcontrol.wait``) before the first LSE/dPsum (and Q/dO) loads, the dQ writer before its
    first reduce-add into the zeroed accumulator.
    """

    def __init__(
        self,
        dtype: type[cutlass.Numeric],
        head_dim: int,
        tile_m: int,
        tile_n: int,
        is_causal: bool,
        is_gqa: bool,
        is_local: bool = False,
        has_softcap: bool = False,
        num_stages: int = 2,
        dq_split_rows: bool = False,
        deterministic: bool = False,
        head_dim_v: int | None = None,
        has_gate: bool = False,
        dq_transposed: bool = False,
        trace: bool = False,
        pingpong: bool = False,
        ds_packed: bool = False,
        dq_claim: bool = False,
        gqa_loop: bool = False,
        loop_chunk_n: int = 8,
        loop_desc: bool = False,
        gate_key_mma: bool = False,
        gate_query_mma: bool = False,
        skip_decayed: bool = False,
    ):
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        reason = self.can_implement(dtype, head_dim, tile_m, tile_n, is_causal, is_local, num_stages, dq_split_rows,
                                    has_softcap, head_dim_v=head_dim_v, has_gate=has_gate,
                                    dq_transposed=dq_transposed, **({"pingpong": True} if pingpong else {}))
        if reason is None and trace and deterministic:
            reason = "trace stores its clocks where deterministic keeps its semaphores"
        if reason is None and dq_claim and (deterministic or trace):
            reason = "dq_claim keeps its tile states where deterministic keeps its turns and trace its clocks"
        if reason is None and gqa_loop and (is_gqa or has_gate or trace or tile_n != 128):
            reason = ("gqa_loop keeps dK/dV in registers over a KV head's query heads (the MHA epilogue): not with "
                      "the GQA sums (is_gqa), the gate (a bias per query head), trace, or the wide kernels")
        if reason is None and (gate_key_mma or gate_query_mma) and (not has_gate or pingpong or tile_m not in (64, 128)):
            reason = ("gate_key_mma / gate_query_mma take the gate's sums by WGMMA: only with has_gate, not pingpong, "
                      "tile_m 64 or 128")
        if reason is None and gate_key_mma and gate_query_mma and head_dim == 128:
            # (ptxas C7512 at 168 registers: both accumulators beside dK/dV serialize every WGMMA, 44 waits)
            reason = "gate_key_mma and gate_query_mma together serialize every WGMMA at head_dim 128: one of them"
        if reason is None and (gate_key_mma or gate_query_mma) and (
                FlashBwdSm90.smem_bytes(dtype, head_dim, tile_m, tile_n, num_stages, has_gate)
                + 8 * (tile_m + tile_n) * dtype.width // 8 + 2048 > _SMEM_CAPACITY):
            reason = "gate_key_mma / gate_query_mma's tiles of ones do not fit in shared memory"
        if reason is None and skip_decayed and not (has_gate and is_causal and not is_local and not deterministic):
            reason = ("skip_decayed ends each key block's query blocks at the launcher's bound of the decayed ones: a "
                      "causal gated kernel without a window, not deterministic (its turns count every key block)")
        if reason is None and loop_desc and (not gqa_loop or dq_claim):
            reason = "loop_desc orders gqa_loop's blocks; dq_claim's claims a block ahead assume ascending blocks"
        if reason is not None:
            raise ValueError(f"FlashBwdSm90 cannot implement this config: {reason}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v  # V, dO, dV (== head_dim here; bwd_wide.py: 192/128, 256/128, 256/192)
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.is_causal = is_causal
        self.is_local = is_local
        self.is_gqa = is_gqa
        self.has_softcap = has_softcap
        # Gated log-decay (bwd_gate.py): a bias per (query head, key) in P^T, dG's sums from dS^T.
        self.has_gate = has_gate
        # The gate's per-key sums by one more WGMMA beside dK's (dS^T times a tile of ones, bwd_gate.py) instead
        # of the threads' adds (session 38: written and compiled without a GPU; opt-in, not yet measured).
        self.gate_key_mma = gate_key_mma
        # The per-query sums likewise beside dQ's (dS times a tile of ones), staged whole into warp 0's row of
        # sQuerySums (the other rows zeroed once: the dQ writer's sum stays as it is). Same status.
        self.gate_query_mma = gate_query_mma
        self.num_stages = num_stages
        self.num_stages_do = num_stages  # dO / dPsum ring stages (bwd_wide96.py: fewer than Q's where dO is wide)
        # Deterministic: semaphore-ordered dQ (and GQA dK/dV) adds, compiled in only where asked
        # (the turn bookkeeping costs registers the main loop does not have to spare).
        self.deterministic = deterministic
        # The dQ GEMM (tile_m x head_dim) is split between the two MMA warpgroups by columns
        # (head_dim halves) or, with tile_m = 128, by rows (64 queries each).
        self.dq_split_rows = dq_split_rows
        # tile_m 80 (FA4's non-causal hdim-128 tile: more queries per K/V byte of smem traffic): a WGMMA's
        # M is 64 per warpgroup, so 80 query rows cannot be dQ's M; the kernel computes dQ^T = K^T dS^T
        # (M = head_dim, 64 per warpgroup; N = 80 queries) and the postprocess transposes it back.
        self.dq_transposed = dq_transposed
        # tile_m 80 and 128: S^T and dP^T (40 / 64 registers each) stay in flight together, but fp32
        # P^T is not kept for dS^T beside them (ptxas serialized every WGMMA and spilled): dS^T is formed
        # from the 16-bit P^T (as PyTorch's bf16 autograd does; dS^T is rounded to 16 bits next) before
        # dV, whose A operand it is, is issued.
        self.ds_from_p16 = tile_m in (80, 128)
        # The gate at tile_m 128: dV waits until the dG sums are staged (with dV issued right after dS^T,
        # its pinned P^T beside the sums spilled 2 registers). (At tile_m 64 that order spilled 31.)
        self.dv_after_sums = tile_m == 128 and has_gate
        # Debug timeline (perf/trace_bwd.py): each MMA warpgroup's clock() at 16 points of blocks TRACE_BLOCK and
        # TRACE_BLOCK + 1, stored by the first two CTAs after their loop into mdQ_sem (the host passes a
        # ``TRACE_SLOTS`` buffer there; plain loop only, never with deterministic).
        self.trace = trace
        # Ping-pong (opt-in, perf/NOTES.md session 29): no per-block meeting of the MMA warpgroups; each stores its
        # dS^T, issues dK and the previous block's dQ, and signals the other (``pingpong_tail``); warpgroup 1 starts
        # half a block late, so one's exp2 / dS^T pass runs under the other's GEMMs.
        self.pingpong = pingpong
        # dS^T = P^T (dP^T - dPsum) as packed 16-bit products of the 16-bit P^T (the dV GEMM's operand) and the
        # rounded difference (``ds16_from_probs16``: per pair 2 FADD, 1 F2FP, 1 HMUL2) instead of fp32 products that
        # widen P^T back (ds_from_p16) and round after: the block pays per issued instruction (NOTES session 31).
        self.ds_packed = ds_packed
        # dQaccum not zeroed by the preprocess: the dQ writer claims each tile before its first add (one int32
        # state per tile in mdQ_sem), the claimant zeroes it (``FlashBwdSm90Store.claim_dq_tile``), so the tile's
        # lines are allocated in L2 right before the adds instead of zeroed in DRAM and read back.
        self.dq_claim = dq_claim
        # (has_gate, causal) Each key block's query blocks end where the launcher's bound (``mLiveRows``:
        # flashattn_hopper/backends/gate_blocks.py ``last_live_rows``) finds every later block's P exactly 0: their
        # dS, dV, dK and dG parts are 0, so no role walks them (the diagonal block is always live: never empty).
        self.skip_decayed = skip_decayed
        # GQA with one CTA per (key block, KV head): it walks every query head of its KV head, m_blocks in turn per
        # head (a virtual m_block runs over heads x m_blocks, ``block_head``), dK / dV summed in registers and
        # stored once in 16 bits by the MHA epilogue: no fp32 sums, their zeroing, reduce-adds or postprocess.
        self.gqa_loop = gqa_loop
        # Dense masked gqa_loop grids go in chunks of ``loop_chunk_n`` key blocks: (chunk, batch, KV head, key block
        # in chunk), the last fastest. A CTA is group x its key block's query blocks long, so later heads' long CTAs
        # must not start in the last waves (key block slowest: -5 % -> +3 % at 4k), while a head's key blocks keep
        # running together, sharing its Q / dO and dQ tiles in L2 (one key block per chunk lost 8-24 % at 1k).
        self.loop_chunks = gqa_loop and (is_causal or is_local) and not deterministic
        self.loop_chunk_n = loop_chunk_n
        # gqa_loop's blocks in the other order (the table's masked rows past ``loop_desc_above``): the heads innermost,
        # the query blocks descending. Under a causal mask every key block sees the last query block, so all CTAs of a
        # KV head then walk the same query block at the same time (each stops at its own first), and one block of
        # each of the group's heads is live in L2 instead of whole heads (heads outermost, ascending: the CTAs drift
        # apart over the heads, -2 to -7 % from 4k at hdim 128; descending +2 to +9 % at 1k-8k, perf/NOTES.md
        # sessions 36-37).
        self.loop_desc = loop_desc
        # Two MMA warpgroups (64 keys each here; bwd_wide.py splits head_dim between them instead).
        self.num_mma_wg = 2
        self.dq_sync_threads = _WG_THREADS + 32  # DQ_FULL / DQ_EMPTY per warpgroup: its threads + the writer
        self.pds_stages = 2  # sdSt buffers (bwd_wide.py adds two for P^T)
        self.num_mma_threads = self.num_mma_wg * _WG_THREADS
        self.num_threads = self.num_mma_threads + _WG_THREADS
        elem = dtype.width // 8
        # GQA epilogue: fp32 dV / dK of both warpgroups (2 x 64 rows) over sK | sV and sQ | sdO. Those
        # pairs are adjacent fields of whole 1 KB periods (no alignment gap); sQ | sdO needs 2 * num_stages * tile_m >= 256
        # rows of 16 bits. (bwd_wide.py, tile_n 64, keeps row-major sums.)
        self.gqa_staging = 2 * 64 * head_dim
        if is_gqa and tile_n == 128 and (
            (tile_n * head_dim * elem) % _SMEM_ALIGN or (num_stages * tile_m * head_dim * elem) % _SMEM_ALIGN
            or num_stages * tile_m < 128
        ):
            raise ValueError("the GQA epilogue's fp32 staging needs sK | sV and sQ | sdO adjacent and 64 rows deep")
        self.tx_bytes_kv = tile_n * (head_dim + head_dim_v) * elem
        self.tx_bytes_q = tile_m * head_dim * elem + tile_m * 4
        self.tx_bytes_do = tile_m * head_dim_v * elem + tile_m * 4

    @staticmethod
    def can_implement(dtype, head_dim, tile_m, tile_n, is_causal=False, is_local=False, num_stages=2,
                      dq_split_rows=False, has_softcap=False, head_dim_v=None, has_gate=False,
                      dq_transposed=False, pingpong=False) -> str | None:
        if dtype not in (cutlass.BFloat16, cutlass.Float16):
            return f"dtype must be BFloat16 or Float16, got {dtype}"
        if head_dim not in (64, 96, 128):
            return f"head_dim must be 64, 96 or 128, got {head_dim}"
        if head_dim_v not in (None, head_dim):
            return f"head_dim_v must equal head_dim, got {head_dim_v} and {head_dim}"
        if tile_n != 128:
            return f"tile_n must be 128 (two MMA warpgroups of 64 keys), got {tile_n}"
        if tile_m not in (64, 80, 128):
            return f"tile_m must be 64, 80 or 128, got {tile_m}"
        if dq_transposed != (tile_m == 80):
            return "the kernel computes dQ^T exactly when tile_m is 80 (a WGMMA's M cannot be 80)"
        if pingpong and (dq_transposed or has_gate or has_softcap):
            return "pingpong is the plain loop's: not at tile_m 80 (dQ^T), not with the gate or softcap"
        if dq_transposed and (head_dim != 128 or has_softcap or has_gate):
            return ("tile_m 80 (dQ^T: head_dim is its M, 64 per warpgroup) needs head_dim 128, and keeps fp32 P^T "
                    "for dS^T: no softcap or gate (their registers)")
        if dq_split_rows != (tile_m == 128):
            return "the dQ GEMM splits rows exactly when tile_m is 128"
        if tile_m == 128 and has_softcap:
            return "tile_m 128 issues dP^T after P^T is formed and frees S^T: the softcap derivative needs it"
        if not dq_split_rows and not dq_transposed and (head_dim // 2) % 8 != 0:
            return f"head_dim {head_dim} does not split into two dQ column halves a WGMMA takes (N a multiple of 8)"
        if is_causal and is_local:
            return "is_causal and is_local are exclusive"
        if has_gate and has_softcap:
            return "the gate's bias enters the raw score, which the softcap would pass through tanh"
        if num_stages not in (1, 2, 3):
            return f"num_stages must be 1, 2 or 3, got {num_stages}"
        if FlashBwdSm90.smem_bytes(dtype, head_dim, tile_m, tile_n, num_stages, has_gate) > _SMEM_CAPACITY:
            return "does not fit in shared memory"
        return None

    @staticmethod
    def smem_bytes(dtype, head_dim, tile_m, tile_n, num_stages, has_gate=False) -> int:
        elem = dtype.width // 8
        operands = (2 * tile_n * head_dim + 2 * num_stages * tile_m * head_dim + 2 * tile_m * tile_n) * elem
        query_sums = 2 * bwd_gate.NUM_MMA_WARPS * tile_m * 4 if has_gate else 0
        return operands + tile_m * head_dim * 4 + 2 * num_stages * _stats_stride(tile_m) * 4 + query_sums + 1024 + 256

    # ------------------------------------------------------------------ layouts and MMAs

    def _smem_layouts(self):
        d, s = self.head_dim, self.num_stages
        return {
            "sQ": make_smem_layout_sm90(self.dtype, self.tile_m, d, s),
            "sdO": make_smem_layout_sm90(self.dtype, self.tile_m, self.head_dim_v, self.num_stages_do),
            # (dQ by head_dim halves reads each half of K as an MN-major B operand: at d = 96 a 48-column half
            # is not a whole 64-byte swizzle atom, 32-byte atoms are; at d = 128 the atom is 128 bytes either way)
            "sK": make_smem_layout_sm90(self.dtype, self.tile_n, d,
                                        atom_cols=d if self.dq_split_rows or self.dq_transposed else d // 2),
            "sV": make_smem_layout_sm90(self.dtype, self.tile_n, self.head_dim_v),
            # dS^T: (keys, queries), queries contiguous; the dQ GEMM reads its transpose (M-major A).
            "sdSt": make_smem_layout_sm90(self.dtype, self.tile_n, self.tile_m, self.pds_stages),
            # gate_key_mma: the ones the per-key sums' WGMMA takes as B, (8, queries) K-major (every element 1:
            # the swizzle does not matter)
            **({"sOnes": make_smem_layout_sm90(self.dtype, 8, self.tile_m)} if self.gate_key_mma else {}),
            # gate_query_mma: the ones of the per-query sums' WGMMA, (8, keys) K-major
            **({"sOnesN": make_smem_layout_sm90(self.dtype, 8, self.tile_n)} if self.gate_query_mma else {}),
        }

    def _shared_storage(self, layouts):
        def buffer(layout):
            return cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layout)], _SMEM_ALIGN]

        stats = _stats_stride(self.tile_m) * self.num_stages
        stats_do = _stats_stride(self.tile_m) * self.num_stages_do
        query_sums = 2 * bwd_gate.NUM_MMA_WARPS * self.tile_m if self.has_gate else 4

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages_do]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, stats], 128]
            sdPsum: cute.struct.Align[cute.struct.MemRange[Float32, stats_do], 128]
            sK: buffer(layouts["sK"])
            sV: buffer(layouts["sV"])
            sQ: buffer(layouts["sQ"])
            sdO: buffer(layouts["sdO"])
            sdSt: buffer(layouts["sdSt"])
            # fp32 dQ staging: the m_block's tile in the dQ MMA's fragment order (``dq_staging``).
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, self.tile_m * self.head_dim], _SMEM_ALIGN]
            # has_gate: each MMA warp's query sums of the m_block (bwd_gate.py), read by the dQ writer.
            sQuerySums: cute.struct.Align[cute.struct.MemRange[Float32, query_sums], 128]
            if self.gate_key_mma:
                sOnes: buffer(layouts["sOnes"])
            if self.gate_query_mma:
                sOnesN: buffer(layouts["sOnesN"])

        return SharedStorage

    def _tiled_mma_key_sums(self):
        """gate_key_mma: dS^T (A from registers, as dK's) times a (queries x 8) tile of ones (K-major B): each key
        row's sum of dS^T in every one of its 8 columns."""
        K = cute.nvgpu.OperandMajorMode.K
        return hopper_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, K, Float32, atom_layout_mnk=(self.num_mma_wg, 1, 1), tiler_mn=(64, 8),
            a_source=warpgroup.OperandSource.RMEM,
        )

    def _tiled_mma_query_sums(self):
        """gate_query_mma: dS (A = dQ's M-major view of sdSt) times a (keys x 8) tile of ones (K-major B): each
        query row's sum of dS. The warpgroups split the rows where dQ's do (tile_m 128); at tile_m 64 (dQ split
        by columns) warpgroup 0 takes the whole 64 x 8 product."""
        K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        return hopper_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, MN, K, Float32, atom_layout_mnk=(self.tile_m // 64, 1, 1), tiler_mn=(64, 8),
        )

    def _tiled_mmas(self):
        """S^T / dP^T: SS, both K-major, warpgroups along keys. dV / dK: A = P^T / dS^T from
        registers, B = dO^T / Q^T (MN-major views). dQ: A = dS (M-major view of sdSt), B = K^T
        (MN-major), warpgroups along head_dim (or rows)."""
        K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        wg = self.num_mma_wg
        sdp = hopper_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, K, Float32, atom_layout_mnk=(wg, 1, 1), tiler_mn=(64, self.tile_m),
        )
        dkv = hopper_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, MN, Float32, atom_layout_mnk=(wg, 1, 1),
            tiler_mn=(64, self.head_dim), a_source=warpgroup.OperandSource.RMEM,
        )
        if const_expr(self.dq_transposed):
            return sdp, dkv, tiled_mma_dqt_sm90(self.dtype, self.tile_m, wg)
        return sdp, dkv, tiled_mma_dq_sm90(self.dtype, self.head_dim, self.dq_split_rows, wg)

    # ------------------------------------------------------------------ host entry point

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, nheads, head_dim) | varlen (total_q, nheads, head_dim)
        mK: cute.Tensor,  # (batch, seqlen_k, nheads_k, head_dim) | varlen (total_k, ...)
        mV: cute.Tensor,  # like mK
        mdO: cute.Tensor,  # like mQ
        mLSE_log2: cute.Tensor,  # (batch | 1, nheads, seqlen_q_padded) fp32
        mdPsum: cute.Tensor,  # (batch | 1, nheads, seqlen_q_padded) fp32
        mdQaccum: cute.Tensor,  # (batch | 1, nheads, seqlen_q_padded * head_dim) fp32, fragment order, zeroed (dq_claim: not)
        mdK: cute.Tensor,  # MHA: like mK, 16-bit output;
        mdV: cute.Tensor,  # GQA: (batch | 1, nheads_k, seqlen_k_padded * head_dim) fp32, zeroed
        mdQ_sem: cute.Tensor,  # (batch | 1, nheads, seqlen_q_padded / tile_m) int32, zeroed (turns or dq_claim's states)
        mdKV_sem: cute.Tensor,  # (batch | 1, nheads_k, seqlen_k_padded / tile_n) int32, zeroed
        softmax_scale: Float32,
        window_left: Int32,  # is_local only; unbounded: a huge value
        window_right: Int32,
        softcap: Float32,  # has_softcap only
        deterministic: Int32,  # must equal the compiled flag (the launcher's runtime argument)
        tail_blocks: Int32,  # unused (the sm80 launcher's split tail): 0
        tail_segments: Int32,  # unused: 1
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        mSeqUsedQ: cute.Tensor | None,
        mSeqUsedK: cute.Tensor | None,
        mdKV_tail: cute.Tensor | None,  # unused: None
        mGate: cute.Tensor | None,  # has_gate: (batch, nheads, seqlen_k) | varlen (nheads, total_k) fp32 bias
        mdGq: cute.Tensor | None,  # has_gate: like LSE, (batch, nheads, seqlen_q) | (nheads, total_q) fp32, zeroed
        mdGk: cute.Tensor | None,  # has_gate: like mGate, fp32 (rows past seqused_k are not written)
        mLiveRows: cute.Tensor | None,  # skip_decayed: (batch | sequences, nheads, key blocks) int32, each's end
        stream: cuda.CUstream,
    ):
        if const_expr(
            not (mQ.element_type == mK.element_type == mV.element_type == mdO.element_type == self.dtype)
        ):
            raise TypeError(f"Q/K/V/dO must all be {self.dtype}")
        acc_dtype = Float32 if const_expr(self.is_gqa) else self.dtype
        if const_expr(mdK.element_type != acc_dtype or mdV.element_type != acc_dtype):
            raise TypeError(f"dK/dV must be {acc_dtype}")
        if const_expr((mCuSeqlensQ is None) != (mCuSeqlensK is None)):
            raise TypeError("cu_seqlens_q and cu_seqlens_k must be given together")
        if const_expr(mdKV_tail is not None):
            raise TypeError("the Hopper backward has no split tail")
        if const_expr(self.dq_transposed and mCuSeqlensQ is not None):
            raise TypeError("tile_m 80 is dense only: varlen scratch offsets are multiples of 128 rows")
        if const_expr((mGate is not None) != self.has_gate or (mdGq is not None) != self.has_gate
                      or (mdGk is not None) != self.has_gate):
            raise TypeError("mGate, mdGq and mdGk must be given exactly when has_gate")
        if const_expr((mLiveRows is not None) != self.skip_decayed):
            raise TypeError("mLiveRows must be given exactly when skip_decayed")
        varlen = const_expr(mCuSeqlensQ is not None)
        if const_expr(self.has_gate):  # -> (s, h[, b]), as LSE in the forward
            mGate, mdGq, mdGk = (select_modes(t, [1, 0] if varlen else [2, 1, 0]) for t in (mGate, mdGq, mdGk))
        modes = [0, 2, 1] if varlen else [1, 3, 2, 0]  # -> (s, d, h[, b])
        mQ, mK, mV, mdO = [select_modes(assume_strides_aligned(t), modes) for t in (mQ, mK, mV, mdO)]
        if const_expr(not self.is_gqa):
            mdK, mdV = [select_modes(assume_strides_aligned(t), modes) for t in (mdK, mdV)]
        # Scratch rows: (s_pad, h, b) views for the 1-D TMA boxes of LSE_log2 / dPsum.
        mLSE_t = select_modes(mLSE_log2, [2, 1, 0])
        mdPsum_t = select_modes(mdPsum, [2, 1, 0])
        layouts = self._smem_layouts()
        d = self.head_dim
        tma_load = cpasync.CopyBulkTensorTileG2SOp()

        def tma(t, layout, rows, cols):
            return cpasync.make_tiled_tma_atom(tma_load, t, layout, (rows, cols))

        dv = self.head_dim_v
        tma_atom_Q, tma_Q = tma(mQ, cute.select(layouts["sQ"], mode=[0, 1]), self.tile_m, d)
        tma_atom_dO, tma_dO = tma(mdO, cute.select(layouts["sdO"], mode=[0, 1]), self.tile_m, dv)
        tma_atom_K, tma_K = tma(mK, layouts["sK"], self.tile_n, d)
        tma_atom_V, tma_V = tma(mV, layouts["sV"], self.tile_n, dv)
        stat_layout = cute.make_layout(self.tile_m)
        tma_atom_LSE, tma_LSE = cpasync.make_tiled_tma_atom(tma_load, mLSE_t, stat_layout, (self.tile_m,))
        tma_atom_dPsum, tma_dPsum = cpasync.make_tiled_tma_atom(tma_load, mdPsum_t, stat_layout, (self.tile_m,))
        mdQaccum = assume_strides_aligned(mdQaccum)  # (whole tiles go out by 16-byte-aligned bulk adds)
        SharedStorage = self._shared_storage(layouts)
        qhead_per_kvhead = mQ.shape[2] // mK.shape[2]
        if const_expr(self.has_softcap):
            softcap_scale, scale_log2 = softcap_scale_log2(softmax_scale, softcap)
        else:
            softcap_scale, scale_log2 = Float32(1.0), softmax_scale * LOG2_E
        if const_expr(varlen):
            num_batch = mCuSeqlensK.shape[0] - 1
            grid = [num_varlen_tiles_upper_bound(mK.shape[0], num_batch, self.tile_n), mQ.shape[2], 1]
        else:
            num_batch = mQ.shape[3]
            grid = [(mK.shape[0] + (self.tile_n - 1)) // self.tile_n, mQ.shape[2], num_batch]
        if const_expr(self.gqa_loop):  # (one CTA per KV head)
            grid[1] = mK.shape[2]
            if const_expr(self.loop_chunks and not varlen):  # (the launcher keeps z <= 65535)
                chunk_n = self.loop_chunk_n
                grid = [chunk_n, grid[1], num_batch * ((grid[0] + chunk_n - 1) // chunk_n)]
        self.kernel(
            tma_Q, tma_K, tma_V, tma_dO, tma_LSE, tma_dPsum,
            tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_LSE, tma_atom_dPsum,
            mdQaccum, mdK, mdV, mdQ_sem, mdKV_sem, softmax_scale, scale_log2, softcap_scale,
            window_left, window_right, qhead_per_kvhead, deterministic, num_batch,
            mQ.shape[0], mK.shape[0], mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, mGate, mdGq, mdGk,
            mLiveRows, SharedStorage,
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
            use_pdl=True,  # a programmatic dependent of the preprocess (``configs.bwd_pdl``)
        )

    # ------------------------------------------------------------------ device code

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,  # TMA coordinates of (seqlen_q | total_q, head_dim, nheads[, batch])
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,  # TMA coordinates of (seqlen_q_padded, nheads, batch | 1)
        mdPsum: cute.Tensor,
        tma_atom_Q: cute.CopyAtom,
        tma_atom_K: cute.CopyAtom,
        tma_atom_V: cute.CopyAtom,
        tma_atom_dO: cute.CopyAtom,
        tma_atom_LSE: cute.CopyAtom,
        tma_atom_dPsum: cute.CopyAtom,
        mdQaccum: cute.Tensor,  # (batch | 1, nheads, seqlen_q_padded * head_dim) fp32
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mdQ_sem: cute.Tensor,
        mdKV_sem: cute.Tensor,
        softmax_scale: Float32,
        scale_log2: Float32,
        softcap_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        qhead_per_kvhead: Int32,
        deterministic: Int32,
        num_batch: Int32,
        seqlen_q_static: Int32,
        seqlen_k_static: Int32,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        mSeqUsedQ: cute.Tensor | None,
        mSeqUsedK: cute.Tensor | None,
        mGate: cute.Tensor | None,  # has_gate: (s_k | total_k, nheads[, batch]) fp32
        mdGq: cute.Tensor | None,  # has_gate: (s_q | total_q, nheads[, batch]) fp32
        mdGk: cute.Tensor | None,  # has_gate: like mGate
        mLiveRows: cute.Tensor | None,  # skip_decayed: (batch, nheads, key blocks) int32
        SharedStorage: cutlass.Constexpr,
    ):
        """Prologue (pipelines, smem views, this CTA's key block and query range), role dispatch."""
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        cta_start = cute.arch.globaltimer_lo() if const_expr(self.trace) else None
        # The postprocess (a programmatic dependent: it waits for this grid to complete) may launch once
        # every CTA of this grid has started: its launch then overlaps the last wave.
        cute.arch.griddepcontrol_launch_dependents()
        atoms = (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_LSE, tma_atom_dPsum)
        if warp_idx == 0:
            for atom in atoms:
                cpasync.prefetch_descriptor(atom)
        storage = SmemAllocator().allocate(SharedStorage)
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads // 32)
        pipe_kv = pipeline.PipelineTmaAsync.create(
            num_stages=1, producer_group=producer, consumer_group=consumers, tx_count=self.tx_bytes_kv,
            barrier_storage=storage.mbar_kv.data_ptr(), defer_sync=True,
        )
        pipe_q = pipeline.PipelineTmaAsync.create(
            num_stages=self.num_stages, producer_group=producer, consumer_group=consumers,
            tx_count=self.tx_bytes_q, barrier_storage=storage.mbar_q.data_ptr(), defer_sync=True,
        )
        pipe_do = pipeline.PipelineTmaAsync.create(
            num_stages=self.num_stages_do, producer_group=producer, consumer_group=consumers,
            tx_count=self.tx_bytes_do, barrier_storage=storage.mbar_do.data_ptr(), defer_sync=True,
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=None, is_relaxed=True)
        layouts = self._smem_layouts()

        def smem(field, name):
            return field.get_tensor(layouts[name].outer, swizzle=layouts[name].inner)

        sQ, sdO = smem(storage.sQ, "sQ"), smem(storage.sdO, "sdO")
        sK, sV = smem(storage.sK, "sK"), smem(storage.sV, "sV")
        sdSt = smem(storage.sdSt, "sdSt")
        sdQ = storage.sdQ.get_tensor(cute.make_layout(self.tile_m * self.head_dim))
        stats_layout = cute.make_layout((self.tile_m, self.num_stages), stride=(1, _stats_stride(self.tile_m)))
        sLSE = storage.sLSE.get_tensor(stats_layout)
        sdPsum = storage.sdPsum.get_tensor(
            cute.make_layout((self.tile_m, self.num_stages_do), stride=(1, _stats_stride(self.tile_m)))
        )
        sQuerySums = storage.sQuerySums.get_tensor(cute.make_layout((bwd_gate.NUM_MMA_WARPS * self.tile_m, 2)))
        sOnes = smem(storage.sOnes, "sOnes") if const_expr(self.gate_key_mma) else None
        sOnesN = smem(storage.sOnesN, "sOnesN") if const_expr(self.gate_query_mma) else None

        # This CTA's (sequence, key block): varlen CTAs past the last tile have none.
        block_x, head_idx, block_z = cute.arch.block_idx()
        varlen = const_expr(mCuSeqlensK is not None)
        batch_idx, n_block = block_z, block_x
        if const_expr(self.loop_chunks and not varlen):
            chunk = block_z // num_batch
            batch_idx, n_block = block_z - chunk * num_batch, chunk * self.loop_chunk_n + block_x
            if n_block * self.tile_n >= seqlen_k_static:  # (past the last key block: no work)
                batch_idx = Int32(-1)
        if const_expr(varlen):
            batch_idx, n_block = varlen_tile_coord(block_x, num_batch, self.tile_n, mCuSeqlensK, mSeqUsedK)
        pipeline.pipeline_init_wait(cluster_shape_mn=None)
        if batch_idx >= 0:
            seqlen = SeqlenInfo.create(
                batch_idx, seqlen_q_static, seqlen_k_static, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK
            )
            num_n_blocks = (seqlen.seqlen_k + (self.tile_n - 1)) // self.tile_n
            if const_expr(self.is_causal or self.is_local):
                if const_expr(self.deterministic):
                    # Shortest-first: the last key block (fewest query blocks) takes the lowest
                    # block index and the first turn on every m_block (sm80/bwd.py, same rule).
                    n_block = num_n_blocks - 1 - n_block
            m_block_min, m_block_max = m_block_min_max(
                self.tile_m, self.tile_n, n_block, seqlen.seqlen_q, seqlen.seqlen_k, self.is_causal,
                self.is_local, window_left, window_right,
            )
            if const_expr(self.skip_decayed):  # (packed: batch_idx is the sequence, a table row each)
                m_block_max = cutlass.min(m_block_max, mLiveRows[batch_idx, head_idx, n_block])
            # Scratch rows of this sequence: dense (batch, head) rows; varlen padded offsets.
            scratch_b = Int32(0) if const_expr(varlen) else batch_idx
            row_offset_q = scratch_offset(seqlen.offset_q, batch_idx) if const_expr(varlen) else Int32(0)
            head_idx_kv = head_idx // qhead_per_kvhead
            # The m_block loops run to m_iter_end: past m_block_max over the KV head's query heads with gqa_loop.
            m_iter_end = m_block_max
            if const_expr(self.gqa_loop):
                head_idx_kv = head_idx
                head_idx = head_idx_kv * qhead_per_kvhead  # (the first of them)
                m_iter_end = m_block_min + (m_block_max - m_block_min) * qhead_per_kvhead
            # has_gate: this (sequence, query head)'s bias and sums, 1-D over its keys / queries.
            gate = dgq = dgk = None
            if const_expr(self.has_gate):
                gate = seqlen.k_view(select_head(mGate, head_idx, 1), batch_idx)
                dgq = seqlen.q_view(select_head(mdGq, head_idx, 1), batch_idx)
                dgk = seqlen.k_view(select_head(mdGk, head_idx, 1), batch_idx)
            if warp_idx < 4:
                cute.arch.setmaxregister_decrease(_PRODUCER_REGS)
                if warp_idx == 0:
                    self.load(
                        mQ, mK, mV, mdO, mLSE, mdPsum, sQ, sK, sV, sdO, sLSE, sdPsum, atoms,
                        pipe_kv, pipe_q, pipe_do, seqlen, batch_idx, head_idx, head_idx_kv, scratch_b,
                        row_offset_q, n_block, m_block_min, m_block_max, m_iter_end,
                    )
                if warp_idx == 1:
                    if const_expr(self.gqa_loop):  # (every head's accumulator and turns: ``store_dq`` picks)
                        self.store_dq(
                            sdQ, mdQaccum[scratch_b, None, None], mdQ_sem[scratch_b, None, None], seqlen, n_block,
                            m_block_min, m_block_max, row_offset_q // self.tile_m, window_left, window_right,
                            sQuerySums, dgq, m_iter_end=m_iter_end, head_first=head_idx,
                        )
                    else:
                        self.store_dq(
                            sdQ, mdQaccum[scratch_b, head_idx, None],
                            mdQ_sem[scratch_b, head_idx, None], seqlen, n_block, m_block_min, m_block_max,
                            row_offset_q // self.tile_m, window_left, window_right, sQuerySums, dgq,
                        )
            else:
                cute.arch.setmaxregister_increase(_MMA_REGS)
                mma_out = self.mma(
                    sQ, sK, sV, sdO, sdSt, sLSE, sdPsum, sdQ, pipe_kv, pipe_q, pipe_do,
                    seqlen, n_block, m_block_min, m_block_max, scale_log2,
                    softcap_scale if const_expr(self.has_softcap) else None, window_left, window_right,
                    sQuerySums, gate, dgk, mdQ_sem[0, 0, None] if const_expr(self.trace) else None,
                    **({"m_iter_end": m_iter_end} if const_expr(self.gqa_loop) else {}),
                    **({"sOnes": sOnes} if const_expr(self.gate_key_mma) else {}),
                    **({"sOnesN": sOnesN} if const_expr(self.gate_query_mma) else {}),
                )
                acc_dK, acc_dV, tiled_mma_dkv = mma_out[:3]
                tidx = cute.arch.thread_idx()[0] - _WG_THREADS
                row_offset_k = scratch_offset(seqlen.offset_k, batch_idx) if const_expr(varlen) else Int32(0)
                if const_expr(self.is_gqa):
                    k_block = (row_offset_k // self.tile_n if const_expr(varlen) else Int32(0)) + n_block
                    num_keys = None
                    if const_expr(self.tile_n % 64 != 0):
                        # (bwd_wide96.py: its sums are addressed by first key row, the adds predicated at the
                        # sequence's end: a 96-key block may reach past its region of the 128-row-padded scratch)
                        k_block = row_offset_k + n_block * self.tile_n
                        num_keys = seqlen.seqlen_k - n_block * self.tile_n
                    # fp32 staging of dV over sK | sV and of dK over sQ | sdO (each pair adjacent:
                    # ``gqa_staging``), free once every WGMMA is done.
                    staging = tuple(
                        cute.make_tensor(cute.recast_ptr(ptr, dtype=Float32), cute.make_layout(self.gqa_staging))
                        for ptr in (storage.sK.data_ptr(), storage.sQ.data_ptr())
                    )
                    self.epilogue_gqa(
                        acc_dK, acc_dV, mdK[scratch_b, head_idx_kv, None], mdV[scratch_b, head_idx_kv, None],
                        mdKV_sem[scratch_b, head_idx_kv, None], tiled_mma_dkv, tidx, k_block,
                        head_idx - head_idx_kv * qhead_per_kvhead, deterministic, staging, num_keys,
                    )
                else:
                    self.epilogue_mha(
                        acc_dK, acc_dV, softmax_scale,
                        seqlen.k_view(select_head(mdK, head_idx_kv, 2), batch_idx),
                        seqlen.k_view(select_head(mdV, head_idx_kv, 2), batch_idx),
                        sK, sV, tiled_mma_dkv, tidx, n_block, seqlen.seqlen_k,
                    )
                if const_expr(self.trace):
                    self.store_cta_span(mdQ_sem[0, 0, None], (cta_start, *mma_out[3]), tidx, m_block_max - m_block_min)

    # ------------------------------------------------------------------ producer

    @cute.jit
    def load(
        self,
        mQ, mK, mV, mdO, mLSE, mdPsum,  # TMA coordinate tensors
        sQ, sK, sV, sdO, sLSE, sdPsum,
        atoms,
        pipe_kv: pipeline.PipelineTmaAsync,
        pipe_q: pipeline.PipelineTmaAsync,
        pipe_do: pipeline.PipelineTmaAsync,
        seqlen: SeqlenInfo,
        batch_idx: Int32,
        head_idx: Int32,
        head_idx_kv: Int32,
        scratch_b: Int32,
        row_offset_q: Int32,
        n_block: Int32,
        m_block_min: Int32,
        m_block_max: Int32,
        m_iter_end: Int32,
    ):
        """Producer warp: K and V of this key block once, then Q + LSE and dO + dPsum of each
        query block into the ``num_stages`` rings (the consumers release a stage after its last GEMM);
        with ``gqa_loop``, those of each query head of the KV head in turn (``head_idx`` the first)."""
        atom_K, atom_V = atoms[1:3]
        d = self.head_dim
        if m_block_min < m_block_max:
            gK = cute.local_tile(seqlen.k_view(select_head(mK, head_idx_kv, 2), batch_idx), (self.tile_n, d), (n_block, 0))
            gV = cute.local_tile(seqlen.k_view(select_head(mV, head_idx_kv, 2), batch_idx), (self.tile_n, self.head_dim_v),
                                 (n_block, 0))
            tKsK, tKgK = _tma_tiles(atom_K, sK, gK, 2)
            tVsV, tVgV = _tma_tiles(atom_V, sV, gV, 2)
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            pipe_kv.producer_acquire(kv_state)
            cute.copy(atom_K, tKgK, tKsK, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
            cute.copy(atom_V, tVgV, tVsV, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))

            q_ring, do_ring = self.query_rings(mQ, mdO, mLSE, mdPsum, sQ, sdO, sLSE, sdPsum, atoms, pipe_q, pipe_do,
                                               seqlen, batch_idx, head_idx, scratch_b)
            block_offset = row_offset_q // self.tile_m
            # Launched as the preprocess's programmatic dependent: LSE_log2 and dPsum (and the zeroed
            # dQaccum the writer adds into) are complete only past this wait. K, V, Q and dO were
            # written before the preprocess started.
            cute.arch.griddepcontrol_wait()
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
            if const_expr(self.gqa_loop):  # (num_stages_do == num_stages: the base kernel's tiles only)
                for m_virtual in cutlass.range(m_block_min, m_iter_end, unroll=1):
                    m_block, head = self.block_head(m_virtual, m_block_min, m_block_max, m_iter_end, head_idx)
                    head_rings = self.query_rings(mQ, mdO, mLSE, mdPsum, sQ, sdO, sLSE, sdPsum, atoms, pipe_q,
                                                  pipe_do, seqlen, batch_idx, head, scratch_b)
                    self.load_stage(head_rings[0], state, m_block, block_offset + m_block)
                    self.load_stage(head_rings[1], state, m_block, block_offset + m_block)
                    state.advance()
            elif const_expr(self.num_stages_do == self.num_stages):
                for m_block in cutlass.range(m_block_min, m_block_max, unroll=1):
                    self.load_stage(q_ring, state, m_block, block_offset + m_block)
                    self.load_stage(do_ring, state, m_block, block_offset + m_block)
                    state.advance()
            else:  # (bwd_wide96.py: fewer dO stages than Q stages)
                state_do = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages_do)
                for m_block in cutlass.range(m_block_min, m_block_max, unroll=1):
                    self.load_stage(q_ring, state, m_block, block_offset + m_block)
                    self.load_stage(do_ring, state_do, m_block, block_offset + m_block)
                    state.advance()
                    state_do.advance()

    @cute.jit
    def query_rings(self, mQ, mdO, mLSE, mdPsum, sQ, sdO, sLSE, sdPsum, atoms, pipe_q, pipe_do, seqlen: SeqlenInfo,
                    batch_idx: Int32, head: Int32, scratch_b: Int32):
        """The producer's Q + LSE and dO + dPsum rings of query head ``head`` (``load_stage``'s ``ring``)."""
        atom_Q, _, _, atom_dO, atom_LSE, atom_dPsum = atoms
        gQ = cute.local_tile(seqlen.q_view(select_head(mQ, head, 2), batch_idx), (self.tile_m, self.head_dim),
                             (None, 0))
        gdO = cute.local_tile(seqlen.q_view(select_head(mdO, head, 2), batch_idx), (self.tile_m, self.head_dim_v),
                              (None, 0))
        tQsQ, tQgQ = _tma_tiles(atom_Q, sQ, gQ, 2)
        tdOsdO, tdOgdO = _tma_tiles(atom_dO, sdO, gdO, 2)
        # Scratch rows of this (sequence, head): m_block's tile_m values start at
        # row_offset_q + m_block * tile_m (row_offset_q is a multiple of tile_m).
        gLSE = cute.local_tile(mLSE[None, head, scratch_b], (self.tile_m,), (None,))
        gdPsum = cute.local_tile(mdPsum[None, head, scratch_b], (self.tile_m,), (None,))
        tLsL, tLgL = _tma_tiles(atom_LSE, sLSE, gLSE, 1)
        tPsP, tPgP = _tma_tiles(atom_dPsum, sdPsum, gdPsum, 1)
        return ((pipe_q, atom_Q, tQgQ, tQsQ, atom_LSE, tLgL, tLsL),
                (pipe_do, atom_dO, tdOgdO, tdOsdO, atom_dPsum, tPgP, tPsP))

    @cute.jit
    def block_head(self, m_virtual: Int32, m_block_min: Int32, m_block_max: Int32, m_iter_end: Int32,
                   head_first: Int32):
        """(gqa_loop) The query block and head of virtual m_block ``m_virtual`` (from ``m_block_min`` to
        ``m_iter_end``): the heads' blocks in turn, each from ``m_block_min`` to ``m_block_max``; ``loop_desc``: the
        query blocks from ``m_block_max - 1`` down, every head's in turn at each."""
        num_m_blocks = m_block_max - m_block_min
        step = m_virtual - m_block_min
        if const_expr(self.loop_desc):
            group = (m_iter_end - m_block_min) // num_m_blocks
            back = step // group
            return m_block_max - 1 - back, head_first + step - back * group
        head_in_loop = step // num_m_blocks
        return m_virtual - head_in_loop * num_m_blocks, head_first + head_in_loop

    @cute.jit
    def load_stage(self, ring: tuple, state, m_block: Int32, stats_block: Int32):
        """Producer: query block ``m_block`` of Q (+ LSE) or dO (+ dPsum) into ``ring``'s stage ``state``
        (``ring``: its pipeline, the tile's TMA atom and partitions, the row statistics' atom and
        partitions, whose 1-D blocks are indexed by ``stats_block``)."""
        pipe, atom_X, tXgX, tXsX, atom_stat, tSgS, tSsS = ring
        pipe.producer_acquire(state)
        bar = pipe.producer_get_barrier(state)
        cute.copy(atom_X, tXgX[None, m_block], tXsX[None, state.index], tma_bar_ptr=bar)
        cute.copy(atom_stat, tSgS[None, stats_block], tSsS[None, state.index], tma_bar_ptr=bar)
