"""Key-block steps of the Hopper forward's MMA warpgroups (kernels/sm90/fwd.py): ``FwdSm90Steps``.

Split out of the kernel module by role (STYLE: files under ~900 lines). A mixin of ``FlashFwdSm90``: the
intra-warpgroup-overlap prologue and epilogue half blocks, one key block's GEMMs and softmax, the
ping-pong turns, the QK^T GEMM and P's conversion, and the hooks the FP8 subclass
(``fwd_fp8.FlashFwdSm90Fp8``) overrides. Reads the kernel's static configuration (``tile_m``,
``tile_n``, ``dtype``, ``intra_wg_overlap``, ``pingpong``, ``num_mma_wg``, masks) and ``_score_mods``
(``fwd_scores.py``) from ``self``.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from ..common.sm90_utils import acc_to_frag_a_sm90, wgmma
from ..common.utils import convert_to_16bit, transpose_view, warpgroup_any_positive
from .fwd_parts import WG_THREADS as _WG_THREADS, BlockStep, MmaParts, NamedBarrierFwd


class FwdSm90Steps:
    @cute.jit
    def first_half_block(self, step: BlockStep, kv_state, n_block: Int32):
        """Intra-WG overlap prologue: S = Q K^T of the first block, its softmax and P; no P.V."""
        mma = step.mma
        k_state = step.kv(kv_state)
        step.pipeline_k.consumer_wait(k_state, step.pipeline_k.consumer_try_wait(k_state))
        # A ping-pong turn like every later block's GEMMs (FA3): the warpgroups enter each tile
        # in turn instead of both issuing the first QK^T at once.
        self._scheduler_sync(step.wg_idx)
        acc_S = self._qk_gemm(step, k_state.index, wg_wait=-1)
        self._scheduler_arrive(step.wg_idx)
        warpgroup.wait_group(0)
        self._add_gate(step, acc_S, k_state.index)
        step.pipeline_k.consumer_release(k_state)
        self._pass_other_ring(step, step.pipeline_k, kv_state)
        self._score_mods(step, acc_S, n_block, True, self.is_causal, self.is_local)
        step.softmax.update(acc_S, True, self._block_scale_log2(step, n_block), self._block_value_log2(step, n_block))
        self._note_zero_block(step)
        self._store_p(mma, acc_S)
        return kv_state

    @cute.jit
    def last_half_block(self, step: BlockStep, kv_state):
        """Intra-WG overlap epilogue: O += P V of the last block visited."""
        v_state = step.kv(kv_state)
        self._pv_gemm_unless_zero(step, v_state, wg_wait=0)
        self._release_v(step, v_state, kv_state)
        kv_state.advance()
        return kv_state

    @cute.jit
    def one_block(
        self,
        step: BlockStep,
        kv_state,
        n_block: Int32,
        is_first: cutlass.Constexpr[bool],
        mask_seqlen: cutlass.Constexpr[bool],
        mask_causal: cutlass.Constexpr[bool],
        mask_local: cutlass.Constexpr[bool],
    ):
        """One key block. With overlap: S_j = Q K_j^T and O += P_{j+1} V_{j+1} in flight together,
        softmax of S_j under the P.V GEMM. Without: S, softmax, P.V in sequence."""
        mma = step.mma
        if const_expr(self.intra_wg_overlap):
            v_local = kv_state.clone()
            v_state = step.kv(v_local)
            kv_state.advance()
            k_state = step.kv(kv_state)
            step.pipeline_k.consumer_wait(k_state, step.pipeline_k.consumer_try_wait(k_state))
            self._scheduler_sync(step.wg_idx)
            acc_S = self._qk_gemm(step, k_state.index, wg_wait=-1)
            if const_expr(self.skip_zero_pv):
                # (the previous block's P, all zeros where its flag is 0: no P.V, so only S_j is in flight)
                if step.softmax.block_sum[0] > Float32(0.0):
                    self._pv_gemm(step, v_state, wg_wait=-1)
                    self._scheduler_arrive(step.wg_idx)
                    warpgroup.wait_group(1)
                else:
                    self._wait_v(step, v_state)
                    self._scheduler_arrive(step.wg_idx)
                    warpgroup.wait_group(0)
            else:
                self._pv_gemm(step, v_state, wg_wait=-1)
                self._scheduler_arrive(step.wg_idx)
                warpgroup.wait_group(1)  # S_j has landed; P.V may still run
            self._add_gate(step, acc_S, k_state.index)
            step.pipeline_k.consumer_release(k_state)
            self._pass_other_ring(step, step.pipeline_k, kv_state)
            self._score_mods(step, acc_S, n_block, mask_seqlen, mask_causal, mask_local)
            row_scale = step.softmax.update(
                acc_S, False, self._block_scale_log2(step, n_block), self._block_value_log2(step, n_block)
            )
            warpgroup.wait_group(0)  # P.V done: P registers and V stage are free again
            self._release_v(step, v_state, v_local)
            self._note_zero_block(step)  # (after the flag's last read: it now names block n_block)
            self._store_p(mma, acc_S)
            step.softmax.rescale_O(mma.acc_O, row_scale)
        else:
            kv_cur = step.kv(kv_state)
            step.pipeline_k.consumer_wait(kv_cur, step.pipeline_k.consumer_try_wait(kv_cur))
            acc_S = self._qk_gemm(step, kv_cur.index, wg_wait=0)
            self._add_gate(step, acc_S, kv_cur.index)
            step.pipeline_k.consumer_release(kv_cur)
            self._pass_other_ring(step, step.pipeline_k, kv_state)
            self._score_mods(step, acc_S, n_block, mask_seqlen, mask_causal, mask_local)
            row_scale = step.softmax.update(acc_S, is_first=is_first)
            self._note_zero_block(step)
            self._store_p(mma, acc_S)
            if const_expr(not is_first):
                step.softmax.rescale_O(mma.acc_O, row_scale)
            self._pv_gemm_unless_zero(step, kv_cur, wg_wait=0)
            self._release_v(step, kv_cur, kv_state)
            kv_state.advance()
        return kv_state

    @cute.jit
    def _pv_gemm(self, step: BlockStep, v_state, wg_wait: cutlass.Constexpr[int]) -> None:
        """O += P V of V's ring stage ``v_state``, once the TMA has filled it (``wg_wait``: as ``wgmma``)."""
        mma = step.mma
        step.pipeline_v.consumer_wait(v_state, step.pipeline_v.consumer_try_wait(v_state))
        wgmma(
            mma.tiled_mma_pv, mma.acc_O, mma.tOrP, mma.tOrVt[None, None, None, v_state.index],
            zero_init=False, wg_wait=wg_wait,
        )

    @cute.jit
    def _pv_gemm_unless_zero(self, step: BlockStep, v_state, wg_wait: cutlass.Constexpr[int]) -> None:
        """``_pv_gemm``; with ``skip_zero_pv`` only where the block's vote (``_note_zero_block``) found a nonzero P,
        else just the wait for V's stage (``_wait_v``)."""
        if const_expr(self.skip_zero_pv):
            if step.softmax.block_sum[0] > Float32(0.0):
                self._pv_gemm(step, v_state, wg_wait)
            else:
                self._wait_v(step, v_state)
        else:
            self._pv_gemm(step, v_state, wg_wait)

    @cute.jit
    def _wait_v(self, step: BlockStep, v_state) -> None:
        """V's stage ``v_state`` filled, its P.V skipped (``skip_zero_pv``): waited for all the same, so that its
        release follows the TMA's write and the stage's phases stay in step."""
        step.pipeline_v.consumer_wait(v_state, step.pipeline_v.consumer_try_wait(v_state))

    @cute.jit
    def _note_zero_block(self, step: BlockStep) -> None:
        """``skip_zero_pv``: after ``softmax.update``, the block's P sums of the whole warpgroup in ``block_sum[0]``:
        positive where any thread's P has a nonzero, else 0 (one ``bar.red.or`` on the warpgroup's own named
        barrier), the same in all 128 threads, so its P.V WGMMA is issued or skipped by the warpgroup as one."""
        if const_expr(self.skip_zero_pv):
            live = warpgroup_any_positive(step.softmax.block_sum[0], int(NamedBarrierFwd.ZERO_BLOCK_WG1) + step.wg_idx)
            step.softmax.block_sum[0] = Float32(live)

    @cute.jit
    def _release_v(self, step: BlockStep, v_state, ring_state) -> None:
        """V's stage ``v_state`` read (its P.V done): release it, and the other ring's of ``ring_state``."""
        step.pipeline_v.consumer_release(v_state)
        self._pass_other_ring(step, step.pipeline_v, ring_state)

    @cute.jit
    def _pass_other_ring(self, step: BlockStep, pipe: pipeline.PipelineTmaAsync, state) -> None:
        """Spanning tiles over two (batch, head) pairs: wait for and release, unread, the other
        ring's stage of the block ring-local ``state`` names. Every warpgroup thus consumes every
        stage of both rings in order, so its wait parities never fall a phase behind (a
        warpgroup that skipped stages could see a stage two phases on and misread its parity)."""
        if const_expr(step.other_offset is not None):
            other = step.other(state)
            pipe.consumer_wait(other, pipe.consumer_try_wait(other))
            pipe.consumer_release(other)

    # FP8 hooks (kernels/sm90/fwd_fp8.py overrides them): O's dtype, V transposed on chip, P's offset.
    transposes_v = False
    num_transpose_warps = 0
    p_max_offset = 0.0
    block_scales = False
    kv_scale_ratio = 1  # (FP8 block scales: key blocks per k/v descale)
    skip_zero_pv = False  # (the gated kernel's option: FlashFwdSm90 sets it)

    @staticmethod
    def _out_dtype(dtype: type[cutlass.Numeric]) -> type[cutlass.Numeric]:
        return dtype

    def _block_scale_log2(self, step: BlockStep, n_block: Int32) -> Float32 | None:
        """FP8 block scales: key block ``n_block``'s scale (the tile's times its k descale); else None."""
        if const_expr(step.kv_scales is None):
            return None
        return step.softmax.scale_log2 * step.kv_scales[0][n_block]

    def _block_value_log2(self, step: BlockStep, n_block: Int32) -> Float32 | None:
        """FP8 block scales: log2 of key block ``n_block``'s V descale, a bias on its scores (``OnlineSoftmax.update``:
        O then sums true values, so blocks of different descales need no O rescale between them); else None.
        Descales below 2**-100 count as 2**-100 (the row sum takes P / vd: a zero descale would give 0 * inf; such a
        block's values are ~0 either way)."""
        if const_expr(step.kv_scales is None):
            return None
        return cute.math.log2(cute.arch.fmax(step.kv_scales[1][n_block], Float32(2.0 ** -100)), fastmath=True)

    def _pv_operand(self, storage, sV: cute.Tensor) -> cute.Tensor:
        """The shared-memory tensor the P.V WGMMA reads (16-bit: the V stages as the TMA wrote them)."""
        return sV

    def _pv_fragment_b(self, wg_mma_pv: cute.ThrMma, sV: cute.Tensor) -> cute.Tensor:
        """The P.V WGMMA's B operand: V^T, an MN-major view of the TMA tile (16-bit: transpose bit)."""
        return wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(transpose_view(sV)))

    def _pv_fragment_a(self, wg_mma_pv: cute.ThrMma) -> cute.Tensor:
        """The register A fragment P of the P.V WGMMA."""
        return wg_mma_pv.make_fragment_A(wg_mma_pv.partition_shape_A((self.tile_m, self.tile_n)))

    def _qk_gemm(self, step: BlockStep, stage: Int32, wg_wait: int) -> cute.Tensor:
        mma = step.mma
        acc_S = cute.make_rmem_tensor(
            mma.tiled_mma_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32
        )
        tSrQ = mma.tSrQ if const_expr(step.q_stage is None) else mma.tSrQ[None, None, None, step.q_stage]
        # The gate's bias through the tensor cores (``fwd_budget.gate_in_gemm``): ones in Q's extra k16
        # slice against its parts in K's.
        extra = None if const_expr(mma.tSrQx is None) else (mma.tSrQx, mma.tSrKx[None, None, None, stage])
        wgmma(
            mma.tiled_mma_qk, acc_S, tSrQ, mma.tSrK[None, None, None, stage],
            zero_init=True, wg_wait=wg_wait, extra=extra,
        )
        return acc_S

    def _store_p(self, mma: MmaParts, acc_S: cute.Tensor) -> None:
        """P (fp32, in S's registers) -> 16-bit A fragment of the P.V WGMMA (paired cvt)."""
        mma.tOrP.store(acc_to_frag_a_sm90(convert_to_16bit(acc_S, self.dtype)).load())

    def _scheduler_sync(self, wg_idx: Int32) -> None:
        """Wait for this warpgroup's turn to issue GEMMs (ping-pong, design doc 1.8)."""
        if const_expr(self.pingpong):
            cute.arch.barrier(
                barrier_id=int(NamedBarrierFwd.WARP_SCHEDULER_WG1) + wg_idx,
                number_of_threads=2 * _WG_THREADS,
            )

    def _scheduler_arrive(self, wg_idx: Int32) -> None:
        """Hand the tensor cores to the next MMA warpgroup (round robin)."""
        if const_expr(self.pingpong):
            next_wg = (wg_idx + 1) % self.num_mma_wg
            cute.arch.barrier_arrive(
                barrier_id=int(NamedBarrierFwd.WARP_SCHEDULER_WG1) + next_wg,
                number_of_threads=2 * _WG_THREADS,
            )
