"""FlashAttention-3 backward for head dim 192 on Hopper (sm90): ``FlashBwdSm90Wide96``, 96 keys per CTA.

Measured on an H100 (perf/NOTES.md session 35): +14 to +41 % over ``bwd_wide.py``'s 64-key blocks at d = 192,
0.96-1.14x FA4's backward.

Purpose: ``bwd_wide.py``'s 64-key blocks read every Q / dO tile and add every dQ tile once per 64 keys;
at head dim 192 that traffic is what separates it from FA3 / FA4's 96-key tile (0.79-0.94x FA4, perf/NOTES.md
session 34). 96 keys do not split into two WGMMA M halves of 64, so this kernel turns the GEMMs around
(the tile of the FA3 C++ launch template for d = 192): scores by query rows, each MMA warpgroup owning 48
keys, and dK / dV accumulated transposed, head dim along M:

    S  = Q K_w^T,  P  = exp2(S * scale_log2 - LSE)            (64 queries x 48 keys per warpgroup w)
    dP = dO V_w^T, dS = P (dP - dPsum)                        (same split)
    P, dS -> sdSt transposed (stmatrix.trans: keys x queries)
    dV_w^T += dO^T P_w,  dK_w^T += Q^T dS_w                   (d x 48 per warpgroup, B = its own sdSt rows)
    dQaccum += dS K                                           (64 queries x d/2 per warpgroup, all 96 keys)

Registers per MMA thread (d = dv = 192): dK^T 72 + dV^T 72 + S 24 + dP 24, then dQ 48 once S and dP are in smem.
Everything else (producer, dQ writer and its fragment order, semaphores, pipelines, launch) is ``FlashBwdSm90``'s;
the MHA epilogue is ``bwd_wide.py``'s through stmatrix.trans.

GQA: each query head reduce-adds its dK^T / dV^T into the KV head's row-major fp32 sums element by element, keys
below the sequence's end only (the sums' rows are padded to 128 per sequence, which a 96-key block can overrun).
Deterministic GQA takes those adds in query-head turns per 96-key block; the block's semaphore is the one of its
first key row over 32 (``KV_SEM_ROWS``: sequences start at multiples of 128 rows, blocks at multiples of 96 after
it, so no two blocks share one).

Constraints: head dims 192 / 128, 192 / 192, or 256 / 128 (one Q/dO stage), ``tile_m`` 64, ``tile_n`` 96; no gate;
softcap included.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as hopper_helpers
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warp, warpgroup

from ..common.bwd_utils import elem_pointer, semaphore_signal, semaphore_wait, tiled_mma_dq_sm90
from ..common.mask import AttentionMask
from ..common.seqlen import SeqlenInfo
from ..common.sm90_utils import wgmma
from ..common.softmax import apply_softcap
from ..common.utils import acc_rows_cols, convert_to_16bit, transpose_view
from .bwd import _SMEM_CAPACITY, FlashBwdSm90, _stats_stride
from .bwd_store import _WG_THREADS, NamedBarrierBwd
from .bwd_wide import FlashBwdSm90Wide

_TILE_N = 96
# Rows of the dK/dV sums per deterministic-GQA semaphore: gcd(96, the scratch's 128-row sequence padding)
KV_SEM_ROWS = 32


def _do_stages(num_stages: int, head_dim_v: int) -> int:
    """dO / dPsum stages beside ``num_stages`` Q stages: one where v is 192 wide (two do not fit beside sdQ)."""
    return num_stages if head_dim_v <= 128 else 1


class FlashBwdSm90Wide96(FlashBwdSm90Wide):
    """FA3 backward on sm90 for head dim 192: one CTA per 96-key block, 384 threads.

        | warpgroup | warps | registers | role                                                   |
        | WG0       | 0     | 24        | producer: TMA of K, V once; Q, LSE, dO, dPsum per m    |
        | WG0       | 1     | 24        | dQ writer: bulk reduce-add sdQ -> dQaccum per m        |
        | WG1, WG2  | 4 each| 240       | MMA: S, dP, dK^T, dV^T of 48 keys each; dQ for d/2     |

    Pipelines as ``FlashBwdSm90``: 2 Q stages; 2 dO stages at dv = 128, 1 at dv = 192 (two do not fit beside sdQ).

    Per m_block, each MMA warpgroup::

        wait Q; issue S = Q K_w^T; wait dO; issue dP = dO V_w^T; wait S; [softcap]; mask;
        P = exp2(S * scale_log2 - LSE); wait dP; dS = P (dP - dPsum) [* tanh'];
        P -> sdSt[1] (its rows); [after the first block: bar DS_FREE]; dS -> sdSt[0] (its rows); fence;
        bar DS_READY; issue dV^T += dO^T P, dK^T += Q^T dS (its rows), dQ = dS K (all 96 keys);
        wait dV^T: release dO; wait dK^T: release Q; wait dQ; [bar DQ_EMPTY]; dQ -> sdQ; fence; arrive DQ_FULL

    sdSt holds one P^T and one dS^T: a warpgroup's dV^T / dK^T read only its own rows, done before its
    next block's stores; the other warpgroup's dQ reads all of dS^T, hence DS_FREE (both passed the wait
    for their dQ of the block before) ahead of a dS^T store.
    """

    # The MHA epilogue (``bwd_wide.py``) stores dK^T / dV^T through stmatrix.trans into sK / sV.
    dkv_transposed = True

    def __init__(self, dtype, head_dim, tile_m, tile_n, is_causal, is_gqa, is_local=False, has_softcap=False,
                 num_stages=1, dq_split_rows=False, deterministic=False, head_dim_v=None, dq_claim=False):
        super().__init__(dtype, head_dim, tile_m, tile_n, is_causal, is_gqa, is_local=is_local,
                         has_softcap=has_softcap, num_stages=num_stages, dq_split_rows=dq_split_rows,
                         deterministic=deterministic, head_dim_v=head_dim_v, dq_claim=dq_claim)
        self.pds_stages = 2  # dS^T in 0, P^T in 1
        self.num_stages_do = _do_stages(num_stages, self.head_dim_v)

    @staticmethod
    def can_implement(dtype, head_dim, tile_m, tile_n, is_causal=False, is_local=False, num_stages=1,
                      dq_split_rows=False, has_softcap=False, head_dim_v=None, has_gate=False,
                      dq_transposed=False) -> str | None:
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        if dq_transposed or dq_split_rows:
            return "the dQ GEMM splits head_dim columns"
        if has_gate:
            return "the gate's backward is in FlashBwdSm90 (head dims up to 128) only"
        if dtype not in (cutlass.BFloat16, cutlass.Float16):
            return f"dtype must be BFloat16 or Float16, got {dtype}"
        if (head_dim, head_dim_v) not in ((192, 128), (192, 192), (256, 128)):
            return f"head dims must be 192 / 128, 192 / 192 or 256 / 128, got {head_dim} / {head_dim_v}"
        if tile_m != 64 or tile_n != _TILE_N:
            return f"tile must be 64 x {_TILE_N}, got {tile_m} x {tile_n}"
        if is_causal and is_local:
            return "is_causal and is_local are exclusive"
        if num_stages not in (1, 2):
            return f"num_stages must be 1 or 2, got {num_stages}"
        if FlashBwdSm90Wide96.smem_bytes(dtype, head_dim, tile_m, tile_n, num_stages, head_dim_v) > _SMEM_CAPACITY:
            return "does not fit in shared memory"
        return None

    @staticmethod
    def smem_bytes(dtype, head_dim, tile_m, tile_n, num_stages, head_dim_v=None) -> int:
        elem = dtype.width // 8
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        stages_do = _do_stages(num_stages, head_dim_v)
        operands = (tile_n * (head_dim + head_dim_v) + tile_m * (num_stages * head_dim + stages_do * head_dim_v)
                    + 2 * tile_m * tile_n) * elem
        return operands + tile_m * head_dim * 4 + (num_stages + stages_do) * _stats_stride(tile_m) * 4 + 1024 + 256

    def _smem_layouts(self):
        """``FlashBwdSm90``'s, not ``bwd_wide.py``'s: Q, dO and V keep 128-byte swizzle atoms (no GEMM here reads a
        head_dim half of them); K is in head_dim halves there too (each warpgroup's dQ GEMM reads its 96-column half
        as an MN-major B operand)."""
        return FlashBwdSm90._smem_layouts(self)

    def _tiled_mmas(self):
        """S / dP: SS, both K-major, warpgroups along keys (48 each). dK^T / dV^T: A = Q^T / dO^T (MN-major
        views), B = dS^T / P^T rows of sdSt (K-major), warpgroups along keys. dQ: ``bwd.py``'s (A = dS, the
        M-major view of sdSt; B = K^T; warpgroups along head_dim)."""
        K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        wg = self.num_mma_wg
        sdp = hopper_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, K, Float32, atom_layout_mnk=(1, wg, 1), tiler_mn=(64, self.tile_n // wg),
        )
        dkv = hopper_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, MN, K, Float32, atom_layout_mnk=(1, wg, 1), tiler_mn=(64, self.tile_n // wg),
        )
        return sdp, (dkv, dkv), tiled_mma_dq_sm90(self.dtype, self.head_dim, False, wg)

    # ------------------------------------------------------------------ MMA warpgroups

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
        gate: None,  # (no gate here)
        dgk: None,
        trace_out: None = None,  # (no trace here)
    ):
        """The m_block loop of both MMA warpgroups; returns (acc_dKt, acc_dVt, tiled_mma_dkv)."""
        tidx = cute.arch.thread_idx()[0] - _WG_THREADS
        wg_idx = cute.arch.make_warp_uniform(tidx // _WG_THREADS)
        tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq = self._tiled_mmas()
        tiled_mma_dkt = tiled_mma_dkv[0]
        wg_sdp = tiled_mma_sdp.get_slice(wg_idx * _WG_THREADS)
        wg_dkt = tiled_mma_dkt.get_slice(wg_idx * _WG_THREADS)
        wg_dq = tiled_mma_dq.get_slice(wg_idx * _WG_THREADS)
        thr_sdp = tiled_mma_sdp.get_slice(tidx)
        d, dv = self.head_dim, self.head_dim_v
        tSrQ = wg_sdp.make_fragment_A(wg_sdp.partition_A(sQ))
        tSrK = wg_sdp.make_fragment_B(wg_sdp.partition_B(sK))
        tdPrdO = wg_sdp.make_fragment_A(wg_sdp.partition_A(sdO))
        tdPrV = wg_sdp.make_fragment_B(wg_sdp.partition_B(sV))
        tdKrQt = wg_dkt.make_fragment_A(wg_dkt.partition_A(transpose_view(sQ)))
        tdVrdOt = wg_dkt.make_fragment_A(wg_dkt.partition_A(transpose_view(sdO)))
        tdKVrPdS = wg_dkt.make_fragment_B(wg_dkt.partition_B(sdSt))  # dS^T: stage 0, P^T: stage 1
        tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(transpose_view(sdSt)))
        tdQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(transpose_view(sK)))
        acc_dKt = cute.make_rmem_tensor(tiled_mma_dkt.partition_shape_C((d, self.tile_n)), Float32)
        acc_dVt = cute.make_rmem_tensor(tiled_mma_dkt.partition_shape_C((dv, self.tile_n)), Float32)
        acc_dKt.fill(0.0)
        acc_dVt.fill(0.0)
        # P and dS (16-bit, C layout, queries x keys) -> sdSt (keys x queries) with stmatrix.trans.
        r2s_PdS = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype),
            tiled_mma_sdp,
        ).get_slice(tidx)
        tXsX = r2s_PdS.partition_D(transpose_view(sdSt))
        tScS_mn, mask = self.score_coords_and_mask(thr_sdp, seqlen, window_left, window_right, queries_on_rows=True)
        tdQsdQ = self.dq_staging(sdQ, tidx)

        self.wait_kv(pipe_kv, m_block_min, m_block_max)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        state_do = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages_do)
        for m_block in cutlass.range(m_block_min, m_block_max, unroll=1):
            stage, stage_do = state.index, state_do.index
            pipe_q.consumer_wait(state, pipe_q.consumer_try_wait(state))
            acc_S = cute.make_rmem_tensor(tiled_mma_sdp.partition_shape_C((self.tile_m, self.tile_n)), Float32)
            wgmma(tiled_mma_sdp, acc_S, tSrQ[None, None, None, stage], tSrK, zero_init=True, wg_wait=-1)
            pipe_do.consumer_wait(state_do, pipe_do.consumer_try_wait(state_do))
            acc_dP = cute.make_rmem_tensor(tiled_mma_sdp.partition_shape_C((self.tile_m, self.tile_n)), Float32)
            wgmma(tiled_mma_sdp, acc_dP, tdPrdO[None, None, None, stage_do], tdPrV, zero_init=True, wg_wait=-1)
            self.probs_and_ds_rows(acc_S, acc_dP, sLSE, sdPsum, tScS_mn, stage, stage_do, mask, thr_sdp, m_block,
                                   n_block, scale_log2, softcap_scale)
            rP = convert_to_16bit(acc_S, self.dtype)
            cute.copy(r2s_PdS, r2s_PdS.retile(rP), tXsX[None, None, None, 1])
            rdS = convert_to_16bit(acc_dP, self.dtype)
            if m_block > m_block_min:
                # Both warpgroups' dQ of the block before (which reads every row of dS^T) is done.
                cute.arch.barrier(barrier_id=int(NamedBarrierBwd.DS_FREE), number_of_threads=self.num_mma_threads)
            cute.copy(r2s_PdS, r2s_PdS.retile(rdS), tXsX[None, None, None, 0])
            # Both warpgroups' P^T and dS^T are in smem and visible to the async proxy (WGMMA).
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=int(NamedBarrierBwd.DS_READY), number_of_threads=self.num_mma_threads)
            wgmma(tiled_mma_dkt, acc_dVt, tdVrdOt[None, None, None, stage_do], tdKVrPdS[None, None, None, 1],
                  zero_init=False, wg_wait=-1)
            wgmma(tiled_mma_dkt, acc_dKt, tdKrQt[None, None, None, stage], tdKVrPdS[None, None, None, 0],
                  zero_init=False, wg_wait=-1)
            acc_dQ = cute.make_rmem_tensor(tiled_mma_dq.partition_shape_C((self.tile_m, d)), Float32)
            wgmma(tiled_mma_dq, acc_dQ, tdQrdS[None, None, None, 0], tdQrKt, zero_init=True, wg_wait=2)
            # dV^T has read dO (the producer may refill its stage while dK^T and dQ run), then dK^T Q.
            pipe_do.consumer_release(state_do)
            state_do.advance()
            warpgroup.wait_group(1)
            pipe_q.consumer_release(state)
            state.advance()
            warpgroup.wait_group(0)
            self.dq_to_smem(acc_dQ, tdQsdQ, m_block > m_block_min)
        return acc_dKt, acc_dVt, tiled_mma_dkv

    @cute.jit
    def probs_and_ds_rows(self, acc_S, acc_dP, sLSE, sdPsum, tScS_mn, stage: Int32, stage_do: Int32,
                          mask: AttentionMask, thr_sdp, m_block: Int32, n_block: Int32, scale_log2: Float32,
                          softcap_scale: Float32 | None):
        """``FlashBwdSm90Loop.probs_and_ds`` with queries along rows: S and dP issued (in that order), not yet
        waited for; in place S -> P = exp2(S * scale_log2 - LSE) (softcap, masks) and dP -> dS = P (dP - dPsum)
        [* tanh']. LSE (Q ring stage ``stage``) and dPsum (dO ring stage ``stage_do``) of a row (query) are read
        from smem where they are used."""
        acc_S_mn, acc_dP_mn = acc_rows_cols(acc_S), acc_rows_cols(acc_dP)
        num_rows = cute.size(acc_S_mn.shape[0])
        num_cols = cute.size(acc_S_mn.shape[1])
        warpgroup.wait_group(1)  # S has landed
        if const_expr(softcap_scale is not None):
            # S = tanh(x * scale / softcap); dS_x = dS_s * (1 - tanh^2), folded into dP - dPsum before the
            # mask (a masked score's P is 0, so its factor does not matter).
            apply_softcap(acc_S, softcap_scale)
            warpgroup.wait_group(0)  # dP has landed
            for r in cutlass.range_constexpr(num_rows):
                dpsum = sdPsum[tScS_mn[r, 0][0], stage_do]
                for c in cutlass.range_constexpr(num_cols):
                    t = acc_S_mn[r, c]
                    acc_dP_mn[r, c] = (acc_dP_mn[r, c] - dpsum) * (Float32(1.0) - t * t)
        if mask.block_needs_mask(m_block, n_block, self.is_causal, self.is_local):
            mask.apply(acc_S, thr_sdp, m_block, n_block, mask_seqlen=True, mask_causal=self.is_causal,
                       mask_local=self.is_local)
        for r in cutlass.range_constexpr(num_rows):
            lse = sLSE[tScS_mn[r, 0][0], stage]
            for c in cutlass.range_constexpr(num_cols):
                acc_S_mn[r, c] = cute.math.exp2(acc_S_mn[r, c] * scale_log2 - lse, fastmath=True)
        if const_expr(softcap_scale is None):
            warpgroup.wait_group(0)  # dP has landed
            for r in cutlass.range_constexpr(num_rows):
                dpsum = sdPsum[tScS_mn[r, 0][0], stage_do]
                for c in cutlass.range_constexpr(num_cols):
                    acc_dP_mn[r, c] = acc_S_mn[r, c] * (acc_dP_mn[r, c] - dpsum)
        else:
            for i in cutlass.range_constexpr(cute.size(acc_dP)):
                acc_dP[i] = acc_dP[i] * acc_S[i]

    # ------------------------------------------------------------------ epilogue (GQA)

    @cute.jit
    def epilogue_gqa(self, acc_dKt, acc_dVt, mdKaccum, mdVaccum, mdKV_sem, tiled_mma_dkv: tuple,
                     tidx: Int32, k_row: Int32, head_in_group: Int32, deterministic: Int32, staging: tuple,
                     num_keys: Int32):
        """Reduce-add this query head's fp32 dK^T (unscaled) and dV^T into its KV head's row-major sums from
        row ``k_row`` (this block's first key in the scratch), the keys below ``num_keys`` only: one
        ``red.add.f32`` per value (a fragment's neighbours are keys, a head_dim row apart in the sums).
        Deterministic: in query-head turns on the semaphore of row ``k_row`` (``KV_SEM_ROWS`` rows each)."""
        if const_expr(self.deterministic):
            semaphore_wait(mdKV_sem, k_row // KV_SEM_ROWS, head_in_group, tidx, int(NamedBarrierBwd.SEMAPHORE),
                           self.num_mma_threads)
        for acc, mX, width in ((acc_dVt, mdVaccum, self.head_dim_v), (acc_dKt, mdKaccum, self.head_dim)):
            thr = tiled_mma_dkv[0].get_slice(tidx)
            gXt = cute.make_tensor(mX.iterator + k_row * width,
                                   cute.make_layout((width, self.tile_n), stride=(1, width)))
            tXgX = thr.partition_C(gXt)
            tXcX = thr.partition_C(cute.make_identity_tensor((width, self.tile_n)))
            for i in cutlass.range_constexpr(cute.size(acc)):
                if tXcX[i][1] < num_keys:
                    cute.arch.red(elem_pointer(tXgX, i), acc[i], op="add", dtype=Float32, sem="relaxed", scope="gpu")
        if const_expr(self.deterministic):
            semaphore_signal(mdKV_sem, k_row // KV_SEM_ROWS, tidx, int(NamedBarrierBwd.SEMAPHORE),
                             self.num_mma_threads)
