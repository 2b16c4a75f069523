"""Shared pieces of the forward parity tests: random inputs and the checks against the fp32 reference,
each taking the backend (``sm80``, ``sm90``) as an argument."""

import itertools

import torch

from flashattn_hopper import dispatch, flash_attn_func, flash_attn_varlen_func, validate
from flashattn_hopper.api import _fwd
from flashattn_hopper.backends.common import VarlenArgs
from flashattn_hopper.testing import assert_close_to_ref, attention_ref


def make_qkv(batch, s_q, s_k, h, h_k, d, dv=None, dtype=torch.bfloat16, device="cuda", seed=0):
    """Fresh random (never zero) q, k, v in the API's (batch, seqlen, nheads, headdim) layout."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dv = d if dv is None else dv
    q = torch.randn(batch, s_q, h, d, dtype=dtype, device=device, generator=gen)
    k = torch.randn(batch, s_k, h_k, d, dtype=dtype, device=device, generator=gen)
    v = torch.randn(batch, s_k, h_k, dv, dtype=dtype, device=device, generator=gen)
    return q, k, v


def check_parity(q, k, v, causal, backend, **kwargs):
    """flash_attn_func on ``backend`` vs the fp32 reference by flash-attn's rule, for out and lse."""
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True, backend=backend, **kwargs)
    out_ref, lse_ref = attention_ref(q, k, v, causal=causal, **kwargs)
    out_pt, lse_pt = attention_ref(q, k, v, causal=causal, upcast=False, **kwargs)
    assert out.shape == out_ref.shape and out.dtype == q.dtype
    assert lse.shape == lse_ref.shape and lse.dtype == torch.float32
    assert not torch.isnan(out).any(), "NaN in out"
    assert_close_to_ref("out", out, out_ref, out_pt)
    assert_close_to_ref("lse", lse, lse_ref, lse_pt, atol=1e-4)
    return out, lse


