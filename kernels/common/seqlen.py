"""Per-sequence offsets and lengths for dense and varlen (packed) attention inputs.

Purpose: one place that turns ``(batch_idx, cu_seqlens, seqused)`` into the row offset and the
length of one sequence, and views a tensor at that sequence, so the forward and backward kernels
of both architectures address dense ``(s, ..., b)`` and packed ``(total, ...)`` tensors alike
(design doc 1.14).

- Dense: offset 0, length = the tensor's static (dynamic-extent) sequence mode; the tensor view
  selects the batch mode.
- Varlen: ``offset = cu_seqlens[b]``, ``length = seqused[b]`` if given else
  ``cu_seqlens[b + 1] - cu_seqlens[b]``; the tensor view is shifted with ``cute.domain_offset``.
  Rows past the length may belong to the next sequence or lie past ``total``: callers predicate
  loads (zero-fill) and stores on the length.
- ``varlen_tile_coord`` maps a 1-D tile index over all sequences to ``(batch_idx, m_block)``
  without any host-side read of ``cu_seqlens`` (no sync): the launch covers the upper bound
  ``ceil((total_q + batch * (tile_m - 1)) / tile_m)`` tiles and the CTAs past the last real tile
  find no sequence and exit.

Presence of ``cu_seqlens``/``seqused`` is a compile-time fact (the tensor is None or not); the
values are runtime.

Paper: FlashAttention-2 (Dao, 2023) section 3.1 (variable-length batches as in the FA2 code).
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@dataclass(frozen=True)
class SeqlenInfo:
    """Offset (first row in the packed tensor, 0 when dense) and length of one sequence."""

    offset_q: Int32
    offset_k: Int32
    seqlen_q: Int32
    seqlen_k: Int32
    has_cu_seqlens_q: bool
    has_cu_seqlens_k: bool

    @staticmethod
    def create(
        batch_idx: Int32,
        seqlen_q_static: Int32,
        seqlen_k_static: Int32,
        mCuSeqlensQ: cute.Tensor | None = None,  # (batch + 1,) int32
        mCuSeqlensK: cute.Tensor | None = None,  # (batch + 1,) int32
        mSeqUsedQ: cute.Tensor | None = None,  # (batch,) int32
        mSeqUsedK: cute.Tensor | None = None,  # (batch,) int32
    ) -> "SeqlenInfo":
        """Read this sequence's offsets/lengths (trace-time choice of which tensors exist)."""
        offset_q, offset_k = Int32(0), Int32(0)
        seqlen_q, seqlen_k = seqlen_q_static, seqlen_k_static
        if mCuSeqlensQ is not None:
            offset_q = mCuSeqlensQ[batch_idx]
            seqlen_q = mCuSeqlensQ[batch_idx + 1] - offset_q
        if mCuSeqlensK is not None:
            offset_k = mCuSeqlensK[batch_idx]
            seqlen_k = mCuSeqlensK[batch_idx + 1] - offset_k
        if mSeqUsedQ is not None:
            seqlen_q = mSeqUsedQ[batch_idx]
        if mSeqUsedK is not None:
            seqlen_k = mSeqUsedK[batch_idx]
        return SeqlenInfo(
            offset_q, offset_k, seqlen_q, seqlen_k,
            mCuSeqlensQ is not None, mCuSeqlensK is not None,
        )

    @staticmethod
    def _at(mX: cute.Tensor, packed: bool, offset: Int32, batch_idx: Int32) -> cute.Tensor:
        rank = cute.rank(mX)
        if packed:  # (total, ...) -> (seqlen, ...) starting at this sequence's first row
            return cute.domain_offset((offset,) + (0,) * (rank - 1), mX)
        return mX[(None,) * (rank - 1) + (batch_idx,)]  # (s, ..., b) -> (s, ...)

    def q_view(self, mX: cute.Tensor, batch_idx: Int32) -> cute.Tensor:
        """This sequence of a query-side tensor: sequence mode first, batch mode last if dense."""
        return self._at(mX, self.has_cu_seqlens_q, self.offset_q, batch_idx)

    def k_view(self, mX: cute.Tensor, batch_idx: Int32) -> cute.Tensor:
        """This sequence of a key-side tensor: sequence mode first, batch mode last if dense."""
        return self._at(mX, self.has_cu_seqlens_k, self.offset_k, batch_idx)


def num_varlen_tiles_upper_bound(total: Int32, batch: Int32, tile: int) -> Int32:
    """Tiles of size ``tile`` over all sequences, at most: each sequence wastes < one tile."""
    return (total + batch * (tile - 1) + (tile - 1)) // tile


@cute.jit
def varlen_tile_coord(
    tile_idx: Int32,
    num_batch: Int32,
    tile: cutlass.Constexpr[int],
    mCuSeqlens: cute.Tensor,  # (batch + 1,) int32
    mSeqUsed: cute.Tensor | None,  # (batch,) int32
):
    """``(batch_idx, m_block)`` of the ``tile_idx``-th tile over all sequences; batch -1 if none.

    Each warp scans 32 sequences per step: lane ``l`` counts the tiles of sequence ``base + l``,
    an inclusive warp prefix sum (5 ``shfl.up``) gives the tiles up to it, and a ballot finds the
    sequence holding ``tile_idx``. Every warp of the CTA computes the same answer; all lanes of a
    warp must call this together. Zero-length sequences own no tile.
    """
    lane = cute.arch.lane_idx()
    base = Int32(0)
    remaining = tile_idx
    batch_idx = Int32(-1)
    m_block = Int32(0)
    while base < num_batch:
        b = base + lane
        seqlen = Int32(0)
        if b < num_batch:
            if cutlass.const_expr(mSeqUsed is not None):
                seqlen = mSeqUsed[b]
            else:
                seqlen = mCuSeqlens[b + 1] - mCuSeqlens[b]
        num_tiles = (seqlen + (tile - 1)) // tile
        incl = num_tiles
        for i in cutlass.range_constexpr(5):
            other = cute.arch.shuffle_sync_up(incl, 1 << i)
            if lane >= (1 << i):
                incl = incl + other
        total = cute.arch.shuffle_sync(incl, 31)
        if remaining < total:
            # incl is non-decreasing over lanes: the first lane with incl > remaining owns it.
            owner = cute.arch.popc(cute.arch.vote_ballot_sync(incl <= remaining))
            incl_owner = cute.arch.shuffle_sync(incl, owner)
            tiles_owner = cute.arch.shuffle_sync(num_tiles, owner)
            batch_idx = base + owner
            m_block = remaining - (incl_owner - tiles_owner)
            base = num_batch
        else:
            remaining = remaining - total
            base = base + 32
    return batch_idx, m_block
