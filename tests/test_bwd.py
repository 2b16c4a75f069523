"""Backward parity through the public API (GPU tier): dq, dk, dv against the fp32 reference's autograd.

Rule (flash-attn's): max|ours - ref_fp32| <= 2 * max|pytorch_same_dtype - ref_fp32| + atol for every gradient,
with atol = twice the dtype's rounding error at the reference's magnitude (FA3's test atol). The reference is
autograd through plain PyTorch attention, once on fp32 leaf copies (the oracle) and once in the input dtype.

The reference here masks rows that see no key before the softmax: ``testing.attention_ref`` fills them with
-inf and zeroes the softmax's NaN afterwards, which is right in the forward but makes its backward NaN on
those rows (and, through dS^T Q, on every dk).
"""

from __future__ import annotations

import math

import pytest
import torch

from flashattn_hopper import flash_attn_func
from flashattn_hopper.testing import assert_close_to_ref

from .shapes import HEAD_DIMS_FAST, HEAD_DIMS_SLOW, HEADS, SEQLENS_SLOW

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16]
# (seqlen_q, seqlen_k) for the fast tier: tiny, partial tiles with s_q != s_k, no-key rows, long.
SEQLENS_BWD_FAST = [
    (1, 1),  # one query, one key: dS is 0 up to rounding
    (17, 17),  # odd, smaller than any tile
    (113, 203),  # s_q != s_k, both partial; causal offset 90
    (239, 1),  # causal: most rows see no key (their gradients must be 0, not NaN)
    (1023, 1024),  # many m_blocks and n_blocks, partial last tiles
]


def make_inputs(batch, s_q, s_k, h, h_k, d, dv=None, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dv = d if dv is None else dv

    def randn(*shape):
        return torch.randn(*shape, dtype=dtype, device="cuda", generator=gen)

    return randn(batch, s_q, h, d), randn(batch, s_k, h_k, d), randn(batch, s_k, h_k, dv), randn(batch, s_q, h, dv)


def reference_grads(q, k, v, dout, causal, softmax_scale=None, upcast=True):
    """(out, dq, dk, dv) by autograd; upcast: on fp32 copies (the oracle), else in the input dtype."""
    dtype = torch.float32 if upcast else q.dtype
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    g = q.shape[2] // k.shape[2]
    kk, vv = (t.repeat_interleave(g, dim=2) if g > 1 else t for t in (k, v))
    scores = torch.einsum("bthd,bshd->bhts", q * scale, kk)
    s_q, s_k = q.shape[1], k.shape[1]
    if causal:
        rows = torch.arange(s_q, device=q.device)[:, None] + (s_k - s_q)
        visible = torch.arange(s_k, device=q.device)[None, :] <= rows
        has_key = visible.any(dim=-1, keepdim=True)
        # Rows with no key: constant scores (no NaN in the softmax), probabilities zeroed afterwards.
        scores = scores.masked_fill(~visible, float("-inf")).masked_fill(~has_key, 0.0)
        probs = torch.softmax(scores, dim=-1) * has_key
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhts,bshd->bthd", probs, vv)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout.to(dtype))
    return out, dq, dk, dv


def rounding_atol(ref: torch.Tensor, dtype: torch.dtype) -> float:
    r = ref.to(dtype)
    return 2.0 * ((r + 0.3 - 0.3) - r).abs().max().item() if r.numel() else 0.0


def ours(q, k, v, dout, causal, deterministic=False, **kwargs):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = flash_attn_func(q, k, v, causal=causal, deterministic=deterministic, backend="sm80", **kwargs)
    out.backward(dout)
    return out, q.grad, k.grad, v.grad


def check_grads(q, k, v, dout, causal, **kwargs):
    out, *grads = ours(q, k, v, dout, causal, **kwargs)
    _, *ref = reference_grads(q, k, v, dout, causal, kwargs.get("softmax_scale"))
    _, *pt = reference_grads(q, k, v, dout, causal, kwargs.get("softmax_scale"), upcast=False)
    for name, g, t, r, p in zip(("dq", "dk", "dv"), grads, (q, k, v), ref, pt):
        assert g.shape == t.shape and g.dtype == t.dtype, f"{name}: {g.shape} {g.dtype}"
        assert torch.isfinite(g).all(), f"{name} has NaN/Inf"
        assert_close_to_ref(name, g, r, p, atol=rounding_atol(r, q.dtype))
    return grads


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS_FAST)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS_BWD_FAST, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}k{h[1]}")
def test_bwd_parity(dtype, head_dim, causal, seqlens, heads):
    (s_q, s_k), (h, h_k) = seqlens, heads
    check_grads(*make_inputs(2, s_q, s_k, h, h_k, head_dim, dtype=dtype), causal)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS_SLOW)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS_SLOW, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}k{h[1]}")
def test_bwd_parity_full(dtype, head_dim, causal, seqlens, heads):
    (s_q, s_k), (h, h_k) = seqlens, heads
    check_grads(*make_inputs(3, s_q, s_k, h, h_k, head_dim, dtype=dtype, seed=1), causal)


def test_rows_with_no_keys_get_zero_gradients():
    q, k, v, dout = make_inputs(1, 300, 40, 4, 2, 64)
    dq, dk, dv = check_grads(q, k, v, dout, causal=True)
    assert (dq[:, :260] == 0).all()


@pytest.mark.parametrize("head_dim,head_dim_v", [(32, 32), (80, 80), (96, 96), (128, 64)])
def test_padded_head_dims(head_dim, head_dim_v):
    q, k, v, dout = make_inputs(2, 77, 150, 4, 2, head_dim, dv=head_dim_v)
    check_grads(q, k, v, dout, causal=True)


def test_softmax_scale_and_expanded_dout():
    q, k, v, dout = make_inputs(1, 130, 130, 2, 2, 64)
    check_grads(q, k, v, dout, causal=False, softmax_scale=0.3)
    # out.sum().backward() hands the kernel an expanded (stride-0) dout.
    q = q.detach().requires_grad_()
    flash_attn_func(q, k, v, backend="sm80").sum().backward()
    assert torch.isfinite(q.grad).all()


@pytest.mark.parametrize("head_dim", HEAD_DIMS_FAST)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_deterministic_is_bitwise_stable(head_dim, causal, heads):
    h, h_k = heads
    q, k, v, dout = make_inputs(2, 1000, 1100, h, h_k, head_dim)
    first = check_grads(q, k, v, dout, causal, deterministic=True)
    for _ in range(9):
        _, *again = ours(q, k, v, dout, causal, deterministic=True)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name} differs between deterministic runs"
