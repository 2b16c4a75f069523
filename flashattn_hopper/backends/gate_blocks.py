"""Which key blocks of a gated forward's tiles can hold a nonzero P (``configs.FWD_SM90_GATE_SKIP_DECAYED``).

With log forget gates the score of query i and key j is ``q_i . k_j + b_j`` in the kernel's raw units, with
``b_j = -G_j / softmax_scale`` (G_i cancels in the softmax). For a tile of rows and a block of keys, Cauchy-Schwarz
bounds every score of the block by ``Qmax Kmax + max_j b_j`` (the tile's largest query norm, the head's largest key
norm), and each row's max by its reference key's score, at least ``-Qmax Kmax + b_ref(i)`` (its last visible key:
its own, bottom-right aligned, when causal; the last key otherwise), so

    P_ij = exp2((s_ij - m_i) * scale_log2) <= exp2((2 Qmax Kmax + max_block b - min_tile b_ref) * scale_log2).

Where that exponent is below ``-SKIP_LOG2_MARGIN`` every P of the block is exactly 0 in fp32 (exp2 below -150
underflows even without flushing denormals; 10 more cover the bound's and the kernel's rounding) and the block
cannot raise a row max: skipping it changes nothing. The table holds, per (batch, head, tile), the number of such
blocks at the front of the tile's key range (a block is counted only after all the blocks before it are), which
the kernel's producer and MMA warpgroups both take as the tile's first block (``kernels/sm90/fwd_tiles.py``).
The backward's mirror (``last_live_rows``, causal): per key block, one past the last query tile with a possibly
nonzero P, where every role of the block's CTA stops (``kernels/sm90/bwd.py`` ``skip_decayed``; the backward's P
is ``exp2(s - lse)`` with ``lse >= m``: smaller still, and its dS, dV, dK and dG parts are 0 with it).
Dense problems, causal or not, no local window. On CUDA with Triton two launches (``kernels/triton/gate_blocks.py``:
the torch build's ~30 ops were ~650 us of host time per call on the H100 machine), else torch ops.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

SKIP_LOG2_MARGIN = 160.0


Packed = tuple[torch.Tensor, int]  # packed self-attention: (cu_seqlens for queries and keys alike, max_seqlen)


def first_live_blocks(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, softmax_scale: float, tile_m: int,
                      tile_n: int, causal: bool, packed: Packed | None = None) -> torch.Tensor:
    """``(batch, nheads, m_blocks)`` int32: per tile of ``tile_m`` query rows, how many of its first key blocks of
    ``tile_n`` keys hold only exact zeros of P (see the module's docstring). ``q`` ``(batch, seqlen_q, nheads,
    d)``, ``k`` ``(batch, seqlen_k, nheads_k, d)``, ``bias`` the kernel's fp32 rows ``(batch, nheads, seqlen_k)``
    (``-G_j / softmax_scale``, any last-axis padding past seqlen_k ignored). ``packed``: q ``(total, nheads, d)``,
    k ``(total, nheads_k, d)``, bias ``(nheads, total)``, one table row per sequence, m_blocks from max_seqlen."""
    if _takes_triton(q, k, packed):
        return first_live_blocks_triton(q, k, bias, softmax_scale, tile_m, tile_n, causal, packed)
    if packed is not None:
        return _per_sequence(first_live_blocks_torch, q, k, bias, packed, tile_m, softmax_scale, tile_m, tile_n,
                             causal)
    return first_live_blocks_torch(q, k, bias, softmax_scale, tile_m, tile_n, causal)


def last_live_rows(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, softmax_scale: float, tile_m: int,
                   tile_n: int, packed: Packed | None = None) -> torch.Tensor:
    """``(batch, nheads, n_blocks)`` int32, causal: per key block of ``tile_n`` keys, one past the last tile of
    ``tile_m`` query rows whose P of the block may be nonzero (0: none), by the same bound as ``first_live_blocks``
    (its arguments)."""
    if _takes_triton(q, k, packed):
        return last_live_rows_triton(q, k, bias, softmax_scale, tile_m, tile_n, packed)
    if packed is not None:
        return _per_sequence(last_live_rows_torch, q, k, bias, packed, tile_n, softmax_scale, tile_m, tile_n)
    return last_live_rows_torch(q, k, bias, softmax_scale, tile_m, tile_n)


def _takes_triton(q: torch.Tensor, k: torch.Tensor, packed: Packed | None) -> bool:
    """CUDA tensors with unit stride in head_dim, batch (or sequences) within the grid's z, and Triton importable."""
    from .sm90_fwd import _has_triton

    batch = q.shape[0] if packed is None else packed[0].shape[0] - 1
    return q.is_cuda and _has_triton() and batch <= 65535 and q.stride(-1) == 1 and k.stride(-1) == 1


