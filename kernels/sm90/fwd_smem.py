"""Shared-memory and MMA building blocks of the Hopper forward kernel (kernels/sm90/fwd.py).

Split out of the kernel module by role (STYLE: files under ~900 lines). ``FwdSm90Smem`` is a mixin
of ``FlashFwdSm90``; it reads the kernel's static configuration (``dtype``, ``tile_m``, ``tile_n``,
``head_dim``, ``head_dim_v``, ``num_stages``, ``num_rings``, ``q_stages``, ``num_mma_wg``,
``o_aliases_q``) from ``self``: the smem byte count, the swizzled layouts, the storage struct, the two
tiled WGMMAs, and the views of the Q ring.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as hopper_helpers
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from ..common.sm90_utils import make_smem_layout_sm90
from .fwd_budget import GATE_COLS, GATE_K, SMEM_ALIGN, gate_stage_floats, smem_bytes


class FwdSm90Smem:
    @staticmethod
    def _smem_bytes(
        dtype, head_dim, head_dim_v, tile_m, tile_n, num_stages, own_sO: bool, q_stages: int = 1, gate: bool = False,
        gate_slice: bool = False,
    ) -> int:
        """Shared memory of the storage struct: Q, K/V stages, optionally O, mbarriers, the gate."""
        return smem_bytes(dtype.width // 8, head_dim, head_dim_v, tile_m, tile_n, num_stages, own_sO, q_stages, gate,
                          gate_slice)

    def _implement_options(self) -> dict:
        """A subclass's own ``can_implement`` keywords for its configuration (FP8: ``v_colmajor``)."""
        return {}

    def _smem_layouts(self):
        """sQ (stages last when q_stages > 1), sK, sV (stages last; ring A's, then ring B's) and
        sO (in sQ's buffer only where head_dim_v <= head_dim)."""
        kv_stages = self.num_stages * self.num_rings
        q_stages = self.q_stages if const_expr(self.q_stages > 1) else None
        return (
            make_smem_layout_sm90(self.dtype, self.tile_m, self.head_dim, q_stages),
            make_smem_layout_sm90(self.dtype, self.tile_n, self.head_dim, kv_stages),
            make_smem_layout_sm90(self.dtype, self.tile_n, self.head_dim_v, kv_stages),
            make_smem_layout_sm90(self.o_dtype, self.tile_m, self.head_dim_v),
        )

    def _gate_layouts(self):
        """has_gate: the QK^T GEMM's extra k16 slice, sQx ``(tile_m, GATE_K)`` (once) and sKx ``(tile_n,
        GATE_K, K stages)`` (with each K stage), K-major like sQ and sK; sKx in atoms of GATE_COLS columns (no
        swizzle at 16 bytes), so that each stage's first GATE_COLS columns, which TMA loads, are one contiguous box
        (``_gate_load_view``)."""
        kv_stages = self.num_stages * self.num_rings
        return (
            make_smem_layout_sm90(self.dtype, self.tile_m, GATE_K),
            make_smem_layout_sm90(self.dtype, self.tile_n, GATE_K, kv_stages, atom_cols=GATE_COLS),
        )

    def _gate_load_view(self, sKx: cute.Tensor) -> cute.Tensor:
        """The columns of sKx ``(tile_n, GATE_K, K stages)`` that TMA loads: ``(tile_n, GATE_COLS, K stages)``."""
        return cute.make_tensor(sKx.iterator, cute.composition(
            sKx.layout, cute.make_layout((self.tile_n, GATE_COLS, cute.size(sKx.shape[2])),
                                         stride=(1, self.tile_n, self.tile_n * GATE_K))))

    def _tiled_mmas(self):
        """S = Q K^T: SS, both K-major. O += P V: A = P from registers, B = V^T (MN-major)."""
        tiled_mma_qk = hopper_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            Float32, atom_layout_mnk=(self.num_mma_wg, 1, 1), tiler_mn=(64, self.tile_n),
        )
        tiled_mma_pv = hopper_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN,
            Float32, atom_layout_mnk=(self.num_mma_wg, 1, 1), tiler_mn=(64, self.head_dim_v),
            a_source=warpgroup.OperandSource.RMEM,
        )
        return tiled_mma_qk, tiled_mma_pv

    def _shared_storage(self, sQ_layout, sK_layout, sV_layout, sO_layout):
        def buffer(num_elems: int, dtype=self.dtype):
            return cute.struct.Align[cute.struct.MemRange[dtype, num_elems], SMEM_ALIGN]

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * self.q_stages]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages * self.num_rings]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages * self.num_rings]
            mbar_tile: cute.struct.MemRange[cutlass.Int64, 2]  # the tile handoff's full/empty
            next_tile: cute.struct.MemRange[cutlass.Int32, 4]  # dynamic scheduler's handoff slot
            sQ: buffer(cute.cosize(sQ_layout))  # also sO when o_aliases_q
            sK: buffer(cute.cosize(sK_layout))
            sV: buffer(cute.cosize(sV_layout))
            if const_expr(self.transposes_v):  # FP8: V^T (K-major) stages and their barriers
                mbar_vt: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
                sVt: buffer(cute.cosize(self._vt_layout()))
            if const_expr(self.gate_in_gemm):
                # the QK^T GEMM's extra k16 slice: K's per stage (K's TMA barrier), Q's once
                sKx: buffer(cute.cosize(self._gate_layouts()[1]))
                sQx: buffer(cute.cosize(self._gate_layouts()[0]))
            elif const_expr(self.has_gate):  # the gate's bias per key of each K stage (K's TMA barrier)
                sGate: buffer(gate_stage_floats(self.tile_n) * self.num_stages * self.num_rings, cutlass.Float32)

        if const_expr(self.o_aliases_q):
            return SharedStorage

        # A persistent CTA's own sO: the next tile's Q loads while this tile's O is still being stored.
        @cute.struct
        class SharedStorageWithO:
            base: SharedStorage
            sO: buffer(cute.cosize(sO_layout), self.o_dtype)

        return SharedStorageWithO

    def _q_stage_layout(self, sQ_layout):
        """One Q buffer's (tile_m, head_dim) layout."""
        if const_expr(self.q_stages == 1):
            return sQ_layout
        return cute.select(sQ_layout, mode=[0, 1])

    def _q_buffer(self, sQ: cute.Tensor, index: Int32) -> cute.Tensor:
        """Stage ``index`` of the Q ring (sQ itself without a ring)."""
        if const_expr(self.q_stages == 1):
            return sQ
        return sQ[None, None, index]
