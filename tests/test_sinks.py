"""``learnable_sink`` (one logit per query head in every row's softmax denominator, GPT-OSS).

CPU tier: ``sinks.SinkAttnFunc`` with its two op seams filled by the fp32 reference (forward) and by
an emulation of what the kernels' backward computes from ``(dout, q, k, v, out, lse)`` (P recomputed
from the LSE it is given, dPsum = rowsum(dout * out), dS = P (dP - dPsum)), against autograd through
an explicit softmax over the keys plus a sink column with a zero value: out, LSE and the gradients
of q, k, v and the sink, dense and varlen (seqused, zero-length sequences, rows that see no key),
causal and windows, GQA. This checks the identity the sink rests on and every layout around it.
Also the argument's errors and a fullgraph trace.

GPU tier: the public API on both backends against the explicit reference with the parity rule.
"""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch

from flashattn_hopper import flash_attn_func, flash_attn_varlen_func, sinks, testing


def _ref_fwd(q, k, v, cu_q, cu_k, used_q, used_k, scale, causal, left, right, softcap, deterministic, backend):
    """The fp32 reference, with rows past seqused_q NaN in out and lse (the kernels do not write them)."""
    out, lse = testing.attention_ref(q, k, v, softmax_scale=scale, causal=causal, window_size=(left, right),
                                     softcap=softcap, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q,
                                     seqused_k=used_k)
    if used_q is not None:
        for i in range(len(used_q)):
            rows = slice(int(cu_q[i]) + int(used_q[i]), int(cu_q[i + 1]))
            out[rows], lse[:, rows] = float("nan"), float("nan")
    return out, lse


def _kernel_bwd_dense(dout, q, k, v, out, lse, scale, causal, window):
    """What the kernels compute for one dense problem: P from the given LSE, dS = P (dP - dPsum)."""
    group = q.shape[2] // k.shape[2]
    kr, vr = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bthd,bshd->bhts", q, kr) * scale
    visible = testing._key_mask(q.shape[1], k.shape[1], causal, window, q.device)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    p = torch.exp(s - lse[..., None])
    dp = torch.einsum("bthd,bshd->bhts", dout, vr)
    dpsum = (dout * out).sum(-1).transpose(1, 2)[..., None]
    ds = p * (dp - dpsum)
    dq = torch.einsum("bhts,bshd->bthd", ds, kr) * scale
    dk = torch.einsum("bhts,bthd->bshd", ds, q) * scale
    dv = torch.einsum("bhts,bthd->bshd", p, dout)
    b, s_k, h_k = k.shape[0], k.shape[1], k.shape[2]
    return dq, dk.view(b, s_k, h_k, group, -1).sum(3), dv.view(b, s_k, h_k, group, -1).sum(3)


def _kernel_bwd(dout, q, k, v, out, lse, cu_q, cu_k, used_q, used_k, scale, causal, left, right, softcap,
                deterministic, backend):
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if cu_q is None:
        return _kernel_bwd_dense(dout, q, k, v, out, lse, scale, causal, (left, right))
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for i in range(len(cu_q) - 1):
        q0, k0 = int(cu_q[i]), int(cu_k[i])
        n_q = int(used_q[i]) if used_q is not None else int(cu_q[i + 1]) - q0
        n_k = int(used_k[i]) if used_k is not None else int(cu_k[i + 1]) - k0
        if n_q == 0 or n_k == 0:
            continue
        sl_q, sl_k = slice(q0, q0 + n_q), slice(k0, k0 + n_k)
        g = _kernel_bwd_dense(dout[sl_q][None], q[sl_q][None], k[sl_k][None], v[sl_k][None], out[sl_q][None],
                              lse[:, sl_q][None], scale, causal, (left, right))
        dq[sl_q], dk[sl_k], dv[sl_k] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv


