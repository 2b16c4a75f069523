"""Public API: flash-attn-compatible attention functions and their autograd Functions.

Same names, layout and meaning as FlashAttention-3's ``flash_attn_interface``: ``(batch, seqlen,
nheads, headdim)`` (varlen: ``(total, nheads, headdim)``), GQA/MQA when ``nheads % nheads_k == 0``,
causal aligned to the bottom-right corner, ``window_size=(left, right)`` with -1/None unbounded,
LSE in fp32 natural log. Everything after ``q, k, v`` (and the varlen positionals) is keyword-only,
so flash-attn 2 code that passes ``dropout_p`` positionally fails loudly.
"""

from __future__ import annotations

from typing import Any

import torch

from . import chunk, configs, dispatch, fp8, gate, ops, sinks, validate
from .backends.common import FwdPlan, VarlenArgs, keys_contiguous_ready
from .env import settings
from .validate import AttnProblem

# Dense forward plans (backends.common.FwdPlan, or None where a call cannot have one) by call
# signature: shapes, dtypes and devices of q, k, v and the options. A cached call skips validation,
# dispatch and key building: everything they derive is a function of the signature, and TVM-FFI
# checks what it does not hold (strides, alignment) before launching.
_PLANS: dict[tuple[Any, ...], FwdPlan | None] = {}
_MAX_PLANS = 4096  # signatures kept (then the table starts over): shapes that vary call to call


def clear_plans() -> None:
    """Forget the cached call plans, the gated and sinked forwards' and the backward families' too (they hold no
    tensors, only the compiled functions' references)."""
    from .backends import common, sm80_bwd, sm90_fwd

    _PLANS.clear()
    sm80_bwd._PLAN_MEMO.clear()
    sm90_fwd._GATE_PLANS.clear()
    sm90_fwd._GATE_KEYS.clear()
    common._SINK_PLANS.clear()


def _fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: AttnProblem,
    backend: str | None,
    varlen: VarlenArgs | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    family = dispatch.fwd_kernel_for(q.device, backend, p)
    return family.forward(q, k, v, p, varlen, out=out, lse=lse)


class FlashAttnFunc(torch.autograd.Function):
    """Autograd for both entry points; ``varlen`` is None for the dense layout."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnProblem, backend: str | None,
                deterministic: bool, varlen: VarlenArgs | None) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = _fwd(q, k, v, p, backend, varlen)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # (no zero-filled dLSE allocated and passed per backward)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.problem, ctx.backend, ctx.deterministic, ctx.varlen = p, backend, deterministic, varlen
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if dout is None:
            return None, None, None, None, None, None, None
        q, k, v, out, lse = ctx.saved_tensors
        family = dispatch.bwd_kernel_for(q.device, ctx.backend, ctx.problem, ctx.deterministic)
        dq, dk, dv = family.backward(dout, q, k, v, out, lse, ctx.problem, ctx.varlen, ctx.deterministic)
        return dq, dk, dv, None, None, None, None


class PlannedAttnFunc(torch.autograd.Function):
    """Autograd of a call with a dense plan (``_PLANS``); its backward keeps a backward plan on the
    forward's (one per ``deterministic``)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: FwdPlan,
                deterministic: bool, varlen: VarlenArgs | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = plan(q, k, v) if varlen is None else plan(q, k, v, varlen)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # (no zero-filled dLSE allocated and passed per backward)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.deterministic, ctx.varlen = plan, deterministic, varlen
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if dout is None:
            return None, None, None, None, None, None
        q, k, v, out, lse = ctx.saved_tensors
        plan, deterministic, varlen = ctx.plan, ctx.deterministic, ctx.varlen
        bwd = plan.bwd.get(deterministic)
        if bwd is None:
            bwd = plan.bwd[deterministic] = _bwd_plan(plan, q.device, deterministic, varlen)
        dq, dk, dv = bwd(dout, q, k, v, out, lse, varlen)
        return dq, dk, dv, None, None, None


