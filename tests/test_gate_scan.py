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

    def forward_with_gate(self, q, k, v, p, varlen, bias_rows, k_slice=None, key=None):
        """Packed calls (the dense route launches through its plan): each sequence on its own."""
        assert varlen is not None, "the dense scanned route launches through its plan"
        cu = varlen.cu_seqlens_k.tolist()
        outs, lses = [], []
        for start, end in zip(cu[:-1], cu[1:]):
            o, l = self.launch(q[None, start:end], k[None, start:end], v[None, start:end],
                               bias_rows[None, :, start:end], None)
            outs.append(o[0]), lses.append(l[0])
        return torch.cat(outs), torch.cat(lses, dim=1)

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
        if varlen is not None:  # (each sequence on its own; the sums in (h, total) rows)
            cu = varlen.cu_seqlens_k.tolist()
            parts = [self.backward_with_gate(dout[None, a:b], q[None, a:b], k[None, a:b], v[None, a:b], None, None,
                                             p, None, deterministic, bias[None, :, a:b]) for a, b in zip(cu[:-1], cu[1:])]
            return (*(torch.cat([part[i][0] for part in parts]) for i in range(3)),
                    *(torch.cat([part[i][0] for part in parts], dim=1) for i in (3, 4)))
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
    plan.fwd_plan = plan.fwd_key = plan.packed = None
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


