"""Online softmax over the rows of an MMA accumulator, kept in registers.

Purpose: the running ``row_max`` / ``row_sum`` statistics of FlashAttention. Each thread owns a
few rows of the S tile (2 per 16-row MMA atom); the 4 threads of a quad hold the columns of a
row, so a row reduction is a thread-local reduction plus two ``shfl.bfly`` steps.

Numerics (design doc 1.6, pitfall 18):
- ``scale_log2 = softmax_scale * log2(e)`` is folded into the exponent:
  ``P = exp2(S * scale_log2 - row_max * scale_log2)`` (one FFMA + one MUFU.EX2 per element).
  This assumes ``softmax_scale > 0`` (the max is taken on the unscaled S), as in FA2/FA3/FA4.
- A row whose max is still ``-inf`` (every key masked so far) uses 0 as its offset, so the
  exponent is ``-inf`` (P = 0) instead of ``-inf - -inf = NaN``.
- ``row_sum`` is kept thread-local inside the key loop and reduced across the quad once, in
  ``finalize``.
- ``finalize``: a row with ``row_sum == 0`` (it saw no key, e.g. causal with
  ``seqlen_q > seqlen_k``) gets output scale 0 and LSE ``-inf``; otherwise
  ``O *= 1 / row_sum`` and ``LSE = (row_max * scale_log2 + log2(row_sum)) * ln(2)`` (natural log).

Softcap (Gemma-2 style, ``s = softcap * tanh(s * softmax_scale / softcap)``): ``apply_softcap``
runs on S before masking and ``update`` and leaves ``tanh(s * softmax_scale / softcap)``; the
caller then builds ``OnlineSoftmax`` with ``scale_log2 = softcap * log2(e)`` so the exponent and
the LSE come out in the capped units (``softcap_scale_log2`` gives both constants). The max is
still taken before the scale, which is right because ``softcap > 0``.

Lazy rescale (``rescale_threshold``, FA4's trick, used by the sm90 forward): a row keeps its old
max while the block's max exceeds it by at most ``threshold`` in exponent units, so P grows up to
``2**threshold`` (256 at 8: far inside fp32, bf16 and fp16 range) and the row's scale is exactly 1;
``rescale_O`` then skips the O multiply for a warp whose rows all kept theirs (one vote per block).
The LSE stays exact: ``row_sum`` is kept relative to the max actually used. Why: the sm90 forward
runs at the GPU's power cap, so instructions not issued (one FMUL per O element per block) are
clock gained (perf/NOTES.md, session 13).

Constraints: fp32 accumulators in the sm80/sm90 MMA C layout (see ``utils.acc_rows_cols``).

Paper: FlashAttention-2 (Dao, 2023) section 3.1, Algorithm 1 lines 8-12 (online softmax with
the rescaling of O deferred to the end).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .utils import LN_2, LOG2_E, acc_rows_cols


def softcap_scale_log2(softmax_scale: Float32, softcap: Float32) -> tuple[Float32, Float32]:
    """``(scale for apply_softcap, scale_log2 for OnlineSoftmax)`` when softcap is on."""
    return softmax_scale / softcap, softcap * LOG2_E


@cute.jit
def apply_softcap(acc_S: cute.Tensor, softcap_scale: Float32) -> None:
    """``S = tanh(S * softcap_scale)`` in place (``tanh.approx.f32``, one MUFU op per element)."""
    for i in cutlass.range_constexpr(cute.size(acc_S)):
        acc_S[i] = cute.math.tanh(acc_S[i] * softcap_scale, approx=True)


def _chained_reduce(row: cute.Tensor, op, num_chains: int):
    """Reduce a 1-D register view with ``num_chains`` independent chains.

    Independent partial results let the FMNMX/FADD latencies overlap instead of forming one
    serial chain of ``size(row)`` dependent instructions.
    """
    n = cute.size(row)
    chains = num_chains if n % num_chains == 0 else 1
    partial = [row[i] for i in range(chains)]
    for i in range(chains, n, chains):
        for j in range(chains):
            partial[j] = op(partial[j], row[i + j])
    while len(partial) > 1:
        partial = [op(partial[2 * i], partial[2 * i + 1]) for i in range(len(partial) // 2)] + (
            [partial[-1]] if len(partial) % 2 else []
        )
    return partial[0]


class OnlineSoftmax:
    """Running softmax statistics for ``num_rows`` accumulator rows of the calling thread."""

    def __init__(
        self, scale_log2: Float32, num_rows: int, rescale_threshold: float | None = None, max_offset: float = 0.0,
        block_scales: bool = False, track_zero_blocks: bool = False,
    ):
        self.scale_log2 = scale_log2
        self.num_rows = num_rows
        self.rescale_threshold = rescale_threshold
        # Per-block scales (FP8 block quantization: each key block's k descale): every ``update`` gets its
        # block's scale, and the running max is kept in scaled (log2) units so blocks compare.
        self.block_scales = block_scales
        # P = 2**max_offset * p (FP8's P in (0, 256] instead of (0, 1], so small probabilities stay
        # above e4m3's underflow): O / row_sum cancels the factor, the LSE subtracts it at finalize.
        self.max_offset = max_offset
        self.row_max = cute.make_rmem_tensor(num_rows, Float32)
        self.row_sum = cute.make_rmem_tensor(num_rows, Float32)
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)
        # ``track_zero_blocks``: each ``update`` leaves in ``block_sum[0]`` the largest of this thread's row sums of
        # the block's P (0: every P of the thread's part of the block underflowed to 0; the gated forward then
        # skips the block's P.V, whose product would be exactly 0).
        self.track_zero_blocks = track_zero_blocks
        self.block_sum = cute.make_rmem_tensor(1, Float32) if track_zero_blocks else None

    @cute.jit
    def update(
        self, acc_S: cute.Tensor, is_first: cutlass.Constexpr[bool], block_scale_log2: Float32 | None = None,
        block_value_log2: Float32 | None = None,
    ) -> cute.Tensor:
        """Fold one (already masked) S block in: S is overwritten with P, returns the O row scale.

        The returned ``row_scale[r] = exp2((old_max - new_max) * scale_log2)`` must be applied
        to the O accumulator before this block's P.V is added (``rescale_O``). On the first
        block O is zero, so the scale is 1 and need not be applied. ``block_scale_log2``: this
        block's scale (``block_scales`` mode only, where it replaces ``scale_log2``).
        ``block_value_log2`` (``block_scales`` mode): log2 of the block's V descale ``vd``, folded into
        its scores as a bias: P = 2**offset * p * vd / 2**(max's share), so O sums p * v in true units
        whatever each block's descale (no O rescale between blocks of different descales, no descale at
        the end), the max is taken over the biased scores (P stays in range), and the row sum takes
        P / vd (one multiply per row).
        """
        acc_S_mn = acc_rows_cols(acc_S)
        row_scale = cute.make_rmem_tensor(self.num_rows, Float32)
        if cutlass.const_expr(self.track_zero_blocks):
            self.block_sum[0] = Float32(0.0)
        scaled = self.block_scales
        scale_log2 = block_scale_log2 if cutlass.const_expr(scaled) else self.scale_log2
        value_inv = None
        if cutlass.const_expr(block_value_log2 is not None):
            value_inv = cute.math.exp2(-block_value_log2, fastmath=True)
        for r in cutlass.range_constexpr(self.num_rows):
            row = acc_S_mn[r, None]
            row_max_cur = _chained_reduce(row, cute.arch.fmax, 4)
            row_max_cur = cute.arch.warp_reduction_max(row_max_cur, threads_in_group=4)
            if cutlass.const_expr(scaled):  # (a positive scale keeps the order; -inf stays -inf)
                row_max_cur = row_max_cur * scale_log2
                if cutlass.const_expr(block_value_log2 is not None):
                    row_max_cur = row_max_cur + block_value_log2
            row_max_prev = self.row_max[r]
            if cutlass.const_expr(not is_first):
                if cutlass.const_expr(self.rescale_threshold is not None):
                    # Keep the old max unless this block's exceeds it by more than the threshold
                    # (-inf - -inf = NaN compares false: an all-masked row stays at -inf).
                    growth = row_max_cur - row_max_prev
                    if cutlass.const_expr(not scaled):
                        growth = growth * scale_log2
                    grows = growth > self.rescale_threshold
                    row_max_cur = row_max_cur if grows else row_max_prev
                else:
                    row_max_cur = cute.arch.fmax(row_max_cur, row_max_prev)
            self.row_max[r] = row_max_cur
            # Fully masked row so far: offset 0 keeps exp2 at exp2(-inf) = 0, never NaN.
            row_max_safe = Float32(0.0) if row_max_cur == -Float32.inf else row_max_cur
            if cutlass.const_expr(scaled):
                neg_max_scaled = -row_max_safe
                if cutlass.const_expr(block_value_log2 is not None):
                    neg_max_scaled = neg_max_scaled + block_value_log2
            else:
                neg_max_scaled = -(row_max_safe * scale_log2)
            if cutlass.const_expr(self.max_offset != 0.0):
                neg_max_scaled = neg_max_scaled + self.max_offset
            for c in cutlass.range_constexpr(cute.size(row)):
                row[c] = cute.math.exp2(row[c] * scale_log2 + neg_max_scaled, fastmath=True)
            row_sum_cur = _chained_reduce(row, lambda a, b: a + b, 4)
            if cutlass.const_expr(block_value_log2 is not None):
                row_sum_cur = row_sum_cur * value_inv
            if cutlass.const_expr(self.track_zero_blocks):
                self.block_sum[0] = cute.arch.fmax(self.block_sum[0], row_sum_cur)
            if cutlass.const_expr(is_first):
                row_scale[r] = Float32(1.0)
                self.row_sum[r] = row_sum_cur
            else:
                if cutlass.const_expr(scaled):
                    row_scale[r] = cute.math.exp2(row_max_prev - row_max_safe, fastmath=True)
                else:
                    row_scale[r] = cute.math.exp2(
                        (row_max_prev - row_max_safe) * scale_log2, fastmath=True
                    )
                if cutlass.const_expr(self.rescale_threshold is not None):
                    # Exactly 1 for a kept max (also an all-masked row: -inf kept), so
                    # rescale_O's vote sees it.
                    row_scale[r] = Float32(1.0) if row_max_cur == row_max_prev else row_scale[r]
                self.row_sum[r] = self.row_sum[r] * row_scale[r] + row_sum_cur
        return row_scale

    @cute.jit
    def rescale_O(self, acc_O: cute.Tensor, row_scale: cute.Tensor) -> None:
        """Multiply each row of the O accumulator by its scale (lazy: only in a warp where some
        row's scale is not 1)."""
        if cutlass.const_expr(self.rescale_threshold is not None):
            needed = row_scale[0] != 1.0
            for r in cutlass.range_constexpr(1, self.num_rows):
                needed = needed or row_scale[r] != 1.0
            if cute.arch.vote_any_sync(needed):
                self._scale_rows(acc_O, row_scale)
        else:
            self._scale_rows(acc_O, row_scale)

    @cute.jit
    def _scale_rows(self, acc_O: cute.Tensor, row_scale: cute.Tensor) -> None:
        acc_O_mn = acc_rows_cols(acc_O)
        for r in cutlass.range_constexpr(cute.size(acc_O_mn.shape[0])):
            for c in cutlass.range_constexpr(cute.size(acc_O_mn.shape[1])):
                acc_O_mn[r, c] = acc_O_mn[r, c] * row_scale[r]

    @cute.jit
    def finalize(self, sink_log2: cute.Tensor | None = None) -> tuple[cute.Tensor, cute.Tensor]:
        """Reduce ``row_sum`` across the quad; return ``(o_scale, lse)`` per row.

        ``o_scale`` is what O must be multiplied by (``1 / row_sum``, or 0 for a row that saw
        no key), ``lse`` is the natural-log log-sum-exp of the scaled scores (``-inf`` for such
        a row). A NaN sum (NaN inputs) is treated like an empty row for the LSE.

        ``sink_log2`` (log2 units, per row or one for every row; ``-inf``: none): a learnable sink's logit joins the
        denominator with no value, once, here: with ``m`` the row's max in log2 units and
        ``M = max(m, sink)``, ``D = row_sum * 2^(m - M) + 2^(sink - M)``, ``o_scale = 2^(m - M) / D``
        and ``lse = (M + log2 D) * ln 2``. A row with no key gets ``o_scale = 0``, ``lse = sink``.
        """
        o_scale = cute.make_rmem_tensor(self.num_rows, Float32)
        lse = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            row_sum = cute.arch.warp_reduction_sum(self.row_sum[r], threads_in_group=4)
            is_empty = row_sum == 0.0 or row_sum != row_sum
            if cutlass.const_expr(sink_log2 is None):
                o_scale[r] = Float32(0.0) if is_empty else cute.arch.rcp_approx(row_sum)
                log_sum = cute.math.log2(row_sum, fastmath=True)
                if cutlass.const_expr(self.max_offset != 0.0):
                    log_sum = log_sum - self.max_offset
                if cutlass.const_expr(self.block_scales):
                    lse[r] = -Float32.inf if is_empty else (self.row_max[r] + log_sum) * LN_2
                else:
                    lse[r] = (
                        -Float32.inf
                        if is_empty
                        else (self.row_max[r] * self.scale_log2 + log_sum) * LN_2
                    )
            else:
                row_max_log2 = -Float32.inf if is_empty else self.row_max[r] * self.scale_log2
                sink = sink_log2[r] if cutlass.const_expr(isinstance(sink_log2, cute.Tensor)) else sink_log2
                top = cute.arch.fmax(row_max_log2, sink)
                if top == -Float32.inf:  # no key and no sink
                    o_scale[r] = Float32(0.0)
                    lse[r] = -Float32.inf
                else:
                    keys_share = Float32(0.0) if is_empty else cute.math.exp2(row_max_log2 - top, fastmath=True)
                    keys_sum = Float32(0.0) if is_empty else row_sum * keys_share  # (a NaN sum stays out)
                    denom = keys_sum + cute.math.exp2(sink - top, fastmath=True)
                    o_scale[r] = keys_share * cute.arch.rcp_approx(denom)
                    lse[r] = (top + cute.math.log2(denom, fastmath=True)) * LN_2
        return o_scale, lse


@cute.jit
def read_sink_log2(mLSE_cur: cute.Tensor, tOcO_mn: cute.Tensor, row0: Int32, seqlen_q: Int32) -> cute.Tensor:
    """The sm80 forward's learnable sink: this thread's accumulator rows' logits in log2 units (-inf past
    ``seqlen_q``), read from the LSE rows (``mLSE_cur``: this (batch, head)'s) that the launcher filled with it and
    the epilogue will overwrite. ``tOcO_mn``: the O accumulator's (row, col) coordinates (``acc_rows_cols`` of an
    identity tensor's partition). The quad takes its lane 0's value (its column-0 thread's) by a shuffle: the
    epilogue writes a row's LSE from that lane, so that read precedes the write in program order (another lane's
    read has no ordering against it). (The sm90 forward reads one logit per tile from a kernel argument instead: no
    fill of the LSE buffer.)"""
    num_rows = cute.size(tOcO_mn.shape[0])
    logits = cute.make_rmem_tensor(num_rows, Float32)
    for r in cutlass.range_constexpr(num_rows):
        row = row0 + tOcO_mn[r, 0][0]
        logit = -Float32.inf
        if row < seqlen_q:
            logit = mLSE_cur[row]
        logits[r] = logit
    quad_writer = cute.arch.lane_idx() // 4 * 4
    sink_log2 = cute.make_rmem_tensor(num_rows, Float32)
    for r in cutlass.range_constexpr(num_rows):
        sink_log2[r] = cute.arch.shuffle_sync(logits[r], quad_writer) * LOG2_E
    return sink_log2
