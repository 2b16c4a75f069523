"""Backends for the perf sweep, their inputs, and the correctness gate every cell passes before timing.

Backends: ours (`sm90`, `sm80` through `flash_attn_func(..., backend=...)`, BSHD layout) and PyTorch
SDPA pinned to one kernel each (`cudnn`, `flash`, `efficient`, BHSD layout: copies made contiguous
once per shape, outside any timed region). SDPA gets GQA only through `enable_gqa=True`; a backend
that refuses it is skipped with its reason, never fed repeated K/V.

Correctness (a wrong kernel must never get a speed): the full-size output and gradients of the very
call that gets timed are sliced to one batch element and a few heads and compared with
`flashattn_hopper.testing.attention_ref` on the same slice of the inputs, by the flash-attn rule
`max|ours - ref| <= 2 * max|pt - ref| + atol` (ref in fp32, pt in the input dtype). Attention is
independent per (batch, head), so the slice is exact; the reference runs one query head at a time,
so at 16k tokens it holds one 16k x 16k fp32 score matrix (1 GiB) at a time, not one per head.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..testing import rounding_atol

# "auto": backend=None, what users get (sm90 kernels where they exist, e.g. the sm90 forward with the
# sm80 backward in training); "sm90"/"sm80": one kernel family forced.
OURS = ("auto", "sm90", "sm80")
BASELINES = ("cudnn", "flash", "efficient")
BACKENDS = OURS + BASELINES

_SDPA_BACKEND = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}
# Messages PyTorch uses when the pinned SDPA kernel cannot take the inputs (CUDA, CPU).
_SDPA_NO_KERNEL = ("No available kernel", "No viable backend")
_NOTE_CHARS = 300


class Skip(Exception):
    """The backend cannot run this configuration; the message is the note the report shows."""


@dataclass(frozen=True)
class Shape:
    """One problem size. Heads h query / hk key-value; hdim for Q·K, hdim_v for P·V."""

    batch: int
    seqlen: int
    nheads: int
    nheads_k: int
    hdim: int
    hdim_v: int

    @property
    def gqa(self) -> int:
        return self.nheads // self.nheads_k


class ShapeInputs:
    """Random q, k, v (autograd leaves) and dout for one shape: BSHD for ours, BHSD copies for SDPA."""

    def __init__(self, shape: Shape, *, device: torch.device, dtype: torch.dtype, need_bhsd: bool):
        b, s, h, hk = shape.batch, shape.seqlen, shape.nheads, shape.nheads_k
        self.shape, self.dtype = shape, dtype

        def leaf(*size: int) -> torch.Tensor:
            return torch.randn(size, device=device, dtype=dtype).requires_grad_()

        self.q, self.k, self.v = leaf(b, s, h, shape.hdim), leaf(b, s, hk, shape.hdim), leaf(b, s, hk, shape.hdim_v)
        self.dout = torch.randn(b, s, h, shape.hdim_v, device=device, dtype=dtype)
        self.bhsd = None
        if need_bhsd:
            q, k, v = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (self.q, self.k, self.v))
            self.bhsd = (q, k, v, self.dout.transpose(1, 2).contiguous())


class OursRunner:
    """`flash_attn_func(q, k, v, causal=..., backend=name)` on BSHD inputs (``auto``: backend=None)."""

    def __init__(self, name: str, inputs: ShapeInputs, causal: bool, attn_fn: Callable):
        self.name = name
        self.leaves = (inputs.q, inputs.k, inputs.v)
        self.dout = inputs.dout
        self._call = functools.partial(attn_fn, causal=causal, backend=None if name == "auto" else name)

    def context(self):
        return contextlib.nullcontext()

    def forward(self) -> torch.Tensor:
        return self._call(*self.leaves)

    def to_bshd(self, t: torch.Tensor) -> torch.Tensor:
        return t


class SdpaRunner:
    """`F.scaled_dot_product_attention` with one SDPA kernel allowed (no fallback to math) on BHSD inputs."""

    def __init__(self, name: str, inputs: ShapeInputs, causal: bool):
        from torch.nn.attention import SDPBackend

        self.name = name
        self._backend = getattr(SDPBackend, _SDPA_BACKEND[name], None)
        if self._backend is None:
            raise Skip(f"torch {torch.__version__} has no SDPBackend.{_SDPA_BACKEND[name]}")
        q, k, v, self.dout = inputs.bhsd
        self.leaves = (q, k, v)
        # Square problems only, so SDPA's top-left causal equals flash-attn's bottom-right causal.
        self._kwargs = {"is_causal": causal}
        if inputs.shape.gqa > 1:
            self._kwargs["enable_gqa"] = True

    def context(self):
        from torch.nn.attention import sdpa_kernel

        return sdpa_kernel(self._backend)

    def forward(self) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(*self.leaves, **self._kwargs)

    def to_bshd(self, t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2)


def make_runner(name: str, inputs: ShapeInputs, causal: bool, attn_fn: Callable | None, attn_fn_note: str = ""):
    if name in OURS:
        if attn_fn is None:
            raise Skip(attn_fn_note or "flashattn_hopper.flash_attn_func is not available")
        return OursRunner(name, inputs, causal, attn_fn)
    if name in BASELINES:
        return SdpaRunner(name, inputs, causal)
    raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {name!r}")


def load_attn_fn() -> tuple[Callable | None, str]:
    """Our public entry point, or (None, why) so the sweep records our cells as skipped."""
    try:
        from flashattn_hopper import flash_attn_func
    except Exception as exc:  # an unfinished or broken package must not stop the baselines
        return None, one_line(f"flashattn_hopper.flash_attn_func could not be imported: {type(exc).__name__}: {exc}")
    return flash_attn_func, ""


def one_line(text: str, limit: int = _NOTE_CHARS) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe_failure(exc: BaseException, backend: str, warnings_seen: Sequence = ()) -> tuple[str, str]:
    """(status, note) for an exception from a backend call: 'skipped' when the configuration is
    unsupported there, 'error' when something broke (reported, never timed)."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, Skip):
        return "skipped", one_line(message)
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return "error", one_line(f"out of memory: {message}")
    if isinstance(exc, NotImplementedError):
        return "skipped", one_line(f"not implemented: {message}")
    if backend in OURS and isinstance(exc, ValueError):
        return "skipped", one_line(f"unsupported: {message}")
    if backend in BASELINES and isinstance(exc, RuntimeError):
        # SDPA explains why a kernel was not used in warnings, then raises a generic error.
        reasons = []
        for w in warnings_seen:
            text = one_line(str(w.message), 160)
            if text and not text.endswith(":") and text not in reasons:
                reasons.append(text)
        detail = "; ".join(reasons)
        if any(marker in message for marker in _SDPA_NO_KERNEL):
            message = "no SDPA kernel for these inputs"
        return "skipped", one_line(f"{message}: {detail}" if detail else message)
    return "error", one_line(f"{type(exc).__name__}: {message}")