def _bwd_plan(plan: FwdPlan, device: torch.device, deterministic: bool, varlen: VarlenArgs | None = None) -> Any:
    """A callable ``(dout, q, k, v, out, lse, varlen) -> (dq, dk, dv)`` for a planned problem (``varlen``: a
    packed plan's first call's, whose given tensors the backward's keys follow; each call passes its own): the
    backward family's own plan where it has one, else its ``backward``."""
    p = plan.problem
    family = dispatch.bwd_kernel_for(device, plan.backend, p, deterministic)
    if hasattr(family, "plan"):
        return family.plan(p, varlen, deterministic, device)
    return lambda dout, q, k, v, out, lse, varlen: family.backward(dout, q, k, v, out, lse, p, varlen, deterministic)


def _planned(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, signature: tuple[Any, ...], deterministic: bool,
    log_decay: torch.Tensor | None = None, want_lse: bool = True, cu_seqlens: torch.Tensor | None = None,
    varlen: VarlenArgs | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The cached call of a signature that has a plan; None where it has none (yet) or where TVM-FFI
    turns the inputs down (strides or alignment the kernel cannot take: the general path copies them).
    A gated call's plan (``gate.ScannedPlan``; packed self-attention's with its ``cu_seqlens``) launches the scan
    and the forward itself, through autograd, and adds ``G_i`` to the LSE only where the caller returns it
    (``want_lse``). A plain varlen call's (``PackedFwdPlan``) takes the call's ``varlen``."""
    plan = _PLANS.get(signature)
    if plan is None:
        return None
    try:
        if log_decay is not None:
            # (the one check the signature does not hold: its kept forward plan would fall back to the general
            # launch on other strides, past the validation's error; cu_seqlens as the kernels read it)
            if (q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1
                    or cu_seqlens is not None and cu_seqlens.stride(0) != 1):
                return None
            return plan(q, k, v, log_decay, None, want_lse, cu_seqlens)
        if varlen is not None and any(t is not None and t.stride(0) != 1 for t in (
                varlen.cu_seqlens_q, varlen.cu_seqlens_k, varlen.seqused_q, varlen.seqused_k)):
            return None  # (the kernels read them contiguous: the general path makes them so)
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return PlannedAttnFunc.apply(q, k, v, plan, deterministic, varlen)
        return plan(q, k, v) if varlen is None else plan(q, k, v, varlen)
    except (ValueError, TypeError):
        return None


def _make_plan(q: torch.Tensor, p: AttnProblem, backend: str | None, signature: tuple[Any, ...],
               varlen: VarlenArgs | None = None) -> None:
    family = dispatch.fwd_kernel_for(q.device, backend, p)
    plan = family.plan(q, p, varlen=varlen) if hasattr(family, "plan") else None
    if plan is not None:
        plan.backend = backend
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[signature] = plan


def _make_gate_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                    softmax_scale: float | None, causal: bool, window_size: Any, deterministic: bool,
                    backend: str | None, signature: tuple[Any, ...], cu_seqlens: torch.Tensor | None = None,
                    max_seqlen: int | None = None) -> None:
    """Keep a validated gated call's ``gate.ScannedPlan`` (None where it takes another route) under its
    signature, dense or (``cu_seqlens``, ``max_seqlen``) packed self-attention: later calls skip validation, the
    route lookups and the key building (a gated call at 1k tokens was host-bound: ~160 us of Python for ~160 us of
    GPU time on an H100 node, a packed one ~300 us, perf/NOTES.md sessions 38 and 39)."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    options = gate.gate_options(scale, causal, validate.check_window(window_size, causal), deterministic, backend)
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[signature] = gate.scanned_gate(q, k, v, log_decay, options, cu_seqlens, max_seqlen)


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnProblem, backend: str | None, deterministic: bool,
    varlen: VarlenArgs | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Through autograd only when a gradient can be asked for (saves ~10 us per inference call)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return FlashAttnFunc.apply(q, k, v, p, backend, deterministic, varlen)
    return _fwd(q, k, v, p, backend, varlen)