def _sink_ref_dense(q, k, v, sink, causal, window):
    """Explicit: softmax over [keys, sink] with the sink's value 0; (out, lse incl. the sink)."""
    group = q.shape[2] // k.shape[2]
    kr, vr = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bthd,bshd->bhts", q, kr) / math.sqrt(q.shape[-1])
    visible = testing._key_mask(q.shape[1], k.shape[1], causal, window, q.device)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    s = torch.cat([s, sink[None, :, None, None].expand(*s.shape[:3], 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1)[..., :-1]
    return torch.einsum("bhts,bshd->bthd", p, vr), lse


def _sink_ref(q, k, v, sink, causal, window, cu_q=None, cu_k=None, used_q=None, used_k=None):
    if cu_q is None:
        return _sink_ref_dense(q, k, v, sink, causal, window)
    outs, lses, rows = [], [], []
    for i in range(len(cu_q) - 1):
        q0, k0 = int(cu_q[i]), int(cu_k[i])
        n_q = int(used_q[i]) if used_q is not None else int(cu_q[i + 1]) - q0
        n_k = int(used_k[i]) if used_k is not None else int(cu_k[i + 1]) - k0
        o, lse = _sink_ref_dense(q[q0:q0 + n_q][None], k[k0:k0 + n_k][None], v[k0:k0 + n_k][None], sink, causal, window)
        outs.append(o[0]), lses.append(lse[0]), rows.append(torch.arange(q0, q0 + n_q))
    return torch.cat(outs), torch.cat(lses, dim=1), torch.cat(rows)


@pytest.fixture
def reference_ops(monkeypatch):
    monkeypatch.setattr(sinks, "_fwd_op", _ref_fwd)
    monkeypatch.setattr(sinks, "_bwd_op", _kernel_bwd)


def _leaves(*shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen, dtype=torch.float64).requires_grad_() for s in shapes]


# The sink arithmetic runs in fp32 (the kernels' precision) on float64 inputs: fp32 rounding, no more.
TOL = dict(atol=1e-5, rtol=1e-4, check_dtype=False)
CASES = [dict(causal=False, window=(-1, -1)), dict(causal=True, window=(-1, -1)), dict(causal=False, window=(6, 2)),
         dict(causal=True, window=(4, -1))]


@pytest.mark.parametrize("case", CASES, ids=["full", "causal", "window", "causal_window"])
@pytest.mark.parametrize("s_q,s_k", [(17, 17), (9, 23), (23, 9)])
def test_sink_dense_matches_the_explicit_softmax(reference_ops, case, s_q, s_k):
    q, k, v, dout = _leaves((2, s_q, 4, 8), (2, s_k, 2, 8), (2, s_k, 2, 8), (2, s_q, 4, 8))
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    window = case["window"] if not case["causal"] else (case["window"][0], 0)
    out, lse = sinks.attention(q, k, v, sink, None, None, case["causal"], window, 0.0, False, None)
    ref_out, ref_lse = _sink_ref(q, k, v, sink, case["causal"], window)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)
    got = torch.autograd.grad(out, (q, k, v, sink), dout.detach())
    want = torch.autograd.grad(ref_out, (q, k, v, sink), dout.detach())
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), got, want):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sink_varlen_seqused_matches_the_explicit_softmax(reference_ops, causal):
    """Zero-length sequences, unused slot rows (out 0, no share of the sink's gradient), rows that see
    no key (out 0, lse = sink)."""
    slots_q, slots_k = [7, 0, 12, 5], [9, 4, 3, 6]
    used_q, used_k = torch.tensor([5, 0, 12, 5], dtype=torch.int32), torch.tensor([9, 4, 3, 0], dtype=torch.int32)
    cu_q = torch.tensor([0, *itertools.accumulate(slots_q)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(slots_k)], dtype=torch.int32)
    q, k, v, dout = _leaves((sum(slots_q), 4, 8), (sum(slots_k), 1, 8), (sum(slots_k), 1, 8), (sum(slots_q), 4, 8),
                            seed=1)
    sink = torch.tensor([0.3, 1.5, -0.7, -3.0], dtype=torch.float64, requires_grad=True)
    out, lse = sinks.attention(q, k, v, sink, (cu_q, cu_k, used_q, used_k), None, causal, (-1, 0 if causal else -1),
                               0.0, False, None)
    ref_out, ref_lse, rows = _sink_ref(q, k, v, sink, causal, (-1, 0 if causal else -1), cu_q, cu_k, used_q, used_k)
    torch.testing.assert_close(out[rows], ref_out, **TOL)
    torch.testing.assert_close(lse[:, rows], ref_lse, **TOL)
    unused = torch.ones(out.shape[0], dtype=torch.bool)
    unused[rows] = False
    assert bool((out[unused] == 0).all())
    got = torch.autograd.grad(out, (q, k, v, sink), dout.detach())
    want = torch.autograd.grad(ref_out, (q, k, v, sink), dout.detach()[rows])
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), got, want):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("value,error,match", [
    ([0.0, 0.0], TypeError, "learnable_sink must be a tensor of shape \\(nheads,\\)"),
    (torch.zeros(3), ValueError, "learnable_sink must have shape \\(nheads,\\) = \\(2,\\), got \\(3,\\)"),
    (torch.zeros(2, 1), ValueError, "learnable_sink must have shape"),
    (torch.zeros(2, dtype=torch.int32), TypeError, "learnable_sink must be float32"),
])
def test_bad_learnable_sink_is_named(value, error, match):
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(error, match=match):
        flash_attn_func(q, q, q, learnable_sink=value)
    with pytest.raises(error, match=match):
        cu = torch.tensor([0, 8], dtype=torch.int32)
        flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 8, 8, learnable_sink=value)


