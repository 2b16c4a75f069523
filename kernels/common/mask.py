"""Element masks applied to an S block (``-inf`` where a key is not visible).

Purpose: inside the key blocks that ``BlockInfo`` flags as straddling a boundary, set the
scores of invisible (row, key) pairs to ``-inf`` before the online softmax:
- the key-length bound ``j < seqlen_k`` (only the first block visited can be cut by it);
- the causal / right-window bound ``j <= i + seqlen_k - seqlen_q + window_right``
  (bottom-right aligned, causal = ``window_right = 0``);
- the left-window bound ``j >= i + seqlen_k - seqlen_q - window_left`` (local attention).
Which bounds apply is a compile-time choice of the caller, so blocks that need none carry no
masking code at all (design doc 1.9, pitfall 15).

Technique: column coordinates come from thread 0's partition of an identity tensor, which are
compile-time constants; this thread's column offset is folded into the runtime limit once per
row, so each element costs one integer compare and one select (design doc 1.9, ``t0ScS``).
A score modifier such as softcap runs on S before masking and needs nothing from here.

Constraints: S in the MMA C layout of ``thr_mma`` (sm80 ``mma.sync`` or sm90 WGMMA), viewed as
rows/cols with ``utils.acc_rows_cols``; ``n_block >= 0``.

Paper: FlashAttention-2 (Dao, 2023) section 3.1.1 (causal masking on the diagonal blocks only).
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .pack_gqa import packed_row_to_query
from .utils import acc_rows_cols


@dataclass(frozen=True)
class AttentionMask:
    tile_m: int
    tile_n: int
    seqlen_q: Int32
    seqlen_k: Int32
    window_left: Int32 | None = None
    window_right: Int32 | None = None
    # Pack GQA (common/pack_gqa.py): row r of a tile is query r // g; seqlen_q counts queries.
    qhead_per_kvhead: int = 1

    @cute.jit
    def apply(
        self,
        acc_S: cute.Tensor,
        thr_mma: cute.ThrMma,
        m_block: Int32,
        n_block: Int32,
        mask_seqlen: cutlass.Constexpr[bool],
        mask_causal: cutlass.Constexpr[bool],
        mask_local: cutlass.Constexpr[bool] = False,
    ) -> None:
        """Mask one ``(tile_m, tile_n)`` S block of this thread in place."""
        acc_S_mn = acc_rows_cols(acc_S)
        cS = cute.make_identity_tensor((self.tile_m, self.tile_n))
        tScS_mn = acc_rows_cols(thr_mma.partition_C(cS))
        t0ScS_mn = acc_rows_cols(thr_mma.get_slice(0).partition_C(cS))
        num_rows = cute.size(acc_S_mn.shape[0])
        num_cols = cute.size(acc_S_mn.shape[1])
        # Global key index of this thread's column c is col_base + t0ScS_mn[0, c][1].
        col_base = n_block * self.tile_n + tScS_mn[0, 0][1]
        col_limit_seqlen = self.seqlen_k - col_base
        if cutlass.const_expr(not mask_causal and not mask_local):
            if cutlass.const_expr(mask_seqlen):
                for c in cutlass.range_constexpr(num_cols):
                    key_oob = t0ScS_mn[0, c][1] >= col_limit_seqlen
                    for r in cutlass.range_constexpr(num_rows):
                        acc_S_mn[r, c] = -Float32.inf if key_oob else acc_S_mn[r, c]
        else:
            # Row i sees keys up to i + diag_offset (+ window_right), from i + diag_offset
            # - window_left; both limits are taken relative to col_base.
            diag_offset = self.seqlen_k - self.seqlen_q - col_base
            row_base = m_block * self.tile_m
            for r in cutlass.range_constexpr(num_rows):
                row_idx = packed_row_to_query(row_base + tScS_mn[r, 0][0], self.qhead_per_kvhead)
                col_limit_right = row_idx + diag_offset + 1
                if cutlass.const_expr(mask_local):
                    col_limit_right = (
                        col_limit_right + self.window_right
                        if cutlass.const_expr(self.window_right is not None)
                        else Int32(self.tile_n)
                    )
                if cutlass.const_expr(mask_seqlen):
                    col_limit_right = cutlass.min(col_limit_right, col_limit_seqlen)
                if cutlass.const_expr(mask_local and self.window_left is not None):
                    col_limit_left = row_idx + diag_offset - self.window_left
                    for c in cutlass.range_constexpr(num_cols):
                        col = t0ScS_mn[0, c][1]
                        hidden = col >= col_limit_right or col < col_limit_left
                        acc_S_mn[r, c] = -Float32.inf if hidden else acc_S_mn[r, c]
                else:
                    for c in cutlass.range_constexpr(num_cols):
                        hidden = t0ScS_mn[0, c][1] >= col_limit_right
                        acc_S_mn[r, c] = -Float32.inf if hidden else acc_S_mn[r, c]

    @cute.jit
    def apply_transposed(
        self,
        acc_St: cute.Tensor,
        thr_mma: cute.ThrMma,
        m_block: Int32,
        n_block: Int32,
        mask_causal: cutlass.Constexpr[bool],
        mask_local: cutlass.Constexpr[bool] = False,
    ) -> None:
        """Mask one ``(tile_n, tile_m)`` block of ``S^T`` (rows = keys, columns = queries), as the
        Hopper backward computes it, in place: the key-length bound always, the causal / window
        bounds when compiled in. Per column (one query) the visible keys are
        ``[q + offset - window_left, q + offset + window_right]``, taken relative to this thread's
        first row so each element costs one compare against a compile-time row offset."""
        acc_mn = acc_rows_cols(acc_St)
        cS = cute.make_identity_tensor((self.tile_n, self.tile_m))
        tScS_mn = acc_rows_cols(thr_mma.partition_C(cS))
        t0ScS_mn = acc_rows_cols(thr_mma.get_slice(0).partition_C(cS))
        num_rows = cute.size(acc_mn.shape[0])
        num_cols = cute.size(acc_mn.shape[1])
        # Global key index of this thread's row r is row_base + t0ScS_mn[r, 0][0].
        row_base = n_block * self.tile_n + tScS_mn[0, 0][0]
        row_limit_seqlen = self.seqlen_k - row_base
        diag_offset = self.seqlen_k - self.seqlen_q - row_base
        col_base = m_block * self.tile_m
        for c in cutlass.range_constexpr(num_cols):
            row_limit = row_limit_seqlen
            row_first = Int32(0)
            if cutlass.const_expr(mask_causal or mask_local):
                query = col_base + tScS_mn[0, c][1]
                row_end = query + diag_offset + 1
                if cutlass.const_expr(mask_local):
                    row_end = (
                        row_end + self.window_right
                        if cutlass.const_expr(self.window_right is not None)
                        else Int32(self.tile_n)
                    )
                row_limit = cutlass.min(row_limit, row_end)
                if cutlass.const_expr(mask_local and self.window_left is not None):
                    row_first = query + diag_offset - self.window_left
            for r in cutlass.range_constexpr(num_rows):
                row = t0ScS_mn[r, 0][0]
                hidden = row >= row_limit
                if cutlass.const_expr(mask_local and self.window_left is not None):
                    hidden = hidden or row < row_first
                acc_mn[r, c] = -Float32.inf if hidden else acc_mn[r, c]

    @cute.jit
    def block_needs_mask(
        self,
        m_block: Int32,
        n_block: Int32,
        is_causal: cutlass.Constexpr[bool],
        is_local: cutlass.Constexpr[bool],
    ):
        """Whether block ``(m_block, n_block)`` holds any pair the masks hide: keys past
        ``seqlen_k``, or (causal / local) keys right of the first row's last visible key, or
        (local) left of the last row's first visible key. Runtime-uniform, so the element mask
        is traced once and most blocks branch around it."""
        block_start = n_block * self.tile_n
        block_end = block_start + self.tile_n
        need = block_end > self.seqlen_k
        offset = self.seqlen_k - self.seqlen_q
        if cutlass.const_expr(is_causal or is_local):
            first_row_limit = m_block * self.tile_m + offset
            if cutlass.const_expr(is_local):
                first_row_limit = first_row_limit + self.window_right
            need = need | (first_row_limit < block_end - 1)
        if cutlass.const_expr(is_local):
            last_row_first = (m_block + 1) * self.tile_m - 1 + offset - self.window_left
            need = need | (last_row_first > block_start)
        return need
