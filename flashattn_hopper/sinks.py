"""Learnable attention sinks (``learnable_sink``, as FA4 names it; GPT-OSS): one logit per query head
that joins every row's softmax denominator with no value,
``p_ij = exp(s_ij) / (sum_j exp(s_ij) + exp(sink_h))``, computed around the unchanged kernels.

Forward: the kernels give ``O`` and ``lse`` of the keys alone; with ``lse' = logaddexp(lse, sink)``
the sink's share is ``exp(sink - lse')`` and every key's probability shrinks by
``w = exp(lse - lse') = sigmoid(lse - sink)``, so ``out = O * w`` (fp32, then the input dtype) and
the returned LSE is ``lse'``. A row that sees no key gets ``out = 0`` and ``lse' = sink``. On the
forward kernels the same math can run in their finalize instead (``IN_KERNEL``:
``FwdLauncher.forward_with_sink``, ``OnlineSoftmax.finalize``), with no pass over out.

Backward: softmax over the keys plus a sink column whose value is 0. The kernels' backward, given
``out`` and ``lse'``, recomputes ``P' = exp(S - lse')`` (the sinked probabilities), takes
``dPsum = rowsum(dout * out)`` (the sink column adds ``p_sink * 0``) and forms
``dS = P' * (dP - dPsum)``: exactly this softmax's gradient, so dq, dk, dv come from the unchanged
backward. The sink's own gradient is ``d sink_h = -sum_rows exp(sink_h - lse'_i) * dPsum_i``.

Both directions call the custom ops (``ops.py``), so the same code runs eagerly and under
``torch.compile``. Rows past ``seqused_q`` (varlen) take no part: their out is 0 here and they add
nothing to the sink's gradient. The returned LSE is not differentiable, as elsewhere.
"""

from __future__ import annotations

from typing import Any

import torch

from .packed import sequence_of_rows