def test_compile_traces_a_sink_call_in_one_graph():
    from .test_compile import _dense, _traced_ops

    q, k, v = _dense()
    sink = torch.zeros(q.shape[2])

    def block(q, k, v, sink):
        return flash_attn_func(q, k, v, causal=True, learnable_sink=sink).float().sum()

    targets = _traced_ops(block, q, k, v, sink)
    assert targets.count("flashattn_hopper.fwd") == 1, targets


# ---------------------------------------------------------------- GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [None, "sm80"], ids=["default", "sm80"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(113, 203), (239, 100), (1023, 1024)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_sink_api_parity(monkeypatch, backend, dtype, causal, seqlens):
    """out, lse and dq/dk/dv/dsink against the explicit fp32 reference (2x PyTorch's error in the dtype),
    with the sink joined after the kernel (``IN_KERNEL`` off: the path torch.compile and the gate take)."""
    monkeypatch.setattr(sinks, "IN_KERNEL", False)
    _api_parity(backend, dtype, causal, seqlens)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [None, "sm80"], ids=["default", "sm80"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(1, 1), (239, 100), (1023, 1024)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_sink_in_kernel_parity(monkeypatch, backend, head_dim, dtype, causal, seqlens):
    """The sink in the forward kernels' finalize (``sinks.IN_KERNEL``, the default): the same checks, and the call must have taken that path (239x100 causal: rows with no
    key, whose LSE is the sink and out 0)."""
    taken = _in_kernel_on(monkeypatch)
    _api_parity(backend, dtype, causal, seqlens, head_dim)
    assert taken == [True], taken


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [None, "sm80"], ids=["default", "sm80"])
@pytest.mark.parametrize("s_k", [1, 300])
def test_sink_in_kernel_decode(monkeypatch, backend, s_k):
    """Batch 1, one query (decode): the LSE buffer the launcher fills has the sink's own shape, and must
    still be a copy (the kernel overwrites it; the sink parameter stays as it was, checked in
    ``_api_parity``), with dsink right."""
    taken = _in_kernel_on(monkeypatch)
    _api_parity(backend, torch.bfloat16, True, (1, s_k), 128, batch=1)
    assert taken == [True], taken


@pytest.mark.gpu
def test_sink_decode_gqa_joins_after_the_packed_kernel(monkeypatch):
    """The default settings at a GQA decode shape on Hopper: the in-kernel route declines (the plain
    kernel packs the query heads), the sink is joined after it; results by the parity rule."""
    if torch.cuda.get_device_capability() != (9, 0) or os.environ.get("FLASHATTN_HOPPER_BACKEND") == "sm80":
        pytest.skip("needs the default backend on a Hopper GPU: only the sm90 forward packs GQA heads")
    taken = _in_kernel_on(monkeypatch, unpacked=False)
    _api_parity(None, torch.bfloat16, True, (1, 300), 128, batch=2)
    assert taken == [False], taken