def problem(q, k, v, varlen=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
    """The launchers' ``AttnProblem`` (and ``VarlenArgs``) for q/k/v; ``varlen``: dict of cu_seqlens_q/k
    and optional seqused_q/k, as the backward tests build it."""
    if varlen is None:
        return validate.validate_dense(q, k, v, softmax_scale, causal, window_size, softcap), None
    cu_q, cu_k = varlen["cu_seqlens_q"], varlen["cu_seqlens_k"]
    used_q, used_k = varlen.get("seqused_q"), varlen.get("seqused_k")
    p = validate.validate_varlen(q, k, v, cu_q, cu_k, None, None, used_q, used_k, softmax_scale, causal, window_size,
                                 softcap)
    return p, VarlenArgs(cu_q, cu_k, used_q, used_k, None, None)


def poisoned_fwd(q, k, v, backend, varlen=None, **options):
    """The forward launcher writing into NaN-filled out/lse buffers made here, just before the call.

    Poisoning is guaranteed by construction: the buffers are filled with NaN by this function and the
    launcher must return exactly them (same data pointers), so any element the kernel does not write is
    NaN, whatever memory the allocator handed out. ``options``: softmax_scale, causal, window_size,
    softcap. Returns (out, lse), checked free of NaN (not against the reference).
    """
    p, va = problem(q, k, v, varlen, **options)
    out_shape = (*q.shape[:-1], v.shape[-1])
    lse_shape = (q.shape[1], q.shape[0]) if varlen is not None else (q.shape[0], q.shape[2], q.shape[1])
    out = torch.full(out_shape, float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full(lse_shape, float("nan"), dtype=torch.float32, device=q.device)
    got_out, got_lse = _fwd(q, k, v, p, backend, va, out=out, lse=lse)
    assert got_out.data_ptr() == out.data_ptr() and got_lse.data_ptr() == lse.data_ptr(), "launcher ignored out/lse"
    assert not torch.isnan(out).any(), "out: NaN left in the poisoned buffer (rows the kernel did not write)"
    assert not torch.isnan(lse).any(), "lse: NaN left in the poisoned buffer (rows the kernel did not write)"
    return out, lse


def poisoned_bwd(q, k, v, dout, fwd_backend, bwd_backend, varlen=None, deterministic=False, **options):
    """dq, dk, dv from the backward launcher writing into NaN-filled buffers made here, just before the
    call; the forward's out/lse come from ``poisoned_fwd``.

    Poisoning is guaranteed by construction (as in ``poisoned_fwd``): the launcher must return exactly the
    buffers filled here (same data pointers), so an element no kernel writes stays NaN. Head dims must be
    native (the buffers have q/k/v's shapes). ``bwd_backend`` None: the family the API would pick
    (``dispatch.bwd_kernel_for``). Checked free of NaN, not against the reference.
    """
    p, va = problem(q, k, v, varlen, **options)
    out, lse = poisoned_fwd(q, k, v, fwd_backend, varlen, **options)
    family = dispatch.bwd_kernel_for(q.device, bwd_backend, p, deterministic)
    bufs = [torch.full(t.shape, float("nan"), dtype=q.dtype, device=q.device) for t in (q, k, v)]
    grads = family.backward(dout, q, k, v, out, lse, p, va, deterministic, dq=bufs[0], dk=bufs[1], dv=bufs[2])
    for name, g, buf in zip(("dq", "dk", "dv"), grads, bufs):
        assert g.data_ptr() == buf.data_ptr(), f"{name}: the launcher did not write the given buffer"
        assert not torch.isnan(g).any(), f"{name}: NaN left in the poisoned buffer (elements no kernel wrote)"
    return grads


def check_poisoned_outputs(q, k, v, causal, backend):
    """NaN-filled out/lse buffers given to the launcher must be fully overwritten, and correct."""
    out, lse = poisoned_fwd(q, k, v, backend, causal=causal)
    out_ref, lse_ref = attention_ref(q, k, v, causal=causal)
    out_pt, lse_pt = attention_ref(q, k, v, causal=causal, upcast=False)
    assert_close_to_ref("out", out, out_ref, out_pt)
    assert_close_to_ref("lse", lse, lse_ref, lse_pt, atol=1e-4)


def _rand(shape, dtype, gen):
    return torch.randn(*shape, dtype=dtype, device="cuda", generator=gen)


def make_varlen(lens, h, h_k, d, dv, dtype, slack_q=0, slack_k=0, seed=0):
    """Packed q/k/v and cu_seqlens; ``slack_*`` extra tokens per slot (then seqused = lens)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    slots_q = [lq + slack_q for lq, _ in lens]
    slots_k = [lk + slack_k for _, lk in lens]
    cu_q = torch.tensor([0, *itertools.accumulate(slots_q)], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *itertools.accumulate(slots_k)], dtype=torch.int32, device="cuda")
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    q = _rand((total_q, h, d), dtype, gen)
    k, v = _rand((total_k, h_k, d), dtype, gen), _rand((total_k, h_k, dv), dtype, gen)
    used_q = torch.tensor([lq for lq, _ in lens], dtype=torch.int32, device="cuda") if slack_q else None
    used_k = torch.tensor([lk for _, lk in lens], dtype=torch.int32, device="cuda") if slack_k else None
    return q, k, v, cu_q, cu_k, used_q, used_k


def seqused_pad_rows(cu_q, used_q):
    """Packed row indices past each sequence's ``seqused_q`` (rows the kernel must leave to the launcher)."""
    return torch.cat([torch.arange(int(cu_q[i]) + int(used_q[i]), int(cu_q[i + 1])) for i in range(len(used_q))])


def check_out_lse(name, out, lse, ref, pt, factor):
    """out and lse vs the fp32 reference: max|ours - ref| <= factor * max|pt - ref| + atol."""
    assert not torch.isnan(out).any(), f"{name}: NaN in out"
    for what, ours, r, p, atol in (("out", out, ref[0], pt[0], 1e-5), ("lse", lse, ref[1], pt[1], 1e-4)):
        assert_close_to_ref(f"{name} {what}", ours, r, p, atol=atol, factor=factor)


def check_features_dense(q, k, v, backend, causal=False, window=(-1, -1), softcap=0.0, softmax_scale=None):
    """Dense window / softcap parity (3x PyTorch's error for softcap: tanh.approx vs torch.tanh)."""
    kwargs = dict(causal=causal, window_size=window, softcap=softcap, softmax_scale=softmax_scale)
    out, lse = flash_attn_func(q, k, v, return_lse=True, backend=backend, **kwargs)
    assert out.shape == (*q.shape[:3], v.shape[-1]) and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    check_out_lse("dense", out, lse, attention_ref(q, k, v, **kwargs), attention_ref(q, k, v, upcast=False, **kwargs),
           3.0 if softcap else 2.0)
    return out, lse


def check_features_varlen(q, k, v, cu_q, cu_k, backend, used_q=None, used_k=None, causal=False,
                          window=(-1, -1), softcap=0.0, max_seqlen_q=None, softmax_scale=None):
    """Varlen parity (cu_seqlens, optional seqused and max_seqlen_q) with windows / softcap."""
    kwargs = dict(causal=causal, window_size=window, softcap=softcap, softmax_scale=softmax_scale)
    out, lse = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max_seqlen_q, None, seqused_q=used_q, seqused_k=used_k, return_lse=True,
        backend=backend, **kwargs,
    )
    assert out.shape == (*q.shape[:2], v.shape[-1]) and lse.shape == (q.shape[1], q.shape[0])
    ref_args = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q, seqused_k=used_k, **kwargs)
    check_out_lse("varlen", out, lse, attention_ref(q, k, v, **ref_args), attention_ref(q, k, v, upcast=False, **ref_args),
           3.0 if softcap else 2.0)
    return out, lse
