"""Self-tests of the fp32 reference and the acceptance rule (CPU tier)."""

from __future__ import annotations

import math

import pytest
import torch

from flashattn_hopper.testing import assert_close_to_ref, attention_ref, max_err_check


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


def test_gqa_equals_repeated_kv():
    q, k, v = _rand(1, 5, 8, 8), _rand(1, 7, 2, 8), _rand(1, 7, 2, 8)
    out, lse = attention_ref(q, k, v, causal=True)
    out_rep, lse_rep = attention_ref(q, k.repeat_interleave(4, dim=2), v.repeat_interleave(4, dim=2), causal=True)
    torch.testing.assert_close(out, out_rep)
    torch.testing.assert_close(lse, lse_rep)


def test_varlen_equals_per_sequence_dense():
    lens_q = [3, 0, 5]
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 6, 12], dtype=torch.int32)
    q, k, v = _rand(8, 2, 8), _rand(12, 2, 8), _rand(12, 2, 8)
    out, lse = attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    assert out.shape == (8, 2, 8) and lse.shape == (2, 8)
    for i in range(3):
        if lens_q[i] == 0:
            continue
        sq, sk = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        o_i, l_i = attention_ref(q[sq][None], k[sk][None], v[sk][None], causal=True)
        torch.testing.assert_close(out[sq], o_i[0])
        torch.testing.assert_close(lse[:, sq], l_i[0])


def test_varlen_seqused_limits_rows_and_keys():
    cu = torch.tensor([0, 6], dtype=torch.int32)
    q, k, v = _rand(6, 1, 8), _rand(6, 1, 8), _rand(6, 1, 8)
    out, lse = attention_ref(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, seqused_q=torch.tensor([4], dtype=torch.int32),
                             seqused_k=torch.tensor([3], dtype=torch.int32))
    o_dense, l_dense = attention_ref(q[:4][None], k[:3][None], v[:3][None])
    torch.testing.assert_close(out[:4], o_dense[0])
    assert (out[4:] == 0).all() and torch.isneginf(lse[:, 4:]).all()


def test_upcast_false_keeps_dtype_and_differs_from_fp32():
    q, k, v = (_rand(1, 64, 2, 64).bfloat16() for _ in range(3))
    out_ref, _ = attention_ref(q, k, v)
    out_pt, _ = attention_ref(q, k, v, upcast=False)
    assert out_ref.dtype == out_pt.dtype == torch.bfloat16
    ok, err, bound = max_err_check(out_pt, out_ref, out_pt)
    assert ok and err > 0


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


def test_gradients_finite_on_rows_with_no_keys():
    q, k, v = (_rand(1, s, 2, 8).requires_grad_() for s in (6, 2, 2))
    out, _ = attention_ref(q, k, v, causal=True)  # rows 0..3 see no key
    out.sum().backward()
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert torch.isfinite(t.grad).all(), f"d{name} has NaN/inf"
    assert (q.grad[:, :4] == 0).all()