def _per_sequence(table: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor,
                  packed: Packed, tile: int, *args: Any) -> torch.Tensor:
    """A packed call's table by the dense torch build per sequence (tests and machines without Triton: reads
    cu_seqlens on the host), each row padded to ``max_seqlen``'s blocks of ``tile``."""
    cu, max_seqlen = packed
    bounds = cu.tolist()
    rows = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:  # (an empty sequence has no tiles)
            rows.append(torch.zeros(q.shape[1], -(-max_seqlen // tile), dtype=torch.int32, device=q.device))
            continue
        one = table(q[None, start:end], k[None, start:end], bias[None, :, start:end], *args)[0]
        rows.append(F.pad(one, (0, -(-max_seqlen // tile) - one.shape[-1])))
    return torch.stack(rows) if rows else torch.zeros(0, q.shape[1], 0, dtype=torch.int32, device=q.device)


def first_live_blocks_triton(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, softmax_scale: float,
                             tile_m: int, tile_n: int, causal: bool, packed: Packed | None = None) -> torch.Tensor:
    """``first_live_blocks`` by two Triton launches (``_takes_triton``'s tensors)."""
    from ..kernels.triton.gate_blocks import live_table_kernel
    from .sm90_fwd import _next_pow2, on_device_of

    (batch, seqlen_q, seqlen_k, nheads, nheads_k), strides, cu = _layout(q, k, bias, packed)
    m_blocks, n_blocks = -(-seqlen_q // tile_m), -(-seqlen_k // tile_n)
    live = torch.empty(batch, nheads, m_blocks, dtype=torch.int32, device=q.device)
    if live.numel() == 0 or n_blocks == 0:
        return live.zero_()

    def launch() -> None:
        q_norm, k_norm, _ = _block_norms(q, k, bias, tile_m, tile_n, packed, with_ref=False)
        live_table_kernel[(m_blocks, nheads, batch)](
            q_norm, k_norm, bias, live, seqlen_q, seqlen_k, m_blocks, n_blocks, nheads // nheads_k, *strides[2],
            float(softmax_scale) * math.log2(math.e), cu, CAUSAL=causal, TILE_M=tile_m,
            TILE_M_PAD=_next_pow2(tile_m), TILE_N=tile_n, TILE_N_PAD=_next_pow2(tile_n), BLOCK_K=128,
            MARGIN=SKIP_LOG2_MARGIN, VARLEN=packed is not None, num_warps=4)

    on_device_of(q, launch)
    return live


def last_live_rows_triton(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, softmax_scale: float,
                          tile_m: int, tile_n: int, packed: Packed | None = None) -> torch.Tensor:
    """``last_live_rows`` by two Triton launches (``_takes_triton``'s tensors)."""
    from ..kernels.triton.gate_blocks import live_rows_kernel
    from .sm90_fwd import _next_pow2, on_device_of

    (batch, seqlen_q, seqlen_k, nheads, nheads_k), strides, cu = _layout(q, k, bias, packed)
    m_blocks, n_blocks = -(-seqlen_q // tile_m), -(-seqlen_k // tile_n)
    end = torch.empty(batch, nheads, n_blocks, dtype=torch.int32, device=q.device)
    if end.numel() == 0 or m_blocks == 0:
        return end.zero_()

    def launch() -> None:
        q_norm, k_norm, ref_bias = _block_norms(q, k, bias, tile_m, tile_n, packed, with_ref=True)
        live_rows_kernel[(n_blocks, nheads, batch)](
            q_norm, k_norm, ref_bias, bias, end, seqlen_q, seqlen_k, m_blocks, n_blocks, nheads // nheads_k,
            *strides[2], float(softmax_scale) * math.log2(math.e), cu, TILE_M=tile_m, TILE_N=tile_n,
            TILE_N_PAD=_next_pow2(tile_n), BLOCK_K=128, BLOCK_M=128, MARGIN=SKIP_LOG2_MARGIN,
            VARLEN=packed is not None, num_warps=4)

    on_device_of(q, launch)
    return end


def _layout(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, packed: Packed | None
            ) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...], torch.Tensor]:
    """``((batch, seqlen_q, seqlen_k, nheads, nheads_k), (q's, k's, bias's (batch, row, head) strides), cu)`` as the
    Triton kernels take them: packed, one batch entry per sequence (batch strides 0, the rows from ``cu``), the
    lengths ``max_seqlen``; ``cu``: the cu_seqlens, or a stand-in pointer the dense kernels never read."""
    if packed is None:
        batch, seqlen_q, nheads, _ = q.shape
        strides = (q.stride()[:3], k.stride()[:3], bias.stride())
        return (batch, seqlen_q, k.shape[1], nheads, k.shape[2]), strides, bias
    cu, max_seqlen = packed
    strides = ((0, *q.stride()[:2]), (0, *k.stride()[:2]), (0, *bias.stride()))
    return (cu.shape[0] - 1, max_seqlen, max_seqlen, q.shape[1], k.shape[1]), strides, cu


def _block_norms(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, tile_m: int, tile_n: int,
                 packed: Packed | None, with_ref: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(q_norm, k_norm, ref_bias)`` by one launch of ``block_norms_kernel``: the tiles' largest q norms ``(batch,
    nheads, m_blocks)``, the key blocks' largest k norms ``(batch, nheads_k, n_blocks)``, fp32; ``with_ref``
    (causal): the tiles' smallest reference-key bias ``(batch, nheads, m_blocks)``, else None."""
    from ..kernels.triton.gate_blocks import block_norms_kernel
    from .sm90_fwd import _next_pow2

    (batch, seqlen_q, seqlen_k, nheads, nheads_k), strides, cu = _layout(q, k, bias, packed)
    head_dim = q.shape[-1]
    m_blocks, n_blocks = -(-seqlen_q // tile_m), -(-seqlen_k // tile_n)
    q_norm = torch.empty(batch, nheads, m_blocks, dtype=torch.float32, device=q.device)
    k_norm = torch.empty(batch, nheads_k, n_blocks, dtype=torch.float32, device=q.device)
    ref_bias = torch.empty_like(q_norm) if with_ref else None
    block_norms_kernel[(max(m_blocks, n_blocks), nheads, batch)](
        q, k, q_norm, k_norm, seqlen_q, seqlen_k, m_blocks, n_blocks, nheads_k, *strides[0], *strides[1],
        bias, q_norm if ref_bias is None else ref_bias, *strides[2], cu, HEAD_DIM=head_dim,
        D_PAD=_next_pow2(head_dim), TILE_M=tile_m, TILE_N=tile_n, CHUNK=min(64, 8192 // _next_pow2(head_dim)),
        WITH_REF=with_ref, TILE_M_PAD=_next_pow2(tile_m), VARLEN=packed is not None, num_warps=4)
    return q_norm, k_norm, ref_bias


def first_live_blocks_torch(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, softmax_scale: float,
                            tile_m: int, tile_n: int, causal: bool) -> torch.Tensor:
    """``first_live_blocks`` by torch ops (any device)."""
    zero = _zero_blocks_torch(q, k, bias, softmax_scale, tile_m, tile_n, causal)
    return zero.to(torch.int32).cumprod(-1).sum(-1, dtype=torch.int32)


def last_live_rows_torch(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, softmax_scale: float,
                         tile_m: int, tile_n: int) -> torch.Tensor:
    """``last_live_rows`` by torch ops (any device)."""
    zero = _zero_blocks_torch(q, k, bias, softmax_scale, tile_m, tile_n, True)  # (b, h, m_blocks, n_blocks)
    tile_end = torch.arange(1, zero.shape[2] + 1, dtype=torch.int32, device=q.device)[:, None]
    return torch.where(zero, 0, tile_end).amax(2).to(torch.int32)


def _zero_blocks_torch(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, softmax_scale: float, tile_m: int,
                       tile_n: int, causal: bool) -> torch.Tensor:
    """Bool ``(batch, nheads, m_blocks, n_blocks)``: where the bound finds the (tile, key block)'s P all 0."""
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    m_blocks, n_blocks = -(-seqlen_q // tile_m), -(-seqlen_k // tile_n)
    scale_log2 = float(softmax_scale) * math.log2(math.e)
    q_norm = torch.linalg.vector_norm(q, dim=-1, dtype=torch.float32)  # (b, s_q, h)
    q_norm = F.pad(q_norm, (0, 0, 0, m_blocks * tile_m - seqlen_q)).view(batch, m_blocks, tile_m, nheads)
    q_max = q_norm.amax(2).transpose(1, 2)  # (b, h, m_blocks)
    k_max = torch.linalg.vector_norm(k, dim=-1, dtype=torch.float32).amax(1)  # (b, h_k)
    k_max = k_max.repeat_interleave(nheads // nheads_k, dim=1)  # (b, h): query head i reads kv head i // group
    rows = bias[..., :seqlen_k].float()
    block_bias = F.pad(rows, (0, n_blocks * tile_n - seqlen_k), value=-math.inf)
    block_bias = block_bias.view(batch, nheads, n_blocks, tile_n).amax(-1)  # (b, h, n_blocks)
    row = torch.arange(m_blocks * tile_m, device=q.device)
    ref = row + (seqlen_k - seqlen_q) if causal else torch.full_like(row, seqlen_k - 1)
    has_ref = (row < seqlen_q) & (ref >= 0) & (ref < seqlen_k)  # (rows without one see no key: no P at all)
    ref_bias = torch.where(has_ref, rows[..., ref.clamp(0, seqlen_k - 1)], math.inf)
    ref_bias = ref_bias.view(batch, nheads, m_blocks, tile_m).amin(-1)  # (b, h, m_blocks)
    exponent = (2 * q_max * k_max[..., None])[..., None] + block_bias[:, :, None, :] - ref_bias[..., None]
    return exponent * scale_log2 < -SKIP_LOG2_MARGIN  # (NaN compares False)