def _segmented_scans(g, cu, warps=2, keys_per_warp=4):
    """The varlen kernels' algorithm (``kernels/common/gate_scan.py`` / ``gate_scan_grad.py`` with ``mCu``) step for
    step in Python on one head: chunk records, then each chunk's carry from the chunks its first (last) key's
    sequence reaches, warps' sums with their restart flags, and the per-key restarts. ``(G, reverse)``."""
    total, chunk = len(g), warps * keys_per_warp
    chunks = -(-total // chunk)
    big = 2**31 - 1

    def next_start(s):
        return int(cu[s + 1]) if s + 1 < len(cu) else big

    def sequence_of(s, key):
        while next_start(s) <= key:
            s += 1
        return s

    chunk_seq = [int(torch.searchsorted(cu, torch.tensor([c * chunk], dtype=cu.dtype), right=True)) for c in range(chunks)]
    value = [float(x) for x in g] + [0.0] * (chunks * chunk - total)
    fwd_rec, rev_rec = [], []
    for c in range(chunks):
        keys = range(c * chunk, c * chunk + chunk)
        last_start = int(cu[sequence_of(chunk_seq[c] - 1, min(c * chunk + chunk, total) - 1)])
        fwd_rec.append(sum(value[j] for j in keys if j >= last_start))
        first_end = next_start(chunk_seq[c] - 1)
        rev_rec.append(sum(value[j] for j in keys if j < first_end))
    G, rev = [0.0] * total, [0.0] * total
    for c in range(chunks):
        first_seq = chunk_seq[c] - 1
        first_chunk = int(cu[first_seq]) // chunk
        last_end = next_start(sequence_of(first_seq, min(c * chunk + chunk, total) - 1))
        end_chunk = min((min(last_end, total) - 1) // chunk + 1, chunks)
        starts, ends, own_f, own_r, flag_f, flag_r = {}, {}, [], [], [], []
        for w in range(warps):
            start = c * chunk + w * keys_per_warp
            seq, own, restarted = sequence_of(first_seq, start), 0.0, False
            for j in range(start, start + keys_per_warp):
                seq = sequence_of(seq, j)
                starts[j], ends[j] = int(cu[seq]) == j, next_start(seq) == j + 1
                if starts[j]:
                    own, restarted = 0.0, True
                own += value[j]
            own_f.append(own), flag_f.append(restarted)
            own, ended = 0.0, False
            for j in reversed(range(start, start + keys_per_warp)):
                if ends[j]:
                    own, ended = 0.0, True
                own += value[j]
            own_r.append(own), flag_r.append(ended)
        for w in range(warps):
            start = c * chunk + w * keys_per_warp
            carry = sum(fwd_rec[first_chunk:c])
            for v in range(w):
                carry = own_f[v] if flag_f[v] else carry + own_f[v]
            for j in range(start, start + keys_per_warp):
                carry = (0.0 if starts[j] else carry) + value[j]
                if j < total:
                    G[j] = carry
            carry = sum(rev_rec[c + 1:end_chunk])
            for v in reversed(range(w + 1, warps)):
                carry = own_r[v] if flag_r[v] else carry + own_r[v]
            for j in reversed(range(start, start + keys_per_warp)):
                carry = (0.0 if ends[j] else carry) + value[j]
                if j < total:
                    rev[j] = carry
    return torch.tensor(G, dtype=torch.float64), torch.tensor(rev, dtype=torch.float64)


@pytest.mark.parametrize("lens", [[5, 0, 13, 1, 0, 20], [40], [3, 3, 3, 3, 3, 3, 3, 3, 3, 3], [0, 9, 17], [8, 8, 8]])
@pytest.mark.parametrize("pad", [0, 3])
def test_segmented_scan_algorithm_is_the_per_sequence_cumsum(lens, pad):
    """The varlen scans' chunked algorithm (``_segmented_scans``: the kernels' steps, 2 warps of 4 keys) gives, on
    packed sequences with zero-length ones and rows past the last sequence, each sequence's cumsum (G) and reverse
    cumsum (dg) within the sequence."""
    import itertools

    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    gen = torch.Generator().manual_seed(len(lens) + pad)
    g = torch.randn(int(cu[-1]) + pad, generator=gen, dtype=torch.float64)
    G, rev = _segmented_scans(g, cu)
    for i in range(len(lens)):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        torch.testing.assert_close(G[rows], g[rows].cumsum(0))
        torch.testing.assert_close(rev[rows], g[rows].flip(0).cumsum(0).flip(0))


@pytest.mark.gpu
def test_gate_scan_kernels_varlen_restart_per_sequence():
    """The scans' varlen mode (``scan_varlen`` / ``scan_gradient_varlen``: ``gate.SCAN_KERNEL_VARLEN``'s kernels) on
    packed sequences with zero-length ones, lengths across and inside 32-key chunks and rows past the last sequence:
    G each sequence's cumsum (against fp64), the bias rows ``G / -scale`` bit for bit, and dg each sequence's reverse
    cumsum of ``query_sums - key_sums``."""
    import itertools

    from flashattn_hopper.backends.gate_scan import scan_gradient_varlen, scan_varlen

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs a Hopper GPU: the scan kernels compile for sm_90a only")
    gen = torch.Generator(device="cuda").manual_seed(5)
    for lens, pad, heads in (([5, 0, 13, 1, 0, 200, 31, 33], 3, 7), ([4096], 0, 32), ([1] * 70, 5, 3),
                             ([0, 1000, 0, 999, 64], 0, 40)):
        cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
        total = int(cu[-1]) + pad
        g = torch.nn.functional.logsigmoid(torch.randn(total, heads, device="cuda", generator=gen) * 2 - 1)
        G_rows, bias_rows, k_slice, chunk_seq = scan_varlen(g, cu, 0.125, None, "sm_90a")
        assert k_slice is None and tuple(G_rows.shape) == (heads, total) and G_rows.stride(0) % 4 == 0
        assert torch.equal(bias_rows, G_rows / -0.125)
        key_rows = torch.randn(heads, total, device="cuda", generator=gen)
        query_rows = torch.randn(heads, total, device="cuda", generator=gen)
        dg = scan_gradient_varlen(key_rows, query_rows, cu, chunk_seq, torch.float32, "sm_90a")
        assert tuple(dg.shape) == (total, heads)
        total_grad = (query_rows - key_rows).double()
        for i in range(len(lens)):
            rows = slice(int(cu[i]), int(cu[i + 1]))
            want = g[rows].double().cumsum(0).t()
            torch.testing.assert_close(G_rows[:, rows].double(), want, rtol=0,
                                       atol=float(want.abs().amax()) * 2e-7 + 1e-6 if want.numel() else 1e-6)
            want = total_grad[:, rows].flip(-1).cumsum(-1).flip(-1).t()
            torch.testing.assert_close(dg[rows].double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[300, 0, 517, 1, 64], [1100, 0, 517, 1, 64]], ids=["rows", "slice"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gate_varlen_scan_route_parity(monkeypatch, head_dim, lens):
    """Packed self-attention (one cu_seqlens, no seqused) on the scan route (``gate.SCAN_KERNEL_VARLEN`` forced on):
    the route is taken (one varlen scan per call; K's k16 slice built by the scan from a max length of 1k keys, as
    dense calls), and out, lse and dq/dk/dv/dg match the fp32 definition per sequence (2x PyTorch's error in bf16);
    zero-length and one-key sequences, GQA, causal."""
    import itertools

    from flashattn_hopper import flash_attn_varlen_func
    from flashattn_hopper.backends import gate_scan
    from flashattn_hopper.testing import assert_close_to_ref, rounding_atol

    if torch.cuda.get_device_capability() != (9, 0) or os.environ.get("FLASHATTN_HOPPER_BACKEND") == "sm80":
        pytest.skip("needs a Hopper GPU and the sm90 backend: only the sm90 kernels take the scan route")
    monkeypatch.setattr(gate, "SCAN_KERNEL_VARLEN", True)
    scans, scan_varlen = [], gate_scan.scan_varlen
    monkeypatch.setattr(gate_scan, "scan_varlen", lambda *a: scans.append(a[3]) or scan_varlen(*a))
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(4)
    h, h_k = 4, 2
    q, dout = (torch.randn(sum(lens), h, head_dim, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(2))
    k, v = (torch.randn(sum(lens), h_k, head_dim, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(2))
    g = torch.nn.functional.logsigmoid(torch.randn(sum(lens), h, device="cuda", generator=gen) * 2 + 3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g)]
    out, lse = flash_attn_varlen_func(leaves[0], leaves[1], leaves[2], cu, cu, max(lens), max(lens), causal=True,
                                      log_decay=leaves[3], return_lse=True)
    assert scans == [torch.bfloat16 if max(lens) >= 1024 else None]
    grads = torch.autograd.grad(out, leaves, dout)
    refs = {}
    for upcast in (True, False):
        ls = [(t.float() if upcast else t).detach().clone().requires_grad_() for t in (q, k, v)]
        ls.append(g.detach().clone().requires_grad_())
        outs, lses, loss = [], [], 0
        for i in range(len(lens)):
            rows = slice(int(cu[i]), int(cu[i + 1]))
            if lens[i] == 0:
                continue
            o, l = _gated_ref_dense(ls[0][rows][None], ls[1][rows][None], ls[2][rows][None], ls[3][rows][None], True,
                                    (-1, 0), head_dim ** -0.5)
            outs.append(o[0]), lses.append(l[0])
            loss = loss + (o[0] * dout[rows].to(o.dtype)).sum()
        refs[upcast] = (torch.cat(outs), torch.cat(lses, dim=1), torch.autograd.grad(loss, ls))
    assert_close_to_ref("out", out, refs[True][0].to(torch.bfloat16), refs[False][0])
    assert_close_to_ref("lse", lse, refs[True][1].float(), refs[False][1].float(), atol=1e-3)
    for name, gr, r, pt in zip(("dq", "dk", "dv", "dg"), grads, refs[True][2], refs[False][2]):
        assert_close_to_ref(name, gr, r.to(gr.dtype), pt.to(gr.dtype), atol=rounding_atol(r, torch.bfloat16))


def test_packed_gated_call_keeps_its_plan(monkeypatch):
    """``api``'s kept plan of a gated call on packed self-attention (CPU, a stand-in plan): made once, after the
    validation, from the call's cu_seqlens and max length; a later call of the same shapes runs it with its own
    cu_seqlens and ``return_lse``, with no validation; another max length keys another plan."""
    from flashattn_hopper import api, flash_attn_varlen_func, validate

    made, calls = [], []

    def stand_in(q, k, v, g, options, cu_seqlens, max_seqlen):
        made.append((cu_seqlens, max_seqlen))
        return lambda q, k, v, g, sink, want_lse, cu: calls.append((cu, want_lse)) or (q + 1, None)

    monkeypatch.setattr(gate, "scanned_gate", stand_in)
    monkeypatch.setattr(validate, "_check_devices", lambda *a: None)  # (CPU tensors: the validation's other checks)
    api.clear_plans()
    q, k, v = (torch.randn(10, 2, 8, dtype=torch.bfloat16) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(10, 2))
    cu, cu2 = torch.tensor([0, 4, 10], dtype=torch.int32), torch.tensor([0, 7, 10], dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, causal=True, log_decay=g)
    assert torch.equal(out, q + 1) and len(made) == 1 and made[0][0] is cu and made[0][1] == 6
    validations, validate_varlen = [], validate.validate_varlen
    monkeypatch.setattr(validate, "validate_varlen", lambda *a, **kw: validations.append(1))
    flash_attn_varlen_func(q, k, v, cu2, cu2, 6, 6, causal=True, log_decay=g, return_lse=True)
    assert len(made) == 1 and calls[-1][0] is cu2 and calls[-1][1] is True and not validations
    monkeypatch.setattr(validate, "validate_varlen", validate_varlen)
    flash_attn_varlen_func(q, k, v, cu2, cu2, 7, 7, causal=True, log_decay=g)
    assert len(made) == 2 and made[1][1] == 7
    api.clear_plans()


@pytest.mark.gpu
def test_repeated_packed_gated_call_runs_its_kept_plan():
    """A gated call on packed self-attention keeps its plan (``gate.ScannedPlan`` with ``packed``, in ``api._PLANS``)
    and a later call of the same shapes runs it with its own cu_seqlens (another packing of as many tokens and
    sequences), through the forward's kept ``PackedGatePlan``: out and lse bit for bit those of a plan made for that
    packing, dq/dk/dv/dg within the backward's atomic dQ rounding; without ``return_lse`` the same out."""
    from flashattn_hopper import api, flash_attn_varlen_func

    if torch.cuda.get_device_capability() != (9, 0) or os.environ.get("FLASHATTN_HOPPER_BACKEND") == "sm80":
        pytest.skip("needs a Hopper GPU and the sm90 backend: only the sm90 kernels take the scan route")
    gen = torch.Generator(device="cuda").manual_seed(6)
    total = 1500
    q, dout = (torch.randn(total, 4, 64, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(2))
    k, v = (torch.randn(total, 2, 64, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(2))
    g = torch.nn.functional.logsigmoid(torch.randn(total, 4, device="cuda", generator=gen) * 2 + 3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g)]
    packings = [torch.tensor(c, dtype=torch.int32, device="cuda") for c in ([0, 700, 1400, 1500], [0, 64, 800, 1500])]

    def call(cu, want_lse=True):
        result = flash_attn_varlen_func(*leaves[:3], cu, cu, 800, 800, causal=True, log_decay=leaves[3],
                                        return_lse=want_lse)
        out = result[0] if want_lse else result
        return (*(result if want_lse else (out,)), *torch.autograd.grad(out, leaves, dout))

    api.clear_plans()
    fresh = call(packings[1])  # (its first call: validated, the plan made and run)
    api.clear_plans()
    call(packings[0])
    plans = [plan for plan in api._PLANS.values() if isinstance(plan, gate.ScannedPlan)]
    assert len(plans) == 1 and plans[0].packed == (800, 800) and plans[0].fwd_plan is not None
    kept = call(packings[1])
    assert torch.equal(fresh[0], kept[0]) and torch.equal(fresh[1], kept[1])
    for first, second in zip(fresh[2:], kept[2:]):
        torch.testing.assert_close(first, second)
    assert torch.equal(call(packings[1], want_lse=False)[0], fresh[0])
    assert len([plan for plan in api._PLANS.values() if isinstance(plan, gate.ScannedPlan)]) == 1


def test_scanned_varlen_route_autograd_with_emulated_kernels(monkeypatch):
    """``GatedAttnFunc`` on the packed scan route (``gate.SCAN_KERNEL_VARLEN``: ``scan_varlen``, the in-kernel
    forward and backward per sequence, ``scan_gradient_varlen``), its kernels replaced by torch stand-ins: out, the
    LSE and dq/dk/dv/dg against the definition per sequence, zero-length and one-key sequences included."""
    import itertools

    from flashattn_hopper.backends import gate_scan
    scale = 0.3
    family = _EmulatedGateFamily(scale)
    lens = [7, 0, 12, 1, 5]
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)

    def per_sequence(rows, reverse):
        out = torch.zeros_like(rows, dtype=torch.float64)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            part = rows[..., a:b].double()
            out[..., a:b] = part.flip(-1).cumsum(-1).flip(-1) if reverse else part.cumsum(-1)
        return out

    def scan_varlen(g, cu_, scale_, slice_dtype, arch):
        assert cu_ is cu
        G_rows = per_sequence(g.t(), False).float()
        return G_rows, G_rows / -scale_, None, "chunk_seq"

    def scan_gradient_varlen(key_rows, query_rows, cu_, chunk_seq, dtype, arch):
        assert cu_ is cu and chunk_seq == "chunk_seq"
        return per_sequence(query_rows - key_rows, True).t().to(dtype)

    monkeypatch.setattr(gate_scan, "scan_varlen", scan_varlen)
    monkeypatch.setattr(gate_scan, "scan_gradient_varlen", scan_gradient_varlen)
    plan = gate.ScannedPlan.__new__(gate.ScannedPlan)
    plan.route, plan.packed = (family, family, None, None), (None, None)
    plan.options, plan.slice_dtype, plan.arch, plan.fwd_plan, plan.fwd_key = (
        gate.gate_options(scale, True, (-1, 0), False, None), None, "sm_90a", None, None)
    gen = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(sum(lens), 3, 8, generator=gen) for _ in range(4))
    g = torch.nn.functional.logsigmoid(torch.randn(sum(lens), 3, generator=gen) + 1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g)]
    out, lse = plan(*leaves, None, True, cu)
    grads = torch.autograd.grad(out, leaves, dout)
    ref = [t.clone().requires_grad_() for t in (q, k, v, g)]
    outs, lses = [], []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if a < b:
            o, l = _gated_ref_dense(*(t[None, a:b] for t in ref), True, (-1, 0), scale)
            outs.append(o[0]), lses.append(l[0])
    ref_out = torch.cat(outs)
    ref_grads = torch.autograd.grad(ref_out, ref, dout)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, torch.cat(lses, dim=1), rtol=1e-5, atol=1e-5)
    for name, got, want in zip(("dq", "dk", "dv", "dg"), grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=name)


def test_packed_gate_plan_hands_the_kernel_the_general_launch_arguments(monkeypatch):
    """``sm90_fwd.PackedGatePlan`` (a packed gated call's kept forward plan) hands the compiled kernel what
    ``launch_forward`` does for the same varlen key: the same tensors (cu_seqlens for queries and keys), scalars
    and empty slots in the same places. CPU: the kernel and device lookups are stand-ins."""
    pytest.importorskip("cutlass")
    from flashattn_hopper.backends import common, sm90_fwd
    from flashattn_hopper.backends.common import VarlenArgs
    from flashattn_hopper.validate import AttnProblem

    from ._plan_launch import assert_same_launch, record_sm90_launches

    calls = record_sm90_launches(monkeypatch)
    monkeypatch.setattr(sm90_fwd, "_has_triton", lambda: False)
    family = sm90_fwd.FwdSm90()
    total, heads = 3000, 4
    p = AttnProblem(batch=2, seqlen_q=total, seqlen_k=total, nheads=heads, nheads_k=heads, head_dim=128,
                    head_dim_v=128, dtype=torch.bfloat16, softmax_scale=0.125, causal=True, window_left=-1,
                    window_right=0, softcap=0.0, is_varlen=True)
    cu = torch.tensor([0, 1800, 3000], dtype=torch.int32)
    varlen = VarlenArgs(cu, cu, None, None, 1800, 1800)
    q, k, v = (torch.zeros(total, heads, 128, dtype=torch.bfloat16) for _ in range(3))
    bias = torch.randn(heads, total)
    key = family.gate_key(p, varlen)
    gate = sm90_fwd.gate_k_slice(bias, q.dtype, True) if sm90_fwd.gate_slice(key) else common.aligned_rows(bias)
    extra = family.extra_args(key, q.device, 0)
    common.launch_forward(lambda *args: calls.append(args), key, q, k, v, p, varlen, None, None,
                          (extra[0], extra[1], gate, None, None, None))
    plan = family.gate_plan(q, p, key)
    assert isinstance(plan, sm90_fwd.PackedGatePlan)
    plan(q, k, v, gate, cu)
    general, planned = calls
    assert_same_launch(planned, general)
