"""``log_decay`` (gated log-decay attention, Forgetting Transformer): score ``q_i . k_j * scale +
G_i - G_j`` with ``G = cumsum(g)`` per sequence.

CPU tier: ``gate.py``'s construction (three more q/k columns holding ``-G_j`` in bf16 parts, q
pre-scaled, scale 1, ``G_i`` added to the LSE) run through the fp32/fp64 reference equals the gated
attention written out from its definition (an explicit N x N bias): out, LSE and the gradients of
q, k, v and g (``dg`` through the cumsum), dense (``seqlen_q`` above and below ``seqlen_k``, causal,
windows, GQA with a gate per query head) and varlen (seqused, zero-length sequences); the cumsum
restarting per sequence; the split's precision; the argument's errors.

GPU tier: the public API on both backends against the fp32 definition with the parity rule.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from flashattn_hopper import flash_attn_func, flash_attn_varlen_func, gate, testing


def _gated_ref_dense(q, k, v, g, causal, window, scale):
    """The definition: scores + G_i - G_j, masked, softmax; (out, lse) in the API's layouts."""
    group = q.shape[2] // k.shape[2]
    kr, vr = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    # G and the bias G_i - G_j at (at least) fp32, the bias then in q's dtype (as careful PyTorch code
    # would add it: a near key's small bias stays exact, whatever |G| has grown to).
    wide = torch.promote_types(q.dtype, torch.float32)
    G = torch.cumsum(g.to(wide), dim=1)  # (b, s_k, h)
    s_q, s_k = q.shape[1], k.shape[1]
    pos = (torch.arange(s_q) + s_k - s_q).to(G.device)
    Gq = torch.where((pos >= 0)[None, :, None], G[:, pos.clamp(0, max(s_k - 1, 0))], torch.zeros((), dtype=wide, device=G.device))
    bias = (Gq.permute(0, 2, 1)[..., None] - G.permute(0, 2, 1)[:, :, None, :]).to(q.dtype)
    s = torch.einsum("bthd,bshd->bhts", q, kr) * scale + bias
    visible = testing._key_mask(s_q, s_k, causal, window, q.device)
    if visible is None:
        visible = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device)
    has_key = visible.any(-1, keepdim=True)
    s = s.masked_fill(~visible, float("-inf")).masked_fill(~has_key, 0.0)
    lse = torch.logsumexp(s, -1).masked_fill(~has_key[..., 0], float("-inf"))
    out = torch.einsum("bhts,bshd->bthd", torch.softmax(s, -1) * has_key, vr)
    return out, lse


def _via_gate(q, k, v, g, causal, window, scale, varlen=None):
    """gate.py's construction with attention_ref standing in for the kernels."""
    cu_q, cu_k, used_q, used_k = varlen if varlen is not None else (None,) * 4
    G = gate.cumulative(g, cu_k)
    q2, k2, v2 = gate.augment(q, k, v, G, scale, 1 if varlen is not None else 2)
    out, lse = testing.attention_ref(q2, k2, v2, softmax_scale=1.0, causal=causal, window_size=window,
                                     cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q, seqused_k=used_k)
    if varlen is None:
        return out, lse + gate.at_queries(G, q.shape[1]).transpose(1, 2)
    return out, lse + gate.at_queries_varlen(G, q.shape[0], cu_q, cu_k, used_q, used_k).t()


def _leaves(*shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen, dtype=torch.float64).requires_grad_() for s in shapes]


def _gates(shape, seed=1):
    """Log forget gates: log(sigmoid(x)) <= 0, with some strong decays."""
    gen = torch.Generator().manual_seed(seed)
    return torch.nn.functional.logsigmoid(torch.randn(*shape, generator=gen, dtype=torch.float64) * 2 + 1).requires_grad_()


# fp32 inside the construction (q pre-scaled in fp32, G in fp32) on fp64 inputs
TOL = dict(atol=2e-5, rtol=2e-4, check_dtype=False)


@pytest.fixture(autouse=True)
def exact_parts(request, monkeypatch):
    """The algebra tests take -G's parts unrounded (G, 0, 0): bf16 parts round the gradient that
    flows back through them to bf16 as well, which the kernels' bf16 dk does anyway; the split's own
    precision and gradient are tested apart."""
    if "split" in request.node.name or "gpu" in request.keywords:
        return
    monkeypatch.setattr(gate, "split_bf16", lambda x: torch.stack([x, torch.zeros_like(x), torch.zeros_like(x)], -1))
def _assert_matches_definition(out, lse, leaves, dout, causal, window, scale):
    """out, LSE and the gradients of (q, k, v, g) equal the dense definition's (``TOL``)."""
    ref_out, ref_lse = _gated_ref_dense(*leaves, causal, window, scale)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)
    got = torch.autograd.grad(out, leaves, dout.detach())
    want = torch.autograd.grad(ref_out, leaves, dout.detach())
    for name, a, b in zip(("dq", "dk", "dv", "dg"), got, want):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, n=name: f"{n}: {m}")


CASES = [(False, (-1, -1)), (True, (-1, 0)), (False, (5, 3)), (True, (6, 0))]


@pytest.mark.parametrize("causal,window", CASES, ids=["full", "causal", "window", "causal_window"])
@pytest.mark.parametrize("s_q,s_k", [(21, 21), (9, 23), (23, 9)])
def test_gate_dense_matches_the_definition(causal, window, s_q, s_k):
    q, k, v, dout = _leaves((2, s_q, 4, 16), (2, s_k, 2, 16), (2, s_k, 2, 16), (2, s_q, 4, 16))
    g = _gates((2, s_k, 4))
    scale = 0.3
    out, lse = _via_gate(q, k, v, g, causal, window, scale)
    _assert_matches_definition(out, lse, (q, k, v, g), dout, causal, window, scale)


def test_gate_varlen_self_attention_shortcut_matches_the_general_route():
    """One ``cu_seqlens`` object for queries and keys (no seqused) takes G as G_q; the same call with a
    copy of it takes ``at_queries_varlen``: out, lse and every gradient agree bit for bit."""
    lens = [7, 0, 12, 5]
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    q, k, v, dout = _leaves((sum(lens), 2, 16), (sum(lens), 1, 16), (sum(lens), 1, 16), (sum(lens), 2, 16))
    g = _gates((sum(lens), 2))
    results = []
    for cu_k in (cu, cu.clone()):
        out, lse = _via_gate(q, k, v, g, True, (-1, 0), 0.25, (cu, cu_k, None, None))
        grads = torch.autograd.grad((out * dout.detach()).sum(), (q, k, v, g))
        results.append((out, lse, *grads))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_gate_varlen_matches_the_definition_per_sequence():
    slots_q, slots_k = [7, 0, 12, 5], [9, 4, 3, 6]
    used_q, used_k = torch.tensor([5, 0, 12, 5], dtype=torch.int32), torch.tensor([9, 4, 3, 0], dtype=torch.int32)
    cu_q = torch.tensor([0, *itertools.accumulate(slots_q)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(slots_k)], dtype=torch.int32)
    q, k, v, dout = _leaves((sum(slots_q), 2, 16), (sum(slots_k), 1, 16), (sum(slots_k), 1, 16), (sum(slots_q), 2, 16))
    g = _gates((sum(slots_k), 2))
    out, lse = _via_gate(q, k, v, g, True, (-1, 0), 0.25, (cu_q, cu_k, used_q, used_k))
    loss = (out * dout.detach()).sum()
    grads = torch.autograd.grad(loss, (q, k, v, g))
    want_loss = 0
    for i in range(4):
        sq = slice(int(cu_q[i]), int(cu_q[i]) + int(used_q[i]))
        sk = slice(int(cu_k[i]), int(cu_k[i]) + int(used_k[i]))
        if int(used_q[i]) == 0:
            continue
        if int(used_k[i]) == 0:  # no keys: out 0, lse -inf
            assert bool((out[sq] == 0).all()) and bool((lse[:, sq] == float("-inf")).all())
            continue
        o, l = _gated_ref_dense(q[sq][None], k[sk][None], v[sk][None], g[sk][None], True, (-1, 0), 0.25)
        torch.testing.assert_close(out[sq], o[0], **TOL)
        torch.testing.assert_close(lse[:, sq], l[0], **TOL)
        want_loss = want_loss + (o[0] * dout.detach()[sq]).sum()
    want = torch.autograd.grad(want_loss, (q, k, v, g), allow_unused=True)
    for name, a, b in zip(("dq", "dk", "dv", "dg"), grads, want):
        b = torch.zeros_like(a) if b is None else b
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture
def emulated_ops(monkeypatch):
    """gate.py's op seams: the fp32 reference forward and the kernels' backward formula
    (``test_sinks``), which must be asked for dk in fp32 and returns it so."""
    from .test_sinks import _kernel_bwd, _ref_fwd

    def bwd(*args):
        *plain, dk_fp32 = args
        assert dk_fp32 is True, "the gated backward must take dK's columns unrounded"
        dq, dk, dv = _kernel_bwd(*plain)
        return dq, dk.float(), dv

    monkeypatch.setattr(gate, "_fwd_op", _ref_fwd)
    monkeypatch.setattr(gate, "_bwd_op", bwd)


@pytest.mark.parametrize("causal,window", [(True, (-1, 0)), (False, (5, 3))], ids=["causal", "window"])
def test_gated_function_matches_the_definition(emulated_ops, causal, window):
    """``gate.attention`` (``GatedAttnFunc`` on the op seams, as the API runs it): out, LSE, dq/dk/dv/dg."""
    q, k, v, dout = _leaves((2, 19, 4, 16), (2, 23, 2, 16), (2, 23, 2, 16), (2, 19, 4, 16))
    g = _gates((2, 23, 4))
    out, lse = gate.attention(q, k, v, g, None, 0.3, causal, window, False, None)
    _assert_matches_definition(out, lse, (q, k, v, g), dout, causal, window, 0.3)


