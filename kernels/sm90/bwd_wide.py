"""FlashAttention-3 backward for wide heads on Hopper (sm90): ``FlashBwdSm90Wide``, head dims 192/256.

Purpose: the backward of ``bwd.py`` where its register plan cannot hold: there each MMA warpgroup
keeps dK and dV of its 64 keys over the whole head dim (2 * 64 * d fp32 over 128 threads: 256
registers at d = 256 before anything else). Here one CTA owns 64 keys and the two MMA warpgroups
split the head dim of every d-wide GEMM instead (design doc 2.10, FA4's d = 256 row):

    S^T  = K Q^T,  P^T = exp2(S^T * scale_log2 - LSE_log2)    (64 keys x 64 queries: 32 queries per WG)
    dP^T = V dO^T, dS^T = P^T * (dP^T - dPsum)                 (same split)
    P^T, dS^T -> smem (stmatrix); barrier: the whole 64 x 64 P^T and dS^T of both warpgroups
    dK += dS^T Q,  dV += P^T dO                                (64 keys x d/2 per WG, A from smem)
    dQaccum += dS K                                            (64 queries x d/2 per WG, A from smem)

Registers per MMA thread at d = 256: dK 64 + dV 64 + dQ 64 (S^T and dP^T, 16 each, are dead once
written to smem). Everything else (producer, dQ writer, semaphores, masks, epilogues, scratch
layouts, launch arguments) is ``FlashBwdSm90``'s; the key picks this class by ``tile_n == 64``.

Constraints: as ``bwd.py`` with ``head_dim`` in {192, 256} (the launcher pads) and ``head_dim_v`` in
{128, 192, 256}, at most ``head_dim`` (V, dO and dV at v's width, one tiled MMA each for dK and dV),
``tile_m == tile_n == 64``; softcap included (its tanh' reuses S^T's registers before P^T is formed).
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as hopper_helpers
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warp, warpgroup

from ..common.bwd_utils import accum_tile, red_add_tile, semaphore_signal, semaphore_wait, tiled_mma_dq_sm90
from ..common.seqlen import SeqlenInfo
from ..common.sm90_utils import make_smem_layout_sm90, store_rows_predicated, wgmma
from ..common.utils import convert_to_16bit, transpose_view
from .bwd import _SMEM_CAPACITY, FlashBwdSm90
from .bwd_store import _WG_THREADS, NamedBarrierBwd


class FlashBwdSm90Wide(FlashBwdSm90):
    """FA3 backward on sm90 for head dims 192/256: one CTA per 64-key block, 384 threads.

        | warpgroup | warps | registers | role                                                   |
        | WG0       | 0     | 24        | producer: TMA of K, V once; Q, LSE, dO, dPsum per m    |
        | WG0       | 1     | 24        | dQ writer: bulk reduce-add sdQ -> dQaccum per m        |
        | WG1, WG2  | 4 each| 240       | MMA: S^T/dP^T for 32 queries each; dK, dV, dQ for d/2  |

    Pipelines as ``FlashBwdSm90`` (``num_stages`` Q / dO stages: 1 at d = 256, where two would not
    fit beside the 64 KB fp32 sdQ).

    Per m_block, each MMA warpgroup::

        wait Q; issue S^T = K Q^T; wait dO; issue dP^T = V dO^T; wait S; [softcap]; mask;
        P^T = exp2(...); wait dP; dS^T = P^T (dP^T - dPsum) [* tanh'];
        P^T -> sdSt[2 + s], dS^T -> sdSt[s] (s = block parity); fence; barrier DS_READY;
        issue dK += dS^T Q, dV += P^T dO, dQ = dS K (all SS); wait dK, dV: release Q, dO;
        wait dQ; [bar DQ_EMPTY]; dQ -> sdQ; fence; arrive DQ_FULL

    sdSt holds two dS^T and two P^T buffers: a warpgroup writes block j+1's while the other may
    still read block j's, and cannot reach block j+2 before the other passed DS_READY of j+1, by
    which point the other's GEMMs of block j are done. Epilogue: MHA: dK * scale, dV to 16 bits,
    through sK / sV (stmatrix), barrier, warpgroup 1 stores dK's rows, warpgroup 2 dV's; GQA: fp32
    reduce-adds into the KV head's sums, each at its own width.
    """

    # dK / dV accumulated as (keys, head_dim) here; bwd_wide96.py's as (head_dim, keys), stored by stmatrix.trans.
    dkv_transposed = False

    def __init__(self, dtype, head_dim, tile_m, tile_n, is_causal, is_gqa, is_local=False, has_softcap=False,
                 num_stages=1, dq_split_rows=False, deterministic=False, head_dim_v=None, dq_claim=False):
        super().__init__(dtype, head_dim, tile_m, tile_n, is_causal, is_gqa, is_local=is_local,
                         has_softcap=has_softcap, num_stages=num_stages, dq_split_rows=dq_split_rows,
                         deterministic=deterministic, head_dim_v=head_dim_v, dq_claim=dq_claim)
        self.pds_stages = 4  # dS^T in 0, 1; P^T in 2, 3

    @staticmethod
    def can_implement(dtype, head_dim, tile_m, tile_n, is_causal=False, is_local=False, num_stages=1,
                      dq_split_rows=False, has_softcap=False, head_dim_v=None, has_gate=False,
                      dq_transposed=False) -> str | None:
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        if dq_transposed:
            return "the wide kernel's dQ GEMM is not transposed"
        if has_gate:
            return "the gate's backward is in FlashBwdSm90 (head dims up to 128) only"
        if dtype not in (cutlass.BFloat16, cutlass.Float16):
            return f"dtype must be BFloat16 or Float16, got {dtype}"
        if head_dim not in (192, 256):
            return f"head_dim must be 192 or 256, got {head_dim}"
        if head_dim_v not in (128, 192, 256) or head_dim_v > head_dim:
            return f"head_dim_v must be 128, 192 or 256 and at most head_dim, got {head_dim_v}"
        if tile_m != 64 or tile_n != 64:
            return f"tile must be 64 x 64, got {tile_m} x {tile_n}"
        if dq_split_rows:
            return "the dQ GEMM splits head_dim columns"
        if is_causal and is_local:
            return "is_causal and is_local are exclusive"
        if num_stages not in (1, 2):
            return f"num_stages must be 1 or 2, got {num_stages}"
        if FlashBwdSm90Wide.smem_bytes(dtype, head_dim, tile_m, tile_n, num_stages, head_dim_v) > _SMEM_CAPACITY:
            return "does not fit in shared memory"
        return None

    @staticmethod
    def smem_bytes(dtype, head_dim, tile_m, tile_n, num_stages, head_dim_v=None) -> int:
        elem = dtype.width // 8
        widths = head_dim + (head_dim if head_dim_v is None else head_dim_v)  # K + V, Q + dO
        operands = (tile_n * widths + num_stages * tile_m * widths + 4 * tile_m * tile_n) * elem
        return operands + tile_m * head_dim * 4 + 2 * num_stages * tile_m * 4 + 1024 + 256

    def _smem_layouts(self):
        """``FlashBwdSm90``'s, with Q, dO, K and V swizzled in head_dim halves: the dK / dV / dQ GEMMs
        read a warpgroup's half of Q, dO, K as MN-major B operands, and the epilogue writes each
        half of dK / dV into sK / sV (at d = 192 a 96-column half is not a whole 128-byte swizzle
        atom; 64-byte atoms are)."""
        layouts = super()._smem_layouts()
        d, dv, wg = self.head_dim, self.head_dim_v, self.num_mma_wg
        layouts["sQ"] = make_smem_layout_sm90(self.dtype, self.tile_m, d, self.num_stages, atom_cols=d // wg)
        layouts["sdO"] = make_smem_layout_sm90(self.dtype, self.tile_m, dv, self.num_stages, atom_cols=dv // wg)
        layouts["sK"] = make_smem_layout_sm90(self.dtype, self.tile_n, d, atom_cols=d // wg)
        # (sV too: the MHA epilogue stages each warpgroup's dV half in it.)
        layouts["sV"] = make_smem_layout_sm90(self.dtype, self.tile_n, dv, atom_cols=dv // wg)
        return layouts

    def _tiled_mmas(self):
        """S^T / dP^T: SS, K-major, warpgroups along queries. dK / dV: A = dS^T / P^T from sdSt
        (K-major), B = Q^T / dO^T (MN-major views), warpgroups along head_dim / head_dim_v (one tiled
        MMA each: the pair is this kernel's ``tiled_mma_dkv``). dQ: as ``bwd.py`` (A = dS, M-major
        view of sdSt; B = K^T; warpgroups along head_dim)."""
        K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        wg = self.num_mma_wg
        sdp = hopper_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, K, Float32, atom_layout_mnk=(1, wg, 1), tiler_mn=(64, self.tile_m // wg),
        )
        dk, dv = (
            hopper_helpers.make_trivial_tiled_mma(
                self.dtype, self.dtype, K, MN, Float32, atom_layout_mnk=(1, wg, 1), tiler_mn=(64, width // wg),
            )
            for width in (self.head_dim, self.head_dim_v)
        )
        return sdp, (dk, dv), tiled_mma_dq_sm90(self.dtype, self.head_dim, False, wg)

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
        """The m_block loop of both MMA warpgroups; returns (acc_dK, acc_dV, tiled_mma_dkv)."""
        tidx = cute.arch.thread_idx()[0] - _WG_THREADS
        wg_idx = cute.arch.make_warp_uniform(tidx // _WG_THREADS)
        tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq = self._tiled_mmas()
        tiled_mma_dk, tiled_mma_dv = tiled_mma_dkv
        wg_sdp = tiled_mma_sdp.get_slice(wg_idx * _WG_THREADS)
        wg_dk = tiled_mma_dk.get_slice(wg_idx * _WG_THREADS)
        wg_dv = tiled_mma_dv.get_slice(wg_idx * _WG_THREADS)
        wg_dq = tiled_mma_dq.get_slice(wg_idx * _WG_THREADS)
        thr_sdp = tiled_mma_sdp.get_slice(tidx)
        d = self.head_dim
        tSrK, tSrQ, tdPrV, tdPrdO = self.sdp_operands(wg_sdp, sQ, sK, sV, sdO)
        tdKrdSt = wg_dk.make_fragment_A(wg_dk.partition_A(sdSt))  # dS^T: stages 0, 1
        tdVrPt = wg_dv.make_fragment_A(wg_dv.partition_A(sdSt))  # P^T: stages 2, 3
        tdVrdOt = wg_dv.make_fragment_B(wg_dv.partition_B(transpose_view(sdO)))
        tdKrQt = wg_dk.make_fragment_B(wg_dk.partition_B(transpose_view(sQ)))
        tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(transpose_view(sdSt)))
        tdQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(transpose_view(sK)))
        acc_dK = cute.make_rmem_tensor(tiled_mma_dk.partition_shape_C((self.tile_n, d)), Float32)
        acc_dV = cute.make_rmem_tensor(tiled_mma_dv.partition_shape_C((self.tile_n, self.head_dim_v)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)
        # P^T and dS^T (16-bit, C layout) -> sdSt with stmatrix.
        r2s_PdS = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype),
            tiled_mma_sdp,
        ).get_slice(tidx)
        tXsX = r2s_PdS.partition_D(sdSt)
        tScS_mn, mask = self.score_coords_and_mask(thr_sdp, seqlen, window_left, window_right)
        tdQsdQ = self.dq_staging(sdQ, tidx)

        self.wait_kv(pipe_kv, m_block_min, m_block_max)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        for m_block in cutlass.range(m_block_min, m_block_max, unroll=1):
            stage = state.index
            ds_stage = (m_block - m_block_min) % 2
            p_stage = ds_stage + 2
            acc_S, acc_dP = self.issue_s_dp(tiled_mma_sdp, tSrK, tSrQ, tdPrV, tdPrdO, pipe_q, pipe_do, state, stage)
            self.probs_and_ds(
                acc_S, acc_dP, sLSE, sdPsum, tScS_mn, stage, mask, thr_sdp, m_block, n_block, scale_log2,
                softcap_scale,
            )
            rP = convert_to_16bit(acc_S, self.dtype)
            cute.copy(r2s_PdS, r2s_PdS.retile(rP), tXsX[None, None, None, p_stage])
            rdS = convert_to_16bit(acc_dP, self.dtype)
            cute.copy(r2s_PdS, r2s_PdS.retile(rdS), tXsX[None, None, None, ds_stage])
            # Both warpgroups' P^T and dS^T are in smem and visible to the async proxy (WGMMA).
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=int(NamedBarrierBwd.DS_READY), number_of_threads=self.num_mma_threads)
            wgmma(tiled_mma_dk, acc_dK, tdKrdSt[None, None, None, ds_stage], tdKrQt[None, None, None, stage],
                  zero_init=False, wg_wait=-1)
            wgmma(tiled_mma_dv, acc_dV, tdVrPt[None, None, None, p_stage], tdVrdOt[None, None, None, stage],
                  zero_init=False, wg_wait=-1)
            acc_dQ = cute.make_rmem_tensor(tiled_mma_dq.partition_shape_C((self.tile_m, d)), Float32)
            wgmma(tiled_mma_dq, acc_dQ, tdQrdS[None, None, None, ds_stage], tdQrKt, zero_init=True, wg_wait=1)
            # dK and dV have read Q and dO: the producer may refill the stage while dQ runs.
            pipe_q.consumer_release(state)
            pipe_do.consumer_release(state)
            state.advance()
            warpgroup.wait_group(0)
            self.dq_to_smem(acc_dQ, tdQsdQ, m_block > m_block_min)
        return acc_dK, acc_dV, tiled_mma_dkv

    # ------------------------------------------------------------------ epilogue

    @cute.jit
    def epilogue_mha(self, acc_dK, acc_dV, dk_scale: Float32, mdK_cur, mdV_cur, sK, sV,
                     tiled_mma_dkv: tuple, tidx: Int32, n_block: Int32, seqlen_k: Int32):
        """dK * scale, dV -> 16-bit -> sK / sV (stmatrix; every WGMMA is done reading them; each
        warpgroup writes its head_dim half) -> warpgroup 1 stores dK's 64 rows below ``seqlen_k``,
        warpgroup 2 dV's, with 128-bit stores."""
        acc_dK.store(acc_dK.load() * dk_scale)
        rdK = convert_to_16bit(acc_dK, self.dtype)
        rdV = convert_to_16bit(acc_dV, self.dtype)
        cute.arch.barrier(barrier_id=int(NamedBarrierBwd.EPILOGUE), number_of_threads=self.num_mma_threads)
        for acc16, sX, tiled_mma in ((rdK, sK, tiled_mma_dkv[0]), (rdV, sV, tiled_mma_dkv[1])):
            r2s = cute.make_tiled_copy_C(
                cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=self.dkv_transposed, num_matrices=4), self.dtype),
                tiled_mma,
            ).get_slice(tidx)
            cute.copy(r2s, r2s.retile(acc16), r2s.partition_D(transpose_view(sX) if const_expr(self.dkv_transposed)
                                                               else sX))
        cute.arch.barrier(barrier_id=int(NamedBarrierBwd.EPILOGUE), number_of_threads=self.num_mma_threads)
        wg_idx = cute.arch.make_warp_uniform(tidx // _WG_THREADS)
        num_valid = seqlen_k - n_block * self.tile_n
        if wg_idx == 0:
            store_rows_predicated(sK, cute.local_tile(mdK_cur, (self.tile_n, self.head_dim), (n_block, 0)),
                                  tidx % _WG_THREADS, num_valid, self.dtype, _WG_THREADS)
        else:
            store_rows_predicated(sV, cute.local_tile(mdV_cur, (self.tile_n, self.head_dim_v), (n_block, 0)),
                                  tidx % _WG_THREADS, num_valid, self.dtype, _WG_THREADS)

    @cute.jit
    def epilogue_gqa(self, acc_dK, acc_dV, mdKaccum, mdVaccum, mdKV_sem, tiled_mma_dkv: tuple,
                     tidx: Int32, k_block: Int32, head_in_group: Int32, deterministic: Int32, staging: tuple,
                     num_keys: None = None):
        """Reduce-add this query head's fp32 dK (unscaled) and dV into its KV head's sums (each at
        its own width; row-major, ``staging`` unused)."""
        gdK = tiled_mma_dkv[0].get_slice(tidx).partition_C(accum_tile(mdKaccum, self.tile_n, self.head_dim, k_block))
        gdV = tiled_mma_dkv[1].get_slice(tidx).partition_C(
            accum_tile(mdVaccum, self.tile_n, self.head_dim_v, k_block)
        )
        if const_expr(self.deterministic):
            semaphore_wait(mdKV_sem, k_block, head_in_group, tidx, int(NamedBarrierBwd.SEMAPHORE), self.num_mma_threads)
        red_add_tile(acc_dV, gdV, 2)
        red_add_tile(acc_dK, gdK, 2)
        if const_expr(self.deterministic):
            semaphore_signal(mdKV_sem, k_block, tidx, int(NamedBarrierBwd.SEMAPHORE), self.num_mma_threads)
