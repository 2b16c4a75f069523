"""Shared pieces of the forward parity tests: random inputs and the check against the fp32 reference."""

import torch

from flashattn_hopper import flash_attn_func
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
