"""Epilogue role of the Hopper forward kernel (kernels/fwd_sm90.py): O and LSE to global memory.

Split out of the kernel module by role (STYLE: files under ~900 lines). ``FwdSm90Epilogue`` is a
mixin of ``FlashFwdSm90``; it reads the kernel's static configuration (``dtype``, ``tile_m``,
``head_dim_v``, ``num_mma_threads``, ``defer_store_wait``) from ``self``.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warp

from .common.sm90_utils import store_rows_predicated
from .common.utils import acc_rows_cols, convert_to_16bit
from .fwd_sm90_parts import NamedBarrierFwd


class FwdSm90Epilogue:
    @cute.jit
    def epilogue(
        self,
        acc_O: cute.Tensor,
        lse: cute.Tensor,
        mO_cur: cute.Tensor,  # (seqlen_q, head_dim_v): TMA coordinates (dense) or the tensor
        mLSE_cur: cute.Tensor,  # (seqlen_q,) of this (batch, head)
        sO: cute.Tensor,
        tiled_mma_pv: cute.TiledMma,
        tma_atom_O: cute.CopyAtom | None,
        tidx: Int32,
        m_block: Int32,
        seqlen_q: Int32,
    ):
        """O (normalised) -> 16-bit -> ``stmatrix`` into sO -> gmem; LSE per row.

        Dense: one TMA store (it clips rows past the tensor, so no predicates). Varlen (no TMA
        atom): 16-byte row chunks from sO, rows past ``seqlen_q`` predicated off so the next
        sequence's rows are never touched. LSE goes straight from registers (2 rows per thread,
        lane % 4 == 0).
        """
        rO = convert_to_16bit(acc_O, self.dtype)
        if const_expr(self.defer_store_wait and tma_atom_O is not None):
            if tidx // 32 == 0:
                # The previous tile's TMA store must have read sO before anyone overwrites it.
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        # sO is sQ: every warpgroup's last QK^T WGMMA must have read it (each waited on its own).
        # Own sO: the previous tile's store has read it (the wait above) or been copied out.
        cute.arch.barrier(
            barrier_id=int(NamedBarrierFwd.EPILOGUE), number_of_threads=self.num_mma_threads
        )
        smem_copy_O = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype),
            tiled_mma_pv,
        )
        smem_thr_copy_O = smem_copy_O.get_slice(tidx)
        cute.copy(smem_copy_O, smem_thr_copy_O.retile(rO), smem_thr_copy_O.partition_D(sO))

        cO_acc = cute.make_identity_tensor((self.tile_m, self.head_dim_v))
        tOcO_mn = acc_rows_cols(tiled_mma_pv.get_slice(tidx).partition_C(cO_acc))
        if tOcO_mn[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = m_block * self.tile_m + tOcO_mn[r, 0][0]
                if row < seqlen_q:
                    mLSE_cur[row] = lse[r]

        if const_expr(tma_atom_O is not None):
            # Generic-proxy smem writes must be visible to the async proxy (TMA) that reads them.
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(
                barrier_id=int(NamedBarrierFwd.EPILOGUE), number_of_threads=self.num_mma_threads
            )
            if tidx // 32 == 0:
                gO = cute.local_tile(mO_cur, (self.tile_m, self.head_dim_v), (m_block, 0))
                tOsO, tOgO = cpasync.tma_partition(
                    tma_atom_O, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2),
                    cute.group_modes(gO, 0, 2),
                )
                cute.copy(tma_atom_O, tOsO, tOgO)
                cute.arch.cp_async_bulk_commit_group()
                if const_expr(not self.defer_store_wait):
                    # sO must outlive the bulk read: the CTA exits, or sO is the next tile's sQ.
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
        else:
            cute.arch.barrier(
                barrier_id=int(NamedBarrierFwd.EPILOGUE), number_of_threads=self.num_mma_threads
            )
            gO = cute.local_tile(mO_cur, (self.tile_m, self.head_dim_v), (m_block, 0))
            store_rows_predicated(
                sO, gO, tidx, seqlen_q - m_block * self.tile_m, self.dtype, self.num_mma_threads
            )