def _autocast(*tensors: Any) -> tuple[Any, ...]:
    """fp32 inputs under ``torch.autocast("cuda")`` run in its dtype (the cast is differentiable:
    fp32 leaves get fp32 gradients). Unlike SDPA, 16-bit inputs are left as they are, so a dtype
    mismatch stays a validation error rather than a silent cast."""
    if not torch.is_autocast_enabled("cuda"):
        return tensors
    dtype = torch.get_autocast_dtype("cuda")
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t for t in tensors)


def _fp8_signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: dict[str, Any], softmax_scale: Any,
                   causal: Any, window_size: Any, softcap: Any, backend: Any) -> tuple[Any, ...] | None:
    """The ``_PLANS`` signature of a dense FP8 call whose options passed the fast path's type checks and
    whose only extras are descales, all per tensor (2-D tensors) or all per block (3-D), or None as if
    left out; else None."""
    if not set(extras).issubset(fp8.DESCALE_NAMES) or not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
        return None
    scales, dims = [], set()
    for name in fp8.DESCALE_NAMES:
        value = extras.get(name)
        if value is not None and (not isinstance(value, torch.Tensor) or value.dim() not in (2, 3)):
            return None
        scales.append(None if value is None else (value.shape, value.dtype, value.get_device()))
        dims |= set() if value is None else {value.dim()}
    if len(dims) > 1:  # (per tensor and per block mixed: the general path says what is wrong)
        return None
    if validate.keys_contiguous(v) and not keys_contiguous_ready(v):  # (the general path copies it to rows)
        return None
    return ("e4m3", q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.get_device(), k.get_device(),
            v.get_device(), validate.keys_contiguous(v), softmax_scale, causal, window_size, softcap, backend,
            settings().backend, *scales)


def _fp8_call(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: dict[str, Any], softmax_scale: Any, causal: Any,
    window_size: Any, softcap: Any, attention_chunk: Any, learnable_sink: Any, log_decay: Any, deterministic: Any,
    return_lse: Any, return_attn_probs: Any, backend: Any, varlen: tuple[Any, ...] | None = None,
    plain_options: bool = False,
) -> Any:
    """FP8 inputs (``fp8.py``): the plain forward only (under torch.compile as the ``fwd_fp8`` custom op);
    the options that need more say so. ``plain_options`` (dense calls whose options passed the fast
    path's type checks): a call with per-tensor or per-block descales is cached like a 16-bit call
    (``Fp8Plan``: no validation or key building; the descales assembled by one stack, or per block by a
    fill of ones and a copy per given descale where they do not stack)."""
    signature = None
    if plain_options and varlen is None:
        signature = _fp8_signature(q, k, v, extras, softmax_scale, causal, window_size, softcap, backend)
        plan = _PLANS.get(signature) if signature is not None else None
        if plan is not None and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
            try:
                out, lse = plan(q, k, v, tuple(extras.get(name) for name in fp8.DESCALE_NAMES))
                return (out, lse) if (return_lse or return_attn_probs) else out
            except (ValueError, TypeError):  # strides TVM-FFI turns down: the general path copies
                pass
    validate.check_common_options(
        softmax_scale, causal, window_size, softcap, deterministic, return_lse, return_attn_probs, backend
    )
    for name, value, off in (("attention_chunk", attention_chunk, 0), ("learnable_sink", learnable_sink, None),
                             ("log_decay", log_decay, None)):
        if value is not off and not (off == 0 and value == 0 and type(value) is int):
            raise NotImplementedError(f"{name} is not implemented for FP8 (float8_e4m3fn) inputs")
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v)):
        raise NotImplementedError("FP8 attention is a forward only: no gradient flows to q, k, v")
    if torch.compiler.is_compiling():  # one opaque graph node (ops.fwd_fp8)
        if validate.check_softcap(softcap) > 0.0:
            raise NotImplementedError("softcap is not implemented for FP8 inputs")
        out, lse = ops.attention_fp8(q, k, v, varlen, dict(extras), softmax_scale, causal, window_size, backend)
    else:
        out, lse = fp8.attention(q, k, v, dict(extras), softmax_scale, causal, window_size, softcap, backend, varlen)
        if signature is not None and signature not in _PLANS:
            p = validate.validate_dense(q, k, v, softmax_scale, causal, window_size, softcap, fp8=True)
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            block_scales = any(isinstance(d, torch.Tensor) and d.dim() == 3 for d in extras.values())
            _PLANS[signature] = dispatch.FWD_KERNELS["sm90"].plan_fp8(q, p, block_scales, validate.keys_contiguous(v))
    return (out, lse) if (return_lse or return_attn_probs) else out


