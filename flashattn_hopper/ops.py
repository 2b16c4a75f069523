"""The forward and backward as ``torch.library`` custom ops, for ``torch.compile``.

Under ``torch.compile`` the public functions (``api.py``) call ``torch.ops.flashattn_hopper.fwd``, so
Dynamo sees one opaque graph node per attention call instead of tracing our Python (whose device
lookups, compile cache and DSL launch it cannot trace: ``fullgraph=True`` failed on
``torch.cuda.get_device_name``). Autograd is registered on the op (``bwd`` is the second node), and
``register_fake`` gives the output shapes from the input shapes alone: no device query, no ``.item()``.
Eager calls keep the direct path (an op dispatch costs 10-60 us of host time per call).

Schema: tensors, optional tensors (the varlen inputs), ints, floats, bools and an optional str
only. ``max_seqlen_*`` is not an input: no kernel reads it (the varlen grid is an upper bound), so
a compiled graph never depends on its value. The ops allocate their outputs and mutate nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from . import dispatch, validate
from .backends.common import VarlenArgs
from .validate import AttnProblem

NAMESPACE = "flashattn_hopper"


def _problem(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None, seqused_q: torch.Tensor | None, seqused_k: torch.Tensor | None,
    softmax_scale: float | None, causal: bool, window_left: int, window_right: int, softcap: float,
) -> tuple[AttnProblem, VarlenArgs | None]:
    """The problem the eager path would build (same validation, same errors), inside the op."""
    window = (window_left, window_right)
    if cu_seqlens_q is None:
        return validate.validate_dense(q, k, v, softmax_scale, causal, window, softcap), None
    p = validate.validate_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, None, None, seqused_q, seqused_k, softmax_scale, causal, window, softcap,
    )
    return p, VarlenArgs(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, None, None)


def eager_forward_family(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None, seqused_q: torch.Tensor | None, seqused_k: torch.Tensor | None,
    options: tuple[Any, ...],
) -> tuple[Any, AttnProblem, VarlenArgs | None] | None:
    """``(family, problem, varlen)`` of a forward a module launches itself, beside the op, for a
    kernel variant the op has no argument for (``sinks.py``, ``gate.py``); ``options`` as the op's
    ``(softmax_scale, causal, window_left, window_right, softcap, deterministic, backend)``. None where
    the call must go through the op: CPU tensors, traced by torch.compile, an empty problem."""
    if not q.is_cuda or torch.compiler.is_compiling():
        return None
    p, varlen = _problem(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, *options[:5])
    if p.batch == 0 or p.seqlen_q == 0 or p.seqlen_k == 0 or p.nheads == 0:
        return None
    return dispatch.fwd_kernel_for(q.device, options[6], p), p, varlen


# Routes of eager calls the modules launch themselves (``gate.py``, ``sinks.py``) by signature: the
# validated problem and both families, worked out once (each gated call validated and dispatched
# twice before, ~50 us on an H200).
_ROUTES: dict[tuple[Any, ...], tuple[Any, ...] | None] = {}
_MAX_ROUTES = 4096


def eager_route(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None, seqused_q: torch.Tensor | None, seqused_k: torch.Tensor | None,
    options: tuple[Any, ...],
) -> tuple[Any, Any, AttnProblem, VarlenArgs | None] | None:
    """``(forward family, backward family, problem, varlen)`` of an eager call a module launches
    itself: ``eager_forward_family`` (same validation, same errors) the first time a signature
    (shapes, strides, dtypes, devices, the varlen tensors' metadata, options) is seen; None where the
    call must go through the ops (CPU, traced by torch.compile, an empty problem). The backward family
    is None where none serves the problem (the backward then goes through the op, which raises)."""
    if not q.is_cuda or torch.compiler.is_compiling():
        return None
    sides = tuple(None if t is None else (t.shape, t.dtype, t.device)
                  for t in (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k))
    # Strides too: validation rejects a last axis that is not contiguous (the kernels assume it).
    signature = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype, q.device,
                 k.device, v.device, sides, options)
    hit = _ROUTES.get(signature, False)
    if hit is False:
        found = eager_forward_family(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, options)
        hit = None
        if found is not None:
            family, p, _ = found
            try:  # (a forward-only call must not fail for want of a backward: None, the op path says why)
                backward = dispatch.bwd_kernel_for(q.device, options[6], p, options[5])
            except (NotImplementedError, ValueError):
                backward = None
            hit = (family, backward, p)
        if len(_ROUTES) >= _MAX_ROUTES:
            _ROUTES.clear()
        _ROUTES[signature] = hit
    if hit is None:
        return None
    varlen = None if cu_seqlens_q is None else VarlenArgs(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, None, None)
    return (*hit, varlen)


@torch.library.custom_op(f"{NAMESPACE}::fwd", mutates_args=())
def fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None, seqused_q: torch.Tensor | None, seqused_k: torch.Tensor | None,
    softmax_scale: float | None, causal: bool, window_left: int, window_right: int, softcap: float,
    deterministic: bool, backend: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``; ``deterministic`` is for the registered backward."""
    from .api import _fwd

    p, varlen = _problem(
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, softmax_scale, causal, window_left,
        window_right, softcap,
    )
    out, lse = _fwd(q, k, v, p, backend, varlen)
    return out.contiguous(), lse.contiguous()


@fwd.register_fake
def _fwd_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None, seqused_q: torch.Tensor | None, seqused_k: torch.Tensor | None,
    softmax_scale: float | None, causal: bool, window_left: int, window_right: int, softcap: float,
    deterministic: bool, backend: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    if cu_seqlens_q is None:  # q (batch, seqlen_q, nheads, d) -> lse (batch, nheads, seqlen_q)
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    else:  # q (total_q, nheads, d) -> lse (nheads, total_q)
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    return out, lse


@torch.library.custom_op(f"{NAMESPACE}::bwd", mutates_args=())
def bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None, seqused_q: torch.Tensor | None,
    seqused_k: torch.Tensor | None, softmax_scale: float | None, causal: bool, window_left: int,
    window_right: int, softcap: float, deterministic: bool, backend: str | None, dk_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` shaped like q, k, v (contiguous); ``dk_fp32``: dk in fp32 (``gate.py``)."""
    p, varlen = _problem(
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, softmax_scale, causal, window_left,
        window_right, softcap,
    )
    family = dispatch.bwd_kernel_for(q.device, backend, p, deterministic)
    extra = {"dk_fp32": True} if dk_fp32 else {}
    dq, dk, dv = family.backward(dout.contiguous(), q, k, v, out, lse, p, varlen, deterministic, **extra)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@bwd.register_fake
def _bwd_fake(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None, seqused_q: torch.Tensor | None,
    seqused_k: torch.Tensor | None, softmax_scale: float | None, causal: bool, window_left: int,
    window_right: int, softcap: float, deterministic: bool, backend: str | None, dk_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dk_dtype = torch.float32 if dk_fp32 else k.dtype
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=dk_dtype, device=k.device),
            torch.empty(v.shape, dtype=v.dtype, device=v.device))


# Non-tensor inputs of fwd after q, k, v and the four varlen tensors, in schema order.
_FWD_OPTIONS = ("softmax_scale", "causal", "window_left", "window_right", "softcap", "deterministic", "backend")


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    q, k, v, cu_q, cu_k, used_q, used_k, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, used_q, used_k)
    ctx.options = dict(zip(_FWD_OPTIONS, options))
    ctx.mark_non_differentiable(lse)  # as in eager (api.FlashAttnFunc) and flash-attn
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Gradients of q, k, v (the LSE is not differentiable, as in flash-attn: ``dlse`` is ignored)."""
    q, k, v, out, lse, cu_q, cu_k, used_q, used_k = ctx.saved_tensors
    if dout is None:
        return (None,) * (7 + len(_FWD_OPTIONS))
    o = ctx.options
    dq, dk, dv = torch.ops.flashattn_hopper.bwd(
        dout, q, k, v, out, lse, cu_q, cu_k, used_q, used_k, o["softmax_scale"], o["causal"],
        o["window_left"], o["window_right"], o["softcap"], o["deterministic"], o["backend"],
    )
    return (dq, dk, dv) + (None,) * (4 + len(_FWD_OPTIONS))


fwd.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op(f"{NAMESPACE}::fwd_fp8", mutates_args=())
def fwd_fp8(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None, seqused_q: torch.Tensor | None, seqused_k: torch.Tensor | None,
    max_seqlen_q: int | None, max_seqlen_k: int | None, q_descale: torch.Tensor | None,
    k_descale: torch.Tensor | None, v_descale: torch.Tensor | None, softmax_scale: float | None, causal: bool,
    window_left: int, window_right: int, backend: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 forward (``fp8.attention``): ``(out, lse)``, out bf16; no backward (forward only).
    ``max_seqlen_*`` (ints or None) size varlen per-block descales only."""
    from . import fp8

    extras = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    varlen = None if cu_seqlens_q is None else (
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k
    )
    out, lse = fp8.attention(q, k, v, extras, softmax_scale, causal, (window_left, window_right), 0.0, backend, varlen)
    return out.contiguous(), lse.contiguous()


@fwd_fp8.register_fake
def _fwd_fp8_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None, seqused_q: torch.Tensor | None, seqused_k: torch.Tensor | None,
    max_seqlen_q: int | None, max_seqlen_k: int | None, q_descale: torch.Tensor | None,
    k_descale: torch.Tensor | None, v_descale: torch.Tensor | None, softmax_scale: float | None, causal: bool,
    window_left: int, window_right: int, backend: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, softmax_scale, causal,
                         window_left, window_right, 0.0, False, backend)
    return out.to(torch.bfloat16), lse


def attention_fp8(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, varlen: tuple[Any, ...] | None, extras: dict[str, Any],
    softmax_scale: float | None, causal: bool, window_size: Any, backend: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled path of ``api.py`` for e4m3 inputs: one ``fwd_fp8`` node. ``varlen``: ``(cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k)``; a tensor ``max_seqlen_*`` is dropped
    (only per-block descales read it, and they need ints)."""
    left, right = validate.check_window(window_size, causal)
    from . import fp8

    scales = fp8.split_descales(extras, varlen is not None)
    cu_q, cu_k, max_q, max_k, used_q, used_k = varlen if varlen is not None else (None,) * 6
    max_q, max_k = (n if type(n) is int else None for n in (max_q, max_k))
    return torch.ops.flashattn_hopper.fwd_fp8(
        q, k, v, cu_q, cu_k, used_q, used_k, max_q, max_k, scales["q_descale"], scales["k_descale"],
        scales["v_descale"], None if softmax_scale is None else float(softmax_scale), bool(causal), left, right,
        backend,
    )


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, varlen: tuple[Any, ...] | None, softmax_scale: float | None,
    causal: bool, window_size: Any, softcap: float, deterministic: bool, backend: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled path of ``api.py``: the window as two ints (checked in Python, which Dynamo
    traces), everything else checked inside the op, with the eager path's messages."""
    left, right = validate.check_window(window_size, causal)
    cu_q, cu_k, used_q, used_k = varlen if varlen is not None else (None, None, None, None)
    return torch.ops.flashattn_hopper.fwd(
        q, k, v, cu_q, cu_k, used_q, used_k,
        None if softmax_scale is None else float(softmax_scale), bool(causal), left, right, float(softcap),
        bool(deterministic), backend,
    )
