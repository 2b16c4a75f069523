"""Warp-level GEMMs for sm80: ``ldmatrix`` smem -> registers feeding ``mma.sync.m16n8k16``.

Purpose: the two GEMM shapes of an FA2-style kernel, both accumulating in fp32 registers:
- ``gemm_ss``: both operands in smem (S = Q K^T).
- ``gemm_rs``: A already in registers, B in smem (O += P V, P kept in registers).

Both walk the K dimension in 16-deep slices and load slice k+1 with ``ldmatrix`` before issuing
the MMAs of slice k, so the shared-memory latency of the next slice hides behind tensor-core
work. The loops are unrolled at trace time (the slice count is static); ptxas sees straight-line
code and keeps only two slices of operand registers live.

Constraints: operands are partitioned with the same tiled MMA that issues the ``mma.sync``;
the smem copies were made with ``cute.make_tiled_copy_A/B`` from that tiled MMA.

Paper: FlashAttention-2 (Dao, 2023) section 3.1 (the per-block GEMMs of the forward pass).
"""

import cutlass.cute as cute


def gemm_ss(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    tCrA: cute.Tensor,
    tCrB: cute.Tensor,
    tCsA: cute.Tensor,
    tCsB: cute.Tensor,
    smem_thr_copy_A: cute.TiledCopy,
    smem_thr_copy_B: cute.TiledCopy,
) -> None:
    """``acc += A B^T``, A ``(MMA, MMA_M, MMA_K)`` and B ``(MMA, MMA_N, MMA_K)`` read from smem."""
    tCrA_copy = smem_thr_copy_A.retile(tCrA)
    tCrB_copy = smem_thr_copy_B.retile(tCrB)
    num_k = cute.size(tCsA.shape[2])
    cute.copy(smem_thr_copy_A, tCsA[None, None, 0], tCrA_copy[None, None, 0])
    cute.copy(smem_thr_copy_B, tCsB[None, None, 0], tCrB_copy[None, None, 0])
    for k in range(num_k):
        if k + 1 < num_k:
            cute.copy(smem_thr_copy_A, tCsA[None, None, k + 1], tCrA_copy[None, None, k + 1])
            cute.copy(smem_thr_copy_B, tCsB[None, None, k + 1], tCrB_copy[None, None, k + 1])
        cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)


def gemm_rs(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    tCrA: cute.Tensor,
    tCrB: cute.Tensor,
    tCsB: cute.Tensor,
    smem_thr_copy_B: cute.TiledCopy,
) -> None:
    """``acc += A B^T`` with A already in registers ``(MMA, MMA_M, MMA_K)`` and B read from smem."""
    tCrB_copy = smem_thr_copy_B.retile(tCrB)
    num_k = cute.size(tCrA.shape[2])
    cute.copy(smem_thr_copy_B, tCsB[None, None, 0], tCrB_copy[None, None, 0])
    for k in range(num_k):
        if k + 1 < num_k:
            cute.copy(smem_thr_copy_B, tCsB[None, None, k + 1], tCrB_copy[None, None, k + 1])
        cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