def _plain_options(causal: Any, attention_chunk: Any, learnable_sink: Any, deterministic: Any, softcap: Any,
                   softmax_scale: Any, window_size: Any, return_lse: Any, return_attn_probs: Any, backend: Any) -> bool:
    """Whether a call's options may key a kept plan: plain types only (a bool and an int, or an int and a float,
    compare equal as dictionary keys, and the general path must see the others to reject them), no chunk, no
    sink, not traced by torch.compile."""
    return (
        (causal is False or causal is True) and type(attention_chunk) is int and attention_chunk == 0
        and learnable_sink is None and (deterministic is False or deterministic is True) and type(softcap) is float
        and (softmax_scale is None or type(softmax_scale) is float) and type(window_size) is tuple
        and len(window_size) == 2 and type(window_size[0]) is int and type(window_size[1]) is int
        and (return_lse is False or return_lse is True) and (return_attn_probs is False or return_attn_probs is True)
        and (backend is None or type(backend) is str) and not torch.compiler.is_compiling()
    )


def _packed_gate_signature(q: Any, k: Any, v: Any, cu_seqlens: Any, log_decay: Any, max_seqlen_q: int,
                           max_seqlen_k: int, softmax_scale: float | None, causal: bool, window_size: Any,
                           softcap: float, deterministic: bool, backend: str | None) -> tuple[Any, ...] | None:
    """The ``_PLANS`` signature of a gated call on packed self-attention (one cu_seqlens tensor for queries and
    keys, no seqused, int max lengths, plain options: the caller checked), None where an input is not a tensor.
    Its first entries are a dense signature's (q's dtype fourth: the autocast check reads it there)."""
    try:
        if q.shape[0] != k.shape[0]:
            return None
        return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.get_device(), k.get_device(),
                v.get_device(), "packed", cu_seqlens.shape, cu_seqlens.dtype, cu_seqlens.get_device(), max_seqlen_q,
                max_seqlen_k, softmax_scale, causal, window_size, softcap, backend, settings().backend,
                "log_decay", log_decay.shape, log_decay.dtype, log_decay.get_device(), deterministic, gate.IN_KERNEL,
                gate.SCAN_KERNEL, gate.SCAN_KERNEL_VARLEN)
    except AttributeError:  # not tensors: the general path says which
        return None