def _fwd_op(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward op (a seam: the CPU tests put the fp32 reference here)."""
    return torch.ops.flashattn_hopper.fwd(*args)


def _bwd_op(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward op (a seam: the CPU tests put an emulation of the kernels' formula here)."""
    return torch.ops.flashattn_hopper.bwd(*args)


# The sink inside the forward kernels' finalize (kernels/common/softmax.py: no pass over out), both
# arches. On an H100 (session 19, perf/results/...-s19/bench_gate_sink_k.md) it ran the hdim-64 causal
# forward at 319/443 TFLOP/s (1k/4k) against 175/363 for the join after the kernel and 336/456 for no
# sink at all. False keeps the join after the kernel (tests and benchmarks compare the two).
IN_KERNEL = True
# The in-kernel sink even where its key gives up the plain key's packing of GQA heads (tests only: the
# join after the packed kernel is the faster route there, ``FwdLauncher.forward_with_sink``).
IN_KERNEL_UNPACKED = False


def _in_kernel_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor,
                       route: tuple[Any, ...] | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(out, lse')`` from the forward kernel with the sink in its finalize, or None where that path
    does not serve the call (switched off, no ``route`` (``ops.eager_route``: CPU tensors, traced by
    torch.compile, empty), or a call whose plain kernel packs GQA heads or spans heads with its tiles)."""
    if route is None or not IN_KERNEL:
        return None
    family, _, p, varlen = route
    return family.forward_with_sink(q, k, v, p, varlen, sink, even_unpacked=IN_KERNEL_UNPACKED)


def _row_mask(q: torch.Tensor, cu_seqlens_q: torch.Tensor, seqused_q: torch.Tensor) -> torch.Tensor:
    """Bool ``(total_q,)``: packed rows below their sequence's ``seqused_q``."""
    if cu_seqlens_q.shape[0] <= 1:  # no sequence: every row is padding (and seqused_q is empty)
        return torch.zeros(q.shape[0], dtype=torch.bool, device=q.device)
    seq = sequence_of_rows(cu_seqlens_q, q.shape[0])
    rows = torch.arange(q.shape[0], device=q.device, dtype=torch.int64)
    return rows - cu_seqlens_q.to(torch.int64)[seq] < seqused_q.to(torch.int64)[seq]


def _per_row(x: torch.Tensor, varlen: bool) -> torch.Tensor:
    """An LSE-layout tensor (dense ``(b, h, s_q)``, varlen ``(h, total_q)``) in out's row layout
    (``(b, s_q, h, 1)`` / ``(total_q, h, 1)``)."""
    return (x.t() if varlen else x.transpose(1, 2))[..., None]


class SinkAttnFunc(torch.autograd.Function):
    """``(out, lse')`` of attention with one sink logit per query head; gradients for q, k, v, sink."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor,
                cu_q: torch.Tensor | None, cu_k: torch.Tensor | None, used_q: torch.Tensor | None,
                used_k: torch.Tensor | None, options: tuple[Any, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        from . import ops

        route = ops.eager_route(q, k, v, cu_q, cu_k, used_q, used_k, options)
        in_kernel = _in_kernel_forward(q, k, v, sink, route)
        if in_kernel is not None:
            out, lse_sink = in_kernel
        else:
            out, lse = _fwd_op(q, k, v, cu_q, cu_k, used_q, used_k, *options)
            lse_sink, out = join_sink(out, lse, sink, q, cu_q, used_q)
        ctx.save_for_backward(q, k, v, sink, out, lse_sink, cu_q, cu_k, used_q, used_k)
        ctx.options, ctx.route = options, route
        ctx.mark_non_differentiable(lse_sink)
        ctx.set_materialize_grads(False)
        return out, lse_sink

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple[Any, ...]:
        q, k, v, sink, out, lse_sink, cu_q, cu_k, used_q, used_k = ctx.saved_tensors
        if dout is None:
            return (None,) * 9
        route = ctx.route
        if route is not None and hasattr(route[1], "cached_plan"):
            # Eager: the backward family's plan for this problem, launched directly (the op validated,
            # dispatched and planned per call: ~600 of a sinked backward's ~785 us of host time). The
            # preprocess takes the sink's gradient beside its rowsum(dout * out) (kernels/common/bwd_pre.py
            # ``sink_grad``: torch's passes over the rows took ~17 us at 16k tokens; recomputing the rowsum
            # in fp32, as the varlen route did, read and wrote ~1 GB at 16k tokens x 2048).
            _, family, p, varlen = route
            plan = family.cached_plan(p, varlen, ctx.options[5], q.device, sink=True)
            grads = plan(dout.contiguous(), q, k, v, out, lse_sink, varlen, sink=sink)
            dq, dk, dv = (t.contiguous() for t in grads[:3])
            return dq, dk, dv, grads[3].to(sink.dtype), None, None, None, None, None
        dq, dk, dv = _bwd_op(dout, q, k, v, out, lse_sink, cu_q, cu_k, used_q, used_k, *ctx.options)
        dsink = sink_gradient(dout, out, sink, lse_sink, q, cu_q, used_q)
        return dq, dk, dv, dsink, None, None, None, None, None


def join_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor, q: torch.Tensor,
              cu_q: torch.Tensor | None, used_q: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lse', out')`` of the keys' ``(out, lse)`` with the sink joined: ``lse' = logaddexp(lse,
    sink)``, out scaled by ``exp(lse - lse')``; rows past ``seqused_q`` (``q``'s packed rows) 0.
    ``out`` is the op's own fresh tensor (scaled in place where it can be)."""
    varlen = cu_q is not None
    sink_rows = sink.float()[:, None] if varlen else sink.float()[None, :, None]  # lse's layout
    lse_sink = torch.logaddexp(lse, sink_rows)
    weight = _per_row(torch.exp(lse - lse_sink), varlen)
    if used_q is not None:  # (rows past seqused_q were never written: out may hold NaN there)
        return lse_sink, torch.where(_row_mask(q, cu_q, used_q)[:, None, None], out.float() * weight, 0.0).to(out.dtype)
    # One pass over out, in place: computed in fp32, rounded once; out.float() * w then .to() made
    # three passes (~0.2 ms at 16k tokens x 2048 on an H100).
    return lse_sink, out.mul_(weight)


def sink_gradient(dout: torch.Tensor, out: torch.Tensor, sink: torch.Tensor, lse_sink: torch.Tensor,
                  q: torch.Tensor, cu_q: torch.Tensor | None, used_q: torch.Tensor | None,
                  rows_dpsum: torch.Tensor | None = None) -> torch.Tensor:
    """``d sink_h = -sum_rows exp(sink_h - lse'_i) * rowsum(dout * out)_i`` over the rows below
    ``seqused_q`` (``out``: the sinked output, ``lse_sink``: the LSE with the sink). ``rows_dpsum``
    (dense): ``rowsum(dout * out)`` already taken, in the LSE's layout (the backward's preprocess)."""
    varlen = cu_q is not None
    # (a -inf sink on a row that sees no key: exp(-inf - -inf) is NaN; its share is 0, as the preprocess's)
    if rows_dpsum is not None:
        p_sink = torch.exp(sink.float()[None, :, None] - lse_sink).nan_to_num(0.0)  # (b, h, s_q)
        return (-(p_sink * rows_dpsum).sum((0, 2))).to(sink.dtype)
    dpsum = (dout.float() * out.float()).sum(-1)  # (b, s_q, h) / (total_q, h)
    sink_rows = sink.float()[None, :] if varlen else sink.float()[None, None, :]
    p_sink = torch.exp(sink_rows - _per_row(lse_sink, varlen)[..., 0]).nan_to_num(0.0)
    contrib = p_sink * dpsum
    if used_q is not None:
        contrib = torch.where(_row_mask(q, cu_q, used_q)[:, None], contrib, 0.0)
    return (-contrib.reshape(-1, contrib.shape[-1]).sum(0)).to(sink.dtype)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor, varlen: tuple[Any, ...] | None,
    softmax_scale: float | None, causal: bool, window: tuple[int, int], softcap: float, deterministic: bool,
    backend: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse')`` with sinks; ``window``: the checked ``(left, right)`` ints; ``varlen``: the four
    varlen tensors or None."""
    cu_q, cu_k, used_q, used_k = varlen if varlen is not None else (None, None, None, None)
    options = (None if softmax_scale is None else float(softmax_scale), bool(causal), window[0], window[1],
               float(softcap), bool(deterministic), backend)
    return SinkAttnFunc.apply(q, k, v, sink, cu_q, cu_k, used_q, used_k, options)
