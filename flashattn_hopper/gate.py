"""Gated log-decay attention (``log_decay``; Forgetting Transformer, flash-linear-attention's
``parallel_attn(q, k, v, g)``): forward and backward in the sm90 kernels' scores (head dims up to 128
for the backward), everything else on the unchanged kernels through an augmented problem.

With ``g`` the log forget gates (<= 0) of every key position and query head and ``G = cumsum(g)``
along each sequence, the score of query ``i`` and key ``j`` is ``q_i . k_j * scale + G_i - G_j``
(``G_i`` read at the query's position in the key sequence, ``i + seqlen_k - seqlen_q``; 0 before
the first key). ``G_i`` is the same for a whole row, so the softmax, and the output, see only
``-G_j``: a bias per key, taken as ``-G_j / scale`` in the scores' units before the softmax scale
(fp32), so that a zero gate leaves every score as the plain call's. On Hopper the forward kernel adds
it to each score (``IN_KERNEL``: ``FwdSm90.forward_with_gate``, the bias loaded by TMA beside each K
block), and the backward kernel to each recomputed score, taking dG's sums from its dS
(``BwdSm90.backward_with_gate``, ``kernels/sm90/bwd_gate.py``; k and v as given, 16-bit dK).
Otherwise (sm80, torch.compile, the wide backward) this module puts it into the QK^T product itself
(the augmented problem): q gets three more columns of ones and k three more columns holding the bias
split into three bf16 parts (hi, mid, lo: 24 significant bits together, fp32's precision, where one
bf16 value would be off by units at ``|G| ~ 1000``), at the call's ``softmax_scale``. The kernels
then compute ``(q . k - G_j / scale) * scale`` in their fp32 accumulators; the returned LSE gets
``G_i`` added back. No N x N bias is built.

Gradients: the three columns' dK are each ``scale`` times the column sum of dS (the kernels' dK GEMM
with q's columns of ones), so ``dG_j = -sum_i dS_ij`` (the row sums ``sum_j dS_ij`` are zero for a softmax,
which is why ``G_i`` carries no gradient), and ``dg = reverse cumsum(dG)`` per sequence via
``torch.cumsum``'s own backward (where the scan kernel built G: after the in-kernel backward one more CuTe DSL call,
``backends/gate_scan.scan_gradient``, else ``_scan_gradient``). Two things keep dg
accurate through that reverse cumsum (measured on an H100 before each: dg 1.2-4x PyTorch's bf16 error over
1k keys):
- The column sums are not rounded to bf16: ``GatedAttnFunc`` asks the backward for dK in fp32
  (``dk_fp32``: the kernels' GQA route, fp32 sums in scratch).
- The row sums are taken, not assumed zero: the kernels' ``dPsum = rowsum(dO * O)`` reads the
  bf16-rounded O, so their dS rows sum to ``-delta_i`` (that rounding), not 0, and the column sums
  carry the same errors; dropped, they pile up in the cumsum. A fourth column pair (0 in q, 1 in k:
  no change to any score) makes dQ's last column the row sums ``sum_j dS_ij`` (small: bf16 holds
  them well), the gradient of ``G_i``, so ``dG = rowsum - colsum`` sums to zero as PyTorch's and
  FLA's do (issue 24's formula).

Cost of the augmented problem: q/k head dims grow by 4 (64 -> 68 runs on the 96-wide rows with v at
64; 128 -> 132 on 192 with v at 128): about 25 % more work than plain attention; k and v are expanded
to one head per query head (a gate per query head). The in-kernel forward and backward run at the
plain kernels' width on k and v as given (one add per score; the backward's dG sums: perf/NOTES.md,
session 22). bf16 inputs only (fp16's range cannot hold ``G`` of long sequences),
q/k head dims up to 252, no softcap (the bias must not pass through tanh). A learnable sink joins
after the kernels' forward, as in ``sinks.py``, on the gated LSE (``GatedAttnFunc``).
"""

from __future__ import annotations

from typing import Any

import torch

from .packed import sequence_of_rows
from .sinks import join_sink, sink_gradient

_PARTS = 3  # bf16 pieces of -G per key: 3 x 8 significant bits