def _varlen_signature(q: Any, k: Any, v: Any, varlen_tensors: tuple[Any, ...], max_seqlen_q: Any, max_seqlen_k: Any,
                      softmax_scale: float | None, causal: bool, window_size: Any, softcap: float,
                      backend: str | None) -> tuple[Any, ...] | None:
    """The ``_PLANS`` signature of a plain varlen call (plain options: the caller checked): a dense signature's
    entries, the varlen tensors' shapes, dtypes and devices (None where not given) and the max lengths (an int's
    value, a tensor's dim and dtype: what the validation reads); None where an input is not a tensor."""
    try:
        sides = tuple(None if t is None else (t.shape, t.dtype, t.get_device()) for t in varlen_tensors)
        maxes = tuple(m if m is None or type(m) is int else (m.dim(), m.dtype) for m in (max_seqlen_q, max_seqlen_k))
        return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.get_device(), k.get_device(), v.get_device(),
                "varlen", sides, maxes, softmax_scale, causal, window_size, softcap, backend, settings().backend)
    except AttributeError:  # not tensors (or a max length neither an int nor a tensor): the general path says which
        return None


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *positional_options: Any,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (-1, -1),
    softcap: float = 0.0,
    attention_chunk: int = 0,
    learnable_sink: torch.Tensor | None = None,
    log_decay: torch.Tensor | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
    return_attn_probs: bool = False,
    backend: str | None = None,
    **flash_attn_extras: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention, softmax(q kᵀ · softmax_scale) v, for q ``(batch, seqlen_q, nheads, headdim)``.

    k, v: ``(batch, seqlen_k, nheads_k, headdim[_v])`` with ``nheads % nheads_k == 0`` (GQA/MQA).
    Returns ``out`` ``(batch, seqlen_q, nheads, headdim_v)``, or ``(out, lse)`` with ``lse``
    ``(batch, nheads, seqlen_q)`` fp32 when ``return_lse`` (alias ``return_attn_probs``) is set.
    ``window_size``: ``(left, right)``, -1/None unbounded; a list, a 1-D integer tensor (any device, read
    once on the host) or a numpy pair works too.
    ``attention_chunk``: 0, or chunked local attention (Llama 4): query ``i`` sees only the keys ``j``
    with ``j // c == (i + seqlen_k - seqlen_q) // c``, with causal and the window on top (run as varlen
    attention over the chunks, ``chunk.py``).
    ``learnable_sink``: ``(nheads,)`` logits (GPT-OSS sinks): each joins its head's softmax denominator
    with no value; differentiable (``sinks.py``). The returned LSE then includes the sink.
    ``log_decay``: log forget gates ``g`` ``(batch, seqlen_k, nheads)`` (<= 0; Forgetting Transformer):
    the score gains ``G_i - G_j`` with ``G = cumsum(g)`` per sequence; differentiable (``gate.py``).
    ``backend``: None (by compute capability), ``"sm90"`` or ``"sm80"``. Other flash-attn keywords
    (``dropout_p``, ``alibi_slopes``, ...) are accepted at their "off" value, else NotImplementedError.
    Options are keyword-only (``positional_options`` exists only to say so).
    """
    # Cached calls first: plain option types only (a bool and an int, or an int and a float, compare
    # equal as dictionary keys, and the general path must see the others to reject them).
    signature = None
    plain_options = not positional_options and _plain_options(
        causal, attention_chunk, learnable_sink, deterministic, softcap, softmax_scale, window_size, return_lse,
        return_attn_probs, backend)
    if plain_options and not flash_attn_extras:
        try:
            signature = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.get_device(), k.get_device(),
                         v.get_device(), softmax_scale, causal, window_size, softcap, backend, settings().backend)
            if log_decay is not None:  # (a gated call's plan: gate.ScannedPlan, per deterministic and route flags)
                signature += ("log_decay", log_decay.shape, log_decay.dtype, log_decay.get_device(), deterministic,
                              gate.IN_KERNEL, gate.SCAN_KERNEL)
        except AttributeError:  # not tensors: the general path says which
            signature = None
        else:
            result = _planned(q, k, v, signature, deterministic, log_decay, return_lse or return_attn_probs)
            if result is not None:
                return result if (return_lse or return_attn_probs) else result[0]
    if positional_options:
        raise validate.too_many_positional("flash_attn_func", "q, k, v", positional_options, "dropout_p", "softmax_scale")
    if fp8.is_fp8(q):  # e4m3 inference forward with FA3's descales (fp8.py)
        return _fp8_call(q, k, v, flash_attn_extras, softmax_scale, causal, window_size, softcap, attention_chunk,
                         learnable_sink, log_decay, deterministic, return_lse, return_attn_probs, backend,
                         plain_options=plain_options)
    q, k, v = _autocast(q, k, v)
    validate.check_flash_attn_extras("flash_attn_func", flash_attn_extras)
    validate.check_common_options(
        softmax_scale, causal, window_size, softcap, deterministic, return_lse, return_attn_probs, backend
    )
    chunk_len = validate.check_attention_chunk(attention_chunk)
    validate.check_learnable_sink(learnable_sink, q, 2)
    validate.check_log_decay(log_decay, q, k, False, softcap)
    if chunk_len > 0:
        out, lse = _chunked_dense(q, k, v, chunk_len, softmax_scale, causal, window_size, softcap, deterministic,
                                  backend, learnable_sink, log_decay)
        return (out, lse) if (return_lse or return_attn_probs) else out
    if log_decay is not None:
        if signature is not None and signature not in _PLANS and q.dtype == signature[3]:  # (not autocast)
            _make_gate_plan(q, k, v, log_decay, softmax_scale, causal, window_size, deterministic, backend, signature)
            result = _planned(q, k, v, signature, deterministic, log_decay, return_lse or return_attn_probs)
            if result is not None:
                return result if (return_lse or return_attn_probs) else result[0]
        out, lse = _gated(q, k, v, log_decay, None, softmax_scale, causal, window_size, deterministic, backend,
                          learnable_sink)
        return (out, lse) if (return_lse or return_attn_probs) else out
    if learnable_sink is not None:
        out, lse = sinks.attention(q, k, v, learnable_sink, None, softmax_scale, causal,
                                   validate.check_window(window_size, causal), softcap, deterministic, backend)
        return (out, lse) if (return_lse or return_attn_probs) else out
    if torch.compiler.is_compiling():  # one opaque graph node (ops.py); constant-folded by Dynamo
        out, lse = ops.attention(q, k, v, None, softmax_scale, causal, window_size, softcap, deterministic, backend)
        return (out, lse) if (return_lse or return_attn_probs) else out
    p = validate.validate_dense(q, k, v, softmax_scale, causal, window_size, softcap)
    if signature is not None and signature not in _PLANS and q.dtype == signature[3]:  # (not autocast)
        _make_plan(q, p, backend, signature)
        result = _planned(q, k, v, signature, deterministic)
        if result is not None:
            return result if (return_lse or return_attn_probs) else result[0]
    out, lse = _attention(q, k, v, p, backend, deterministic, None)
    return (out, lse) if (return_lse or return_attn_probs) else out


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | torch.Tensor | None = None,
    max_seqlen_k: int | torch.Tensor | None = None,
    *positional_options: Any,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (-1, -1),
    softcap: float = 0.0,
    attention_chunk: int = 0,
    learnable_sink: torch.Tensor | None = None,
    log_decay: torch.Tensor | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
    return_attn_probs: bool = False,
    backend: str | None = None,
    **flash_attn_extras: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed variable-length sequences: q ``(total_q, nheads, headdim)``.

    ``cu_seqlens_q/k``: int32 ``(batch + 1,)`` offsets starting at 0; ``seqused_q/k``: optional int32
    ``(batch,)`` lengths actually used inside each sequence's slot; ``max_seqlen_*``: int or 0-d tensor,
    never read on the host (no sync, no recompile). Returns ``out`` ``(total_q, nheads, headdim_v)`` or
    ``(out, lse)`` with ``lse`` ``(nheads, total_q)``. Options after ``max_seqlen_k`` are keyword-only.
    ``attention_chunk``: as in ``flash_attn_func``, per sequence (of its used lengths with ``seqused``);
    the segment table's length follows from the shapes (``chunk.varlen_num_segments``), not ``max_seqlen_k``.
    ``learnable_sink``: as in ``flash_attn_func``.
    """
    want_lse = return_lse or return_attn_probs
    signature = None
    if (log_decay is not None and cu_seqlens_q is cu_seqlens_k and seqused_q is None and seqused_k is None
            and type(max_seqlen_q) is int and type(max_seqlen_k) is int and not positional_options
            and not flash_attn_extras and _plain_options(causal, attention_chunk, learnable_sink, deterministic,
                                                         softcap, softmax_scale, window_size, return_lse,
                                                         return_attn_probs, backend)):
        # (a gated call on packed self-attention: its kept plan, as a dense call's)
        signature = _packed_gate_signature(q, k, v, cu_seqlens_k, log_decay, max_seqlen_q, max_seqlen_k,
                                           softmax_scale, causal, window_size, softcap, deterministic, backend)
        if signature is not None:
            result = _planned(q, k, v, signature, deterministic, log_decay, want_lse, cu_seqlens_k)
            if result is not None:
                return result if want_lse else result[0]
    elif (configs.VARLEN_PLANS and log_decay is None and not positional_options and not flash_attn_extras
          and _plain_options(causal, attention_chunk, learnable_sink, deterministic, softcap, softmax_scale,
                             window_size, return_lse, return_attn_probs, backend)):
        # (a plain varlen call: its kept plan, as a dense call's; the varlen tensors go in per call)
        signature = _varlen_signature(q, k, v, (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k), max_seqlen_q,
                                      max_seqlen_k, softmax_scale, causal, window_size, softcap, backend)
        if signature is not None and signature in _PLANS:
            varlen = VarlenArgs(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)
            result = _planned(q, k, v, signature, deterministic, varlen=varlen)
            if result is not None:
                return result if want_lse else result[0]
    if positional_options:
        raise validate.too_many_positional(
            "flash_attn_varlen_func", "q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k",
            positional_options, "dropout_p", "seqused_q",
        )
    if fp8.is_fp8(q):  # e4m3 inference forward with FA3's descales (fp8.py)
        return _fp8_call(q, k, v, flash_attn_extras, softmax_scale, causal, window_size, softcap, attention_chunk,
                         learnable_sink, log_decay, deterministic, return_lse, return_attn_probs, backend,
                         (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k))
    q, k, v = _autocast(q, k, v)
    validate.check_flash_attn_extras("flash_attn_varlen_func", flash_attn_extras)
    validate.check_common_options(
        softmax_scale, causal, window_size, softcap, deterministic, return_lse, return_attn_probs, backend
    )
    chunk_len = validate.check_attention_chunk(attention_chunk)
    validate.check_learnable_sink(learnable_sink, q, 1)
    validate.check_log_decay(log_decay, q, k, True, softcap)
    if (chunk_len > 0 or log_decay is not None or learnable_sink is not None) and not torch.compiler.is_compiling():
        # The chunk, gate and sink routes index with cu_seqlens / seqused before their kernels' checks run:
        # the varlen errors first (on CUDA a bad index would be a device-side assert, not a message).
        validate.validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                                 softmax_scale, causal, window_size, softcap)
    if chunk_len > 0:
        if not isinstance(cu_seqlens_q, torch.Tensor) or not isinstance(cu_seqlens_k, torch.Tensor):
            raise TypeError("cu_seqlens_q and cu_seqlens_k must be int32 tensors")
        num_segments = chunk.varlen_num_segments(cu_seqlens_k.shape[0] - 1, k.shape[0], chunk_len)
        cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k = chunk.segments(
            cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, chunk_len, num_segments
        )
        max_seqlen_q = max_seqlen_k = chunk_len
    if log_decay is not None:
        if signature is not None and signature not in _PLANS and q.dtype == signature[3]:  # (not autocast)
            _make_gate_plan(q, k, v, log_decay, softmax_scale, causal, window_size, deterministic, backend, signature,
                            cu_seqlens_k, max_seqlen_k)
            result = _planned(q, k, v, signature, deterministic, log_decay, want_lse, cu_seqlens_k)
            if result is not None:
                return result if want_lse else result[0]
        varlen_args = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)
        out, lse = _gated(q, k, v, log_decay, varlen_args, softmax_scale, causal, window_size, deterministic,
                          backend, learnable_sink, want_lse)
        return (out, lse) if want_lse else out
    if learnable_sink is not None:
        out, lse = sinks.attention(q, k, v, learnable_sink, (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k),
                                   softmax_scale, causal, validate.check_window(window_size, causal), softcap,
                                   deterministic, backend)
        return (out, lse) if (return_lse or return_attn_probs) else out
    if torch.compiler.is_compiling():  # one opaque graph node (ops.py); max_seqlen is not read
        out, lse = ops.attention(
            q, k, v, (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k), softmax_scale, causal, window_size,
            softcap, deterministic, backend,
        )
        return (out, lse) if (return_lse or return_attn_probs) else out
    p = validate.validate_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
        softmax_scale, causal, window_size, softcap,
    )
    varlen = VarlenArgs(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)
    if signature is not None and signature[9] == "varlen" and signature not in _PLANS and q.dtype == signature[3]:
        # (not autocast)
        _make_plan(q, p, backend, signature, varlen)
        result = _planned(q, k, v, signature, deterministic, varlen=varlen)
        if result is not None:
            return result if want_lse else result[0]
    out, lse = _attention(q, k, v, p, backend, deterministic, varlen)
    return (out, lse) if want_lse else out