def test_gated_gradient_sums_to_zero_with_an_inexact_dpsum(monkeypatch):
    """The kernels' ``dPsum = rowsum(dO * O)`` reads a rounded O, so their dS rows do not sum to 0.
    dG must take those row sums (dQ's row-sum column) beside the column sums: then it sums to zero
    over a sequence (dg at the first key, the total, is ~0) however large the rounding. Dropping the
    row sums leaves the rounding's sum there (it grew with the sequence on an H100)."""
    from .test_sinks import _kernel_bwd, _ref_fwd

    def bwd(dout, q, k, v, out, lse, *rest):
        *plain, _ = rest
        return tuple(t.float() for t in _kernel_bwd(dout, q, k, v, out * 1.01, lse, *plain))  # O off by 1 %

    monkeypatch.setattr(gate, "_fwd_op", _ref_fwd)
    monkeypatch.setattr(gate, "_bwd_op", bwd)
    q, k, v, dout = _leaves((2, 23, 4, 16), (2, 23, 2, 16), (2, 23, 2, 16), (2, 23, 4, 16))
    g = _gates((2, 23, 4))
    out, _ = gate.attention(q, k, v, g, None, 0.3, True, (-1, 0), False, None)
    (dg,) = torch.autograd.grad(out, (g,), dout.detach())
    assert dg[:, 0].abs().max() < 1e-5, dg[:, 0]
    assert dg.abs().max() > 1e-2  # (not all zero)


def test_cumulative_restarts_per_sequence():
    g = torch.randn(10, 3, dtype=torch.float64)
    cu = torch.tensor([0, 4, 4, 10], dtype=torch.int32)
    G = gate.cumulative(g, cu)
    torch.testing.assert_close(G[:4], torch.cumsum(g[:4].float(), 0), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(G[4:], torch.cumsum(g[4:].float(), 0), atol=1e-6, rtol=1e-6)


def test_cumulative_varlen_matches_the_per_sequence_subtraction():
    """The varlen scan (running-max start rows, ``gate.cumulative``) equals bit for bit the route it
    replaced (fp64 scan over the pack, minus the total before each row's sequence found by searchsorted),
    with empty sequences at the start, middle and end and padding rows past cu_seqlens[-1]; and its
    gradient is the reverse cumsum per sequence."""
    from flashattn_hopper.packed import sequence_of_rows

    lens = [0, 5, 0, 0, 7, 1, 0]
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    g = (torch.randn(sum(lens) + 3, 4) * 3).requires_grad_()  # 3 padding rows
    G = gate.cumulative(g, cu)
    total = torch.cumsum(g.detach().double().t(), dim=-1).t()
    starts = cu[:-1].to(torch.int64)
    before = torch.where((starts > 0)[:, None], total[(starts - 1).clamp_min(0)], torch.zeros_like(total[:1]))
    want = (total - before[sequence_of_rows(cu, total.shape[0])]).float()
    torch.testing.assert_close(G, want, rtol=0, atol=0)
    dG = torch.randn_like(G)
    (dg,) = torch.autograd.grad(G, g, dG)
    for i in range(len(lens)):
        rows = slice(int(cu[i]), int(cu[i + 1]) + (3 if i == len(lens) - 1 else 0))
        want_dg = dG[rows].flip(0).cumsum(0).flip(0)
        torch.testing.assert_close(dg[rows], want_dg, rtol=1e-5, atol=1e-5)


def test_split_gradient_is_that_of_the_sum():
    """The parts carry the gradient of their sum: with equal weights (q's columns of ones give the
    three parts equal gradients in the kernels), d(sum of parts * w)/dx = w (as the bf16 gradient the
    parts receive, which is what the kernels' bf16 dk gives them)."""
    x = (torch.randn(50) * 100).requires_grad_()
    w = torch.randn(50, 1).expand(50, 3)
    (gx,) = torch.autograd.grad((gate.split_bf16(x).float() * w).sum(), x)
    torch.testing.assert_close(gx, w[:, 0].bfloat16().float(), atol=0, rtol=0)


def test_split_bf16_parts_hold_fp32_precision():
    x = torch.cat([torch.linspace(-5000, 0, 1001), torch.randn(1000) * 3]).float()
    parts = gate.split_bf16(x)
    assert parts.dtype == torch.bfloat16 and parts.shape == (*x.shape, 3)
    err = (parts.double().sum(-1) - x.double()).abs()
    assert bool((err <= x.double().abs() * 2.0 ** -22 + 1e-30).all()), float(err.max())
    # one bf16 value alone would be off by units at this range
    assert float((x.bfloat16().double() - x.double()).abs().max()) > 1.0


@pytest.mark.parametrize("varlen", [False, True])
def test_gate_k_slice_is_the_bias_parts_in_the_kernel_layout(varlen):
    """K's extra k16 slice of the gated sm90 forward (``sm90_fwd.gate_k_slice``): the bias's parts as
    ``gate._parts`` makes them, keys before heads as k is laid out, zeros after the parts; the slice's first
    ``GATE_COLS`` columns (the kernel zeroes the rest of its k16 in smem)."""
    from flashattn_hopper.backends.sm90_fwd import gate_k_slice
    from flashattn_hopper.kernels.sm90.fwd_budget import GATE_COLS

    bias = torch.cat([torch.linspace(-5000, 0, 96), torch.randn(96) * 3]).float()
    bias = bias.reshape(4, 48) if varlen else bias.reshape(2, 4, 24)  # (h, total_k) | (b, h, s_k)
    k_slice = gate_k_slice(bias, torch.bfloat16, varlen)
    rows = bias.t() if varlen else bias.transpose(1, 2)
    assert k_slice.shape == (*rows.shape, GATE_COLS) and k_slice.dtype == torch.bfloat16 and k_slice.is_contiguous()
    assert torch.equal(k_slice[..., :3], gate._parts(rows).bfloat16())
    assert bool((k_slice[..., 3:] == 0).all())
    assert torch.equal(gate_k_slice(torch.zeros_like(bias), torch.bfloat16, varlen), torch.zeros_like(k_slice))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_gate_k_slice_triton_is_the_torch_build_bitwise(dtype, varlen):
    """On CUDA the slice is one Triton kernel (``kernels/triton/gate_slice.py``): bit for bit the torch build,
    from bias rows padded as ``gate._kernel_rows`` pads them, over magnitudes from subnormal to 1e4, -0.0, and
    shapes that end mid-block (keys and heads)."""
    pytest.importorskip("triton")
    from flashattn_hopper.backends.sm90_fwd import gate_k_slice, gate_k_slice_torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    for batch, heads, keys in ((2, 3, 37), (1, 32, 1000), (3, 20, 129)):
        shape = (heads, batch * keys) if varlen else (batch, heads, keys)
        n = shape[-1]
        rows = torch.empty(*shape[:-1], -(-n // 4) * 4, device="cuda")[..., :n]
        magnitude = torch.tensor([1e-3, 1.0, 30.0, 1e4], device="cuda")
        pick = torch.randint(0, 4, shape, device="cuda", generator=gen)
        rows.copy_(torch.randn(shape, device="cuda", generator=gen) * magnitude[pick])
        rows[(0,) * rows.dim()] = -0.0
        rows[..., 1] = 1e-40
        got, want = gate_k_slice(rows, dtype, varlen), gate_k_slice_torch(rows, dtype, varlen)
        assert got.shape == want.shape and got.is_contiguous()
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (batch, heads, keys)


def test_gated_forward_kernels_build_where_the_plain_ones_do():
    """The gated sm90 forward takes the bias as an extra k16 slice of the QK^T GEMM only where that slice's
    smem fits beside the key's own sO and Q ring, else the fp32 bias rows; the kernel and the launcher
    (which builds one or the other) decide alike (``sm90_fwd.gate_slice``). Kernel objects only, no compile."""
    pytest.importorskip("cutlass")
    from flashattn_hopper import dispatch
    from flashattn_hopper.backends.common import VarlenArgs
    from flashattn_hopper.backends.sm90_fwd import gate_slice
    from flashattn_hopper.validate import AttnProblem

    family = dispatch.FWD_KERNELS["sm90"]
    seen = set()
    for (d, dv), s, causal, varlen in itertools.product(
        [(64, 64), (128, 128), (192, 192), (256, 256), (128, 192)], (113, 1023, 4096), (False, True), (False, True)
    ):
        p = AttnProblem(batch=2, seqlen_q=s, seqlen_k=s, nheads=4, nheads_k=4, head_dim=d, head_dim_v=dv,
                        dtype=torch.bfloat16, softmax_scale=0.1, causal=causal, window_left=-1, window_right=0,
                        softcap=0.0, is_varlen=varlen)
        cu = torch.zeros(3, dtype=torch.int32)
        args = VarlenArgs(cu, cu, None, None, s, s) if varlen else None
        key = family.gate_key(p, args)
        kernel = family.kernel(key)  # raised for hdim 128 with a Q ring before the choice was per key
        assert kernel.gate_in_gemm == gate_slice(key), key.name
        seen.add(kernel.gate_in_gemm)
    assert seen == {True, False}


@pytest.mark.parametrize("triton_builds", [True, False], ids=["triton", "torch"])
def test_gate_slice_threshold_follows_how_the_slice_is_built(monkeypatch, triton_builds):
    """The gated key asks for the k16 slice from ``FWD_SM90_GATE_SLICE_MIN_SEQLEN_K`` keys where Triton builds the
    slice (one kernel) and from ``..._TORCH`` keys where torch ops do (six per call: the slice paid only from 4k);
    dense and varlen (``max_seqlen_k`` as an int) alike."""
    from flashattn_hopper import configs, dispatch
    from flashattn_hopper.backends import sm90_fwd
    from flashattn_hopper.backends.common import VarlenArgs
    from flashattn_hopper.validate import AttnProblem

    monkeypatch.setattr(sm90_fwd, "_has_triton", lambda: triton_builds)
    threshold = (configs.FWD_SM90_GATE_SLICE_MIN_SEQLEN_K if triton_builds
                 else configs.FWD_SM90_GATE_SLICE_MIN_SEQLEN_K_TORCH)
    assert configs.FWD_SM90_GATE_SLICE_MIN_SEQLEN_K < configs.FWD_SM90_GATE_SLICE_MIN_SEQLEN_K_TORCH
    family = dispatch.FWD_KERNELS["sm90"]
    for keys, varlen in itertools.product((1023, 1024, 2048, 4096), (False, True)):
        p = AttnProblem(batch=2, seqlen_q=keys, seqlen_k=keys, nheads=4, nheads_k=4, head_dim=64, head_dim_v=64,
                        dtype=torch.bfloat16, softmax_scale=0.1, causal=True, window_left=-1, window_right=0,
                        softcap=0.0, is_varlen=varlen)
        cu = torch.zeros(3, dtype=torch.int32)
        key = family.gate_key(p, VarlenArgs(cu, cu, None, None, keys, keys) if varlen else None)
        assert key.gate and key.gate_slice == (keys >= threshold), (keys, varlen, key.name)


def test_gated_keys_take_the_skips_of_decayed_work(monkeypatch):
    """Which gated keys skip decayed work (CPU): the forward's dense key from the min length, causal or not, not with a
    left window; the backward's dense causal key from its min length, not deterministic, not local; packed
    self-attention only with ``configs.GATE_SKIP_DECAYED_VARLEN`` (and Triton: the forward's tables) and without
    seqused; ``BwdSm90.live_rows`` gives a packed call it does not serve one row that skips nothing."""
    import dataclasses

    from flashattn_hopper import configs, dispatch
    from flashattn_hopper.backends import sm90_fwd
    from flashattn_hopper.backends.common import VarlenArgs
    from flashattn_hopper.backends.sm90_bwd import BwdSm90
    from flashattn_hopper.validate import AttnProblem

    monkeypatch.setattr(sm90_fwd, "_has_triton", lambda: True)
    monkeypatch.setattr(sm90_fwd, "_GATE_KEYS", {})
    fwd, bwd = dispatch.FWD_KERNELS["sm90"], BwdSm90()
    base = AttnProblem(batch=1, seqlen_q=4096, seqlen_k=4096, nheads=4, nheads_k=4, head_dim=128, head_dim_v=128,
                       dtype=torch.bfloat16, softmax_scale=0.1, causal=True, window_left=-1, window_right=0,
                       softcap=0.0, is_varlen=False)

    def skips(p, varlen=None, deterministic=False):
        bwd_key = bwd.keys(p, "sm_90a", varlen, deterministic, None, False, True)[1]
        return fwd.gate_key(p, varlen).gate_skip_decayed, bwd_key.gate_skip_decayed

    assert skips(base) == (True, True)
    assert skips(dataclasses.replace(base, seqlen_q=2048, seqlen_k=2048)) == (False, False)
    assert skips(base, deterministic=True) == (True, False)
    assert skips(dataclasses.replace(base, causal=False, window_right=-1)) == (True, False)
    assert skips(dataclasses.replace(base, causal=False, window_left=256, window_right=0)) == (False, False)
    cu = torch.tensor([0, 3000, 8192], dtype=torch.int32)
    packed = dataclasses.replace(base, batch=2, seqlen_q=8192, seqlen_k=8192, is_varlen=True)
    for flag in (False, True):
        monkeypatch.setattr(configs, "GATE_SKIP_DECAYED_VARLEN", flag)
        assert skips(packed, VarlenArgs(cu, cu, None, None, 5192, 5192)) == (flag, flag)
        assert skips(packed, VarlenArgs(cu, cu.clone(), None, None, 5192, 5192)) == (False, flag)  # (two cu_seqlens)
        assert skips(packed, VarlenArgs(cu, cu, None, None, 2048, 2048)) == (False, flag)  # (short: the key's own)
        assert skips(packed, VarlenArgs(cu, cu, cu[1:] - cu[:-1], None, 5192, 5192)) == (False, False)
    key = bwd.keys(packed, "sm_90a", VarlenArgs(cu, cu, None, None, 2048, 2048), False, None, False, True)[1]
    q = torch.zeros(8192, 4, 128, dtype=torch.bfloat16)
    ends = BwdSm90.live_rows(key, packed, VarlenArgs(cu, cu, None, None, 2048, 2048), q, q, torch.zeros(4, 8192))
    assert ends.shape == (2, 4, 8192 // key.tile_n) and bool((ends == 8192 // key.tile_m).all())


def test_gated_key_drops_a_q_stage_for_the_slice(monkeypatch):
    """hdim 128 up to 2k queries keeps two Q stages in the plain key, and the k16 slice does not fit beside them: the
    gated key takes one Q stage and the slice (the 4k key's kernel); hdim 64 fits both and keeps two; below the slice
    threshold nothing changes (the threshold where a GPU builds the slice: with Triton or the scan kernel)."""
    from flashattn_hopper import configs, dispatch
    from flashattn_hopper.backends import sm90_fwd
    from flashattn_hopper.backends.sm90_fwd import gate_slice
    from flashattn_hopper.validate import AttnProblem

    monkeypatch.setattr(sm90_fwd, "_has_triton", lambda: True)
    monkeypatch.setattr(configs, "FWD_SM90_GATE_SKIP_DECAYED", False)  # (the 4k key would also skip decayed blocks)
    family = dispatch.FWD_KERNELS["sm90"]

    def keys(head_dim, seqlen):
        p = AttnProblem(batch=2, seqlen_q=seqlen, seqlen_k=seqlen, nheads=4, nheads_k=4, head_dim=head_dim,
                        head_dim_v=head_dim, dtype=torch.bfloat16, softmax_scale=0.1, causal=True, window_left=-1,
                        window_right=0, softcap=0.0, is_varlen=False)
        return family.key(p, "sm_90a"), family.gate_key(p, None)

    assert configs.FWD_SM90_GATE_SLICE_MIN_SEQLEN_K <= 1024 <= configs.FWD_SM90_Q_RING_MAX_SEQLEN
    plain, gated = keys(128, 1024)
    assert plain.q_stages == 2 and gated.q_stages == 1 and gate_slice(gated)
    assert gated == keys(128, 4096)[1]
    plain, gated = keys(64, 1024)
    assert plain.q_stages == gated.q_stages == 2 and gate_slice(gated)
    plain, gated = keys(128, 512)
    assert gated.q_stages == plain.q_stages and not gated.gate_slice


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(log_decay=[0.0]), TypeError, "log_decay must be a tensor"),
    (dict(log_decay=torch.zeros(1, 8, 3)), ValueError, r"log_decay must have shape \(batch, seqlen_k, nheads\) = \(1, 8, 2\)"),
    (dict(log_decay=torch.zeros(1, 8, 2, dtype=torch.int32)), TypeError, "log_decay must be float32"),
    (dict(log_decay=torch.zeros(1, 8, 2), softcap=5.0), NotImplementedError, "log_decay with softcap"),
])
def test_bad_log_decay_is_named(kwargs, error, match):
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(error, match=match):
        flash_attn_func(q, q, q, **kwargs)


def test_log_decay_needs_bf16():
    q = torch.randn(1, 8, 2, 64, dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="log_decay needs bfloat16"):
        flash_attn_func(q, q, q, log_decay=torch.zeros(1, 8, 2))
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="log_decay needs bfloat16"):
        flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 8, 8, log_decay=torch.zeros(8, 2))