def cumulative(log_decay: torch.Tensor, cu_seqlens_k: torch.Tensor | None) -> torch.Tensor:
    """``G = cumsum(g)`` in fp32 along the sequence axis, restarting at each sequence (varlen:
    ``log_decay`` ``(total_k, nheads)``; dense ``(batch, seqlen_k, nheads)``)."""
    # The scans run along the last axis (PyTorch's scan over an outer axis of (b, s, h) took 0.29 ms
    # at 16k tokens x 32 heads on an H100, about the forward kernel's time).
    if cu_seqlens_k is None:
        return torch.cumsum(log_decay.float().transpose(1, 2), dim=-1).transpose(1, 2)
    # Varlen: one scan over all packed rows, each sequence's start subtracted; in fp64, so that a long
    # pack's running total (|G| summed over sequences) costs no fp32 digits of a sequence's own G.
    # scan[:, r + 1] sums rows <= r (scan[:, 0] = 0); first[r] is the first row of r's sequence (a running
    # max of the sequences' start rows; rows past cu_seqlens[-1] are the last sequence's): 9 small ops
    # where a searchsorted route took ~17 (each ~10-20 us of host time).
    total = log_decay.shape[0]
    scan = torch.nn.functional.pad(torch.cumsum(log_decay.t(), dim=-1, dtype=torch.float64), (1, 0))
    starts = cu_seqlens_k[:-1].long().clamp(0, total)  # (offsets past the packed rows: no device-side assert)
    marks = torch.zeros(total + 1, dtype=torch.int64, device=log_decay.device)
    marks[starts] = starts  # (empty sequences share a start: the same value written twice)
    first = torch.cummax(marks[:total], dim=0).values
    return (scan[:, 1:] - scan[:, first]).t().float()


