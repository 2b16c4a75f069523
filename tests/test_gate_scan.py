"""``log_decay``'s scan route (dense calls on Hopper, ``gate.ScannedPlan``): the CuTe DSL kernels that build G, the
keys' bias rows and K's slice from g (``kernels/common/gate_scan.py``) and g's gradient from the backward's dS sums
(``kernels/common/gate_scan_grad.py``), and the route's autograd and kept plan.

CPU tier: g's gradient from G's at the keys and at the queries (``_scan_gradient``), the route's autograd with torch
stand-ins for its three kernels. GPU tier: both kernels against fp64, the forward through the scan kernel and a
repeated call through its kept plan, with the parity rule.
"""

from __future__ import annotations

import os

import pytest
import torch

from flashattn_hopper import flash_attn_func, gate, testing

from .test_gate import _gated_ref_dense


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("s_q,s_k", [(37, 37), (20, 37), (45, 37)])
def test_scan_gradient_is_that_of_cumsum_at_keys_and_queries(dtype, s_q, s_k):
    """After a scanned forward (``GatedAttnFunc``'s ``scanned`` route: G built by the scan kernel from g) the backward
    turns G's gradients at the keys and at the queries into g's (``_scan_gradient``): the same as autograd through
    ``cumulative`` and ``at_queries``, in g's dtype; ``_rows_at_queries`` is ``at_queries`` on G's rows."""
    gen = torch.Generator().manual_seed(0)
    g = torch.nn.functional.logsigmoid(torch.randn(2, s_k, 3, generator=gen)).to(dtype).requires_grad_()
    G = gate.cumulative(g, None)
    G_q = gate.at_queries(G, s_q)
    torch.testing.assert_close(gate._rows_at_queries(G.detach().transpose(1, 2), s_q), G_q.detach().transpose(1, 2))
    dG, dG_q = torch.randn(2, s_k, 3, generator=gen), torch.randn(2, s_q, 3, generator=gen)
    want = torch.autograd.grad((G * dG).sum() + (G_q * dG_q).sum(), g)[0]
    got = gate._scan_gradient(dG, dG_q, dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class _EmulatedGateFamily:
    """Torch stand-ins for the sm90 gated forward and backward kernels (``forward_with_gate`` / ``backward_with_gate``'s
    contracts: out and the LSE less ``G_i``; dq, dk, dv and dS's sums per key and per query) on the bias ``-G_j /
    scale`` in the scores' units, causal, MHA."""

    def __init__(self, scale):
        self.scale = scale

    def forward_with_gate(self, *args):  # (only its presence is asked)
        raise AssertionError("the scanned route launches through its plan")

    def can_gate(self, p):
        return True

    def scores(self, q, k, bias_rows, key_add, query_add):
        s = torch.einsum("bthd,bshd->bhts", q, k) * self.scale + (bias_rows * self.scale + key_add)[:, :, None, :]
        s = s + query_add[..., None]
        s_q, s_k = q.shape[1], k.shape[1]
        visible = testing._key_mask(s_q, s_k, True, (-1, 0), q.device)
        return s.masked_fill(~visible, float("-inf"))

    def launch(self, q, k, v, bias_rows, k_slice):
        zeros_k, zeros_q = torch.zeros_like(bias_rows), torch.zeros(q.shape[0], q.shape[2], q.shape[1])
        s = self.scores(q, k, bias_rows, zeros_k, zeros_q)
        return torch.einsum("bhts,bshd->bthd", torch.softmax(s, -1), v), torch.logsumexp(s, -1)

    def backward_with_gate(self, dout, q, k, v, out, lse, p, varlen, deterministic, bias, rows_dpsum=False):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        key_add = torch.zeros_like(bias, requires_grad=True)
        query_add = torch.zeros(q.shape[0], q.shape[2], q.shape[1], requires_grad=True)
        with torch.enable_grad():  # (a Function's backward runs without grad mode)
            s = self.scores(*leaves[:2], bias, key_add, query_add)
            o = torch.einsum("bhts,bshd->bthd", torch.softmax(s, -1), leaves[2])
        dq, dk, dv, key_sums, query_sums = torch.autograd.grad(o, [*leaves, key_add, query_add], dout)
        return dq, dk, dv, key_sums, query_sums


@pytest.mark.parametrize("want_lse", [True, False])
def test_scanned_route_autograd_with_emulated_kernels(monkeypatch, want_lse):
    """``GatedAttnFunc`` on the scan route (a ``ScannedPlan``: g in, the scan, the kept forward plan, the in-kernel
    backward's sums, dg by the gradient scan), its three CUDA kernels replaced by torch stand-ins: out, the LSE (None
    without ``want_lse``) and dq/dk/dv/dg against the definition. The CPU tier's check of that route's wiring (its
    inputs and gradients counted alike: the GPU tier found a 13th input without its gradient, session 38)."""
    from flashattn_hopper.backends import gate_scan

    scale = 0.3
    family = _EmulatedGateFamily(scale)

    def scan(g, scale_, slice_dtype, arch):
        G_rows = torch.cumsum(g.double(), 1).float().transpose(1, 2).contiguous()
        return G_rows, G_rows / -scale_, None

    def scan_gradient(key_sums, query_sums, dtype, arch):
        total = query_sums - key_sums  # (self-attention: as many queries as keys)
        return total.double().flip(-1).cumsum(-1).flip(-1).transpose(1, 2).to(dtype)

    monkeypatch.setattr(gate_scan, "scan", scan)
    monkeypatch.setattr(gate_scan, "scan_gradient", scan_gradient)
    plan = gate.ScannedPlan.__new__(gate.ScannedPlan)
    options = gate.gate_options(scale, True, (-1, 0), False, None)
    plan.route, plan.options, plan.slice_dtype, plan.arch = (family, family, None, None), options, None, "sm_90a"
    plan.fwd_plan = None
    monkeypatch.setattr(gate.ScannedPlan, "launch", lambda self, *a: family.launch(*a))
    gen = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(2, 19, 3, 8, generator=gen) for _ in range(4))
    g = torch.nn.functional.logsigmoid(torch.randn(2, 19, 3, generator=gen) + 1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g)]
    out, lse = plan(*leaves, None, want_lse)
    grads = torch.autograd.grad(out, leaves, dout)
    ref = [t.clone().requires_grad_() for t in (q, k, v, g)]
    ref_out, ref_lse = _gated_ref_dense(*ref, True, (-1, 0), scale)
    ref_grads = torch.autograd.grad(ref_out, ref, dout)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    if want_lse:
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    else:
        assert lse is None
    for name, got, want in zip(("dq", "dk", "dv", "dg"), grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("slice_dtype", [None, torch.bfloat16, torch.float16], ids=["rows", "bf16_slice", "fp16_slice"])
def test_gate_scan_kernel_builds_G_bias_and_slice(slice_dtype):
    """The dense gated forward's inputs by one CuTe DSL kernel (``backends/gate_scan.py``): G against an fp64
    cumsum (its fp64 carry: within fp32 rounding of |G| at 16k keys of strong decay), the bias rows bit for bit
    ``G / -scale`` (torch's division of the kernel's own G: a product with the fp32 reciprocal, as the kernel's) and K's slice bit for bit the torch build from them;
    shapes ending mid-step (keys and heads), a bf16 ``g``, a strided one."""
    from flashattn_hopper.backends.gate_scan import scan
    from flashattn_hopper.backends.sm90_fwd import gate_k_slice_torch

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs a Hopper GPU: the G scan kernel compiles for sm_90a only (it serves the sm90 forward)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = 0.125
    for batch, keys, heads in ((2, 37, 3), (1, 1000, 32), (3, 129, 20), (1, 16384, 2), (2, 1, 5), (1, 4099, 40)):
        g = torch.nn.functional.logsigmoid(torch.randn(batch, keys, heads, device="cuda", generator=gen) * 2 - 1)
        G_rows, bias_rows, k_slice = scan(g, scale, slice_dtype, "sm_90a")
        want = torch.cumsum(g.double(), dim=1).transpose(1, 2)
        torch.testing.assert_close(G_rows.double(), want, rtol=0, atol=float(want.abs().max()) * 2e-7 + 1e-6)
        assert bias_rows.stride(1) % 4 == 0 and G_rows.stride(1) % 4 == 0
        assert torch.equal(bias_rows, G_rows / -scale)
        if slice_dtype is None:
            assert k_slice is None
        else:
            built = gate_k_slice_torch(bias_rows, slice_dtype, False)
            assert torch.equal(k_slice.view(torch.int16), built.view(torch.int16)), (batch, keys, heads)
    g = torch.randn(2, 300, 8, device="cuda", generator=gen).clamp(max=0)
    for variant in (g.to(torch.bfloat16), g.transpose(1, 2).contiguous().transpose(1, 2)):
        G_rows, _, _ = scan(variant, scale, None, "sm_90a")
        torch.testing.assert_close(G_rows, torch.cumsum(variant.float(), dim=1).transpose(1, 2), rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(113, 203), (1023, 1024), (300, 2048)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_gate_forward_through_the_scan_kernel(monkeypatch, head_dim, causal, seqlens):
    """A gated forward whose g needs no gradient takes the scan kernel (``gate.scanned_gate``; K's slice from
    1k keys): out and lse against the fp32 definition with the parity rule, GQA, odd lengths."""
    from flashattn_hopper.backends import gate_scan
    from flashattn_hopper.testing import assert_close_to_ref

    if torch.cuda.get_device_capability() != (9, 0) or os.environ.get("FLASHATTN_HOPPER_BACKEND") == "sm80":
        pytest.skip("needs a Hopper GPU and the sm90 backend: only the sm90 forward takes the G scan kernel")
    scans, scan = [], gate_scan.scan
    monkeypatch.setattr(gate_scan, "scan", lambda *a: scans.append(a[2]) or scan(*a))
    s_q, s_k = seqlens
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, s, h, head_dim, dtype=torch.bfloat16, device="cuda", generator=gen)
               for s, h in ((s_q, 8), (s_k, 2), (s_k, 2)))
    g = torch.nn.functional.logsigmoid(torch.randn(2, s_k, 8, device="cuda", generator=gen) * 2 + 3)
    out, lse = flash_attn_func(q, k, v, causal=causal, log_decay=g, return_lse=True)
    assert len(scans) == 1
    window = (-1, 0) if causal else (-1, -1)
    ref_out, ref_lse = _gated_ref_dense(q.float(), k.float(), v.float(), g, causal, window, head_dim ** -0.5)
    pt_out, pt_lse = _gated_ref_dense(q, k, v, g, causal, window, head_dim ** -0.5)
    assert_close_to_ref("out", out, ref_out.to(torch.bfloat16), pt_out)
    assert_close_to_ref("lse", lse, ref_lse.float(), pt_lse.float(), atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_scan_gradient_kernel_is_the_reverse_cumsum(dtype):
    """g's gradient by one CuTe DSL call after the in-kernel backward (``gate_scan.scan_gradient``): the reverse
    cumsum of the query sums (at their key positions, ``seqlen_k - seqlen_q`` on) less the key sums (fp32 terms),
    against fp64 sums;
    fewer, more and as many queries as keys, odd lengths and head counts, padded key rows, 16k keys."""
    from flashattn_hopper.backends.gate_scan import scan_gradient

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs a Hopper GPU: the dg scan kernel compiles for sm_90a only (it serves the sm90 backward)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for batch, heads, s_q, s_k in ((2, 3, 37, 37), (1, 32, 1000, 1000), (3, 20, 100, 129), (2, 5, 300, 37),
                                   (1, 40, 4099, 4099), (1, 2, 16384, 16384), (2, 1, 1, 1)):
        key_rows = torch.randn(batch, heads, -(-s_k // 4) * 4, device="cuda", generator=gen)[..., :s_k]
        query_rows = torch.randn(batch, heads, s_q, device="cuda", generator=gen)
        got = scan_gradient(key_rows, query_rows, dtype, "sm_90a")
        total = -key_rows  # (each term in fp32, as the kernel takes it; the sums in fp64)
        if s_q <= s_k:
            total[..., s_k - s_q:] += query_rows
        else:
            total += query_rows[..., s_q - s_k:]
        want = total.double().flip(-1).cumsum(-1).flip(-1).transpose(1, 2)
        assert got.dtype == dtype and tuple(got.shape) == (batch, s_k, heads)
        if dtype == torch.float32:
            torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
        else:  # (fp64 -> fp32 -> bf16 against fp64 -> bf16: at most one ulp apart)
            torch.testing.assert_close(got.float(), want.to(dtype).float(), rtol=2 ** -7, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen", [203, 1024])
def test_repeated_gated_call_runs_its_kept_plan(seqlen):
    """A dense gated call's second call runs the plan the first kept (``gate.ScannedPlan`` in ``api._PLANS``: no
    validation, no route lookup): out and lse bit for bit the first call's, dq/dk/dv/dg within the rounding of the
    backward's atomic dQ sums, also without ``return_lse`` (no LSE add then); the plan is per ``deterministic``, and
    a bad ``log_decay`` (another shape) still gets the validation's error."""
    from flashattn_hopper import api

    if torch.cuda.get_device_capability() != (9, 0) or os.environ.get("FLASHATTN_HOPPER_BACKEND") == "sm80":
        pytest.skip("needs a Hopper GPU and the sm90 backend: only the sm90 forward takes the scan route")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(2, seqlen, h, 128, dtype=torch.bfloat16, device="cuda", generator=gen)
                     for h in (8, 2, 2, 8))
    g = torch.nn.functional.logsigmoid(torch.randn(2, seqlen, 8, device="cuda", generator=gen) * 2 + 3)
    leaves = [t.requires_grad_() for t in (q, k, v, g)]
    results = []
    for _ in range(2):
        out, lse = flash_attn_func(*leaves[:3], causal=True, log_decay=leaves[3], return_lse=True)
        results.append((out, lse, *torch.autograd.grad(out, leaves, dout)))
    plans = [plan for plan in api._PLANS.values() if isinstance(plan, gate.ScannedPlan)]
    assert len(plans) == 1 and plans[0].fwd_plan is not None
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    for first, second in zip(results[0][2:], results[1][2:]):
        torch.testing.assert_close(first, second)
    # without return_lse the plan skips the LSE's G_i add: the same out and gradients
    out = flash_attn_func(*leaves[:3], causal=True, log_decay=leaves[3])
    assert torch.equal(out, results[0][0])
    for first, second in zip(results[0][2:], torch.autograd.grad(out, leaves, dout)):
        torch.testing.assert_close(first, second)
    flash_attn_func(*leaves[:3], causal=True, log_decay=leaves[3], deterministic=True)
    assert len([plan for plan in api._PLANS.values() if isinstance(plan, gate.ScannedPlan)]) == 2
    with pytest.raises(ValueError, match="log_decay must have shape"):
        flash_attn_func(*leaves[:3], causal=True, log_decay=leaves[3][:, :-1])
