"""Self-tests of the fp32 reference and the acceptance rule (CPU tier)."""

from __future__ import annotations

import math

import pytest
import torch

from flashattn_hopper.testing import assert_close_to_ref, attention_ref, max_err_check, rounding_atol


def _rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def _brute_force(q, k, v, scale, causal=False, window=(-1, -1), softcap=0.0):
    """Loops over every (batch, head, query): slow, obviously right."""
    b, s_q, h, _ = q.shape
    s_k, h_k = k.shape[1], k.shape[2]
    out = torch.zeros(b, s_q, h, v.shape[-1])
    lse = torch.full((b, h, s_q), float("-inf"))
    for bi in range(b):
        for hi in range(h):
            kv = hi // (h // h_k)
            for i in range(s_q):
                lo, hi_k = 0, s_k - 1
                diag = i + s_k - s_q
                if causal:
                    hi_k = min(hi_k, diag)
                if window[1] >= 0:
                    hi_k = min(hi_k, diag + window[1])
                if window[0] >= 0:
                    lo = max(lo, diag - window[0])
                if hi_k < lo:
                    continue
                s = (q[bi, i, hi] @ k[bi, lo : hi_k + 1, kv].T) * scale
                if softcap > 0:
                    s = softcap * torch.tanh(s / softcap)
                p = torch.softmax(s, dim=-1)
                out[bi, i, hi] = p @ v[bi, lo : hi_k + 1, kv]
                lse[bi, hi, i] = torch.logsumexp(s, dim=-1)
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s_q,s_k", [(5, 5), (3, 7), (7, 3), (1, 4)])
@pytest.mark.parametrize("h,h_k", [(2, 2), (4, 1)])
def test_dense_matches_brute_force(causal, s_q, s_k, h, h_k):
    q, k, v = _rand(2, s_q, h, 8), _rand(2, s_k, h_k, 8), _rand(2, s_k, h_k, 6)
    out, lse = attention_ref(q, k, v, causal=causal)
    out_bf, lse_bf = _brute_force(q, k, v, 1 / math.sqrt(8), causal=causal)
    torch.testing.assert_close(out, out_bf, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, lse_bf, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [(2, 0), (0, 2), (1, 1), (3, -1), (-1, 1)])
def test_window_matches_brute_force(window):
    q, k, v = _rand(1, 9, 2, 8), _rand(1, 11, 2, 8), _rand(1, 11, 2, 8)
    out, lse = attention_ref(q, k, v, window_size=window)
    out_bf, lse_bf = _brute_force(q, k, v, 1 / math.sqrt(8), window=window)
    torch.testing.assert_close(out, out_bf, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, lse_bf, atol=1e-5, rtol=1e-5)


def test_softcap_matches_brute_force():
    q, k, v = _rand(1, 6, 2, 8) * 4, _rand(1, 6, 2, 8), _rand(1, 6, 2, 8)
    out, lse = attention_ref(q, k, v, softcap=2.0, softmax_scale=0.5)
    out_bf, lse_bf = _brute_force(q, k, v, 0.5, softcap=2.0)
    torch.testing.assert_close(out, out_bf, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, lse_bf, atol=1e-5, rtol=1e-5)


def test_matches_torch_sdpa_noncausal():
    q, k, v = _rand(2, 33, 4, 16), _rand(2, 47, 4, 16), _rand(2, 47, 4, 16)
    out, _ = attention_ref(q, k, v)
    expected = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_fully_masked_rows_are_zero_with_minus_inf_lse():
    q, k, v = _rand(1, 6, 2, 8), _rand(1, 2, 2, 8), _rand(1, 2, 2, 8)
    out, lse = attention_ref(q, k, v, causal=True)  # rows 0..3 see no key (bottom-right alignment)
    assert not torch.isnan(out).any()
    assert (out[:, :4] == 0).all()
    assert torch.isneginf(lse[:, :, :4]).all() and torch.isfinite(lse[:, :, 4:]).all()


def _plain_attention(q, k, v, scale, visible):
    """One head: q (s_q, d), k/v (s_k, d), visible (s_q, s_k) bool. Softmax row by row, no shared code
    with ``testing._dense_ref``; rows with no visible key: out 0, lse -inf."""
    out = torch.zeros(q.shape[0], v.shape[-1])
    lse = torch.full((q.shape[0],), float("-inf"))
    for i in range(q.shape[0]):
        keys = visible[i].nonzero()[:, 0]
        if keys.numel() == 0:
            continue
        s = (k[keys] @ q[i]) * scale
        p = torch.exp(s - s.max())
        out[i] = (p / p.sum()) @ v[keys]
        lse[i] = s.max() + torch.log(p.sum())
    return out, lse


def _causal_visible(s_q, s_k):
    """Bottom-right causal mask, element by element."""
    return torch.tensor([[j <= i + s_k - s_q for j in range(s_k)] for i in range(s_q)], dtype=torch.bool)


