"""Hopper FA3 forward (backend='sm90') against the fp32 reference (GPU tier, Hopper only).

Rule (flash-attn's): max|ours - ref_fp32| <= 2 * max|pytorch_same_dtype - ref_fp32| + atol, for out and lse.
Covers dtypes x head dims the sm90 table serves (64, 128, 256 natively; others zero-padded) x causal x
seqlens (tests/shapes.py) x MHA/GQA/MQA, NaN-poisoned output buffers, and bitwise determinism.
"""

from __future__ import annotations

import pytest
import torch

from flashattn_hopper import flash_attn_func, validate
from flashattn_hopper.api import _fwd
from flashattn_hopper.testing import assert_close_to_ref, attention_ref

from .shapes import HEADS, SEQLENS_FAST, SEQLENS_SLOW

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]
DTYPES = [torch.bfloat16, torch.float16]
HEAD_DIMS_SM90_FAST = [64, 128, 256]  # one per row of configs.FWD_SM90_TILES
HEAD_DIMS_SM90_SLOW = [32, 64, 96, 128, 192, 256]  # 32/96/192 are padded up to a table row


def make_qkv(batch, s_q, s_k, h, h_k, d, dv=None, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dv = d if dv is None else dv
    q = torch.randn(batch, s_q, h, d, dtype=dtype, device="cuda", generator=gen)
    k = torch.randn(batch, s_k, h_k, d, dtype=dtype, device="cuda", generator=gen)
    v = torch.randn(batch, s_k, h_k, dv, dtype=dtype, device="cuda", generator=gen)
    return q, k, v


def check_parity(q, k, v, causal, **kwargs):
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True, backend="sm90", **kwargs)
    out_ref, lse_ref = attention_ref(q, k, v, causal=causal, **kwargs)
    out_pt, lse_pt = attention_ref(q, k, v, causal=causal, upcast=False, **kwargs)
    assert out.shape == out_ref.shape and out.dtype == q.dtype
    assert lse.shape == lse_ref.shape and lse.dtype == torch.float32
    assert not torch.isnan(out).any(), "NaN in out"
    assert_close_to_ref("out", out, out_ref, out_pt)
    assert_close_to_ref("lse", lse, lse_ref, lse_pt, atol=1e-4)
    return out, lse


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS_SM90_FAST)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS_FAST, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}k{h[1]}")
def test_fwd_sm90_parity(dtype, head_dim, causal, seqlens, heads):
    (s_q, s_k), (h, h_k) = seqlens, heads
    q, k, v = make_qkv(2, s_q, s_k, h, h_k, head_dim, dtype=dtype)
    check_parity(q, k, v, causal)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS_SM90_SLOW)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS_SLOW, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}k{h[1]}")
def test_fwd_sm90_parity_full(dtype, head_dim, causal, seqlens, heads):
    (s_q, s_k), (h, h_k) = seqlens, heads
    q, k, v = make_qkv(3, s_q, s_k, h, h_k, head_dim, dtype=dtype, seed=1)
    check_parity(q, k, v, causal)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fwd_sm90_poisoned_outputs_are_fully_overwritten(head_dim, causal):
    q, k, v = make_qkv(2, 239, 113, 4, 2, head_dim)
    out = torch.full((2, 239, 4, head_dim), float("nan"), dtype=q.dtype, device="cuda")
    lse = torch.full((2, 4, 239), float("nan"), dtype=torch.float32, device="cuda")
    p = validate.validate_dense(q, k, v, None, causal, (-1, -1), 0.0)
    _fwd(q, k, v, p, "sm90", None, out=out, lse=lse)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    out_ref, lse_ref = attention_ref(q, k, v, causal=causal)
    out_pt, lse_pt = attention_ref(q, k, v, causal=causal, upcast=False)
    assert_close_to_ref("out", out, out_ref, out_pt)
    assert_close_to_ref("lse", lse, lse_ref, lse_pt, atol=1e-4)


def test_fwd_sm90_rows_with_no_keys_are_zero_with_minus_inf_lse():
    q, k, v = make_qkv(1, 300, 40, 2, 2, 128)
    out, lse = check_parity(q, k, v, causal=True)
    assert (out[:, :260] == 0).all() and torch.isneginf(lse[:, :, :260]).all()


@pytest.mark.parametrize("head_dim,head_dim_v", [(128, 64), (96, 96), (192, 128)])
def test_fwd_sm90_padded_head_dims(head_dim, head_dim_v):
    q, k, v = make_qkv(2, 77, 150, 4, 4, head_dim, dv=head_dim_v)
    out, _ = check_parity(q, k, v, causal=False)
    assert out.shape[-1] == head_dim_v


def test_fwd_sm90_strided_views_of_packed_qkv():
    qkv = torch.randn(2, 200, 3, 4, 128, dtype=torch.bfloat16, device="cuda")
    q, k, v = qkv.unbind(dim=2)
    check_parity(q, k, v, causal=True)


def test_fwd_sm90_long_causal_many_blocks():
    q, k, v = make_qkv(1, 2048, 2048, 4, 1, 128)
    check_parity(q, k, v, causal=True)


def test_fwd_sm90_is_bitwise_deterministic():
    q, k, v = make_qkv(2, 1000, 1500, 8, 2, 128)
    first, first_lse = flash_attn_func(q, k, v, causal=True, return_lse=True, backend="sm90")
    for _ in range(100):
        out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True, backend="sm90")
        assert torch.equal(out, first) and torch.equal(lse, first_lse)


def test_fwd_sm90_agrees_with_sm80():
    q, k, v = make_qkv(2, 513, 777, 4, 2, 128)
    for causal in (False, True):
        out90, lse90 = flash_attn_func(q, k, v, causal=causal, return_lse=True, backend="sm90")
        out80, lse80 = flash_attn_func(q, k, v, causal=causal, return_lse=True, backend="sm80")
        torch.testing.assert_close(out90, out80, atol=2e-2, rtol=0)
        torch.testing.assert_close(lse90, lse80, atol=1e-3, rtol=0)


@pytest.mark.parametrize("overrides,match", [
    (dict(window_size=(16, 0)), "window_size"),
    (dict(softcap=30.0), "softcap"),
])
def test_fwd_sm90_refuses_what_it_lacks(overrides, match):
    q, k, v = make_qkv(1, 64, 64, 2, 2, 64)
    with pytest.raises(NotImplementedError, match=match):
        flash_attn_func(q, k, v, backend="sm90", **overrides)