def test_valid_log_decay_reaches_the_device_check():
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA device"):
        flash_attn_func(q, q, q, causal=True, log_decay=torch.zeros(1, 8, 2))
    with pytest.raises(ValueError, match="CUDA device"):  # (with a sink too)
        flash_attn_func(q, q, q, causal=True, log_decay=torch.zeros(1, 8, 2), learnable_sink=torch.zeros(2))


def _gated_sink_ref_dense(q, k, v, g, sink, causal, window, scale):
    """The definition with a sink: the gated scores (``G_i - G_j``) and one more column per row
    holding the head's sink logit, whose value is 0; (out, lse incl. the sink)."""
    group = q.shape[2] // k.shape[2]
    kr, vr = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    G = torch.cumsum(g.to(torch.promote_types(q.dtype, torch.float32)), dim=1)  # (as _gated_ref_dense)
    s_q, s_k = q.shape[1], k.shape[1]
    pos = (torch.arange(s_q) + s_k - s_q).to(G.device)
    Gq = torch.where((pos >= 0)[None, :, None], G[:, pos.clamp(0, max(s_k - 1, 0))],
                     torch.zeros((), dtype=G.dtype, device=G.device))
    bias = (Gq.permute(0, 2, 1)[..., None] - G.permute(0, 2, 1)[:, :, None, :]).to(q.dtype)
    s = torch.einsum("bthd,bshd->bhts", q, kr) * scale + bias
    visible = testing._key_mask(s_q, s_k, causal, window, q.device)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    s = torch.cat([s, sink[None, :, None, None].expand(*s.shape[:3], 1).to(s.dtype)], dim=-1)
    return torch.einsum("bhts,bshd->bthd", torch.softmax(s, -1)[..., :-1], vr), torch.logsumexp(s, -1)


