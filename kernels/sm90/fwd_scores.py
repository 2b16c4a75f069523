"""Score modifiers of the Hopper forward kernel (kernels/sm90/fwd.py): what happens to a block's
scores between the QK^T GEMM and the online softmax.

Split out of the kernel module by role (STYLE: files under ~900 lines). ``FwdSm90Scores`` is a mixin of
``FlashFwdSm90``; it reads ``tile_m`` and ``tile_n`` from ``self`` and the rest from the ``BlockStep``:
the gate's bias per key (``has_gate``, from K's stage), the softcap, the masks.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from ..common.softmax import apply_softcap
from ..common.utils import acc_rows_cols
from .fwd_parts import BlockStep


class FwdSm90Scores:
    @cute.jit
    def _score_mods(
        self,
        step: BlockStep,
        acc_S: cute.Tensor,
        n_block: Int32,
        mask_seqlen: cutlass.Constexpr[bool],
        mask_causal: cutlass.Constexpr[bool],
        mask_local: cutlass.Constexpr[bool],
    ) -> None:
        """Softcap (if compiled in), then the element masks this block needs (-inf). (The gate's
        bias is added before, ``_add_gate``, while K's stage is still held.)"""
        if const_expr(step.softcap_scale is not None):
            apply_softcap(acc_S, step.softcap_scale)
        if const_expr(mask_seqlen or mask_causal or mask_local):
            step.mask.apply(
                acc_S, step.mma.thr_mma_qk, step.m_block, n_block, mask_seqlen=mask_seqlen,
                mask_causal=mask_causal, mask_local=mask_local,
            )

    @cute.jit
    def _add_gate(self, step: BlockStep, acc_S: cute.Tensor, k_stage: Int32):
        """has_gate without the bias in the GEMM (head dims over 128: ``fwd_budget.gate_in_gemm``):
        acc_S[r, c] += the bias of column c's key; one add per score, from K stage
        ``k_stage``'s copy in smem (loaded with K, so before that stage is released; varlen at the
        step's ``gate_shift``). Keys past seqlen_k read TMA's zero fill or the next sequence's bias;
        the mask then sets those scores to -inf. No-op without a gate."""
        if const_expr(step.gate is not None):
            acc_mn = acc_rows_cols(acc_S)
            coords = cute.make_identity_tensor((self.tile_m, self.tile_n))
            tScS_mn = acc_rows_cols(step.mma.thr_mma_qk.partition_C(coords))
            for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                col = tScS_mn[0, c][1]
                if const_expr(step.gate_shift is not None):
                    col = col + step.gate_shift
                bias = step.gate[col, k_stage]
                for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
                    acc_mn[r, c] = acc_mn[r, c] + bias