def _in_kernel_on(monkeypatch, unpacked: bool = True) -> list:
    """Switches the in-kernel sink on (``unpacked``: even where the plain kernel would pack GQA heads);
    returns a list that records, per forward, whether it ran."""
    taken = []
    in_kernel = sinks._in_kernel_forward

    def spy(*args):
        result = in_kernel(*args)
        taken.append(result is not None)
        return result

    monkeypatch.setattr(sinks, "IN_KERNEL", True)
    monkeypatch.setattr(sinks, "IN_KERNEL_UNPACKED", unpacked)
    monkeypatch.setattr(sinks, "_in_kernel_forward", spy)
    return taken


def _api_parity(backend, dtype, causal, seqlens, head_dim=128, batch=2):
    from flashattn_hopper.testing import assert_close_to_ref, rounding_atol

    s_q, s_k = seqlens
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(batch, s, h, head_dim, dtype=dtype, device="cuda", generator=gen)
                     for s, h in ((s_q, 8), (s_k, 2), (s_k, 2), (s_q, 8)))
    sink = torch.randn(8, device="cuda", generator=gen)
    window = (-1, 0) if causal else (-1, -1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sink)]
    out, lse = flash_attn_func(*leaves[:3], causal=causal, learnable_sink=leaves[3], return_lse=True, backend=backend)
    assert torch.equal(leaves[3], sink), "the call wrote into the sink parameter"
    grads = torch.autograd.grad(out, leaves, dout)
    refs = {}
    for upcast in (True, False):
        ls = [(t.double() if upcast else t).detach().clone().requires_grad_() for t in (q, k, v)]
        ls.append(sink.double().detach().clone().requires_grad_() if upcast else sink.detach().clone().requires_grad_())
        o, l = _sink_ref(*ls[:3], ls[3].to(ls[0].dtype), causal, window)
        refs[upcast] = (o, l, torch.autograd.grad(o, ls, dout.to(o.dtype)))
    assert_close_to_ref("out", out, refs[True][0].to(dtype), refs[False][0])
    assert_close_to_ref("lse", lse, refs[True][1].float(), refs[False][1].float(), atol=1e-4)
    for name, g, r, pt in zip(("dq", "dk", "dv", "dsink"), grads, refs[True][2], refs[False][2]):
        assert_close_to_ref(name, g, r.to(g.dtype), pt.to(g.dtype), atol=rounding_atol(r, dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [None, "sm80"], ids=["default", "sm80"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sink_in_kernel_varlen_seqused(monkeypatch, backend, causal):
    """The in-kernel sink (``sinks.IN_KERNEL``) on packed sequences with seqused: zero-length
    sequences, unused slot rows (out 0), rows with no key (out 0, lse = sink); out and lse against the
    explicit fp32 reference by the parity rule."""
    from flashattn_hopper.testing import assert_close_to_ref

    taken = _in_kernel_on(monkeypatch)
    slots_q, slots_k = [70, 0, 130, 50], [90, 40, 30, 60]
    used_q = torch.tensor([50, 0, 130, 50], dtype=torch.int32, device="cuda")
    used_k = torch.tensor([90, 40, 30, 0], dtype=torch.int32, device="cuda")
    cu_q = torch.tensor([0, *itertools.accumulate(slots_q)], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *itertools.accumulate(slots_k)], dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(sum(slots_q), 8, 128, dtype=torch.bfloat16, device="cuda", generator=gen)
    k, v = (torch.randn(sum(slots_k), 2, 128, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(2))
    sink = torch.randn(8, device="cuda", generator=gen)
    window = (-1, 0) if causal else (-1, -1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sink)]
    out, lse = flash_attn_varlen_func(*leaves[:3], cu_q, cu_k, 130, 90, causal=causal, learnable_sink=leaves[3],
                                      seqused_q=used_q, seqused_k=used_k, return_lse=True, backend=backend)
    refs = {}
    for upcast in (True, False):
        ls = [(t.double() if upcast else t).detach().clone().requires_grad_() for t in (q, k, v)]
        ls.append((sink.double() if upcast else sink.to(q.dtype)).detach().clone().requires_grad_())
        refs[upcast] = _sink_ref(*ls, causal, window, cu_q, cu_k, used_q, used_k), ls
    (ref_out, ref_lse, rows), ref_leaves = refs[True]
    (pt_out, pt_lse, _), pt_leaves = refs[False]
    rows = rows.to(q.device)
    assert_close_to_ref("out", out[rows], ref_out.to(q.dtype), pt_out)
    assert_close_to_ref("lse", lse[:, rows], ref_lse.float(), pt_lse.float(), atol=1e-4)
    unused = torch.ones(out.shape[0], dtype=torch.bool, device=q.device)
    unused[rows] = False
    assert bool((out[unused] == 0).all())
    assert taken == [True], taken
    # The gradients, the sink's among them (the preprocess's sink_grad parts on the eager route), over the
    # used rows; unused rows' dq reads 0 in both.
    from flashattn_hopper.testing import rounding_atol

    dout = torch.randn(rows.numel(), 8, 128, dtype=q.dtype, device="cuda", generator=gen)
    grads = torch.autograd.grad(out[rows], leaves, dout)
    want = torch.autograd.grad(ref_out, ref_leaves, dout.double())
    pt = torch.autograd.grad(pt_out, pt_leaves, dout)
    for name, g, r, t in zip(("dq", "dk", "dv", "dsink"), grads, want, pt):
        assert_close_to_ref(name, g, r.to(g.dtype), t.to(g.dtype), atol=rounding_atol(r, q.dtype))


@pytest.mark.gpu
def test_sink_view_at_an_offset():
    """A sink that is a view into a larger fp32 parameter at a 4-byte offset (packed parameters): the
    forward and the backward's preprocess read it as it is (the kernels' checks asked 16-byte alignment
    of it once), dsink equal to the same call's with a fresh copy of the logits."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v, dout = (torch.randn(2, 300, 4, 64, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(4))
    packed = torch.randn(9, device="cuda", generator=gen).requires_grad_()
    fresh = packed.detach()[1:5].clone().requires_grad_()
    grads = []
    for leaf, sink in ((packed, packed[1:5]), (fresh, fresh)):  # (the view: a data pointer 4 bytes on)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)] + [leaf]
        out = flash_attn_func(*leaves[:3], causal=True, learnable_sink=sink)
        grads.append(list(torch.autograd.grad(out, leaves, dout)))
    grads[0][3] = grads[0][3][1:5]
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), *grads):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [None, "sm80"], ids=["default", "sm80"])
def test_sink_gradient_deterministic_is_bitwise_stable(backend):
    """``deterministic=True`` with a sink: dq, dk, dv and dsink bit for bit the same over runs (the sink's
    gradient is summed from per-warp parts in a fixed order, no atomics)."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v, dout = (torch.randn(2, 1000, 4, 64, dtype=torch.bfloat16, device="cuda", generator=gen)
                     for _ in range(4))
    sink = torch.randn(4, device="cuda", generator=gen).requires_grad_()
    leaves = [t.requires_grad_() for t in (q, k, v)] + [sink]
    runs = []
    for _ in range(3):
        out = flash_attn_func(*leaves[:3], causal=True, learnable_sink=sink, deterministic=True, backend=backend)
        runs.append(torch.autograd.grad(out, leaves, dout))
    for run in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv", "dsink"), runs[0], run):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("family_name", ["sm80", "sm90"])
@pytest.mark.parametrize("shape", [(1, 1), (2, 300)], ids=["decode", "prefill"])
def test_sink_logits_reach_the_kernel(monkeypatch, family_name, shape):
    """sm80's in-kernel route: the LSE buffer (the kernel reads the logits there and overwrites them) holds each
    head's logit in every row and never shares memory with the sink parameter (batch 1 with one query once made
    ``expand().contiguous()`` return the parameter itself). sm90's: no such buffer (the launch allocates the LSE),
    the fp32 logits in the kernel's sink slot. The sink key has the family's restrictions. CPU: the launch and
    device lookups are stand-ins."""
    from flashattn_hopper import dispatch
    from flashattn_hopper.validate import AttnProblem

    launched = {}

    def launch(compiled, key, q, k, v, p, varlen, out, lse, extra):
        launched.update(key=key, lse=None if lse is None else lse.clone(), extra=extra,
                        lse_ptr=None if lse is None else lse.data_ptr())
        return torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype), lse

    _cpu_launch_stand_ins(monkeypatch, launch)
    batch, s_q = shape
    q = torch.zeros(batch, s_q, 8, 128, dtype=torch.bfloat16)
    k = v = torch.zeros(batch, 40, 2, 128, dtype=torch.bfloat16)
    sink = torch.randn(8)
    p = AttnProblem(batch=batch, seqlen_q=s_q, seqlen_k=40, nheads=8, nheads_k=2, head_dim=128, head_dim_v=128,
                    dtype=torch.bfloat16, softmax_scale=0.1, causal=True, window_left=-1, window_right=0,
                    softcap=0.0, is_varlen=False)
    dispatch.FWD_KERNELS[family_name].forward_with_sink(q, k, v, p, None, sink, even_unpacked=True)
    lse, key = launched["lse"], launched["key"]
    if family_name == "sm80":
        assert lse.shape == (batch, 8, s_q) and torch.equal(lse, sink[None, :, None].expand(batch, 8, s_q))
        assert launched["lse_ptr"] != sink.data_ptr(), "the LSE buffer is the sink parameter itself"
    else:
        logits = launched["extra"][5]  # (max_ctas, counter, gate, FP8 descales, live blocks, sink logits)
        assert lse is None and logits.dtype == torch.float32 and torch.equal(logits, sink)
    assert key.sink and (family_name == "sm80" or (key.pack_gqa == 1 and not key.span_heads))


@pytest.mark.parametrize("causal, softcap", [(True, 0.0), (False, 30.0)], ids=["causal", "full-softcap"])
def test_sink_plan_hands_the_kernel_the_general_launch_arguments(monkeypatch, causal, softcap):
    """A dense sinked sm90 call keeps a plan (``sm90_fwd.SinkPlan``): its call hands the compiled kernel what the
    general launch does for the same key (the logits in the sink slot, the softcap among the scalars, the tile
    counter where the schedule is dynamic), and the second call of a problem takes the kept plan. CPU: the kernel
    and device lookups are stand-ins."""
    pytest.importorskip("cutlass")
    from flashattn_hopper.backends import common, sm90_fwd
    from flashattn_hopper.validate import AttnProblem

    from ._plan_launch import assert_same_launch, record_sm90_launches

    calls = record_sm90_launches(monkeypatch)
    monkeypatch.setattr(common, "_SINK_PLANS", {})
    monkeypatch.setattr(sm90_fwd, "_SINK_PLANS", common._SINK_PLANS)
    family = sm90_fwd.FwdSm90()
    p = AttnProblem(batch=2, seqlen_q=300, seqlen_k=300, nheads=4, nheads_k=4, head_dim=128, head_dim_v=128,
                    dtype=torch.bfloat16, softmax_scale=0.125, causal=causal, window_left=-1,
                    window_right=0 if causal else -1, softcap=softcap, is_varlen=False)
    q, k, v = (torch.zeros(2, 300, 4, 128, dtype=torch.bfloat16) for _ in range(3))
    logits = torch.randn(4)
    _, key = family.variant_key(p, None, sink=True, **family.sink_key_overrides)
    extra = family.extra_args(key, q.device, 0)
    common.launch_forward(lambda *args: calls.append(args), key, q, k, v, p, None, None, None,
                          (*extra[:5], logits))
    family.launch_sinked(q, k, v, p, None, key, logits)
    family.launch_sinked(q, k, v, p, None, key, logits)
    general, planned, again = calls
    assert_same_launch(planned, general)
    assert_same_launch(again, general)
    assert isinstance(common._SINK_PLANS[(key, p, q.device)], sm90_fwd.SinkPlan)


def _cpu_launch_stand_ins(monkeypatch, launch) -> None:
    """The forward launchers on the CPU: no compile, no plans (the dense sink routes' ``plan`` and ``sink_plan``),
    ``launch`` for ``launch_forward``, device 0 with 132 SMs and a CPU tile counter."""
    from flashattn_hopper.backends import common, sm90_fwd

    monkeypatch.setattr(common.compile_cache, "get", lambda key, build: None)
    monkeypatch.setattr(common.FwdLauncher, "plan", lambda self, q, p, key=None: None)
    monkeypatch.setattr(sm90_fwd.FwdSm90, "sink_plan", lambda self, q, p, key: None)
    for module in (common, sm90_fwd):
        monkeypatch.setattr(module, "_SINK_PLANS", {})
        monkeypatch.setattr(module, "launch_forward", launch)
        monkeypatch.setattr(module, "current_stream_handle", lambda index: 0)
        monkeypatch.setattr(module, "device_index", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(sm90_fwd, "num_sms", lambda index: 132)
    monkeypatch.setattr(sm90_fwd, "tile_counter", lambda index, stream=None: torch.zeros(1, dtype=torch.int32))


@pytest.mark.parametrize("heads", [(8, 2), (8, 8)], ids=["gqa", "mha"])
def test_sink_in_kernel_keeps_packed_gqa(monkeypatch, heads):
    """Decode (one query): the sm90 forward packs a KV head's query heads into one tile, which the sink
    key cannot (3-6x faster, perf/NOTES.md session 3): the in-kernel route declines (None: the caller
    joins the sink after the packed kernel); with MHA nothing is given up and it launches. CPU: the
    launch and device lookups are stand-ins."""
    from flashattn_hopper import dispatch
    from flashattn_hopper.validate import AttnProblem

    launched = []
    _cpu_launch_stand_ins(monkeypatch, lambda *args: launched.append(args[1]) or (args[2], args[8]))
    h, h_k = heads
    q = torch.zeros(4, 1, h, 128, dtype=torch.bfloat16)
    k = v = torch.zeros(4, 4096, h_k, 128, dtype=torch.bfloat16)
    p = AttnProblem(batch=4, seqlen_q=1, seqlen_k=4096, nheads=h, nheads_k=h_k, head_dim=128, head_dim_v=128,
                    dtype=torch.bfloat16, softmax_scale=0.1, causal=True, window_left=-1, window_right=0,
                    softcap=0.0, is_varlen=False)
    result = dispatch.FWD_KERNELS["sm90"].forward_with_sink(q, k, v, p, None, torch.randn(h))
    if h == h_k:
        assert result is not None and len(launched) == 1 and launched[0].sink
    else:
        assert result is None and not launched


@pytest.mark.gpu
def test_forward_only_sink_call_needs_no_backward_family():
    """``backend="sm90"`` with v wider than q/k (64 / 256): the forward serves it, the sm90 backward does
    not; a sinked call without gradients still runs (the route looks the backward up lazily: None)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the case is backend='sm90' serving a forward its backward does not, which needs a Hopper GPU "
                    "(on other GPUs no backend forwards this pair without also serving its backward)")
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k = (torch.randn(1, 100, 2, 64, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(2))
    v = torch.randn(1, 100, 2, 256, dtype=torch.bfloat16, device="cuda", generator=gen)
    sink = torch.randn(2, device="cuda", generator=gen)
    with torch.no_grad():
        out = flash_attn_func(q, k, v, causal=True, learnable_sink=sink, backend="sm90")
    assert out.shape == (1, 100, 2, 256) and bool(torch.isfinite(out).all())


def test_row_mask_of_a_batch_with_no_sequence():
    """``cu_seqlens_q = [0]`` (no sequence) with padding rows in q: every row is padding (the lookup indexed the
    empty ``seqused_q``: IndexError on the CPU, a device-side assert on CUDA)."""
    q = torch.zeros(8, 2, 64)
    mask = sinks._row_mask(q, torch.tensor([0], dtype=torch.int32), torch.zeros(0, dtype=torch.int32))
    assert mask.shape == (8,) and not bool(mask.any())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_varlen_sink_and_gate_with_no_sequence_on_cuda():
    """A varlen batch of no sequence (``cu_seqlens = [0]``) whose q holds padding rows, with a learnable sink or a
    gate (and seqused_q): results of the right shapes and no device-side assert (the row lookups indexed empty
    lengths before)."""
    q = torch.randn(8, 2, 64, dtype=torch.bfloat16, device="cuda")
    cu = torch.tensor([0], dtype=torch.int32, device="cuda")
    used = torch.zeros(0, dtype=torch.int32, device="cuda")
    for extra in ({"learnable_sink": torch.zeros(2, device="cuda"), "seqused_q": used},
                  {"log_decay": torch.zeros(8, 2, device="cuda")},
                  {"log_decay": torch.zeros(8, 2, device="cuda"), "seqused_q": used}):
        out, lse = flash_attn_varlen_func(q, q, q, cu, cu, 0, 0, return_lse=True, **extra)
        torch.cuda.synchronize()
        assert out.shape == (8, 2, 64) and lse.shape == (2, 8), list(extra)