@pytest.mark.parametrize("causal,window", [(True, (-1, 0)), (False, (5, 3))], ids=["causal", "window"])
@pytest.mark.parametrize("s_q,s_k", [(19, 23), (23, 9)])
def test_gated_sink_matches_the_definition(emulated_ops, causal, window, s_q, s_k):
    """``log_decay`` with ``learnable_sink`` (``GatedAttnFunc`` on the op seams): out, LSE (incl. the
    sink) and dq/dk/dv/dg/dsink equal the definition's; 23x9 causal has rows with no key (out 0, LSE
    the sink)."""
    q, k, v, dout = _leaves((2, s_q, 4, 16), (2, s_k, 2, 16), (2, s_k, 2, 16), (2, s_q, 4, 16))
    g = _gates((2, s_k, 4))
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    out, lse = gate.attention(q, k, v, g, None, 0.3, causal, window, False, None, sink)
    ref_out, ref_lse = _gated_sink_ref_dense(q, k, v, g, sink, causal, window, 0.3)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)
    leaves = (q, k, v, g, sink)
    got = torch.autograd.grad(out, leaves, dout.detach())
    want = torch.autograd.grad(ref_out, leaves, dout.detach())
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dsink"), got, want):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------- GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [None, "sm80"], ids=["default", "sm80"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(113, 203), (1023, 1024)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_gate_api_parity(monkeypatch, backend, head_dim, causal, seqlens):
    _gate_api_parity(monkeypatch, backend, head_dim, causal, seqlens)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [96, 192])
def test_gate_api_parity_other_head_dims(monkeypatch, head_dim):
    """The sm90 forward's other tiles with the gate's bias by TMA (hdim 192: 112 keys per block, each K
    stage's bias row padded to 128 bytes), causal, with the backward in the kernel (96: on the 128
    row) or on the augmented problem (192)."""
    _gate_api_parity(monkeypatch, None, head_dim, True, (300, 333))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gate_long_strong_decay(monkeypatch, head_dim):
    """16k keys with gates down to ~-5 per step (G reaches ~-1.5e4): the forward takes the bias as the
    QK^T GEMM's k16 slice (``configs.FWD_SM90_GATE_SLICE_MIN_SEQLEN_K``) and the backward adds it in fp32
    (``_kernel_rows``), yet out, lse and every gradient stay within the parity rule (issue 24's long
    strong-decay check)."""
    _gate_api_parity(monkeypatch, None, head_dim, True, (16384, 16384), batch=1, nheads=(2, 1), gate_shift=0.5)


@pytest.mark.parametrize("causal,seqlens", [(True, (300, 300)), (True, (200, 333)), (False, (300, 300))],
                         ids=["causal", "causal_sq_lt_sk", "full"])