def test_gqa_query_heads_share_their_kv_head():
    """Query head h reads KV head h // (h / h_k) (consecutive query heads share one), checked head by head
    against a plain softmax that indexes the KV head itself (no repeat_interleave)."""
    q, k, v = _rand(2, 5, 8, 8), _rand(2, 7, 2, 8), _rand(2, 7, 2, 6)
    out, lse = attention_ref(q, k, v, causal=True)
    visible = _causal_visible(5, 7)
    for b in range(2):
        for h in range(8):
            o, l = _plain_attention(q[b, :, h], k[b, :, h // 4], v[b, :, h // 4], 8**-0.5, visible)
            torch.testing.assert_close(out[b, :, h], o, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse[b, h], l, atol=1e-5, rtol=1e-5)
    # the other grouping (h % h_k) gives other numbers: the check above can tell them apart
    o_wrong, _ = _plain_attention(q[0, :, 1], k[0, :, 1], v[0, :, 1], 8**-0.5, visible)
    assert not torch.allclose(out[0, :, 1], o_wrong, atol=1e-3)


def test_varlen_equals_per_sequence_plain_softmax():
    """Packed sequences (one with no queries, one with no keys, one with more queries than keys: causal
    rows without a key) against a per-sequence, per-head loop of a plain softmax."""
    lens = [(3, 4), (0, 2), (5, 6), (2, 0), (4, 2)]
    cu_q = torch.tensor([0, 3, 3, 8, 10, 14], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 6, 12, 12, 14], dtype=torch.int32)
    q, k, v = _rand(14, 4, 8), _rand(14, 2, 8), _rand(14, 2, 8)
    out, lse = attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    assert out.shape == (14, 4, 8) and lse.shape == (4, 14)
    for i, (len_q, len_k) in enumerate(lens):
        rows, keys = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        for h in range(4):
            o, l = _plain_attention(q[rows, h], k[keys, h // 2], v[keys, h // 2], 8**-0.5, _causal_visible(len_q, len_k))
            torch.testing.assert_close(out[rows, h], o, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse[h, rows], l, atol=1e-5, rtol=1e-5)
    assert (out[10:12] == 0).all() and torch.isneginf(lse[:, 10:12]).all()  # sequence 3: no keys


def test_varlen_seqused_limits_rows_and_keys():
    cu = torch.tensor([0, 6], dtype=torch.int32)
    q, k, v = _rand(6, 1, 8), _rand(6, 1, 8), _rand(6, 1, 8)
    out, lse = attention_ref(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, seqused_q=torch.tensor([4], dtype=torch.int32),
                             seqused_k=torch.tensor([3], dtype=torch.int32))
    o, l = _plain_attention(q[:4, 0], k[:3, 0], v[:3, 0], 8**-0.5, torch.ones(4, 3, dtype=torch.bool))
    torch.testing.assert_close(out[:4, 0], o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[0, :4], l, atol=1e-5, rtol=1e-5)
    assert (out[4:] == 0).all() and torch.isneginf(lse[:, 4:]).all()


def test_upcast_false_computes_in_the_input_dtype():
    """The yardstick really is a low-precision result: upcast=False differs from the fp32 reference by
    bf16 rounding (not 0, not more than a few bf16 ulps of outputs of magnitude < 4), and the rule
    judges an output by how far it is from the reference relative to that difference."""
    q, k, v = (_rand(1, 64, 2, 64).bfloat16() for _ in range(3))
    out_ref, _ = attention_ref(q, k, v)
    out_pt, _ = attention_ref(q, k, v, upcast=False)
    assert out_ref.dtype == out_pt.dtype == torch.bfloat16
    err_pt = (out_pt.float() - out_ref.float()).abs().max().item()
    assert 0 < err_pt < 0.05
    ours = out_ref.float() + 1.9 * err_pt  # within 2x PyTorch's error
    assert max_err_check(ours, out_ref, out_pt, atol=0.0)[0]
    assert not max_err_check(out_ref.float() + 2.1 * err_pt, out_ref, out_pt, atol=0.0)[0]


def test_rule_accepts_within_twice_pytorch_error():
    ref = torch.zeros(10)
    pt = torch.full((10,), 0.01)
    assert max_err_check(torch.full((10,), 0.019), ref, pt, atol=0)[0]
    assert not max_err_check(torch.full((10,), 0.021), ref, pt, atol=0)[0]


def test_rule_rejects_nan_and_wrong_inf():
    ref = torch.tensor([float("-inf"), 1.0])
    assert max_err_check(torch.tensor([float("-inf"), 1.0]), ref, ref)[0]
    assert not max_err_check(torch.tensor([float("nan"), 1.0]), ref, ref)[0]
    assert not max_err_check(torch.tensor([0.0, 1.0]), ref, ref)[0]
    with pytest.raises(AssertionError, match="out: max"):
        assert_close_to_ref("out", torch.tensor([0.0, 2.0]), ref, ref)


@pytest.mark.parametrize("bad_pt", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
def test_rule_fails_loudly_without_a_finite_pytorch_error(bad_pt):
    """A PyTorch result that is not finite where the reference is (overflow, NaN) leaves the rule without
    a yardstick: it must fail, whatever ours is (an error of 99, or none), and say why."""
    ref = torch.tensor([0.0, 1.0, 2.0])
    pt = torch.tensor([bad_pt, 1.0, 2.0])
    for ours in (torch.tensor([99.0, 1.0, 2.0]), ref.clone()):
        ok, err, bound = max_err_check(ours, ref, pt)
        assert not ok and math.isnan(bound), (ours, err, bound)
        with pytest.raises(AssertionError, match="not finite"):
            assert_close_to_ref("out", ours, ref, pt)


def test_rule_fails_where_only_the_reference_is_infinite():
    """-inf in the reference (a row with no keys) but finite in PyTorch's result: PyTorch's error is inf."""
    ref = torch.tensor([float("-inf"), 1.0])
    ok, _, bound = max_err_check(ref.clone(), ref, torch.tensor([0.0, 1.0]))
    assert not ok and math.isnan(bound)


def test_rule_rejects_an_error_of_99():
    ref = torch.zeros(4)
    pt = torch.full((4,), 0.01)
    ok, err, bound = max_err_check(torch.tensor([99.0, 0, 0, 0]), ref, pt, atol=1e-2)
    assert not ok and err == 99.0 and bound == pytest.approx(0.03)
    with pytest.raises(AssertionError, match=r"9\.900e\+01 > allowed 3\.000e-02 \(2x"):
        assert_close_to_ref("dq", torch.tensor([99.0, 0, 0, 0]), ref, pt, atol=1e-2)


def test_rule_factor():
    ref, pt = torch.zeros(2), torch.full((2,), 0.01)
    assert not max_err_check(torch.full((2,), 0.025), ref, pt, atol=0)[0]
    assert max_err_check(torch.full((2,), 0.025), ref, pt, atol=0, factor=3.0)[0]
    with pytest.raises(AssertionError, match="3x PyTorch"):
        assert_close_to_ref("out", torch.full((2,), 0.035), ref, pt, atol=0, factor=3.0)


def _reference_grads(q, k, v, dout, causal, upcast):
    leaves = tuple((t.float() if upcast else t.clone()).requires_grad_() for t in (q, k, v))
    out, _ = attention_ref(*leaves, causal=causal, upcast=upcast)
    return torch.autograd.grad(out, leaves, dout.to(out.dtype))


def _fa2_backward_roundings(q, k, v, dout, causal):
    """The sm80 backward's arithmetic on the CPU: fp32 accumulation, P and dS rounded to the input dtype
    before their MMAs, D = rowsum(dO * O) from the forward's rounded O, each gradient rounded once."""
    dtype, scale = q.dtype, q.shape[-1] ** -0.5
    q, k, v, dout = (t.float() for t in (q, k, v, dout))
    s = torch.einsum("bthd,bshd->bhts", q, k) * scale
    if causal:
        s = s.masked_fill(~_causal_visible(q.shape[1], k.shape[1]), float("-inf"))
    p = torch.softmax(s, dim=-1)
    out = torch.einsum("bhts,bshd->bthd", p.to(dtype).float(), v).to(dtype).float()
    dv = torch.einsum("bhts,bthd->bshd", p.to(dtype).float(), dout)
    dp = torch.einsum("bthd,bshd->bhts", dout, v)
    d = (dout * out).sum(-1).transpose(1, 2)[..., None]
    ds = (p * (dp - d)).to(dtype).float()
    dq = torch.einsum("bhts,bshd->bthd", ds, k) * scale
    dk = torch.einsum("bhts,bthd->bshd", ds, q) * scale
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype, wrong", [(torch.bfloat16, 0.05), (torch.float16, 0.01)], ids=["bf16", "fp16"])
def test_gradient_rule_admits_the_kernel_roundings_and_not_a_wrong_scale(dtype, wrong, causal):
    """Why the gradients' rule keeps FA3's atol (``rounding_atol``), measured: the backward's own roundings
    stay within it, and a gradient off by a few percent (a wrong scale) does not (bf16: 5 %, fp16: 1 %;
    smaller relative errors of the largest entries pass in bf16, see ``rounding_atol``)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, s, 2, 64, generator=gen).to(dtype) for s in (113, 203, 203, 113))
    ref = _reference_grads(q, k, v, dout, causal, upcast=True)
    pt = _reference_grads(q, k, v, dout, causal, upcast=False)
    emulated = _fa2_backward_roundings(q, k, v, dout, causal)
    for name, ours, r, p in zip(("dq", "dk", "dv"), emulated, ref, pt):
        assert_close_to_ref(name, ours, r, p, atol=rounding_atol(r, dtype))
        assert not max_err_check(ours.float() * (1 + wrong), r, p, atol=rounding_atol(r, dtype))[0], name


def test_gradients_finite_on_rows_with_no_keys():
    q, k, v = (_rand(1, s, 2, 8).requires_grad_() for s in (6, 2, 2))
    out, _ = attention_ref(q, k, v, causal=True)  # rows 0..3 see no key
    out.sum().backward()
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert torch.isfinite(t.grad).all(), f"d{name} has NaN/inf"
    assert (q.grad[:, :4] == 0).all()
