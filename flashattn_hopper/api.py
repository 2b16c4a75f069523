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

from . import dispatch, ops, validate
from .backends.common import VarlenArgs
from .validate import AttnProblem


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
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.problem, ctx.backend, ctx.deterministic, ctx.varlen = p, backend, deterministic, varlen
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        family = dispatch.bwd_kernel_for(q.device, ctx.backend, ctx.problem, ctx.deterministic)
        dq, dk, dv = family.backward(dout, q, k, v, out, lse, ctx.problem, ctx.varlen, ctx.deterministic)
        return dq, dk, dv, None, None, None, None


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


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *positional_options: Any,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (-1, -1),
    softcap: float = 0.0,
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
    ``backend``: None (by compute capability), ``"sm90"`` or ``"sm80"``. Other flash-attn keywords
    (``dropout_p``, ``alibi_slopes``, ...) are accepted at their "off" value, else NotImplementedError.
    Options are keyword-only (``positional_options`` exists only to say so).
    """
    if positional_options:
        raise validate.too_many_positional("flash_attn_func", "q, k, v", positional_options, "dropout_p", "softmax_scale")
    q, k, v = _autocast(q, k, v)
    validate.check_flash_attn_extras("flash_attn_func", flash_attn_extras)
    validate.check_common_options(
        softmax_scale, causal, window_size, softcap, deterministic, return_lse, return_attn_probs, backend
    )
    if torch.compiler.is_compiling():  # one opaque graph node (ops.py); constant-folded by Dynamo
        out, lse = ops.attention(q, k, v, None, softmax_scale, causal, window_size, softcap, deterministic, backend)
        return (out, lse) if (return_lse or return_attn_probs) else out
    p = validate.validate_dense(q, k, v, softmax_scale, causal, window_size, softcap)
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
    """
    if positional_options:
        raise validate.too_many_positional(
            "flash_attn_varlen_func", "q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k",
            positional_options, "dropout_p", "seqused_q",
        )
    q, k, v = _autocast(q, k, v)
    validate.check_flash_attn_extras("flash_attn_varlen_func", flash_attn_extras)
    validate.check_common_options(
        softmax_scale, causal, window_size, softcap, deterministic, return_lse, return_attn_probs, backend
    )
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
    out, lse = _attention(q, k, v, p, backend, deterministic, varlen)
    return (out, lse) if (return_lse or return_attn_probs) else out
