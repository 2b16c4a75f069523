"""Epilogues of the Ampere backward kernel (kernels/sm80/bwd.py): dK and dV out of the registers.

Split out of the kernel module by role (STYLE: files under ~900 lines). ``BwdSm80Epilogue`` is a
mixin of ``FlashBwdSm80``; it reads the kernel's static configuration (``dtype``, ``head_dim``,
``head_dim_v``, ``tile_n``, ``num_threads``) from ``self``. Three ends of a key block:

- MHA (``epilogue_mha``): 16-bit dK/dV through smem to global memory;
- GQA (``epilogue_gqa``): fp32 reduce-adds into the KV head's sums (the postprocess converts);
- a segment of a split tail key block (``epilogue_tail``, MHA): fp32 reduce-adds into the block's
  scratch; the segment that arrives last reads the sums back and ends like ``epilogue_mha``.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..common.bwd_utils import (
    accum_tile, elem_pointer, red_add_tile, semaphore_signal, semaphore_wait, tiled_copy_16b,
)
from ..common.utils import convert_to_16bit


class BwdSm80Epilogue:
    @cute.jit
    def epilogue_mha(
        self,
        acc_dK: cute.Tensor,  # unscaled
        acc_dV: cute.Tensor,
        dk_scale: Float32,  # softmax_scale
        mdK_cur: cute.Tensor,  # (seqlen_k, head_dim) of this (batch, kv head)
        mdV_cur: cute.Tensor,  # (seqlen_k, head_dim_v)
        sK: cute.Tensor,
        sV: cute.Tensor,
        tiled_mma_dkv: cute.TiledMma,
        tidx: Int32,
        n_block: Int32,
        seqlen_k: Int32,
    ):
        """dK, dV -> 16-bit -> smem (reusing sK, sV) -> 128-bit predicated stores.

        Rows past ``seqlen_k`` are not stored; a block no query sees stores zeros.
        """
        acc_dK.store(acc_dK.load() * dk_scale)
        rdK = convert_to_16bit(acc_dK, self.dtype)
        rdV = convert_to_16bit(acc_dV, self.dtype)
        # No cp.async may still land in sK/sV and every warp has issued its last ldmatrix.
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        r2s = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32),
            tiled_mma_dkv,
        ).get_slice(tidx)
        cute.copy(r2s, r2s.retile(rdK), r2s.partition_D(sK))
        cute.copy(r2s, r2s.retile(rdV), r2s.partition_D(sV))
        cute.arch.barrier()
        self._store_tile(sK, mdK_cur, self.head_dim, tidx, n_block, seqlen_k)
        self._store_tile(sV, mdV_cur, self.head_dim_v, tidx, n_block, seqlen_k)

    @cute.jit
    def _store_tile(self, sX: cute.Tensor, mX: cute.Tensor, cols: cutlass.Constexpr[int], tidx: Int32,
                    n_block: Int32, seqlen_k: Int32):
        """smem ``(tile_n, cols)`` -> registers -> 128-bit stores of rows ``< seqlen_k``."""
        tiled_copy = tiled_copy_16b(self.dtype, self.num_threads, cols, is_async=False)
        thr_copy = tiled_copy.get_slice(tidx)
        tile = (self.tile_n, cols)
        cX = cute.make_identity_tensor(tile)
        tXcX = thr_copy.partition_S(cX)
        t0XcX = tiled_copy.get_slice(0).partition_S(cX)
        row_bound = seqlen_k - n_block * self.tile_n - tXcX[0][0]
        tXsX = thr_copy.partition_S(sX)
        tXrX = cute.make_fragment_like(tXsX, self.dtype)
        cute.autovec_copy(tXsX, tXrX)
        tXgX = thr_copy.partition_D(cute.local_tile(mX, tile, (n_block, 0)))
        for m in cutlass.range_constexpr(cute.size(tXrX.shape[1])):
            if t0XcX[0, m, 0][0] < row_bound:
                cute.copy(tiled_copy, tXrX[None, m, None], tXgX[None, m, None])

    @cute.jit
    def epilogue_gqa(
        self,
        acc_dK: cute.Tensor,
        acc_dV: cute.Tensor,
        mdKaccum: cute.Tensor,  # (seqlen_k_padded * head_dim,) fp32 of this (batch, kv head)
        mdVaccum: cute.Tensor,  # (seqlen_k_padded * head_dim_v,)
        mdKV_sem: cute.Tensor,  # (seqlen_k_padded / tile_n,)
        thr_mma_dkv: cute.ThrMma,
        tidx: Int32,
        k_block: Int32,  # this key block's tile in the scratch (padded offset + n_block)
        head_idx: Int32,
        head_idx_kv: Int32,
        qhead_per_kvhead: Int32,
        deterministic: Int32,
    ):
        """Reduce-add the fp32 dK (unscaled) and dV of this query head into the KV head's sums."""
        gdK = accum_tile(mdKaccum, self.tile_n, self.head_dim, k_block)
        gdV = accum_tile(mdVaccum, self.tile_n, self.head_dim_v, k_block)
        if deterministic != 0:
            # Turns in ascending query-head order: lower heads have lower block indices.
            semaphore_wait(mdKV_sem, k_block, head_idx - head_idx_kv * qhead_per_kvhead, tidx)
        red_add_tile(acc_dV, thr_mma_dkv.partition_C(gdV))
        red_add_tile(acc_dK, thr_mma_dkv.partition_C(gdK))
        if deterministic != 0:
            semaphore_signal(mdKV_sem, k_block, tidx)

    @cute.jit
    def epilogue_tail(
        self,
        acc_dK: cute.Tensor,  # unscaled
        acc_dV: cute.Tensor,
        # (2, tile_n * max(head_dim, head_dim_v)) fp32 of this tail block, zeroed
        mdKV_tail_block: cute.Tensor,
        mTailArrivals: cute.Tensor,  # (tail_blocks,) int32, zeroed
        sArrived: cute.Tensor,  # (1,) int32 smem: the arrival count, for every thread
        tail_index: Int32,
        tail_segments: Int32,
        softmax_scale: Float32,
        mdK_cur: cute.Tensor,
        mdV_cur: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        tiled_mma_dkv: cute.TiledMma,
        tidx: Int32,
        n_block: Int32,
        seqlen_k: Int32,
    ):
        """One segment's partial dK/dV of a split key block: reduce-add them into the block's
        scratch, count the arrival, and if this is the last segment to arrive, store the sums as
        16-bit dK (scaled) and dV (every thread fences its adds before the CTA counts its arrival;
        the last arrival's threads fence again before reading the sums)."""
        thr_mma_dkv = tiled_mma_dkv.get_slice(tidx)
        gdK = thr_mma_dkv.partition_C(accum_tile(mdKV_tail_block[0, None], self.tile_n, self.head_dim, 0))
        gdV = thr_mma_dkv.partition_C(accum_tile(mdKV_tail_block[1, None], self.tile_n, self.head_dim_v, 0))
        red_add_tile(acc_dK, gdK)
        red_add_tile(acc_dV, gdV)
        # Every thread's fence: a fence waits for its own warp's reduce-adds only, and the last
        # segment must not read the sums while another warp's adds are still in flight.
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier()
        if tidx == 0:
            arrived = cute.arch.atomic_add(
                elem_pointer(mTailArrivals, tail_index), Int32(1), sem="acq_rel", scope="gpu"
            )
            sArrived[0] = arrived
        cute.arch.barrier()
        if sArrived[0] == tail_segments - 1:  # CTA-uniform: one value from smem
            cute.arch.fence_acq_rel_gpu()  # every thread reads the sums after the last arrival
            self._store_sums(mdKV_tail_block[0, None], mdK_cur, self.head_dim, softmax_scale, tidx, n_block, seqlen_k)
            self._store_sums(
                mdKV_tail_block[1, None], mdV_cur, self.head_dim_v, Float32(1.0), tidx, n_block, seqlen_k
            )

    @cute.jit
    def _store_sums(self, mSum: cute.Tensor, mX: cute.Tensor, cols: cutlass.Constexpr[int], scale: Float32,
                    tidx: Int32, n_block: Int32, seqlen_k: Int32):
        """A key block's fp32 sums (row-major ``tile_n x cols``) times ``scale`` -> 16-bit rows
        ``< seqlen_k`` of ``mX`` (``(seqlen_k, cols)``), element by element straight from gmem:
        once per split key block, coalesced (consecutive threads, consecutive elements), and nothing
        written to registers or smem that the rest of the kernel uses."""
        row0 = n_block * self.tile_n
        for i in cutlass.range_constexpr(self.tile_n * cols // self.num_threads):
            e = i * self.num_threads + tidx
            row = e // cols
            if row0 + row < seqlen_k:
                mX[row0 + row, e % cols] = (mSum[e] * scale).to(self.dtype)
