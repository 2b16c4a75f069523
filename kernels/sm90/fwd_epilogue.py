"""Epilogue role of the Hopper forward kernel (kernels/sm90/fwd.py): O and LSE to global memory.

Split out of the kernel module by role (STYLE: files under ~900 lines). ``FwdSm90Epilogue`` is a
mixin of ``FlashFwdSm90``; it reads the kernel's static configuration (``o_dtype``, ``tile_m``,
``head_dim_v``, ``num_mma_threads``, ``defer_store_wait``, ``wg_local_epilogue``) from ``self``.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warp

from ..common.sm90_utils import store_rows_predicated
from ..common.utils import acc_rows_cols, convert_to_16bit
from .fwd_parts import WG_THREADS as _WG_THREADS, NamedBarrierFwd


class FwdSm90Epilogue:
    def _o_store_rows(self) -> int:
        """Rows of O one store covers: a warpgroup's 64 (warpgroup-local epilogue) or the tile."""
        return 64 if self.wg_local_epilogue else self.tile_m

    def _rows_layout(self, layout, cols: int, rows: int):
        """A ``(tile_m, cols)`` smem layout restricted to its first ``rows`` rows (a TMA box; a
        warpgroup's rows are the same layout shifted by whole 64-row swizzle periods)."""
        if rows == self.tile_m:
            return layout
        return cute.composition(layout, cute.make_layout((rows, cols), stride=(1, self.tile_m)))

    def _sO_store_layout(self, sO_layout):
        """sO's layout restricted to the rows one store covers."""
        return self._rows_layout(sO_layout, self.head_dim_v, self._o_store_rows())

    def _is_o_storer(self, tidx: Int32):
        """The warp that issues (and waits for) TMA stores of O: the first warp of each MMA
        warpgroup (warpgroup-local epilogue) or of the first one."""
        group_threads = _WG_THREADS if self.wg_local_epilogue else self.num_mma_threads
        return (tidx % group_threads) // 32 == 0

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
        wg_idx: Int32,
        row0: Int32,  # the sequence row of the tile's row 0 (spanning tiles: may be < 0)
        seqlen_q: Int32,
    ):
        """O (normalised) -> 16-bit -> ``stmatrix`` into sO -> gmem; LSE per row.

        Warpgroup-local (``wg_local_epilogue``): each MMA warpgroup syncs only its own 128
        threads and stores its own 64 rows, so no warpgroup waits for another at a tile's end.
        Else one store of the whole tile after a barrier over every MMA thread.
        Dense: TMA stores (they clip rows past the tensor, so no predicates). Varlen (no TMA
        atom): 16-byte row chunks from sO, rows past ``seqlen_q`` predicated off so the next
        sequence's rows are never touched. LSE goes straight from registers (2 rows per thread,
        lane % 4 == 0).
        """
        rows = self._o_store_rows()
        if const_expr(self.wg_local_epilogue):
            group_threads, group_tidx, row_block = _WG_THREADS, tidx % _WG_THREADS, wg_idx
            barrier_id = int(NamedBarrierFwd.EPILOGUE_WG1) + wg_idx
        else:
            group_threads, group_tidx, row_block = self.num_mma_threads, tidx, 0
            barrier_id = int(NamedBarrierFwd.EPILOGUE)
        rO = convert_to_16bit(acc_O, self.o_dtype)
        if const_expr(self.defer_store_wait and tma_atom_O is not None):
            if self._is_o_storer(tidx):
                # The previous tile's TMA store must have read sO before anyone overwrites it.
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        # sO is sQ: every WGMMA reading these rows of sQ (the group's own QK^T) has completed.
        # Own sO: the previous tile's store has read it (the wait above) or been copied out.
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=group_threads)
        smem_copy_O = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.o_dtype),
            tiled_mma_pv,
        )
        smem_thr_copy_O = smem_copy_O.get_slice(tidx)
        cute.copy(smem_copy_O, smem_thr_copy_O.retile(rO), smem_thr_copy_O.partition_D(sO))

        cO_acc = cute.make_identity_tensor((self.tile_m, self.head_dim_v))
        tOcO_mn = acc_rows_cols(tiled_mma_pv.get_slice(tidx).partition_C(cO_acc))
        if tOcO_mn[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = row0 + tOcO_mn[r, 0][0]
                if row < seqlen_q:
                    mLSE_cur[row] = lse[r]

        # This group's rows of sO and of O (row blocks of `rows` rows).
        sO_rows = cute.local_tile(sO, (rows, self.head_dim_v), (row_block, 0))
        gO_row_block = row0 // rows + row_block  # row0 is a multiple of rows
        if const_expr(tma_atom_O is not None):
            # Generic-proxy smem writes must be visible to the async proxy (TMA) that reads them.
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=barrier_id, number_of_threads=group_threads)
            if self._is_o_storer(tidx):
                gO = cute.local_tile(mO_cur, (rows, self.head_dim_v), (gO_row_block, 0))
                tOsO, tOgO = cpasync.tma_partition(
                    tma_atom_O, 0, cute.make_layout(1), cute.group_modes(sO_rows, 0, 2),
                    cute.group_modes(gO, 0, 2),
                )
                cute.copy(tma_atom_O, tOsO, tOgO)
                cute.arch.cp_async_bulk_commit_group()
                if const_expr(not self.defer_store_wait):
                    # sO must outlive the bulk read: the CTA exits, or sO is the next tile's sQ.
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
        else:
            cute.arch.barrier(barrier_id=barrier_id, number_of_threads=group_threads)
            gO = cute.local_tile(mO_cur, (rows, self.head_dim_v), (gO_row_block, 0))
            store_rows_predicated(
                sO_rows, gO, group_tidx, seqlen_q - gO_row_block * rows, self.o_dtype, group_threads
            )
