"""FP8 (e4m3) forward with v's keys contiguous (``validate.keys_contiguous``): the kernel loads V^T by TMA
straight into the layout its P.V MMA reads and reorders P's keys in registers (kernels/sm90/fwd_fp8.py,
``v_colmajor``) instead of transposing V in shared memory. Same yardstick as ``test_fp8_fwd.py`` (its
helpers; its dense, varlen and one-hot key-order tests run with keys-major v too); each GPU test also checks
which kernel ran."""

from __future__ import annotations

import math

import pytest
import torch

from flashattn_hopper import flash_attn_func, fp8
from flashattn_hopper.backends.common import keys_contiguous_ready
from flashattn_hopper.testing import attention_ref
from flashattn_hopper.validate import keys_contiguous

from .test_fp8_fwd import (
    E4M3, _check, _dequantize, _emulated, _poison_allocator, _quantize, _rows_varied, _score_magnitude,
)
from .test_fp8_fwd import kernel_layouts  # noqa: F401 (a fixture)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp8_keys_major_v_from_the_quantizer_with_block_scales(head_dim, kernel_layouts):
    """``quantize_qkv(v_layout="keys")`` (the Triton quantizer writing V^T) with per-block descales and the
    Hadamard transform, causal, GQA; the same values as its row-major v."""
    batch, heads, heads_k, s_q, s_k = 2, 4, 2, 1023, 700
    gen = torch.Generator(device="cuda").manual_seed(head_dim + 40)
    q = _rows_varied(batch, s_q, heads, head_dim, gen=gen).bfloat16()
    k, v = (_rows_varied(batch, s_k, heads_k, head_dim, gen=gen).bfloat16() for _ in range(2))
    rows = fp8.quantize_qkv(q, k, v, block=True)
    quant = fp8.quantize_qkv(q, k, v, block=True, v_layout="keys")
    assert keys_contiguous(quant.v) and torch.equal(quant.v.view(torch.uint8), rows.v.view(torch.uint8))
    tile_m, tile_n = fp8.kernel_tiles(head_dim)
    qf, kf, vf = (fp8.dequantize(x8, d, r) for x8, d, r in
                  ((quant.q, quant.q_descale, tile_m), (quant.k, quant.k_descale, tile_n),
                   (rows.v, quant.v_descale, tile_n)))
    out_ref, lse_ref = attention_ref(qf, kf, vf, causal=True)
    out_emul = _emulated(qf, kf, vf, True, (-1, 0), 1.0 / math.sqrt(head_dim))
    _poison_allocator()
    out, lse = flash_attn_func(quant.q, quant.k, quant.v, causal=True, q_descale=quant.q_descale,
                               k_descale=quant.k_descale, v_descale=quant.v_descale, return_lse=True)
    assert kernel_layouts[0], "the keys-major kernel did not run"
    _check(out, lse, out_ref, lse_ref, out_emul, f"keys-major block scales d{head_dim}",
           _score_magnitude(qf, kf, 1.0 / math.sqrt(head_dim)), head_dim)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("d, s", [(128, 1023), (96, 1024)], ids=["unaligned", "padded-head-dim"])
def test_fp8_keys_major_v_with_unaligned_strides_is_copied(d, s, kernel_layouts):
    """Keys contiguous but a head-dim stride of 1023 bytes (no TMA can read it), or a head dim the kernel pads
    (96 -> 128): the call copies v to rows and runs the transposing kernel, with the right result (a window)."""
    batch, heads, heads_k = 1, 2, 1
    gen = torch.Generator(device="cuda").manual_seed(9)
    q, k, v = (torch.randn(batch, s, h, d, generator=gen, device="cuda") for h in (heads, heads_k, heads_k))
    (q8, qd), (k8, kd), (v8, vd) = (_quantize(t, heads_k, batch, gen) for t in (q, k, v))
    qf, kf, vf = (_dequantize(t, dd, None) for t, dd in ((q8, qd), (k8, kd), (v8, vd)))
    vt8 = torch.empty(batch, heads_k, d, s, dtype=E4M3, device="cuda").permute(0, 3, 1, 2)
    vt8.view(torch.uint8).copy_(v8.view(torch.uint8))
    assert keys_contiguous(vt8) and keys_contiguous_ready(vt8) == (s % 16 == 0)
    window = (100, 0)
    out_ref, lse_ref = attention_ref(qf, kf, vf, window_size=window)
    out_emul = _emulated(qf, kf, vf, False, window, 1.0 / math.sqrt(d))
    out, lse = flash_attn_func(q8, k8, vt8, window_size=window, q_descale=qd, k_descale=kd, v_descale=vd,
                               return_lse=True)
    assert kernel_layouts[0] is False, kernel_layouts  # (the first key asked for: the call's own)
    _check(out, lse, out_ref, lse_ref, out_emul, f"keys-major v, d {d}, {s} keys")


def test_keys_contiguous_layouts():
    """Which v layouts count as keys-major, and which of those the kernel takes as they are (CPU)."""
    ready = fp8.keys_major_empty((2, 1023, 3, 64))
    assert keys_contiguous(ready) and keys_contiguous_ready(ready)
    assert not keys_contiguous(torch.empty(2, 1023, 3, 64, dtype=E4M3))  # row-major
    unaligned = torch.empty(2, 3, 64, 1023, dtype=E4M3).permute(0, 3, 1, 2)  # head-dim stride 1023 bytes
    assert keys_contiguous(unaligned) and not keys_contiguous_ready(unaligned)
    varlen = fp8.keys_major_empty((1, 500, 2, 128))[0]
    assert keys_contiguous(varlen) and keys_contiguous_ready(varlen)


def test_quantizer_writes_keys_major_v():
    """``quantize_qkv(v_layout="keys")`` (torch path, CPU): v8 has the row-major path's values, keys contiguous."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 100, h, 64, generator=gen) for h in (4, 2, 2))
    for block in (False, True):
        rows = fp8.quantize_qkv(q, k, v, block=block, impl="torch")
        keys = fp8.quantize_qkv(q, k, v, block=block, impl="torch", v_layout="keys")
        assert keys_contiguous(keys.v) and keys_contiguous_ready(keys.v)
        assert torch.equal(keys.v.view(torch.uint8), rows.v.view(torch.uint8))
        assert torch.equal(keys.v_descale, rows.v_descale)
    with pytest.raises(ValueError, match="v_layout"):
        fp8.quantize_qkv(q, k, v, v_layout="cols")


def test_plan_signatures_tell_the_v_layouts_apart():
    """``api._fp8_signature``: a keys-major v gets its own plan (the V^T kernel), an unaligned one none (the general
    path copies it to rows), a row-major v the plan it had (CPU)."""
    from flashattn_hopper import api

    q8 = torch.zeros(1, 32, 4, 64).to(E4M3)
    k8 = torch.zeros(1, 32, 2, 64).to(E4M3)
    keys = fp8.keys_major_empty((1, 32, 2, 64))
    unaligned = torch.empty(1, 2, 64, 33, dtype=E4M3)[..., :32].permute(0, 3, 1, 2)  # head-dim stride 33 bytes

    def sig(v):
        return api._fp8_signature(q8, k8, v, {}, None, True, (-1, -1), 0.0, None)

    assert sig(k8) is not None and sig(keys) is not None and sig(k8) != sig(keys)
    assert keys_contiguous(unaligned) and sig(unaligned) is None