def _parts(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` as ``_PARTS`` bf16 values (a new last axis): each the rest of the ones before, rounded."""
    parts, rest = [], x.float()
    for _ in range(_PARTS):
        part = rest.to(torch.bfloat16)
        parts.append(part)
        rest = rest - part.float()
    return torch.stack(parts, dim=-1)


class _SplitBf16(torch.autograd.Function):
    """fp32 ``x`` as ``_PARTS`` bf16 values summing to it to ~24 bits (a new last axis). Backward:
    the gradient of their sum, taken from the first part's gradient in fp32 (the parts enter the
    scores with equal weights, so their gradients are equal; letting autograd differentiate the
    rounding residuals would add bf16-rounded noise instead of zero)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.x_dtype = x.dtype
        return _parts(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad[..., 0].to(ctx.x_dtype)


def split_bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``_PARTS`` bf16 parts summing to it to fp32's precision; differentiable (``_SplitBf16``)."""
    return _SplitBf16.apply(x)


def at_queries(G: torch.Tensor, seqlen_q: int) -> torch.Tensor:
    """Dense ``G`` ``(b, s_k, h)`` at each query's key position ``i + s_k - s_q`` (0 before the first
    key): ``(b, s_q, h)``."""
    seqlen_k = G.shape[1]
    if seqlen_k == 0:
        return G.new_zeros(G.shape[0], seqlen_q, G.shape[2])
    if seqlen_k == seqlen_q:  # (self-attention: each query sits at its own key position)
        return G
    pos = torch.arange(seqlen_q, device=G.device) + (seqlen_k - seqlen_q)
    picked = G[:, pos.clamp(min=0, max=max(seqlen_k - 1, 0))]
    return torch.where((pos >= 0)[None, :, None], picked, torch.zeros_like(picked))


def at_queries_varlen(G: torch.Tensor, total_q: int, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                      seqused_q: torch.Tensor | None, seqused_k: torch.Tensor | None) -> torch.Tensor:
    """Varlen ``G`` ``(total_k, h)`` at each packed query's key position (per sequence, of its used
    lengths; 0 before the first key and past ``seqused``): ``(total_q, h)``."""
    if cu_seqlens_q.shape[0] <= 1:  # no sequence: every row is padding, G_i = 0 (its LSE row is never read)
        return G.new_zeros(total_q, G.shape[1])
    cu_q, cu_k = cu_seqlens_q.to(torch.int64), cu_seqlens_k.to(torch.int64)
    rows = torch.arange(total_q, device=G.device)
    seq = sequence_of_rows(cu_seqlens_q, total_q)
    len_q = (seqused_q.to(torch.int64) if seqused_q is not None else cu_q[1:] - cu_q[:-1])[seq]
    len_k = (seqused_k.to(torch.int64) if seqused_k is not None else cu_k[1:] - cu_k[:-1])[seq]
    pos = rows - cu_q[seq] + len_k - len_q
    valid = (pos >= 0) & (pos < len_k)
    picked = G[(cu_k[seq] + pos).clamp(min=0, max=max(G.shape[0] - 1, 0))]
    return torch.where(valid[:, None], picked, torch.zeros_like(picked))


def scaled_q(q: torch.Tensor, scale: float) -> torch.Tensor:
    """q pre-scaled, with ``_PARTS`` columns of ones and one of zeros (the row-sum column)."""
    return _q_columns(q * scale)  # (q * scale computed in fp32, rounded once)


def _q_columns(q: torch.Tensor) -> torch.Tensor:
    """``q`` with ``_PARTS`` columns of ones and one of zeros appended (written into one new buffer:
    torch.cat of the narrow columns took twice a copy's time on an H100)."""
    d = q.shape[-1]
    q_aug = q.new_empty(*q.shape[:-1], d + _PARTS + 1)
    q_aug[..., :d] = q
    q_aug[..., d: d + _PARTS] = 1
    q_aug[..., d + _PARTS] = 0
    return q_aug


def _per_query_head(t: torch.Tensor, group: int, head_axis: int) -> torch.Tensor:
    """k or v expanded to one head per query head (``G`` has one value per query head)."""
    return t.repeat_interleave(group, dim=head_axis) if group > 1 else t


def _group_sum(grad: torch.Tensor, group: int, head_axis: int, dtype: torch.dtype) -> torch.Tensor:
    """The expanded heads' gradients summed per kv head in fp32, then in ``dtype``."""
    if group == 1:
        return grad.to(dtype)
    shape = grad.shape
    grouped = grad.float().reshape(*shape[:head_axis], shape[head_axis] // group, group, *shape[head_axis + 1:])
    return grouped.sum(head_axis + 1).to(dtype)


def _k_columns(k: torch.Tensor, neg_G: torch.Tensor) -> torch.Tensor:
    """k with ``-G``'s bf16 parts and a column of ones (the row-sum column) appended."""
    ones = torch.ones(*k.shape[:-1], 1, dtype=k.dtype, device=k.device)
    return torch.cat([k, _parts(neg_G).to(k.dtype), ones], dim=-1)


def augment(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, G: torch.Tensor, scale: float, head_axis: int):
    """``(q', k', v')``: ``expand``'s tensors with ``-G``'s parts as k's last columns; differentiable
    by autograd throughout (the reference construction: the CPU tests run the definition through it)."""
    group = q.shape[head_axis] // k.shape[head_axis]
    k, v = _per_query_head(k, group, head_axis), _per_query_head(v, group, head_axis)
    ones = torch.ones(*k.shape[:-1], 1, dtype=k.dtype, device=k.device)
    return scaled_q(q, scale), torch.cat([k, split_bf16(-G).to(k.dtype), ones], dim=-1), v


def _fwd_op(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward op (a seam: the CPU tests put the fp32 reference here)."""
    return torch.ops.flashattn_hopper.fwd(*args)


# The bias -G_j inside the sm90 forward kernel (kernels/sm90/fwd.py ``has_gate``: one add per score,
# k and v neither expanded nor widened); the backward stays on the augmented problem. False: the
# forward runs the augmented problem too (the sm80 backend always does).
IN_KERNEL = True


def _key_bias(G: torch.Tensor, scale: float) -> torch.Tensor:
    """The keys' bias ``-G_j / softmax_scale`` in the scores' units before the scale, fp32 (division by
    ``-scale``: ``(-G) / scale`` bit for bit)."""
    return G.float() / -scale


def _kernel_rows(G: torch.Tensor, scale: float, varlen: bool) -> torch.Tensor:
    """``_key_bias`` of ``G`` ``(b, s_k, h)`` | ``(total_k, h)`` in the kernels' layout, ``(b, h, s_k)`` |
    ``(h, total_k)``, rows 16-byte aligned (the sm90 forward reads them by TMA): one division written
    straight into those rows (was a negation, a division and a copy), made once per call and kept for
    the backward."""
    rows = G.t() if varlen else G.transpose(1, 2)
    n = rows.shape[-1]
    out = torch.empty(*rows.shape[:-1], -(-n // 4) * 4, dtype=torch.float32, device=G.device)[..., :n]
    return torch.div(rows.float(), -scale, out=out)


def _in_kernel_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, G: torch.Tensor, scale: float,
                       route: tuple[Any, ...] | None, scanned: tuple[torch.Tensor, Any] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(out, lse less G_i, the bias rows)`` from the sm90 forward with the keys' bias (``_key_bias``:
    ``-G_j / softmax_scale``; its rows in the kernels' layout, ``_kernel_rows``, are returned for the
    backward) added in the kernel: with a zero gate, the plain forward's scores bit for bit. None where
    that path does not serve the call (``route`` None, or another forward family). ``scanned``: the bias rows and
    K's slice (or None) the scan kernel built, and the ``ScannedPlan`` that launches the forward with them."""
    if route is None or not hasattr(route[0], "forward_with_gate"):
        return None
    family, _, p, varlen = route
    if scanned is not None:
        bias_rows, k_slice, plan = scanned
        return (*plan.launch(q, k, v, bias_rows, k_slice), bias_rows)
    bias_rows = _kernel_rows(G, scale, varlen is not None)
    return (*family.forward_with_gate(q, k, v, p, varlen, bias_rows), bias_rows)


def _in_kernel_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, bias_rows: torch.Tensor, route: tuple[Any, ...] | None,
                        options: tuple[Any, ...], rows_dpsum: bool = False) -> tuple[torch.Tensor, ...] | None:
    """``(dq, dk, dv, d(-G), dG_q, rowsum(dout * out) or None)`` from the sm90 backward with the keys'
    bias (``bias_rows``: ``_kernel_rows``) in its scores and dG's sums from its dS
    (``BwdSm90.backward_with_gate``); dk and dv summed per kv head by the kernels; the last entry only
    with ``rows_dpsum`` on a dense call. None where that path does not serve the call (the forward's
    ``route`` None, another family, head dims over 128)."""
    if route is None or not hasattr(route[1], "backward_with_gate") or not route[1].can_gate(route[2]):
        return None
    _, family, p, varlen = route
    dq, dk, dv, key_sums, query_sums, *rows = family.backward_with_gate(
        dout, q, k, v, out, lse, p, varlen, options[5], bias_rows, rows_dpsum=rows_dpsum and varlen is None
    )
    if varlen is not None:  # back to the gate's (total, h) layouts
        return dq, dk, dv, key_sums.t(), query_sums.t(), None
    return dq, dk, dv, key_sums.transpose(1, 2), query_sums.transpose(1, 2), (rows[0] if rows else None)


def _bwd_op(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward op, called with ``dk_fp32`` (a seam: the CPU tests emulate the kernels here)."""
    return torch.ops.flashattn_hopper.bwd(*args)


class GatedAttnFunc(torch.autograd.Function):
    """``(out, lse)`` of gated attention from q, k, v, ``G`` at the keys and at the queries
    (``G_q``: dense ``(b, s_q, h)``, varlen ``(total_q, h)``; only the LSE reads it), at the call's
    ``softmax_scale`` (``options[0]``), the keys' bias taken as ``-G_j / softmax_scale`` in the scores'
    units. Forward: the sm90 kernel with that bias (``IN_KERNEL``), else the augmented problem: q's
    columns of ones (``_q_columns``), k and v expanded to q's heads, the bias's parts and the row-sum
    column appended to k. Backward: after an in-kernel forward the sm90 kernel with the bias
    (``_in_kernel_backward``) where it serves the call; else the augmented problem: dq', dk, dv from the kernels
    (dk in fp32), the expanded heads summed per kv head in fp32; ``d(-G)`` dK's gate column and
    ``dG_q`` dQ's row-sum column (the rows' sums of dS), both over ``softmax_scale`` (the kernels'
    dQ and dK carry it); dq dQ's first columns. ``scanned`` (``scanned_gate``'s ``ScannedPlan``):
    ``G`` is then the dense log gates ``g`` themselves and ``G_q`` None: the scan kernel builds G, the bias rows and
    K's slice in the forward, and the backward returns g's gradient (``gate_scan.scan_gradient`` from the in-kernel
    backward's sums, else ``_scan_gradient``), so that a call pays for one autograd node, not two. ``want_lse``
    False (a caller that drops the LSE; no sink): no ``G_i`` add, the second output None."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, G: torch.Tensor,
                G_q: torch.Tensor, sink: torch.Tensor | None, cu_q: torch.Tensor | None,
                cu_k: torch.Tensor | None, used_q: torch.Tensor | None, used_k: torch.Tensor | None,
                options: tuple[Any, ...], scanned: ScannedPlan | None = None, want_lse: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        varlen = cu_q is not None
        head_axis = 1 if varlen else 2
        group = q.shape[head_axis] // k.shape[head_axis]
        from . import ops

        ctx.scan_dtype = None
        G_keys = None
        if scanned is not None:  # (a ScannedPlan: G is g, scanned here; the backward returns g's gradient)
            from .backends import gate_scan

            ctx.scan_dtype, ctx.scan_arch, route = G.dtype, scanned.arch, scanned.route
            if varlen:  # (packed self-attention: G's rows (h, total) are the LSE's layout too)
                G_keys, bias_rows, k_slice, ctx.chunk_seq = gate_scan.scan_varlen(
                    G, cu_k, options[0], scanned.slice_dtype, scanned.arch)
                G = G_keys.t()
            else:
                G_keys, bias_rows, k_slice = gate_scan.scan(G, options[0], scanned.slice_dtype, scanned.arch)
                G = G_keys.transpose(1, 2)
            in_kernel = _in_kernel_forward(q, k, v, G, options[0], route, (bias_rows, k_slice, scanned))
        else:
            route = ops.eager_route(q, k, v, cu_q, cu_k, used_q, used_k, options) if IN_KERNEL else None
            in_kernel = _in_kernel_forward(q, k, v, G, options[0], route)
        bias_rows = None
        if in_kernel is not None:
            out, lse, bias_rows = in_kernel
            q_saved, k_saved, v_saved = q, k, v  # (augmented for the backward there)
        else:
            q_saved = q_aug = _q_columns(q)
            k_saved = _k_columns(_per_query_head(k, group, head_axis), _key_bias(G, options[0]))
            v_saved = _per_query_head(v, group, head_axis)
            out, lse = _fwd_op(q_aug, k_saved, v_saved, cu_q, cu_k, used_q, used_k, *options)
        lse_full = None
        if want_lse or sink is not None:  # (the caller drops the LSE otherwise: no add, ~3 us of GPU at 1k)
            if G_keys is not None:
                G_rows = G_keys if varlen else _rows_at_queries(G_keys, q.shape[1])
            else:
                G_rows = G_q.t() if varlen else G_q.transpose(1, 2)  # (lse's layout)
            lse_full = lse + G_rows
            if sink is not None:
                # The sink's logit joins each row's denominator (sinks.py's math, on the gated LSE: the
                # keys' scores carry G_i, the sink does not); the kernels' backward then gets the sinked
                # out and the sinked LSE less G_i, so it recomputes the sinked probabilities.
                lse_full, out = join_sink(out, lse_full, sink, q, cu_q, used_q)
                lse = lse_full - G_rows
            ctx.mark_non_differentiable(lse_full)
        ctx.save_for_backward(q_saved, k_saved, v_saved, out, lse, cu_q, cu_k, used_q, used_k, sink, lse_full,
                              bias_rows)
        ctx.options, ctx.group, ctx.head_axis, ctx.route = options, group, head_axis, route
        ctx.set_materialize_grads(False)
        return out, lse_full

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple[Any, ...]:
        grads = GatedAttnFunc._backward(ctx, dout)  # (and None for want_lse: 13 inputs at most)
        if ctx.scan_dtype is None or grads[3] is None or grads[4] is None:  # (no g, or g's gradient already)
            return (*grads, None)
        if getattr(ctx, "chunk_seq", None) is not None:  # (scanned_gate packs only where the in-kernel one serves)
            raise RuntimeError("a packed scanned gate call must take the in-kernel backward")
        return (*grads[:3], _scan_gradient(grads[3], grads[4], ctx.scan_dtype), None, *grads[5:], None)

    @staticmethod
    def _backward(ctx: Any, dout: torch.Tensor | None) -> tuple[Any, ...]:
        """The gradients of the inputs, G's and G_q's (``backward`` turns them into g's after a scanned forward)."""
        q_aug, k_aug, v, out, lse, cu_q, cu_k, used_q, used_k, sink, lse_full, bias_rows = ctx.saved_tensors
        if dout is None:
            return (None,) * 12
        if bias_rows is not None:
            # The forward ran the gate in the kernel: so does the backward where it can (k and v as
            # given: q_aug, k_aug, v are the call's tensors here); a sink's gradient then reads the
            # preprocess's rowsum(dout * out) (dense).
            grads = _in_kernel_backward(dout, q_aug, k_aug, v, out, lse, bias_rows, ctx.route, ctx.options,
                                        rows_dpsum=sink is not None)
            if grads is not None:
                dq, dk, dv, d_neg_G, d_G_q, rows = grads
                dsink = None if sink is None else sink_gradient(dout, out, sink, lse_full, q_aug, cu_q, used_q, rows)
                if ctx.scan_dtype is not None:  # (a scanned call: g's gradient straight from the kernel's sums)
                    from .backends import gate_scan

                    if cu_q is not None:  # (packed self-attention: the sums' rows (h, total))
                        dg = gate_scan.scan_gradient_varlen(d_neg_G.t(), d_G_q.t(), cu_k, ctx.chunk_seq,
                                                            ctx.scan_dtype, ctx.scan_arch)
                    else:
                        dg = gate_scan.scan_gradient(d_neg_G.transpose(1, 2), d_G_q.transpose(1, 2), ctx.scan_dtype,
                                                     ctx.scan_arch)
                    return dq, dk, dv, dg, None, dsink, None, None, None, None, None, None
                return dq, dk, dv, -d_neg_G, d_G_q, dsink, None, None, None, None, None, None
        dsink = None if sink is None else sink_gradient(dout, out, sink, lse_full, q_aug, cu_q, used_q)
        if bias_rows is not None:  # else the augmented problem, built here
            key_bias = bias_rows.t() if cu_q is not None else bias_rows.transpose(1, 2)
            q_aug = _q_columns(q_aug)
            k_aug = _k_columns(_per_query_head(k_aug, ctx.group, ctx.head_axis), key_bias)
            v = _per_query_head(v, ctx.group, ctx.head_axis)
        dq, dk32, dv = _bwd_op(dout, q_aug, k_aug, v, out, lse, cu_q, cu_k, used_q, used_k, *ctx.options, True)
        d = k_aug.shape[-1] - _PARTS - 1
        # Each part's column holds the same column sum of dS (times the scale, as all of dK): one of
        # them is d(-G / scale). The row sums (dQ's last column, times the scale) are over the keys
        # only, which is G_i's gradient with a sink too.
        scale = ctx.options[0]
        d_G, d_G_q = dk32[..., d] / -scale, dq[..., d + _PARTS].float() / scale
        dk = _group_sum(dk32[..., :d], ctx.group, ctx.head_axis, k_aug.dtype)
        dv = _group_sum(dv, ctx.group, ctx.head_axis, v.dtype)
        return dq[..., :d], dk, dv, d_G, d_G_q, dsink, None, None, None, None, None, None


# Dense eager calls the sm90 forward serves build G, the bias rows and K's slice with one CuTe DSL call
# (backends/gate_scan.py: chunk sums, then the scan) instead of torch's scan, a transposing copy, a division and the
# slice build, up to SCAN_KERNEL_MAX_SEQLEN keys (each CTA reads every earlier chunk's sums, seqlen / 256 loads per
# lane: measured to 16k) and batch 65535 (its grid's y); inside ``GatedAttnFunc`` (``scanned``), whose backward
# then returns g's gradient (the reverse cumsum of dG: ``gate_scan.scan_gradient``'s kernel after the in-kernel
# backward, torch's flips and scan in ``_scan_gradient`` after the augmented one). On the
# H100 node (perf/NOTES.md session 37): gated forward / FLA 1.65 -> 1.94 at hdim 128 1k, 1.83 -> 1.99 at hdim 64 1k,
# +2 to +4 % at 4k-16k; the backward unchanged. The kernel sums G in fp64, torch's scan in fp32: the two routes'
# out and lse differ by that rounding. False: torch's ops everywhere.
SCAN_KERNEL = True
SCAN_KERNEL_MAX_SEQLEN = 16384
# Packed self-attention (one cu_seqlens for queries and keys, no seqused) by the kernels' varlen mode, G restarting at
# each sequence (``backends/gate_scan.scan_varlen``, ``scan_gradient_varlen``), up to 2M packed keys (the grid's z)
# and only where the in-kernel backward serves the call (its sums feed the gradient scan): instead of
# ``cumulative``'s fp64 torch ops and their autograd. H100 (perf/NOTES.md session 39, 16k packed tokens of 1k / 4k /
# 16k sequences, causal fwd+bwd): hdim 64 2324 -> 1489 / 3558 -> 2437 / 9379 -> 8415 us, hdim 128 2213 -> 1509 /
# 3018 -> 2020 / 7940 -> 7009 us.
SCAN_KERNEL_VARLEN = True


def _rows_at_queries(G_rows: torch.Tensor, seqlen_q: int) -> torch.Tensor:
    """``at_queries`` on dense G rows ``(b, h, s_k)``: ``(b, h, s_q)``, the queries at the last ``s_q`` key positions
    (0 before the first key)."""
    seqlen_k = G_rows.shape[-1]
    if seqlen_q == seqlen_k:
        return G_rows
    if seqlen_q < seqlen_k:
        return G_rows[..., seqlen_k - seqlen_q:]
    return torch.nn.functional.pad(G_rows, (seqlen_q - seqlen_k, 0))


def _scan_gradient(dG: torch.Tensor, dG_q: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The gradient of dense ``g`` ``(b, s_k, h)`` (``dtype``) where ``G = cumsum(g)`` was read at the keys (``dG``)
    and at the queries (``dG_q`` ``(b, s_q, h)``, ``_rows_at_queries``'s positions): the reverse cumsum of their sum
    in fp32, along the rows' last axis as torch.cumsum's own backward of ``cumulative`` (PyTorch's scan over the
    outer axis of (b, s, h) is up to 70x slower, perf/NOTES.md session 37)."""
    total = dG.float()
    if dG_q is not None:
        seqlen_k, seqlen_q = total.shape[1], dG_q.shape[1]
        if seqlen_q == seqlen_k:
            total = total + dG_q
        else:
            total = total.clone()
            if seqlen_q < seqlen_k:
                total[:, seqlen_k - seqlen_q:] += dG_q
            else:
                total += dG_q[:, seqlen_q - seqlen_k:]
    rows = total.transpose(1, 2)
    return rows.flip(-1).cumsum(-1).flip(-1).transpose(1, 2).to(dtype)


class ScannedPlan:
    """How a gated call runs on the scan route, worked out once per call signature (``api``'s plans keep it;
    ``scanned_gate`` builds it): the route (``ops.eager_route``'s), the scan's variant (``slice_dtype``: K's k16 slice
    built too, in q's dtype, or None; ``arch``) and the sm90 forward's kept gated plan (``FwdSm90.gate_plan``;
    None where the kernel takes the inputs padded). Packed self-attention (``SCAN_KERNEL_VARLEN``; ``packed``: the
    call's ``(max_seqlen_q, max_seqlen_k)``, else None): the forward's key (``fwd_key``), the route's ``VarlenArgs``
    made per call around its cu_seqlens (``bound``). A plan holds no tensor (a CUDA graph that captured a call must
    not read one that an evicted plan frees)."""

    __slots__ = ("route", "options", "slice_dtype", "arch", "fwd_plan", "fwd_key", "packed")

    def __init__(self, q: torch.Tensor, route: tuple[Any, ...], options: tuple[Any, ...]) -> None:
        family, bwd_family, p, varlen = route
        self.route, self.options, self.fwd_plan, self.fwd_key, self.packed = route, options, None, None, None
        if varlen is None:
            self.slice_dtype, self.arch = family.gate_scan_args(p)
            self.fwd_plan = family.kept_gate_plan(q, p)
        else:
            from .backends.sm90_fwd import gate_slice_dtype

            self.fwd_key = family.gate_key(p, varlen)
            self.slice_dtype, self.arch = gate_slice_dtype(self.fwd_key), self.fwd_key.arch
            self.fwd_plan = family.kept_gate_plan(q, p, self.fwd_key)
            self.route, self.packed = (family, bwd_family, p, None), (varlen.max_seqlen_q, varlen.max_seqlen_k)

    def bound(self, cu_seqlens: torch.Tensor) -> ScannedPlan:
        """A packed plan's copy for one call: its route's ``VarlenArgs`` hold the call's ``cu_seqlens`` (queries and
        keys alike, no seqused)."""
        from .backends.common import VarlenArgs

        plan = ScannedPlan.__new__(ScannedPlan)
        family, bwd_family, p, _ = self.route
        plan.route = (family, bwd_family, p, VarlenArgs(cu_seqlens, cu_seqlens, None, None, *self.packed))
        plan.options, plan.slice_dtype, plan.arch, plan.fwd_plan, plan.fwd_key, plan.packed = (
            self.options, self.slice_dtype, self.arch, self.fwd_plan, self.fwd_key, self.packed)
        return plan

    def launch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias_rows: torch.Tensor,
               k_slice: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse less G_i)`` of the gated forward on the scan's bias rows and K's slice (the kept plan; else,
        or where TVM-FFI turns the inputs' strides down, ``forward_with_gate``'s general launch)."""
        family, _, p, varlen = self.route
        if self.fwd_plan is not None:
            try:
                gate = bias_rows if k_slice is None else k_slice
                if varlen is None:
                    return self.fwd_plan(q, k, v, gate, bias_rows)
                return self.fwd_plan(q, k, v, gate, varlen.cu_seqlens_k, bias_rows, varlen.max_seqlen_k)
            except (ValueError, TypeError):
                pass
        return family.forward_with_gate(q, k, v, p, varlen, bias_rows, k_slice, self.fwd_key)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                 sink: torch.Tensor | None = None, want_lse: bool = True, cu_seqlens: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(out, lse)`` of the call (autograd through ``GatedAttnFunc``; lse None unless ``want_lse`` or a sink);
        ``cu_seqlens``: a packed plan's call's."""
        plan = self if self.packed is None else self.bound(cu_seqlens)
        return GatedAttnFunc.apply(q, k, v, log_decay, None, sink, cu_seqlens, cu_seqlens, None, None, self.options,
                                   plan, want_lse)


def scanned_gate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                 options: tuple[Any, ...], cu_seqlens: torch.Tensor | None = None,
                 max_seqlen: Any = None) -> ScannedPlan | None:
    """The ``ScannedPlan`` of a dense call where the sm90 forward runs the gate in its kernel, or (``cu_seqlens``,
    ``SCAN_KERNEL_VARLEN``) of packed self-attention where the sm90 backward does too and the call's ``max_seqlen``
    (an int) is at most ``SCAN_KERNEL_MAX_SEQLEN``; None elsewhere (torch.compile, CPU, sm80, long or unbounded
    sequences, ``SCAN_KERNEL`` off, a route the kernels do not take)."""
    if not (SCAN_KERNEL and IN_KERNEL and log_decay.is_cuda) or torch.compiler.is_compiling():
        return None
    if cu_seqlens is None and (log_decay.shape[1] > SCAN_KERNEL_MAX_SEQLEN or log_decay.shape[0] > 65535):
        return None
    if cu_seqlens is not None and (not SCAN_KERNEL_VARLEN or log_decay.shape[0] > 65535 * 32
                                   or type(max_seqlen) is not int or max_seqlen > SCAN_KERNEL_MAX_SEQLEN):
        return None  # (each CTA sums its sequence's earlier chunk records: bounded lengths, as dense calls)
    from . import ops

    route = ops.eager_route(q, k, v, cu_seqlens, cu_seqlens, None, None, options)
    if route is None or not hasattr(route[0], "gate_scan_args"):
        return None
    if cu_seqlens is not None:
        if not (hasattr(route[1], "backward_with_gate") and route[1].can_gate(route[2])):
            return None  # (the gradient scan reads the in-kernel backward's sums)
        from .backends.common import VarlenArgs

        # (the caller's max length: the forward's key takes K's k16 slice from 1k keys, as dense calls')
        route = (*route[:3], VarlenArgs(cu_seqlens, cu_seqlens, None, None, max_seqlen, max_seqlen))
    return ScannedPlan(q, route, options)


def gate_options(scale: float, causal: bool, window: tuple[int, int], deterministic: bool,
                 backend: str | None) -> tuple[Any, ...]:
    """The ops' option tuple of a gated call (softcap 0: the gate takes none)."""
    return (float(scale), bool(causal), window[0], window[1], 0.0, bool(deterministic), backend)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
              varlen: tuple[Any, ...] | None, scale: float, causal: bool, window: tuple[int, int],
              deterministic: bool, backend: str | None,
              sink: torch.Tensor | None = None, max_seqlen_k: Any = None, want_lse: bool = True
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out, lse)`` of gated attention (``varlen``: ``(cu_q, cu_k, used_q, used_k)`` or None; ``max_seqlen_k``
    the caller's, read only to bound the varlen scan route), with a learnable sink per query head if ``sink`` is
    given; the ops run eagerly and under ``torch.compile`` alike. ``want_lse`` False: the scan route may return no
    LSE (``ScannedPlan``)."""
    cu_q, cu_k, used_q, used_k = varlen if varlen is not None else (None,) * 4
    options = gate_options(scale, causal, window, deterministic, backend)
    self_packed = varlen is not None and cu_q is cu_k and used_q is None and used_k is None and q.shape[0] == k.shape[0]
    scanned = None
    if varlen is None or self_packed:
        scanned = scanned_gate(q, k, v, log_decay, options, cu_k, max_seqlen_k)
    if scanned is not None:  # (g itself: the forward scans it)
        return scanned(q, k, v, log_decay, sink, want_lse, cu_k)
    G = cumulative(log_decay, cu_k)
    if varlen is None:
        G_q = at_queries(G, q.shape[1])
    elif self_packed:
        # Self-attention packing (one cu_seqlens for both): each query sits at its own key row, so
        # G_q is G (rows past cu_seqlens[-1] belong to no sequence and are never read); skips ~25
        # small torch ops (~0.4 ms of host time per call on an H200 node).
        G_q = G
    else:
        G_q = at_queries_varlen(G, q.shape[0], cu_q, cu_k, used_q, used_k)
    return GatedAttnFunc.apply(q, k, v, G, G_q, sink, cu_q, cu_k, used_q, used_k, options)
