"""Which key blocks (n_blocks) a query tile (m_block) visits, and which of them need masking.

Purpose: turn the causal / sliding-window rule into per-m_block ranges so that fully masked key
blocks are never loaded or computed, and only the blocks that straddle a mask boundary pay for
element masking (design doc 1.9).

Semantics (bottom-right aligned, as FA2/FA3/FA4): with ``offset = seqlen_k - seqlen_q``, query
row ``i`` may see key ``j`` iff ``j <= i + offset + window_right`` and
``j >= i + offset - window_left``. Causal is ``window_right = 0`` with no left bound. A window
side that is ``None`` is unbounded. Ranges are computed from the first/last row of the tile, so
rows past ``seqlen_q`` in the last tile may widen a range; their outputs are never stored.

Key loop order is right to left: ``n_block_max - 1`` down to ``n_block_min``; the first block
visited is the only one that can be cut by ``seqlen_k``. Segments of that loop:
- ``[n_block_min_right_mask, n_block_max)``: blocks that may cross the right (causal) boundary.
- ``[n_block_min, n_block_max_left_mask)``: blocks that may cross the left window boundary.
- the rest: no element mask at all.
A range can be empty (``n_block_max <= n_block_min``), e.g. causal with ``seqlen_q > seqlen_k``
for the top tiles; the caller must then skip the loop and still write O = 0, LSE = -inf.

All divisions are floor divisions (the DSL's ``//`` on Int32 is ``floordivsi``), so negative
offsets round the safe way; results are clamped to ``[0, ceil(seqlen_k / tile_n)]``.

Paper: FlashAttention-2 (Dao, 2023) section 3.1.1 (skipping blocks above the causal diagonal).
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .pack_gqa import packed_row_to_query


@dataclass(frozen=True)
class BlockInfo:
    tile_m: int
    tile_n: int
    is_causal: bool
    is_local: bool = False
    window_left: Int32 | None = None
    window_right: Int32 | None = None
    # Pack GQA (common/pack_gqa.py): tile rows are (query, head) pairs, g heads per query.
    qhead_per_kvhead: int = 1

    def _first_query(self, m_block: Int32):
        """Query index of the tile's first row."""
        return packed_row_to_query(m_block * self.tile_m, self.qhead_per_kvhead)

    def _end_query(self, m_block: Int32):
        """One past the query index of the tile's last row."""
        if self.qhead_per_kvhead == 1:
            return (m_block + 1) * self.tile_m
        return packed_row_to_query((m_block + 1) * self.tile_m - 1, self.qhead_per_kvhead) + 1

    def _right_bound_offset(self, seqlen_q: Int32, seqlen_k: Int32):
        """``offset + window_right``: the last visible key of row ``i`` is ``i`` plus this."""
        offset = seqlen_k - seqlen_q
        if self.is_local and self.window_right is not None:
            offset = offset + self.window_right
        return offset

    def _has_right_bound(self) -> bool:
        return self.is_causal or (self.is_local and self.window_right is not None)

    def _has_left_bound(self) -> bool:
        return self.is_local and self.window_left is not None

    @cute.jit
    def n_block_min_max(self, seqlen_q: Int32, seqlen_k: Int32, m_block: Int32):
        """``(n_block_min, n_block_max)``: visit key blocks ``n_block_min <= n < n_block_max``."""
        n_block_max = (seqlen_k + (self.tile_n - 1)) // self.tile_n
        if cutlass.const_expr(self._has_right_bound()):
            # Keys visible to the tile's last row: [0, last_row + offset + 1).
            n_idx_end = self._end_query(m_block) + self._right_bound_offset(seqlen_q, seqlen_k)
            n_block_end = (n_idx_end + (self.tile_n - 1)) // self.tile_n
            n_block_max = cutlass.max(cutlass.min(n_block_max, n_block_end), Int32(0))
        n_block_min = Int32(0)
        if cutlass.const_expr(self._has_left_bound()):
            # First key visible to the tile's first row.
            n_idx_begin = self._first_query(m_block) + (seqlen_k - seqlen_q) - self.window_left
            n_block_min = cutlass.max(n_idx_begin // self.tile_n, Int32(0))
        return n_block_min, n_block_max

    @cute.jit
    def n_block_min_right_mask(
        self, seqlen_q: Int32, seqlen_k: Int32, m_block: Int32, n_block_min: Int32
    ) -> Int32:
        """Blocks ``n >= this`` may hold keys right of some row's last visible key.

        Block ``n`` is safe iff its last key ``(n + 1) * tile_n - 1`` is visible to the tile's
        first row; ``floor((first_row + offset) / tile_n)`` is a conservative (never too high)
        bound for that.
        """
        n_idx = self._first_query(m_block) + self._right_bound_offset(seqlen_q, seqlen_k)
        return cutlass.max(n_block_min, n_idx // self.tile_n)

    @cute.jit
    def n_block_max_left_mask(
        self, seqlen_q: Int32, seqlen_k: Int32, m_block: Int32, n_block_min: Int32
    ) -> Int32:
        """Blocks ``n < this`` may hold keys left of some row's first visible key (local only).

        Block ``n`` is safe iff its first key ``n * tile_n`` is visible to the tile's last row,
        i.e. ``n * tile_n >= last_row + offset - window_left``; the ceil below is conservative.
        """
        n_idx = self._end_query(m_block) + (seqlen_k - seqlen_q) - self.window_left
        return cutlass.max(n_block_min, (n_idx + (self.tile_n - 1)) // self.tile_n)