def test_live_block_table_skips_only_zero_probabilities(causal, seqlens):
    """``backends/gate_blocks.first_live_blocks`` (``configs.FWD_SM90_GATE_SKIP_DECAYED``'s table) and, causal, its
    backward mirror ``last_live_rows`` (``BWD_SM90_GATE_SKIP_DECAYED``'s): every key block they let a tile skip, and
    every tile past a key block's end, holds only probabilities below 2^-150 (0 in fp32) for every row, against the
    softmax computed in fp64 from the same q, k and bias; with gates decaying ~1.3 a step most blocks are skipped,
    with gates near 0 none; GQA, odd lengths, small tiles (CPU)."""
    import math

    from flashattn_hopper.backends.gate_blocks import first_live_blocks, last_live_rows

    gen = torch.Generator().manual_seed(11)
    s_q, s_k = seqlens
    scale, tile_m, tile_n = 0.25, 32, 16
    q = torch.randn(2, s_q, 4, 16, generator=gen).bfloat16()
    k = torch.randn(2, s_k, 2, 16, generator=gen).bfloat16()
    for shift, expect_skips in ((-1.0, True), (8.0, False)):
        g = torch.nn.functional.logsigmoid(torch.randn(2, s_k, 4, generator=gen) + shift)
        bias = (-g.double().cumsum(1) / scale).float().transpose(1, 2)  # (b, h, s_k): the kernel's -G_j / scale
        live = first_live_blocks(q, k, bias, scale, tile_m, tile_n, causal)
        assert live.shape == (2, 4, -(-s_q // tile_m)) and live.dtype == torch.int32
        assert bool((live > 0).any()) == expect_skips
        scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(2, dim=2))
        scores = scores + bias.double()[:, :, None, :]
        if causal:
            rows, cols = torch.arange(s_q)[:, None], torch.arange(s_k)[None, :]
            scores = scores.masked_fill(cols > rows + (s_k - s_q), -math.inf)
        log2_p = (scores - scores.amax(-1, keepdim=True)) * scale * math.log2(math.e)
        for b, h, m in itertools.product(range(2), range(4), range(live.shape[-1])):
            skipped = log2_p[b, h, m * tile_m:(m + 1) * tile_m, :int(live[b, h, m]) * tile_n]
            assert bool((skipped.nan_to_num(nan=-math.inf) < -150).all()), (shift, b, h, m, int(live[b, h, m]))
        if causal:  # the backward's mirror: past each key block's end, every query row's P of it is 0
            end = last_live_rows(q, k, bias, scale, tile_m, tile_n)
            assert end.shape == (2, 4, -(-s_k // tile_n)) and end.dtype == torch.int32
            assert bool((end < live.shape[-1]).any()) == expect_skips
            for b, h, n in itertools.product(range(2), range(4), range(end.shape[-1])):
                skipped = log2_p[b, h, int(end[b, h, n]) * tile_m:, n * tile_n:(n + 1) * tile_n]
                assert bool((skipped.nan_to_num(nan=-math.inf) < -150).all()), (shift, b, h, n, int(end[b, h, n]))


_LIVE_TABLE_CHECK = """
import os
os.environ["TRITON_INTERPRET"] = "1"  # Triton's CPU interpreter (before triton is imported)
import torch
from flashattn_hopper.backends import gate_blocks
gen = torch.Generator().manual_seed(11)
cases = [(True, (300, 300), (32, 16), 16), (True, (200, 333), (32, 48), 24), (False, (300, 300), (64, 16), 16),
         (True, (70, 70), (128, 176), 64)]
skipped = 0
for causal, (s_q, s_k), (tile_m, tile_n), d in cases:
    q = torch.randn(2, s_q, 4, d, generator=gen).bfloat16()
    k = torch.randn(2, s_k, 2, d, generator=gen).bfloat16()
    for shift in (-1.0, 1.0, 8.0):
        g = torch.nn.functional.logsigmoid(torch.randn(2, s_k, 4, generator=gen) + shift)
        bias = (-g.double().cumsum(1) / 0.25).float().transpose(1, 2)
        ref = gate_blocks.first_live_blocks_torch(q, k, bias, 0.25, tile_m, tile_n, causal)
        live = gate_blocks.first_live_blocks_triton(q, k, bias, 0.25, tile_m, tile_n, causal)
        assert torch.equal(live, ref), (causal, s_q, s_k, shift, live, ref)
        skipped += int(ref.sum())
        if causal:
            ref = gate_blocks.last_live_rows_torch(q, k, bias, 0.25, tile_m, tile_n)
            end = gate_blocks.last_live_rows_triton(q, k, bias, 0.25, tile_m, tile_n)
            assert torch.equal(end, ref), (s_q, s_k, shift, end, ref)
assert skipped > 100, skipped
# packed self-attention (one table row per sequence, an empty one among them): each sequence's entries as the dense
# torch build's on that sequence alone
lens = [70, 0, 200, 33, 129]
cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
total, packed = int(cu[-1]), (cu, max(lens))
for (tile_m, tile_n), d in (((32, 16), 16), ((64, 48), 24)):
    q = torch.randn(total, 4, d, generator=gen).bfloat16()
    k = torch.randn(total, 2, d, generator=gen).bfloat16()
    g = torch.nn.functional.logsigmoid(torch.randn(total, 4, generator=gen) - 1.0)
    G = torch.cat([g[s:e].double().cumsum(0) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())])
    bias = (-G / 0.25).float().t().contiguous()  # (h, total)
    for causal in (True, False):
        live = gate_blocks.first_live_blocks_triton(q, k, bias, 0.25, tile_m, tile_n, causal, packed)
        for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            if e > s:
                one = gate_blocks.first_live_blocks_torch(q[None, s:e], k[None, s:e], bias[None, :, s:e], 0.25,
                                                          tile_m, tile_n, causal)[0]
                assert torch.equal(live[i, :, :one.shape[-1]], one), (i, causal)
    end = gate_blocks.last_live_rows_triton(q, k, bias, 0.25, tile_m, tile_n, packed)
    assert torch.equal(end, gate_blocks.last_live_rows(q, k, bias, 0.25, tile_m, tile_n, packed))  # (torch, per seq)
"""


def test_live_block_table_triton_matches_torch_in_the_interpreter():
    """``gate_blocks.first_live_blocks_triton`` and ``last_live_rows_triton`` (``kernels/triton/gate_blocks.py``,
    the tables' builds on CUDA with Triton) run by Triton's CPU interpreter: the same tables as the torch builds,
    causal and not (the backward's causal only), seqlen_q below seqlen_k, GQA, tiles that are not powers of two
    (48, 176), odd head dims, gates that skip many blocks and none; packed self-attention (an empty sequence among
    odd lengths) against the dense torch build per sequence."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-c", _LIVE_TABLE_CHECK], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_live_block_table_triton_compiles_for_sm90():
    """The interpreter accepts code compiled Triton refuses: compile the live-block tables' kernels for sm_90 (no
    GPU needed), causal and not, dense and packed, a tile_n that is not a power of two."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flashattn_hopper.kernels.triton.gate_blocks import block_norms_kernel, live_rows_kernel, live_table_kernel

    ints = ("seqlen_q", "seqlen_k", "m_blocks", "n_blocks")
    sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "q_norm_ptr": "*fp32", "k_norm_ptr": "*fp32",
           **{name: "i32" for name in (*ints, "nheads_k")},
           **{f"stride_{t}{a}": "i64" for t in "qk" for a in "bsh"}, "bias_ptr": "*fp32", "ref_ptr": "*fp32",
           **{f"stride_b{a}": "i64" for a in "bhs"}, "cu_ptr": "*i32",
           **{name: "constexpr" for name in ("HEAD_DIM", "D_PAD", "TILE_M", "TILE_N", "CHUNK", "WITH_REF",
                                             "TILE_M_PAD", "VARLEN")}}
    # (q's and k's pointers and strides divisible by 16, as Triton specializes them at launch: the rows' loads
    # must then be 16-byte vectors, not one 2-byte load per element)
    aligned = {(list(sig).index(name),): [["tt.divisibility", 16]]
               for name in ("q_ptr", "k_ptr", *(f"stride_{t}{a}" for t in "qk" for a in "bsh"))}
    for with_ref, varlen in ((False, False), (True, False), (True, True)):
        const = dict(HEAD_DIM=128, D_PAD=128, TILE_M=128, TILE_N=176, CHUNK=64, WITH_REF=with_ref, TILE_M_PAD=128,
                     VARLEN=varlen)
        triton.compile(ASTSource(block_norms_kernel, sig, const), target=GPUTarget("cuda", 90, 32))
        ptx = triton.compile(ASTSource(block_norms_kernel, sig, const, attrs=aligned),
                             target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        assert "ld.global.v4" in ptx and "ld.global.b16" not in ptx
    sig = {"q_norm_ptr": "*fp32", "k_norm_ptr": "*fp32", "bias_ptr": "*fp32", "out_ptr": "*i32",
           **{name: "i32" for name in (*ints, "group")}, **{f"stride_b{a}": "i64" for a in "bhs"},
           "scale_log2": "fp32", "cu_ptr": "*i32",
           **{name: "constexpr" for name in ("CAUSAL", "TILE_M", "TILE_M_PAD", "TILE_N", "TILE_N_PAD", "BLOCK_K",
                                             "MARGIN", "VARLEN")}}
    for causal, varlen in ((True, False), (False, False), (True, True)):
        const = dict(CAUSAL=causal, TILE_M=128, TILE_M_PAD=128, TILE_N=176, TILE_N_PAD=256, BLOCK_K=128, MARGIN=160.0,
                     VARLEN=varlen)
        triton.compile(ASTSource(live_table_kernel, sig, const), target=GPUTarget("cuda", 90, 32))
    sig = {"q_norm_ptr": "*fp32", "k_norm_ptr": "*fp32", "ref_ptr": "*fp32", "bias_ptr": "*fp32", "out_ptr": "*i32",
           **{name: "i32" for name in (*ints, "group")},
           **{f"stride_b{a}": "i64" for a in "bhs"}, "scale_log2": "fp32", "cu_ptr": "*i32",
           **{name: "constexpr" for name in ("TILE_M", "TILE_N", "TILE_N_PAD", "BLOCK_K", "BLOCK_M", "MARGIN",
                                             "VARLEN")}}
    for varlen in (False, True):
        const = dict(TILE_M=64, TILE_N=128, TILE_N_PAD=128, BLOCK_K=128, BLOCK_M=128, MARGIN=160.0, VARLEN=varlen)
        triton.compile(ASTSource(live_rows_kernel, sig, const), target=GPUTarget("cuda", 90, 32))


@pytest.mark.gpu
def test_live_block_table_triton_matches_torch_on_gpu():
    """The live-block table's Triton build (the one CUDA calls take) against the torch build on the GPU: at most one
    block apart per tile (norms summed in another order can round across a block's bound; the margin keeps either
    count exact) and equal in nearly every tile; causal and not, GQA, the gated key's tiles, many blocks skipped."""
    from flashattn_hopper.backends import gate_blocks
    from flashattn_hopper.backends.sm90_fwd import _has_triton

    if not _has_triton():
        pytest.skip("needs Triton: the table's CUDA build")
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(2, 4093, 8, 128, dtype=torch.bfloat16, device="cuda", generator=gen)
    k = torch.randn(2, 4093, 2, 128, dtype=torch.bfloat16, device="cuda", generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(2, 4093, 8, device="cuda", generator=gen) * 2 + 2.0)
    bias = (-g.double().cumsum(1) * 128 ** 0.5).float().transpose(1, 2).contiguous()
    for causal, (tile_m, tile_n) in ((True, (128, 128)), (False, (128, 176))):
        ref = gate_blocks.first_live_blocks_torch(q, k, bias, 128 ** -0.5, tile_m, tile_n, causal)
        live = gate_blocks.first_live_blocks(q, k, bias, 128 ** -0.5, tile_m, tile_n, causal)
        assert int(ref.sum()) > 1000, causal
        assert int((live - ref).abs().max()) <= 1 and float((live != ref).float().mean()) < 0.01, causal


@pytest.mark.gpu
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gate_zero_block_skip_is_exact(monkeypatch, head_dim, varlen):
    """``configs.FWD_SM90_GATE_SKIP_ZERO_PV`` and ``FWD_SM90_GATE_SKIP_DECAYED`` (session 39; the second on since
    session 40: the gated forward skips the P.V of a key block whose P underflowed to 0 in a whole warpgroup; dense
    calls, and packed ones with ``GATE_SKIP_DECAYED_VARLEN`` (on since session 41), also start each tile at the first
    block the launcher's bound keeps, ``backends/gate_blocks.py``): the gated key takes them, and
    out and lse are bit for bit those of the kernel without them, with gates that decay most key blocks to 0 (4k
    keys, ``g`` ~ -1.3 per step: the skips taken) and with gates near 0 (nothing skipped); odd lengths, GQA, causal
    and not."""
    from flashattn_hopper import api, configs
    from flashattn_hopper.backends import sm90_fwd

    if torch.cuda.get_device_capability() != (9, 0) or os.environ.get("FLASHATTN_HOPPER_BACKEND") == "sm80":
        pytest.skip("needs a Hopper GPU and the sm90 backend: the skips are the sm90 gated forward's")
    monkeypatch.setattr(configs, "FWD_SM90_GATE_SKIP_DECAYED_MIN_SEQLEN_K", 1024)
    gen = torch.Generator(device="cuda").manual_seed(7)
    seqlen = 4093
    q = torch.randn(2, seqlen, 4, head_dim, dtype=torch.bfloat16, device="cuda", generator=gen)
    k, v = (torch.randn(2, seqlen, 2, head_dim, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(2))
    keys = []
    gate_key = sm90_fwd.FwdSm90.gate_key
    monkeypatch.setattr(sm90_fwd.FwdSm90, "gate_key", lambda self, *a: keys.append(gate_key(self, *a)) or keys[-1])
    for shift in (-1.0, 6.0):  # (logsigmoid(-1) ~ -1.3 per step: most blocks decay to 0; logsigmoid(6) ~ -0.0025)
        g = torch.nn.functional.logsigmoid(torch.randn(2, seqlen, 4, device="cuda", generator=gen) + shift)
        for causal in (True, False):
            results = []
            for skip_pv, skip_blocks in ((False, False), (True, False), (False, True), (True, True)):
                monkeypatch.setattr(configs, "FWD_SM90_GATE_SKIP_ZERO_PV", skip_pv)
                monkeypatch.setattr(configs, "FWD_SM90_GATE_SKIP_DECAYED", skip_blocks)
                api.clear_plans()
                if varlen:
                    cu = torch.tensor([0, seqlen, 2 * seqlen], dtype=torch.int32, device="cuda")
                    out, lse = flash_attn_varlen_func(
                        *(t.flatten(0, 1) for t in (q, k, v)), cu, cu, seqlen, seqlen, causal=causal,
                        log_decay=g.flatten(0, 1), return_lse=True)
                else:
                    out, lse = flash_attn_func(q, k, v, causal=causal, log_decay=g, return_lse=True)
                assert (keys[-1].gate_skip_pv, keys[-1].gate_skip_decayed) == (
                    skip_pv, skip_blocks and (not varlen or configs.GATE_SKIP_DECAYED_VARLEN))
                results.append((out, lse))
            for i, (out, lse) in enumerate(results[1:]):
                assert torch.equal(results[0][0], out) and torch.equal(results[0][1], lse), (shift, causal, i)
    api.clear_plans()


@pytest.mark.gpu
@pytest.mark.parametrize("nheads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gate_backward_block_skip_is_exact(monkeypatch, head_dim, nheads):
    """``configs.BWD_SM90_GATE_SKIP_DECAYED`` (session 40: the gated sm90 backward ends each key block's query blocks
    at ``gate_blocks.last_live_rows``' bound): the gated main key takes it (dense causal, from the min length), and
    the gradients equal those without it: dk and dv bit for bit (MHA: summed in registers, the skipped blocks' parts
    exact zeros), dq, dg and GQA's dk / dv (fp32 reduce-adds in another order) to fp32 rounding; gates that decay most
    blocks to 0 (the skip taken) and gates near 0; odd lengths."""
    from flashattn_hopper import configs
    from flashattn_hopper.backends import gate_blocks, sm80_bwd

    if torch.cuda.get_device_capability() != (9, 0) or os.environ.get("FLASHATTN_HOPPER_BACKEND") == "sm80":
        pytest.skip("needs a Hopper GPU and the sm90 backend: the skip is the sm90 gated backward's")
    monkeypatch.setattr(configs, "BWD_SM90_GATE_SKIP_DECAYED_MIN_SEQLEN_K", 1024)
    tables, last_live_rows = [], gate_blocks.last_live_rows
    monkeypatch.setattr(gate_blocks, "last_live_rows", lambda *a: tables.append(last_live_rows(*a)) or tables[-1])
    gen = torch.Generator(device="cuda").manual_seed(3)
    seqlen, (h_q, h_k) = 3001, nheads
    q, dout = (torch.randn(2, seqlen, h_q, head_dim, dtype=torch.bfloat16, device="cuda", generator=gen)
               for _ in range(2))
    k, v = (torch.randn(2, seqlen, h_k, head_dim, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(2))
    for shift in (-1.0, 6.0):
        g = torch.nn.functional.logsigmoid(torch.randn(2, seqlen, h_q, device="cuda", generator=gen) + shift)
        grads = []
        for skip in (False, True):
            monkeypatch.setattr(configs, "BWD_SM90_GATE_SKIP_DECAYED", skip)
            monkeypatch.setattr(sm80_bwd, "_PLAN_MEMO", {})  # (a kept plan holds the other key)
            leaves = [t.detach().requires_grad_() for t in (q, k, v, g)]
            out = flash_attn_func(*leaves[:3], causal=True, log_decay=leaves[3])
            grads.append(torch.autograd.grad(out, leaves, dout))
            assert len(tables) == int(skip), (skip, len(tables))
        if shift < 0:
            assert int(tables[-1][..., 0].max()) < -(-seqlen // 128)  # (the first key block ends early: skipped)
        tables.clear()
        for name, base, skipped in zip("q k v g".split(), *grads):
            if name in "kv" and h_q == h_k:
                assert torch.equal(base, skipped), (shift, name)
            else:
                err = float((base.float() - skipped.float()).abs().max())
                assert err <= 1e-3 * float(base.float().abs().max()) + 1e-6, (shift, name, err)


@pytest.mark.gpu
@pytest.mark.parametrize("nheads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_gate_packed_skips_are_exact(monkeypatch, nheads):
    """``configs.GATE_SKIP_DECAYED_VARLEN`` (session 40, off: written without a GPU): packed self-attention takes both
    skips of decayed work (the tables a row per sequence); out and lse bit for bit those without it, dk and dv too
    (MHA), dq, dg and GQA's dk / dv to fp32 rounding; odd lengths, a sequence under the min length among them (its
    rows skip as the table finds), gates that decay most blocks and gates near 0; and the backward's skip key on a
    call under its min length (``BwdSm90.live_rows``' table that skips nothing, read through zero strides)."""
    from flashattn_hopper import api, configs
    from flashattn_hopper.backends import gate_blocks, sm80_bwd

    if torch.cuda.get_device_capability() != (9, 0) or os.environ.get("FLASHATTN_HOPPER_BACKEND") == "sm80":
        pytest.skip("needs a Hopper GPU and the sm90 backend: the skips are the sm90 kernels'")
    from flashattn_hopper.backends.sm90_fwd import _has_triton

    if not _has_triton():
        pytest.skip("needs Triton: the packed tables' build")
    monkeypatch.setattr(configs, "FWD_SM90_GATE_SKIP_DECAYED_MIN_SEQLEN_K", 1024)
    monkeypatch.setattr(configs, "BWD_SM90_GATE_SKIP_DECAYED_MIN_SEQLEN_K", 1024)
    calls = []
    for name in ("first_live_blocks", "last_live_rows"):
        table = getattr(gate_blocks, name)
        monkeypatch.setattr(gate_blocks, name, lambda *a, _t=table, _n=name: calls.append(_n) or _t(*a))
    gen = torch.Generator(device="cuda").manual_seed(4)
    lens, (h_q, h_k), head_dim = [3001, 700, 4093], nheads, 128
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total = int(cu[-1])
    q, dout = (torch.randn(total, h_q, head_dim, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(2))
    k, v = (torch.randn(total, h_k, head_dim, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(2))
    for shift in (-1.0, 6.0):
        g = torch.nn.functional.logsigmoid(torch.randn(total, h_q, device="cuda", generator=gen) + shift)
        results = []
        # (the third: the backward's min length above the call's, so its skip key gets a table that skips nothing)
        for skip, bwd_min in ((False, 1024), (True, 1024), (True, 8192)):
            monkeypatch.setattr(configs, "GATE_SKIP_DECAYED_VARLEN", skip)
            monkeypatch.setattr(configs, "BWD_SM90_GATE_SKIP_DECAYED_MIN_SEQLEN_K", bwd_min)
            api.clear_plans()
            monkeypatch.setattr(sm80_bwd, "_PLAN_MEMO", {})
            calls.clear()
            leaves = [t.detach().requires_grad_() for t in (q, k, v, g)]
            out, lse = flash_attn_varlen_func(*leaves[:3], cu, cu, max(lens), max(lens), causal=True,
                                              log_decay=leaves[3], return_lse=True)
            grads = torch.autograd.grad(out, leaves, dout)
            want = (["first_live_blocks"] if skip else []) + (["last_live_rows"] if skip and bwd_min <= 4093 else [])
            assert sorted(set(calls)) == want, (skip, bwd_min, calls)
            results.append((out, lse, *grads))
        for name, base, *skipped in zip("out lse q k v g".split(), *results):
            for other in skipped:
                if name in ("out", "lse") or name in "kv" and h_q == h_k:
                    assert torch.equal(base, other), (shift, name)
                else:
                    err = float((base.float() - other.float()).abs().max())
                    assert err <= 1e-3 * float(base.float().abs().max()) + 1e-6, (shift, name, err)
    api.clear_plans()


@pytest.mark.gpu
@pytest.mark.parametrize("sums", ["off", "key", "query", "both"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gate_sums_by_wgmma_parity(monkeypatch, sums, head_dim):
    """``configs.BWD_SM90_GATE_KEY_MMA`` / ``BWD_SM90_GATE_QUERY_MMA`` (the gated backward's per-key / per-query dS
    sums by one more WGMMA beside dK's / dQ's, both on by default; "off": each thread's adds): the gated main key takes
    them (at head_dim 128 "both" takes the query half only: the two together serialize its WGMMAs), and out, lse and
    every gradient (dg from those sums) keep the parity rule."""
    from flashattn_hopper import configs
    from flashattn_hopper.backends import sm80_bwd
    from flashattn_hopper.backends.sm90_bwd import BwdSm90

    if torch.cuda.get_device_capability() != (9, 0) or os.environ.get("FLASHATTN_HOPPER_BACKEND") == "sm80":
        pytest.skip("needs a Hopper GPU and the sm90 backend: the sums are the sm90 backward's")
    monkeypatch.setattr(configs, "BWD_SM90_GATE_KEY_MMA", sums in ("key", "both"))
    monkeypatch.setattr(configs, "BWD_SM90_GATE_QUERY_MMA", sums in ("query", "both"))
    monkeypatch.setattr(sm80_bwd, "_PLAN_MEMO", {})  # (a plan kept from an earlier test has the other key)
    keys, main_key = [], BwdSm90._main_key
    monkeypatch.setattr(BwdSm90, "_main_key", lambda self, *a, **kw: keys.append(main_key(self, *a, **kw)) or keys[-1])
    _gate_api_parity(monkeypatch, None, head_dim, True, (1023, 1024))
    want = (sums in ("key", "both") and not (sums == "both" and head_dim == 128), sums in ("query", "both"))
    assert any(k.gate and (k.gate_key_mma, k.gate_query_mma) == want for k in keys), keys


def _gate_api_parity(monkeypatch, backend, head_dim, causal, seqlens, batch=2, nheads=(8, 2), gate_shift=3.0):
    """out, lse and dq/dk/dv/dg against the fp32 definition (2x PyTorch's error in bf16); on Hopper
    without a backend the forward and the backward run the gate in the sm90 kernels (``gate.IN_KERNEL``),
    on sm80 the augmented problem. ``g = logsigmoid(2 x + gate_shift)``, x standard normal."""
    from flashattn_hopper.backends import gate_scan
    from flashattn_hopper.testing import assert_close_to_ref, rounding_atol

    taken = _record_in_kernel(monkeypatch)
    taken_bwd = _record_in_kernel(monkeypatch, "_in_kernel_backward")
    scans, scan = [], gate_scan.scan
    monkeypatch.setattr(gate_scan, "scan", lambda *a: scans.append(a[2]) or scan(*a))

    s_q, s_k = seqlens
    gen = torch.Generator(device="cuda").manual_seed(0)
    h_q, h_k = nheads
    q, k, v, dout = (torch.randn(batch, s, h, head_dim, dtype=torch.bfloat16, device="cuda", generator=gen)
                     for s, h in ((s_q, h_q), (s_k, h_k), (s_k, h_k), (s_q, h_q)))
    g = torch.nn.functional.logsigmoid(torch.randn(batch, s_k, h_q, device="cuda", generator=gen) * 2 + gate_shift)
    window = (-1, 0) if causal else (-1, -1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g)]
    out, lse = flash_attn_func(*leaves[:3], causal=causal, log_decay=leaves[3], return_lse=True, backend=backend)
    grads = torch.autograd.grad(out, leaves, dout)
    refs = {}
    for upcast in (True, False):
        ls = [(t.float() if upcast else t).detach().clone().requires_grad_() for t in (q, k, v)]
        ls.append(g.detach().clone().requires_grad_())
        o, l = _gated_ref_dense(*ls, causal, window, head_dim ** -0.5)
        refs[upcast] = (o, l, torch.autograd.grad(o, ls, dout.to(o.dtype)))
    assert_close_to_ref("out", out, refs[True][0].to(torch.bfloat16), refs[False][0])
    assert_close_to_ref("lse", lse, refs[True][1].float(), refs[False][1].float(), atol=1e-3)
    for name, gr, r, pt in zip(("dq", "dk", "dv", "dg"), grads, refs[True][2], refs[False][2]):
        assert_close_to_ref(name, gr, r.to(gr.dtype), pt.to(gr.dtype), atol=rounding_atol(r, torch.bfloat16))
    sm90 = torch.cuda.get_device_capability() == (9, 0) and os.environ.get("FLASHATTN_HOPPER_BACKEND") != "sm80"
    assert taken == [backend is None and sm90], taken
    assert taken_bwd == ([head_dim <= 128] if backend is None and sm90 else []), taken_bwd
    # dense calls up to SCAN_KERNEL_MAX_SEQLEN keys build G by the scan kernel (``GatedAttnFunc``'s scanned route)
    assert len(scans) == int(backend is None and sm90 and s_k <= gate.SCAN_KERNEL_MAX_SEQLEN), scans


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_zero_gate_is_the_plain_forward_bitwise(causal):
    """Gates exactly 0: out and lse bit for bit the plain call's (issue 24). On Hopper the bias the
    kernel adds is -0.0 / scale to the same scores, the same key otherwise (MHA at 1023 rows: the
    plain call neither packs nor spans heads there)."""
    if torch.cuda.get_device_capability() != (9, 0) or os.environ.get("FLASHATTN_HOPPER_BACKEND") == "sm80":
        pytest.skip("needs the default backend on a Hopper GPU: the gate runs in the kernel only in the sm90 forward")
    gen = torch.Generator(device="cuda").manual_seed(6)
    q, k, v = (torch.randn(2, 1023, 4, 128, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(3))
    g = torch.zeros(2, 1023, 4, device="cuda")
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    out_g, lse_g = flash_attn_func(q, k, v, causal=causal, log_decay=g, return_lse=True)
    assert torch.equal(out_g, out) and torch.equal(lse_g, lse)


def _record_in_kernel(monkeypatch, route: str = "_in_kernel_forward") -> list:
    """A list that records, per gated forward (or backward: ``route``), whether the gate ran in the
    sm90 kernel (the backward tries only after an in-kernel forward)."""
    from flashattn_hopper import gate

    taken, in_kernel = [], getattr(gate, route)

    def spy(*args, **kwargs):
        result = in_kernel(*args, **kwargs)
        taken.append(result is not None)
        return result

    monkeypatch.setattr(gate, route, spy)
    return taken


@pytest.mark.gpu
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_gated_backward_deterministic_is_bitwise_stable(varlen):
    """``deterministic=True`` with a gate: dq, dk, dv and dg bit for bit the same over repeated
    calls (the sm90 kernel adds dG's per-query sums in the key blocks' turns, as dQ), causal GQA."""
    gen = torch.Generator(device="cuda").manual_seed(8)
    s, h, h_k, d = 777, 8, 2, 128
    q, dout = (torch.randn(2 * s, h, d, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(2))
    k, v = (torch.randn(2 * s, h_k, d, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(2))
    g = torch.nn.functional.logsigmoid(torch.randn(2 * s, h, device="cuda", generator=gen) * 2 + 3)
    cu = torch.tensor([0, 300, 2 * s], dtype=torch.int32, device="cuda")

    def grads():
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g)]
        if varlen:
            out = flash_attn_varlen_func(*leaves[:3], cu, cu, 2 * s - 300, 2 * s - 300, causal=True,
                                         log_decay=leaves[3], deterministic=True)
            return torch.autograd.grad(out, leaves, dout)
        dense = [t.view(2, s, *t.shape[1:]) for t in leaves]
        out = flash_attn_func(*dense[:3], causal=True, log_decay=dense[3], deterministic=True)
        return torch.autograd.grad(out, leaves, dout.view(2, s, h, d))

    first = grads()
    for _ in range(4):
        for name, a, b in zip(("dq", "dk", "dv", "dg"), grads(), first):
            assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_gated_call_replays_in_a_cuda_graph(varlen):
    """A gated forward + backward (deterministic, 1k keys: the scan builds K's slice, the sm90 forward is launched as
    the scan's programmatic dependent, ``configs.FWD_GATE_PDL``) captured in a CUDA graph: each replay gives the
    eager call's out, dq, dk, dv and dg bit for bit, the captured outputs NaN-filled before it."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    s, h, d = 1024, 4, 64
    q, k, v, dout = (torch.randn(2 * s, h, d, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(4))
    g = torch.nn.functional.logsigmoid(torch.randn(2 * s, h, device="cuda", generator=gen) * 2 + 3)
    leaves = [t.requires_grad_() for t in (q, k, v, g)]
    cu = torch.tensor([0, s, 2 * s], dtype=torch.int32, device="cuda")

    def step():
        if varlen:
            out = flash_attn_varlen_func(*leaves[:3], cu, cu, s, s, causal=True, log_decay=leaves[3],
                                         deterministic=True)
            return (out, *torch.autograd.grad(out, leaves, dout))
        dense = [t.view(2, s, *t.shape[1:]) for t in leaves]
        out = flash_attn_func(*dense[:3], causal=True, log_decay=dense[3], deterministic=True)
        return (out, *torch.autograd.grad(out, leaves, dout.view(2, s, h, d)))

    eager = [t.detach().clone() for t in step()]
    graph, captured = testing.capture_cuda_graph(step)  # (compiled and the plans kept before the capture)
    for _ in range(3):
        for t in captured:
            t.detach().fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for name, a, b in zip(("out", "dq", "dk", "dv", "dg"), captured, eager):
            assert torch.equal(a, b), f"{name}: the replay differs from the eager call"


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gate_augmented_forward_on_hopper(monkeypatch, causal):
    """``gate.IN_KERNEL`` off: the forward runs the augmented problem on the sm90 kernel too (the
    path torch.compile takes); out and lse the same as the in-kernel gate's within bf16 rounding."""
    from flashattn_hopper import gate

    gen = torch.Generator(device="cuda").manual_seed(4)
    q, k, v = (torch.randn(2, s, h, 64, dtype=torch.bfloat16, device="cuda", generator=gen)
               for s, h in ((300, 8), (300, 2), (300, 2)))
    g = torch.nn.functional.logsigmoid(torch.randn(2, 300, 8, device="cuda", generator=gen) * 2 + 3)
    out_k, lse_k = flash_attn_func(q, k, v, causal=causal, log_decay=g, return_lse=True)
    monkeypatch.setattr(gate, "IN_KERNEL", False)
    out_a, lse_a = flash_attn_func(q, k, v, causal=causal, log_decay=g, return_lse=True)
    assert (out_k.float() - out_a.float()).abs().max().item() < 2e-2
    assert (lse_k - lse_a).abs().max().item() < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [None, "sm80"], ids=["default", "sm80"])
@pytest.mark.parametrize("seqlens", [(239, 100), (1023, 1024)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_gate_with_sink_api_parity(backend, seqlens):
    """``log_decay`` and ``learnable_sink`` together, causal GQA: out, lse (incl. the sink) and
    dq/dk/dv/dg/dsink against the fp32 definition (2x PyTorch's error in bf16); 239x100 has rows with
    no key."""
    from flashattn_hopper.testing import assert_close_to_ref, rounding_atol

    s_q, s_k = seqlens
    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v, dout = (torch.randn(2, s, h, 64, dtype=torch.bfloat16, device="cuda", generator=gen)
                     for s, h in ((s_q, 8), (s_k, 2), (s_k, 2), (s_q, 8)))
    g = torch.nn.functional.logsigmoid(torch.randn(2, s_k, 8, device="cuda", generator=gen) * 2 + 3)
    sink = torch.randn(8, device="cuda", generator=gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, sink)]
    out, lse = flash_attn_func(*leaves[:3], causal=True, log_decay=leaves[3], learnable_sink=leaves[4],
                               return_lse=True, backend=backend)
    grads = torch.autograd.grad(out, leaves, dout)
    refs = {}
    for upcast in (True, False):
        ls = [(t.float() if upcast else t).detach().clone().requires_grad_() for t in (q, k, v)]
        ls += [g.detach().clone().requires_grad_(), sink.detach().clone().requires_grad_()]
        o, l = _gated_sink_ref_dense(*ls, True, (-1, 0), 64 ** -0.5)
        refs[upcast] = (o, l, torch.autograd.grad(o, ls, dout.to(o.dtype)))
    assert_close_to_ref("out", out, refs[True][0].to(torch.bfloat16), refs[False][0])
    assert_close_to_ref("lse", lse, refs[True][1].float(), refs[False][1].float(), atol=1e-3)
    for name, gr, r, pt in zip(("dq", "dk", "dv", "dg", "dsink"), grads, refs[True][2], refs[False][2]):
        assert_close_to_ref(name, gr, r.to(gr.dtype), pt.to(gr.dtype), atol=rounding_atol(r, torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [None, "sm80"], ids=["default", "sm80"])
def test_gate_varlen_api_parity(backend):
    """Varlen (seqused, an empty sequence, a window): out, lse and dq/dk/dv/dg against the fp32
    definition run per sequence (2x PyTorch's error in bf16); rows past seqused_q give out 0."""
    from flashattn_hopper.testing import assert_close_to_ref, rounding_atol

    lens_q, lens_k, used = [300, 0, 517, 64], [333, 5, 517, 200], [250, 0, 517, 64]
    cu_q = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *itertools.accumulate(lens_k)], dtype=torch.int32, device="cuda")
    used_q = torch.tensor(used, dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(2)
    h, h_k, d = 4, 2, 64
    q, dout = (torch.randn(sum(lens_q), h, d, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(2))
    k, v = (torch.randn(sum(lens_k), h_k, d, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(2))
    g = torch.nn.functional.logsigmoid(torch.randn(sum(lens_k), h, device="cuda", generator=gen) * 2 + 3)
    window = (100, 0)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g)]
    out, lse = flash_attn_varlen_func(leaves[0], leaves[1], leaves[2], cu_q, cu_k, max(lens_q), max(lens_k),
                                      seqused_q=used_q, causal=True, window_size=window, log_decay=leaves[3],
                                      return_lse=True, backend=backend)
    rows = torch.cat([torch.arange(int(cu_q[i]), int(cu_q[i]) + used[i]) for i in range(4)]).cuda()
    assert bool((out[torch.cat([torch.arange(int(cu_q[i]) + used[i], int(cu_q[i + 1])) for i in range(4)])] == 0).all())
    grads = torch.autograd.grad(out[rows], leaves, dout[rows])
    refs = {}
    for upcast in (True, False):
        ls = [(t.float() if upcast else t).detach().clone().requires_grad_() for t in (q, k, v)]
        ls.append(g.detach().clone().requires_grad_())
        outs, lses, loss = [], [], 0
        for i in range(4):
            sq = slice(int(cu_q[i]), int(cu_q[i]) + used[i])
            sk = slice(int(cu_k[i]), int(cu_k[i + 1]))
            if used[i] == 0:
                continue
            o, l = _gated_ref_dense(ls[0][sq][None], ls[1][sk][None], ls[2][sk][None], ls[3][sk][None], True,
                                    window, d ** -0.5)
            outs.append(o[0]), lses.append(l[0])
            loss = loss + (o[0] * dout[sq].to(o.dtype)).sum()
        refs[upcast] = (torch.cat(outs), torch.cat(lses, dim=1), torch.autograd.grad(loss, ls))
    assert_close_to_ref("out", out[rows], refs[True][0].to(torch.bfloat16), refs[False][0])
    assert_close_to_ref("lse", lse[:, rows], refs[True][1].float(), refs[False][1].float(), atol=1e-3)
    for name, gr, r, pt in zip(("dq", "dk", "dv", "dg"), grads, refs[True][2], refs[False][2]):
        assert_close_to_ref(name, gr, r.to(gr.dtype), pt.to(gr.dtype), atol=rounding_atol(r, torch.bfloat16))


def test_compile_traces_a_gated_call_in_one_graph():
    from .test_compile import _dense, _traced_ops

    q, k, v = _dense()
    g = torch.zeros(k.shape[0], k.shape[1], q.shape[2])

    def block(q, k, v, g):
        return flash_attn_func(q, k, v, causal=True, log_decay=g).float().sum()

    targets = _traced_ops(block, q, k, v, g)
    assert targets.count("flashattn_hopper.fwd") == 1, targets


@pytest.mark.parametrize("seqused", [False, True], ids=["full", "seqused"])
def test_fp32_dk_is_read_back_from_the_scratch_layout(seqused):
    """``BwdPlan._dk_from_scratch`` (the gate's fp32 dK): varlen sequence i's rows start at its padded
    scratch row (``kernels/common/bwd_utils.scratch_offset``: ``(cu_k[i] + i * 128) // 128 * 128``),
    scaled, rows past ``seqused_k`` or past ``cu_seqlens_k[-1]`` zero; dense rows are ``(b, h_k, s, d)``
    transposed."""
    from flashattn_hopper.backends.sm80_bwd import SEQ_PAD, BwdPlan
    from flashattn_hopper.validate import AttnProblem

    lens, h_k, d, scale = [130, 0, 7, 300], 2, 16, 0.5
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    total = int(cu[-1]) + 3  # 3 padding rows past cu_seqlens_k[-1] (allowed): they read 0
    used = torch.tensor([100, 0, 7, 1], dtype=torch.int32) if seqused else None
    plan = object.__new__(BwdPlan)
    plan.p = AttnProblem(len(lens), total, total, h_k, h_k, d, d, torch.bfloat16, scale, False, -1, -1, 0.0, True)
    plan.d, plan.b_scr, plan.scale, plan.kv_fragment = d, 1, scale, False
    plan.s_k_pad = -(-(total + len(lens) * SEQ_PAD) // SEQ_PAD) * SEQ_PAD
    scratch = torch.randn(1, h_k, plan.s_k_pad * d)
    got = plan._dk_from_scratch(scratch, cu, used)
    rows = scratch.view(h_k, plan.s_k_pad, d)
    for i, n in enumerate(lens):
        start = (int(cu[i]) + i * SEQ_PAD) // SEQ_PAD * SEQ_PAD
        for r in range(n):
            want = rows[:, start + r] * scale if used is None or r < int(used[i]) else torch.zeros(h_k, d)
            torch.testing.assert_close(got[int(cu[i]) + r], want, rtol=0, atol=0)
    assert bool((got[int(cu[-1]):] == 0).all())
    dense = object.__new__(BwdPlan)
    dense.p = AttnProblem(2, 50, 70, 3, h_k, d, d, torch.bfloat16, scale, False, -1, -1, 0.0, False)
    dense.d, dense.b_scr, dense.scale, dense.s_k_pad, dense.kv_fragment = d, 2, scale, 128, False
    scratch = torch.randn(2, h_k, 128 * d)
    want = scratch.view(2, h_k, 128, d)[:, :, :70].transpose(1, 2) * scale
    torch.testing.assert_close(dense._dk_from_scratch(scratch, None, None), want, rtol=0, atol=0)


@pytest.mark.gpu
def test_gated_route_cache_still_checks_strides():
    """A gated call whose q has the shape of an earlier one but a non-contiguous last axis gets the
    validation error (``ops.eager_route`` keys its cache on strides too), not a launch on it."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    q, k, v = (torch.randn(1, 64, 2, 64, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(1, 64, 2, device="cuda", generator=gen))
    flash_attn_func(q, k, v, causal=True, log_decay=g)
    q_strided = torch.randn(1, 64, 64, 2, dtype=torch.bfloat16, device="cuda", generator=gen).transpose(-1, -2)
    with pytest.raises(ValueError, match="q"):
        flash_attn_func(q_strided, k, v, causal=True, log_decay=g)


@pytest.mark.parametrize("causal, seqlen, skip", [(True, 1024, False), (False, 200, False), (True, 4096, False),
                                                  (True, 4096, True)],
                         ids=["causal-rows", "full-rows", "causal-slice", "causal-slice-live-blocks"])
def test_gate_plan_hands_the_kernel_the_general_launch_arguments(monkeypatch, causal, seqlen, skip):
    """Dense gated forwards keep a plan (``sm90_fwd.GatePlan``, like a plain call's): its call hands the
    compiled kernel what ``launch_forward`` does (the same tensors in the same slots, the same scalars, the
    tile counter where the schedule is dynamic), for the fp32 bias rows and the k16 slice alike, with the live-block
    table where the key skips decayed blocks (``configs.FWD_SM90_GATE_SKIP_DECAYED``), and the second call of a
    problem takes the kept plan. CPU: the kernel and device lookups are stand-ins."""
    pytest.importorskip("cutlass")
    from flashattn_hopper import configs
    from flashattn_hopper.backends import common, sm90_fwd
    from flashattn_hopper.validate import AttnProblem

    from ._plan_launch import assert_same_launch, record_sm90_launches

    monkeypatch.setattr(configs, "FWD_SM90_GATE_SKIP_DECAYED", skip)

    calls = record_sm90_launches(monkeypatch)
    # (the slice's torch threshold; the skip's key needs Triton, its CPU tables are torch ops all the same)
    monkeypatch.setattr(sm90_fwd, "_has_triton", lambda: skip)
    monkeypatch.setattr(sm90_fwd, "_GATE_PLANS", {})
    family = sm90_fwd.FwdSm90()
    batch, heads = 2, 4
    p = AttnProblem(batch=batch, seqlen_q=seqlen, seqlen_k=seqlen, nheads=heads, nheads_k=heads, head_dim=128,
                    head_dim_v=128, dtype=torch.bfloat16, softmax_scale=0.125, causal=causal,
                    window_left=-1, window_right=0 if causal else -1, softcap=0.0, is_varlen=False)
    q, k, v = (torch.zeros(batch, seqlen, heads, 128, dtype=torch.bfloat16) for _ in range(3))
    bias = torch.randn(batch, heads, seqlen)
    key = family.gate_key(p, None)
    assert key.gate_skip_decayed == skip
    gate = sm90_fwd.gate_k_slice(bias, q.dtype, False) if sm90_fwd.gate_slice(key) else common.aligned_rows(bias)
    extra = family.extra_args(key, q.device, 0)
    common.launch_forward(lambda *args: calls.append(args), key, q, k, v, p, None, None, None,
                          (extra[0], extra[1], gate, None, sm90_fwd.live_blocks(key, p, q, k, bias), None))

    def general_launch(*args, **kwargs):
        raise AssertionError("the gated call took launch_forward, not its plan")

    monkeypatch.setattr(sm90_fwd, "launch_forward", general_launch)
    family.forward_with_gate(q, k, v, p, None, bias)  # makes the plan
    family.forward_with_gate(q, k, v, p, None, bias)  # takes it
    assert len(sm90_fwd._GATE_PLANS) == 1 and len(calls) == 3
    assert isinstance(next(iter(sm90_fwd._GATE_PLANS.values())), sm90_fwd.GatePlan)
    general, *planned = calls
    for args in planned:
        assert_same_launch(args, general, rebuilt=(11, 13))  # (the gate, the live-block table: built per call)


def test_gate_at_queries_of_a_batch_with_no_sequence():
    """``cu_seqlens = [0]`` (no sequence) with padding rows: G at the queries is 0 (the per-sequence lookup
    indexed empty lengths: IndexError on the CPU, a device-side assert on CUDA)."""
    G = torch.randn(8, 2)
    empty = torch.tensor([0], dtype=torch.int32)
    got = gate.at_queries_varlen(G, 8, empty, empty, torch.zeros(0, dtype=torch.int32), None)
    assert got.shape == (8, 2) and not bool(got.any())