def _chunked_dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_len: int, softmax_scale: float | None, causal: bool,
    window_size: Any, softcap: float, deterministic: bool, backend: str | None,
    learnable_sink: torch.Tensor | None = None, log_decay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense call with ``attention_chunk``: its (batch, chunk) segments as one varlen call on the
    packed view of q, k, v (no copy for contiguous inputs); out and lse back in the dense layouts."""
    if not torch.compiler.is_compiling():
        validate.validate_dense(q, k, v, softmax_scale, causal, window_size, softcap)  # the dense errors
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k = k.shape[1]
    cu_q, cu_k = chunk.dense_segments(batch, seqlen_q, seqlen_k, chunk_len, q.device)
    out, lse = flash_attn_varlen_func(
        q.reshape(batch * seqlen_q, *q.shape[2:]), k.reshape(batch * seqlen_k, *k.shape[2:]),
        v.reshape(batch * seqlen_k, *v.shape[2:]), cu_q, cu_k, chunk_len, chunk_len, softmax_scale=softmax_scale,
        causal=causal, window_size=window_size, softcap=softcap, learnable_sink=learnable_sink,
        log_decay=None if log_decay is None else log_decay.reshape(batch * seqlen_k, log_decay.shape[-1]),
        deterministic=deterministic, return_lse=True, backend=backend,
    )
    out = out.view(batch, seqlen_q, nheads, out.shape[-1])
    lse = lse.view(nheads, batch, seqlen_q).transpose(0, 1).contiguous()
    return out, lse


def _gated(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor, varlen: tuple[Any, ...] | None,
    softmax_scale: float | None, causal: bool, window_size: Any, deterministic: bool, backend: str | None,
    learnable_sink: torch.Tensor | None, want_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A call with ``log_decay`` (``gate.py``): the forward with ``-G_j / scale`` added to the sm90
    kernel's scores (else as three more q/k columns on the plain kernels), the backward on the
    augmented problem; ``G_i`` added to the LSE (and the sink joined, if given); ``want_lse`` False: the scan route
    skips that add and returns no LSE."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    gated_varlen = tuple(varlen[:4]) if varlen is not None else None  # max_seqlen: no kernel reads it
    return gate.attention(q, k, v, log_decay, gated_varlen, float(scale), causal,
                          validate.check_window(window_size, causal), deterministic, backend, learnable_sink,
                          max_seqlen_k=varlen[5] if varlen is not None else None, want_lse=want_lse)