@dataclass(frozen=True)
class CheckSlice:
    """The part of the output compared with the reference: one batch element, whole kv-head groups."""

    batch: int
    q_heads: range
    kv_heads: range


def check_slice(shape: Shape) -> CheckSlice:
    """Last batch element and last heads, so a wrong batch or head stride cannot hide at offset 0.
    MHA: 2 heads. GQA: one kv head with all its query heads, since its dK/dV sum over them."""
    g = shape.gqa
    n_kv = min(shape.nheads_k, 2 if g == 1 else 1)
    kv = range(shape.nheads_k - n_kv, shape.nheads_k)
    return CheckSlice(batch=shape.batch - 1, q_heads=range(kv.start * g, kv.stop * g), kv_heads=kv)


@dataclass(frozen=True)
class Check:
    ok: bool
    err: float
    bound: float
    note: str = ""


def reference_tools() -> tuple[Callable, Callable]:
    from flashattn_hopper.testing import attention_ref, max_err_check

    return attention_ref, max_err_check


class Reference:
    """fp32 and same-dtype references on the check slice of one (shape, mask), computed on first use
    and shared by every backend of that shape."""

    def __init__(self, inputs: ShapeInputs, causal: bool, tools: Callable[[], tuple[Callable, Callable]] = reference_tools):
        self.inputs, self.causal = inputs, causal
        self.slice = check_slice(inputs.shape)
        self._tools = tools
        self._outputs = None
        self._grads = None

    def max_err_check(self) -> Callable:
        return self._tools()[1]

    def outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(out_ref fp32, out_pt input dtype), each (1, seqlen, len(q_heads), hdim_v)."""
        if self._outputs is None:
            with torch.no_grad():
                self._outputs = tuple(self._run(upcast, with_grads=False)[0] for upcast in (True, False))
        return self._outputs

    def grads(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """((dq, dk, dv) fp32, (dq, dk, dv) input dtype) on the slice."""
        if self._grads is None:
            self._grads = tuple(self._run(upcast, with_grads=True)[1] for upcast in (True, False))
        return self._grads

    def _run(self, upcast: bool, with_grads: bool):
        attention_ref = self._tools()[0]
        inp, sl = self.inputs, self.slice
        g, b = inp.shape.gqa, sl.batch
        compute = torch.float32 if upcast else inp.dtype
        outs, dqs = [], []
        dks = {j: None for j in sl.kv_heads}
        dvs = dict(dks)
        for h in sl.q_heads:
            j = h // g
            q, k, v = (
                t[b : b + 1, :, i : i + 1].detach().to(compute).contiguous().requires_grad_(with_grads)
                for t, i in ((inp.q, h), (inp.k, j), (inp.v, j))
            )
            with torch.enable_grad() if with_grads else contextlib.nullcontext():
                out, _ = attention_ref(q, k, v, causal=self.causal, upcast=upcast)
                if with_grads:
                    dout = inp.dout[b : b + 1, :, h : h + 1].to(out.dtype)
                    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
                    dqs.append(dq)
                    # A kv head's gradient is the sum over its query heads; accumulate in fp32.
                    dks[j] = dk.float() if dks[j] is None else dks[j] + dk.float()
                    dvs[j] = dv.float() if dvs[j] is None else dvs[j] + dv.float()
            outs.append(out.detach())
        grads = None
        if with_grads:
            grads = (
                torch.cat(dqs, dim=2),
                torch.cat([dks[j] for j in sl.kv_heads], dim=2).to(compute),
                torch.cat([dvs[j] for j in sl.kv_heads], dim=2).to(compute),
            )
        return torch.cat(outs, dim=2), grads


def _compare(name: str, got: torch.Tensor, ref: torch.Tensor, pt: torch.Tensor, dtype, max_err_check) -> Check:
    got, ref, pt = got.detach().float(), ref.detach().float(), pt.detach().float()
    if not torch.isfinite(got).all():
        return Check(False, float("nan"), float("nan"), f"{name} has NaN/Inf")
    ok, err, bound = max_err_check(got, ref, pt, atol=rounding_atol(ref, dtype))
    err, bound = float(err), float(bound)
    note = "" if ok else f"{name}: max|ours-ref| {err:.3g} > bound {bound:.3g} (2*max|pt-ref| + atol)"
    if not ok and bound != bound:  # NaN bound: PyTorch's error is not finite, the rule has no yardstick
        note = f"{name}: PyTorch's same-dtype error is not finite (max|ours-ref| {err:.3g}): no yardstick"
    return Check(bool(ok), err, bound, note)


def _worst(checks: Sequence[Check]) -> Check:
    failed = [c for c in checks if not c.ok]
    if failed:
        return Check(False, failed[0].err, failed[0].bound, "; ".join(c.note for c in failed))
    return max(checks, key=lambda c: c.err / c.bound if c.bound > 0 else float("inf"))


def check_forward(runner, out: torch.Tensor, reference: Reference) -> Check:
    sl = reference.slice
    got = runner.to_bshd(out)[sl.batch : sl.batch + 1, :, sl.q_heads.start : sl.q_heads.stop]
    out_ref, out_pt = reference.outputs()
    return _compare("out", got, out_ref, out_pt, reference.inputs.dtype, reference.max_err_check())


def check_backward(runner, reference: Reference) -> Check:
    sl = reference.slice
    grads_ref, grads_pt = reference.grads()
    checks = []
    for name, leaf, heads, ref, pt in zip(
        ("dq", "dk", "dv"), runner.leaves, (sl.q_heads, sl.kv_heads, sl.kv_heads), grads_ref, grads_pt
    ):
        if leaf.grad is None:
            return Check(False, float("nan"), float("nan"), f"{name} is None after backward")
        got = runner.to_bshd(leaf.grad)[sl.batch : sl.batch + 1, :, heads.start : heads.stop]
        checks.append(_compare(name, got, ref, pt, reference.inputs.dtype, reference.max_err_check()))
    return _worst(checks)
