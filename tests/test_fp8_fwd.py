"""The FP8 (e4m3) forward on Hopper (kernels/sm90/fwd_fp8.py) through the API: ``q, k, v`` in
``float8_e4m3fn`` with FA3's per-(batch, kv head) ``q_descale``/``k_descale``/``v_descale``, bf16 out.

Yardstick (the flash-attn rule, adapted): the fp32 reference is attention on the dequantized inputs
(exactly what the kernel's fp8 products and fp32 accumulation see), and PyTorch's "same-dtype"
error is an emulation of the one rounding FP8 adds inside the kernel: P = 2^8 softmax numerator
rounded to e4m3 (3 mantissa bits: up to 2^-4 relative per probability) before P.V, the row sum taken
unrounded, O rounded to bf16. Ours must stay within 2x that error plus bf16's rounding of O. The
LSE depends on S only (exact fp8 products, fp32 sums): within 2e-3 absolute.
"""

from __future__ import annotations

import math

import pytest
import torch

from flashattn_hopper import flash_attn_func, flash_attn_varlen_func
from flashattn_hopper.testing import assert_close_to_ref, attention_ref, rounding_atol

E4M3 = torch.float8_e4m3fn


def _poison_allocator() -> None:
    """Fill freed caching-allocator blocks with NaN, so an output the kernel leaves unwritten shows."""
    junk = torch.full((64 << 20,), float("nan"), dtype=torch.float32, device="cuda")
    del junk


def _quantize(x: torch.Tensor, heads_k: int, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x8, descale (batch, heads_k))``: one random scale per (batch, kv head) applied to all of x
    (varlen: per sequence, as the kernel reads it): the dequantized values are x times 0.5-1, scores of
    ordinary size (softmax neither flat nor one-hot)."""
    step = x.abs().amax().clamp_min(1e-6) / 200  # x8 = x / step uses e4m3's range below 448
    descale = (torch.rand(batch, heads_k, generator=gen, device="cuda") * 0.5 + 0.5) * step
    return (x / step).to(E4M3), descale


def _dequantize(x8: torch.Tensor, descale: torch.Tensor, batch_of_row: torch.Tensor | None) -> torch.Tensor:
    """fp32 values the kernel sees: x8 * descale[b, h // g]. Dense (b, s, h, d) or varlen (t, h, d)."""
    heads, heads_k = x8.shape[-2], descale.shape[1]
    per_head = descale.repeat_interleave(heads // heads_k, dim=1)  # (b, h)
    if batch_of_row is None:
        return x8.float() * per_head[:, None, :, None]
    return x8.float() * per_head[batch_of_row][:, :, None]


def _emulated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: tuple[int, int],
              scale: float) -> torch.Tensor:
    """PyTorch's FP8 yardstick, dense fp32 (b, s, h, d) inputs: P rounded to e4m3 as 2^8 p."""
    b, s_q, h, d = q.shape
    s_k, h_k = k.shape[1], k.shape[2]
    k, v = (t.repeat_interleave(h // h_k, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    rows = torch.arange(s_q, device=q.device)[:, None] + s_k - s_q
    cols = torch.arange(s_k, device=q.device)[None, :]
    left, right = window
    visible = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device)
    if causal:
        visible &= cols <= rows
    if left >= 0:
        visible &= cols >= rows - left
    if right >= 0:
        visible &= cols <= rows + right
    scores = scores.masked_fill(~visible, float("-inf"))
    row_max = scores.amax(-1, keepdim=True).clamp_min(-1e30)
    p = torch.exp(scores - row_max) * 256.0
    p8 = p.to(E4M3).float()
    row_sum = p.sum(-1, keepdim=True).permute(0, 2, 1, 3)  # (b, s_q, h, 1)
    out = torch.einsum("bhqk,bkhd->bqhd", p8, v) / row_sum.clamp_min(1e-30)
    return torch.where(row_sum > 0, out, torch.zeros_like(out)).to(torch.bfloat16)


def _score_magnitude(q: torch.Tensor, k: torch.Tensor, scale: float) -> float:
    """``scale * max sum_d |q_d k_d|`` over (row, key) pairs of dense fp32 (b, s, h, d) inputs: the size of the
    partial sums the e4m3 WGMMA accumulates."""
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    return scale * torch.einsum("bqhd,bkhd->bhqk", q.abs(), k.abs()).max().item()


def _emulated_varlen(q, k, v, lens, cu, causal: bool, scale: float) -> torch.Tensor:
    """``_emulated`` per packed sequence ((total, h, d) inputs, the same offsets for q and k)."""
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.bfloat16, device=q.device)
    for i, n in enumerate(lens):
        if n:
            a = int(cu[i])
            out[a:a + n] = _emulated(q[None, a:a + n], k[None, a:a + n], v[None, a:a + n], causal,
                                     (-1, 0 if causal else -1), scale)[0]
    return out


def _check(out, lse, out_ref, lse_ref, out_emul, name, score_magnitude=0.0, head_dim=32):
    """``score_magnitude`` (``_score_magnitude``): Hopper's e4m3 WGMMA adds its products with about 14
    mantissa bits, not fp32's 23 (DeepSeek-V3 report, section 3.3.2), so S, and with it the LSE, is off
    by ~2^-14 of the partial sums' size per 32-deep k step; the LSE bound is 2e-3 plus twice that.
    (Measured on an H200 with scores up to ~50: LSE errors 0.008 / 0.017 / 0.025 at head dim 64 / 128 /
    256, in proportion to the k steps; this bound was set from those figures and passed on the H200.)"""
    assert out.dtype == torch.bfloat16, out.dtype
    atol = rounding_atol(out_ref, torch.bfloat16)
    assert_close_to_ref(f"{name} out", out, out_ref, out_emul, atol=atol)
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite), f"{name}: LSE finite where the reference is not (or back)"
    err = (lse[finite] - lse_ref[finite]).abs().max().item() if finite.any() else 0.0
    bound = 2e-3 + score_magnitude * (head_dim // 32) * 2.0 ** -13
    assert err <= bound, f"{name}: LSE max error {err:.2e} > {bound:.2e}"


def _keys_major(x8: torch.Tensor) -> torch.Tensor:
    """``x8``'s values (e4m3, dense ``(b, s, h, d)`` or varlen ``(t, h, d)``) with the keys contiguous (the V^T
    layout, ``fp8.keys_major_empty``)."""
    from flashattn_hopper import fp8

    if x8.dim() == 3:
        return _keys_major(x8[None])[0]
    out = fp8.keys_major_empty(x8.shape, x8.device)
    out.view(torch.uint8).copy_(x8.view(torch.uint8))
    return out


@pytest.fixture
def kernel_layouts(monkeypatch):
    """The ``fp8_v_colmajor`` of every FP8 key the calls ask for, in order (which kernel ran)."""
    from flashattn_hopper import dispatch

    family = type(dispatch.FWD_KERNELS["sm90"])
    original = family.fp8_key
    seen: list[bool] = []

    def spy(self, *args, **kwargs):
        key = original(self, *args, **kwargs)
        seen.append(key.fp8_v_colmajor)
        return key

    monkeypatch.setattr(family, "fp8_key", spy)
    return seen


CASES_DENSE = [(1, 1), (17, 113), (113, 17), (1023, 1023)]


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", CASES_DENSE, ids=[f"{a}x{b}" for a, b in CASES_DENSE])
@pytest.mark.parametrize("v_layout", ["rows", "keys"])
def test_fp8_forward_matches_the_dequantized_reference(head_dim, causal, seqlens, v_layout, kernel_layouts):
    """``v_layout`` "keys": v with its keys contiguous, the V^T kernel (TMA-loaded V^T, P's keys reordered)."""
    s_q, s_k = seqlens
    batch, heads, heads_k = 2, 4, 2
    gen = torch.Generator(device="cuda").manual_seed(head_dim + 7 * s_q + s_k + causal)
    q, k, v = (torch.randn(batch, s, h, head_dim, generator=gen, device="cuda")
               for s, h in ((s_q, heads), (s_k, heads_k), (s_k, heads_k)))
    (q8, qd), (k8, kd), (v8, vd) = (_quantize(t, heads_k, batch, gen) for t in (q, k, v))
    qf, kf, vf = (_dequantize(t, d, None) for t, d in ((q8, qd), (k8, kd), (v8, vd)))
    scale = 1.0 / math.sqrt(head_dim)
    out_ref, lse_ref = attention_ref(qf, kf, vf, causal=causal)
    out_emul = _emulated(qf, kf, vf, causal, (-1, 0 if causal else -1), scale)
    v_in = _keys_major(v8) if v_layout == "keys" else v8
    _poison_allocator()
    out, lse = flash_attn_func(q8, k8, v_in, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True)
    assert kernel_layouts[0] == (v_layout == "keys"), kernel_layouts
    _check(out, lse, out_ref, lse_ref, out_emul, f"d{head_dim} causal={causal} {s_q}x{s_k} v {v_layout}")


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("window", [(32, 16), (100, -1)])
@pytest.mark.parametrize("v_layout", ["rows", "keys"])
def test_fp8_forward_sliding_window(window, v_layout):
    batch, heads, heads_k, d, s = 1, 2, 1, 128, 1023
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(batch, s, h, d, generator=gen, device="cuda") for h in (heads, heads_k, heads_k))
    (q8, qd), (k8, kd), (v8, vd) = (_quantize(t, heads_k, batch, gen) for t in (q, k, v))
    qf, kf, vf = (_dequantize(t, dd, None) for t, dd in ((q8, qd), (k8, kd), (v8, vd)))
    out_ref, lse_ref = attention_ref(qf, kf, vf, window_size=window)
    out_emul = _emulated(qf, kf, vf, False, window, 1.0 / math.sqrt(d))
    v_in = _keys_major(v8) if v_layout == "keys" else v8
    out, lse = flash_attn_func(q8, k8, v_in, window_size=window, q_descale=qd, k_descale=kd, v_descale=vd,
                               return_lse=True)
    _check(out, lse, out_ref, lse_ref, out_emul, f"window {window}")


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("v_layout", ["rows", "keys"])
def test_fp8_forward_decode_mqa(v_layout):
    """One query per sequence against 1023 keys, 8 query heads on one kv head (packed GQA tiles)."""
    batch, heads, heads_k, d = 3, 8, 1, 128
    gen = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(batch, 1, heads, d, generator=gen, device="cuda")
    k, v = (torch.randn(batch, 1023, heads_k, d, generator=gen, device="cuda") for _ in range(2))
    (q8, qd), (k8, kd), (v8, vd) = (_quantize(t, heads_k, batch, gen) for t in (q, k, v))
    qf, kf, vf = (_dequantize(t, dd, None) for t, dd in ((q8, qd), (k8, kd), (v8, vd)))
    out_ref, lse_ref = attention_ref(qf, kf, vf, causal=True)
    out_emul = _emulated(qf, kf, vf, True, (-1, 0), 1.0 / math.sqrt(d))
    v_in = _keys_major(v8) if v_layout == "keys" else v8
    out, lse = flash_attn_func(q8, k8, v_in, causal=True, q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True)
    _check(out, lse, out_ref, lse_ref, out_emul, f"decode MQA v {v_layout}")


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("v_layout", ["rows", "keys"])
def test_fp8_forward_varlen(causal, v_layout):
    """Varlen; v with its keys contiguous too (the launcher copies it to rows: a sequence's first key would be the
    V^T TMA box's innermost coordinate, which must fall on 16 bytes)."""
    lens = [17, 130, 0, 1, 300]
    heads, heads_k, d = 4, 2, 128
    gen = torch.Generator(device="cuda").manual_seed(3 + causal)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    total, batch = sum(lens), len(lens)
    batch_of_row = torch.repeat_interleave(torch.arange(batch, device="cuda"), torch.tensor(lens, device="cuda"))
    q, k, v = (torch.randn(total, h, d, generator=gen, device="cuda") for h in (heads, heads_k, heads_k))
    (q8, qd), (k8, kd), (v8, vd) = (_quantize(t, heads_k, batch, gen) for t in (q, k, v))
    qf, kf, vf = (_dequantize(t, dd, batch_of_row) for t, dd in ((q8, qd), (k8, kd), (v8, vd)))
    out_ref, lse_ref = attention_ref(qf, kf, vf, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu)
    out_emul = _emulated_varlen(qf, kf, vf, lens, cu, causal, 1.0 / math.sqrt(d))
    _poison_allocator()
    v_in = _keys_major(v8) if v_layout == "keys" else v8
    out, lse = flash_attn_varlen_func(q8, k8, v_in, cu, cu, max(lens), max(lens), causal=causal, q_descale=qd,
                                      k_descale=kd, v_descale=vd, return_lse=True)
    _check(out, lse, out_ref, lse_ref, out_emul, f"varlen causal={causal} v {v_layout}")


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("v_layout", ["rows", "keys"])
def test_fp8_forward_key_order_one_hot_values(d, v_layout, kernel_layouts):
    """V's rows one-hot in the key (V[j, c] = [c == j % d]): any key permutation between P and V^T
    (the transposing kernel stores V^T in P's register order; with keys-major v the V^T kernel reorders P's keys
    in registers) moves mass to the wrong columns."""
    s = 512
    gen = torch.Generator(device="cuda").manual_seed(d)
    q = torch.randn(1, s, 1, d, generator=gen, device="cuda")
    k = torch.randn(1, s, 1, d, generator=gen, device="cuda")
    v = torch.nn.functional.one_hot(torch.arange(s, device="cuda") % d, d).float()[None, :, None, :]
    ones = torch.ones(1, 1, device="cuda")
    q8, k8, v8 = (t.to(E4M3) for t in (q, k, v))
    out_ref, _ = attention_ref(q8.float(), k8.float(), v8.float())
    out_emul = _emulated(q8.float(), k8.float(), v8.float(), False, (-1, -1), 1.0 / math.sqrt(d))
    out = flash_attn_func(q8, k8, _keys_major(v8) if v_layout == "keys" else v8, q_descale=ones, k_descale=ones,
                          v_descale=ones)
    assert kernel_layouts[0] == (v_layout == "keys"), kernel_layouts
    atol = rounding_atol(out_ref, torch.bfloat16)
    assert_close_to_ref(f"one-hot V d{d} {v_layout}", out, out_ref, out_emul, atol=atol)


@pytest.mark.gpu
@pytest.mark.sm90
def test_fp8_descales_are_checked():
    q8 = torch.randn(2, 64, 4, 64, device="cuda").to(E4M3)
    k8 = torch.randn(2, 64, 2, 64, device="cuda").to(E4M3)
    good = torch.ones(2, 2, device="cuda")
    with pytest.raises(ValueError, match="k_descale must have shape"):
        flash_attn_func(q8, k8, k8, q_descale=good, k_descale=torch.ones(2, 4, device="cuda"), v_descale=good)
    with pytest.raises(TypeError, match="v_descale must be float32"):
        flash_attn_func(q8, k8, k8, v_descale=good.half())
    with pytest.raises(ValueError, match="q_descale must be on"):
        flash_attn_func(q8, k8, k8, q_descale=good.cpu())
    with pytest.raises(TypeError, match="float32 tensor"):
        flash_attn_func(q8, k8, k8, q_descale=1.0)
    with pytest.raises(TypeError, match="k must have the same dtype"):
        flash_attn_func(q8, k8.to(torch.bfloat16), k8)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        flash_attn_func(q8.to(torch.float8_e5m2), k8.to(torch.float8_e5m2), k8.to(torch.float8_e5m2))
    with pytest.raises(NotImplementedError, match="Hopper"):
        flash_attn_func(q8, k8, k8, backend="sm80")
    with pytest.raises(NotImplementedError, match="softcap"):
        flash_attn_func(q8, k8, k8, softcap=5.0)
    with pytest.raises(NotImplementedError, match="learnable_sink"):
        flash_attn_func(q8, k8, k8, learnable_sink=torch.zeros(4, device="cuda"))
    # no descale: 1 (FA3's default), the result of the inputs as they are
    out = flash_attn_func(q8, k8, k8)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


@pytest.mark.gpu
@pytest.mark.sm90
def test_fp8_cached_calls_take_their_plan(monkeypatch):
    """A dense FP8 call with per-tensor descales and plain options is cached like a 16-bit call
    (``api._PLANS``, ``Fp8Plan``): after the first call the same bits without the general path (patched
    to fail), also with a descale left out (its own signature, planned after one general call), with none
    (None given counts as left out) and with other descale values of the same shape; a causal GQA shape
    (the dynamic tile schedule's counter)."""
    from flashattn_hopper import api, fp8

    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (torch.randn(2, s, h, 128, generator=gen, device="cuda") for s, h in ((300, 4), (300, 2), (300, 2)))
    (q8, qd), (k8, kd), (v8, vd) = (_quantize(t, 2, 2, gen) for t in (q, k, v))
    api.clear_plans()
    general = fp8.attention
    first = flash_attn_func(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    no_v = flash_attn_func(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd)
    none = flash_attn_func(q8, k8, v8, causal=True, q_descale=None)  # (None as if left out: the same plan)
    kd2 = kd * 0.5
    other = general(q8, k8, v8, {"q_descale": qd, "k_descale": kd2, "v_descale": vd}, None, True, (-1, -1), 0.0, None)[0]

    def general_path(*args, **kwargs):
        raise AssertionError("the call took the general path, not its plan")

    monkeypatch.setattr(fp8, "attention", general_path)
    for _ in range(2):
        assert torch.equal(flash_attn_func(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd), first)
        assert torch.equal(flash_attn_func(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd), no_v)
        assert torch.equal(flash_attn_func(q8, k8, v8, causal=True), none)
        assert torch.equal(flash_attn_func(q8, k8, v8, causal=True, q_descale=None, v_descale=None), none)
        assert torch.equal(flash_attn_func(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd2, v_descale=vd), other)
    with pytest.raises(AssertionError, match="general path"):  # a new signature (non-causal) goes the general way
        flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("case", ["stack", "copies"])
def test_fp8_block_scale_calls_take_their_plan(monkeypatch, case):
    """Per-block descales are cached too (``Fp8Plan`` with ``fp8_block_scales``): after one general call the
    same bits without the general path, all three given (``stack``: MHA at a length with as many key blocks
    as query blocks, one stack; ``copies``: GQA at hdim 256, where the shapes differ) and with one left out
    (fresh ones and copies); a call mixing per-tensor and per-block descales gets no plan signature."""
    from flashattn_hopper import api, fp8

    d, heads_k, seqlen = (128, 4, 256) if case == "stack" else (256, 2, 500)
    gen = torch.Generator(device="cuda").manual_seed(12)
    q, k, v = (_rows_varied(2, seqlen, h, d, gen=gen) for h in (4, heads_k, heads_k))
    quant = fp8.quantize_qkv(q, k, v, block=True, hadamard_qk=False)
    assert (quant.q_descale.shape == quant.k_descale.shape) == (case == "stack")
    scales = dict(q_descale=quant.q_descale, k_descale=quant.k_descale, v_descale=quant.v_descale)
    api.clear_plans()
    first = flash_attn_func(quant.q, quant.k, quant.v, causal=True, **scales)
    no_v = flash_attn_func(quant.q, quant.k, quant.v, causal=True, q_descale=quant.q_descale,
                           k_descale=quant.k_descale)

    def general_path(*args, **kwargs):
        raise AssertionError("the call took the general path, not its plan")

    monkeypatch.setattr(fp8, "attention", general_path)
    for _ in range(2):
        assert torch.equal(flash_attn_func(quant.q, quant.k, quant.v, causal=True, **scales), first)
        assert torch.equal(flash_attn_func(quant.q, quant.k, quant.v, causal=True, q_descale=quant.q_descale,
                                           k_descale=quant.k_descale), no_v)
    mixed = dict(scales, v_descale=quant.v_descale[:, :, 0].contiguous())
    assert api._fp8_signature(quant.q, quant.k, quant.v, mixed, None, True, (-1, -1), 0.0, None) is None


def _rows_varied(*shape, gen):
    """Random values whose rows differ in magnitude (0.25x-4x): per-block scales then differ per block."""
    x = torch.randn(*shape, generator=gen, device="cuda")
    return x * torch.exp2(torch.rand(*shape[:-1], 1, generator=gen, device="cuda") * 4 - 2)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_block_scales_match_the_dequantized_reference(head_dim, causal):
    """Per-block descales (q per tile of rows, k and v per key block, the kernel's tiles): each block's
    k descale in its step's scale, v's as a bias on each block's scores."""
    from flashattn_hopper import fp8

    batch, heads, heads_k, s_q, s_k = 2, 4, 2, 1023, 700
    gen = torch.Generator(device="cuda").manual_seed(head_dim + causal)
    q = _rows_varied(batch, s_q, heads, head_dim, gen=gen)
    k, v = (_rows_varied(batch, s_k, heads_k, head_dim, gen=gen) for _ in range(2))
    quant = fp8.quantize_qkv(q, k, v, block=True, hadamard_qk=False)
    tile_m, tile_n = fp8.kernel_tiles(head_dim)
    qf, kf, vf = (fp8.dequantize(x8, d, rows) for x8, d, rows in
                  ((quant.q, quant.q_descale, tile_m), (quant.k, quant.k_descale, tile_n), (quant.v, quant.v_descale, tile_n)))
    out_ref, lse_ref = attention_ref(qf, kf, vf, causal=causal)
    out_emul = _emulated(qf, kf, vf, causal, (-1, 0 if causal else -1), 1.0 / math.sqrt(head_dim))
    _poison_allocator()
    out, lse = flash_attn_func(quant.q, quant.k, quant.v, causal=causal, q_descale=quant.q_descale,
                               k_descale=quant.k_descale, v_descale=quant.v_descale, return_lse=True)
    _check(out, lse, out_ref, lse_ref, out_emul, f"block scales d{head_dim} causal={causal}",
           _score_magnitude(qf, kf, 1.0 / math.sqrt(head_dim)), head_dim)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("v_layout", ["rows", "keys"])
def test_fp8_block_scales_far_apart_and_a_zero_v_descale(head_dim, causal, v_layout):
    """V's key blocks 2**-6 to 2**6 apart in size, and one block's V descale set to 0 by the caller (its values
    then count as 0, its probabilities still in every row's sum): the kernel folds each block's V descale into
    its scores as a log2 bias (kernels/common/softmax.py ``block_value_log2``), so P and the row sum must stay
    right across blocks whatever their descales."""
    from flashattn_hopper import fp8

    batch, heads, s_q, s_k = 2, 2, 300, 900
    tile_m, tile_n = fp8.kernel_tiles(head_dim)
    gen = torch.Generator(device="cuda").manual_seed(head_dim + 2 * causal)
    q, k = (torch.randn(batch, n, heads, head_dim, generator=gen, device="cuda") for n in (s_q, s_k))
    block_size = torch.exp2(torch.randint(-6, 7, (-(-s_k // tile_n),), generator=gen, device="cuda").float())
    v = torch.randn(batch, s_k, heads, head_dim, generator=gen, device="cuda")
    v = v * block_size.repeat_interleave(tile_n)[:s_k, None, None]
    quant = fp8.quantize_qkv(q, k, v, block=True, hadamard_qk=False, v_layout=v_layout)
    v_descale = quant.v_descale.clone()
    v_descale[:, :, 1] = 0.0
    qf, kf, vf = (fp8.dequantize(x8, d, rows) for x8, d, rows in
                  ((quant.q, quant.q_descale, tile_m), (quant.k, quant.k_descale, tile_n), (quant.v, v_descale, tile_n)))
    out_ref, lse_ref = attention_ref(qf, kf, vf, causal=causal)
    out_emul = _emulated(qf, kf, vf, causal, (-1, 0 if causal else -1), 1.0 / math.sqrt(head_dim))
    _poison_allocator()
    out, lse = flash_attn_func(quant.q, quant.k, quant.v, causal=causal, q_descale=quant.q_descale,
                               k_descale=quant.k_descale, v_descale=v_descale, return_lse=True)
    _check(out, lse, out_ref, lse_ref, out_emul, f"far-apart block scales d{head_dim} causal={causal} {v_layout}",
           _score_magnitude(qf, kf, 1.0 / math.sqrt(head_dim)), head_dim)


@pytest.mark.gpu
@pytest.mark.sm90
def test_fp8_equal_block_scales_give_the_per_tensor_result():
    from flashattn_hopper import fp8

    batch, heads, heads_k, s, d = 2, 4, 2, 900, 128
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(batch, s, h, d, generator=gen, device="cuda") for h in (heads, heads_k, heads_k))
    quant = fp8.quantize_qkv(q, k, v, block=False, hadamard_qk=False)
    tile_m, tile_n = fp8.kernel_tiles(d)
    q_blocks = quant.q_descale.repeat_interleave(heads // heads_k, dim=1)[:, :, None].expand(-1, -1, -(-s // tile_m))
    k_blocks, v_blocks = (t[:, :, None].expand(-1, -1, -(-s // tile_n)).contiguous()
                          for t in (quant.k_descale, quant.v_descale))
    out_t = flash_attn_func(quant.q, quant.k, quant.v, causal=True, q_descale=quant.q_descale,
                            k_descale=quant.k_descale, v_descale=quant.v_descale)
    out_b = flash_attn_func(quant.q, quant.k, quant.v, causal=True, q_descale=q_blocks.contiguous(),
                            k_descale=k_blocks, v_descale=v_blocks)
    diff = (out_b.float() - out_t.float()).abs().max().item()
    assert diff <= 0.01 * out_t.float().abs().max().item(), f"block vs per-tensor: max diff {diff:.3e}"
    with pytest.raises(ValueError, match="per-block descales"):
        flash_attn_func(quant.q, quant.k, quant.v, q_descale=q_blocks[:, :, :1].contiguous(), k_descale=k_blocks,
                        v_descale=v_blocks)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp8_outliers_block_scales_and_hadamard_lower_the_error(head_dim):
    """The FA3 paper's setup (N(0, 1) entries plus 0.1 % with an extra N(0, 100) term): the kernel's RMSE
    against fp32 attention on the original inputs, per-tensor scales vs per-block scales after the
    random-sign Hadamard transform of q and k. The paper reports 2.6x; the torch emulation of the same
    (tests/test_fp8.py) measured 1.36-1.70x, almost all of it the Hadamard step. Asserted: >= 1.3x, and
    the block + Hadamard error within 100x bf16-input attention's (printed)."""
    from flashattn_hopper import fp8

    batch, heads, s = 2, 4, 1024
    gen = torch.Generator(device="cuda").manual_seed(head_dim)

    def outliers():
        x = torch.randn(batch, s, heads, head_dim, generator=gen, device="cuda")
        mask = torch.rand(x.shape, generator=gen, device="cuda") < 0.001
        return x + mask * torch.randn(x.shape, generator=gen, device="cuda") * 10

    q, k, v = outliers(), outliers(), outliers()
    out_ref, _ = attention_ref(q, k, v)

    def rmse(out):
        return (out.float() - out_ref.float()).pow(2).mean().sqrt().item()

    per_tensor = fp8.quantize_qkv(q, k, v, block=False, hadamard_qk=False)
    block_h = fp8.quantize_qkv(q, k, v, block=True, hadamard_qk=True)
    errs = {}
    for name, quant in (("per-tensor", per_tensor), ("block+hadamard", block_h)):
        errs[name] = rmse(flash_attn_func(quant.q, quant.k, quant.v, q_descale=quant.q_descale,
                                          k_descale=quant.k_descale, v_descale=quant.v_descale))
    errs["bf16"] = rmse(flash_attn_func(q.bfloat16(), k.bfloat16(), v.bfloat16()))
    print(f"d{head_dim} RMSE: " + ", ".join(f"{n} {e:.3e}" for n, e in errs.items())
          + f"; per-tensor / block+hadamard = {errs['per-tensor'] / errs['block+hadamard']:.2f}")
    assert errs["per-tensor"] >= 1.3 * errs["block+hadamard"], errs
    assert errs["block+hadamard"] <= 100 * errs["bf16"], errs


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block", [False, True])
def test_triton_quantizer_matches_the_torch_path(head_dim, block):
    """``quantize_qkv(impl="triton")`` against ``impl="torch"`` on the GPU: the same scales (to fp32
    rounding of the Hadamard sums) and e4m3 values at most one step apart (the sums' order differs)."""
    from flashattn_hopper import fp8

    gen = torch.Generator(device="cuda").manual_seed(head_dim)
    q, k, v = (torch.randn(2, 333, h, head_dim, generator=gen, device="cuda").bfloat16() * 3 for h in (4, 2, 2))
    tri = fp8.quantize_qkv(q, k, v, block=block, hadamard_qk=True, impl="triton")
    ref = fp8.quantize_qkv(q, k, v, block=block, hadamard_qk=True, impl="torch")
    tile_m, tile_n = fp8.kernel_tiles(head_dim)
    for name, rows in (("q", tile_m), ("k", tile_n), ("v", tile_n)):
        x8, scale = getattr(tri, name), getattr(tri, f"{name}_descale")
        r8, r_scale = getattr(ref, name), getattr(ref, f"{name}_descale")
        torch.testing.assert_close(scale, r_scale, rtol=1e-5, atol=0)
        deq = fp8.dequantize(x8, scale, rows if block else None)
        ref_deq = fp8.dequantize(r8, r_scale, rows if block else None)
        step = ref_deq.abs() * 2.0 ** -3 + scale.max() * 2.0 ** -9
        assert ((deq - ref_deq).abs() <= step).all(), f"{name}: values more than one e4m3 step apart"


def test_fp8_options_are_checked_before_any_launch():
    """CPU tier: the FP8 route checks the common options and refuses what it does not do, naming it."""
    q8 = torch.randn(1, 16, 2, 64).to(E4M3)
    with pytest.raises(TypeError, match="causal"):
        flash_attn_func(q8, q8, q8, causal="yes")
    with pytest.raises(ValueError, match="backend"):
        flash_attn_func(q8, q8, q8, backend="sm9")
    with pytest.raises(NotImplementedError, match="attention_chunk"):
        flash_attn_func(q8, q8, q8, attention_chunk=8)
    with pytest.raises(NotImplementedError, match="log_decay"):
        flash_attn_func(q8, q8, q8, log_decay=torch.zeros(1, 16, 2))
    with pytest.raises(TypeError, match="goes with float8_e4m3fn"):
        q16 = torch.randn(1, 16, 2, 64, dtype=torch.bfloat16)
        flash_attn_func(q16, q16, q16, q_descale=torch.ones(1, 2))


def test_fp8_byte_views_get_16_byte_strides():
    """An e4m3 tensor's byte view with strides that are multiples of 8 but not 16 bytes is copied
    before the kernel sees it (TMA needs 16-byte strides); 16-bit tensors keep the 8-element rule."""
    from flashattn_hopper.backends.common import kernel_ready

    odd = torch.empty(2, 8, 3, 72, dtype=torch.uint8)[..., :64]  # head stride 72 bytes
    assert kernel_ready(odd).stride(-2) % 16 == 0
    even = torch.empty(2, 8, 3, 80, dtype=torch.uint8)[..., :64]  # 80 bytes: kept
    assert kernel_ready(even).data_ptr() == even.data_ptr() or even.data_ptr() % 16
    half = torch.empty(2, 8, 3, 72, dtype=torch.bfloat16)[..., :64]  # 144 bytes: kept
    assert kernel_ready(half).data_ptr() == half.data_ptr() or half.data_ptr() % 16


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_block_scales_varlen(causal):
    """Per-block descales with packed sequences: blocks counted from each sequence's start, ``ceil(max_seqlen /
    tile)`` per sequence (unused ones ignored); each sequence quantized on its own here."""
    from flashattn_hopper import fp8

    lens = [300, 17, 0, 1, 450]
    heads, heads_k, d = 4, 2, 128
    tile_m, tile_n = fp8.kernel_tiles(d)
    gen = torch.Generator(device="cuda").manual_seed(7 + causal)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    max_len = max(lens)
    q, k, v = (_rows_varied(sum(lens), h, d, gen=gen) for h in (heads, heads_k, heads_k))
    parts = {name: ([], [], []) for name in "qkv"}  # (x8, descale, dequantized) per sequence
    for i, n in enumerate(lens):
        a = int(cu[i])
        for name, x, rows in (("q", q, tile_m), ("k", k, tile_n), ("v", v, tile_n)):
            if n == 0:
                parts[name][0].append(x[a:a].to(E4M3))
                parts[name][1].append(torch.ones(1, x.shape[1], -(-max_len // rows), device="cuda"))
                parts[name][2].append(x[a:a].float())
                continue
            x8, scale = fp8._per_block(x[None, a:a + n], rows)
            blocks = -(-max_len // rows)
            parts[name][0].append(x8[0])
            parts[name][1].append(torch.nn.functional.pad(scale, (0, blocks - scale.shape[-1]), value=1.0))
            parts[name][2].append(fp8.dequantize(x8, scale, rows)[0])
    (q8, qd, qf), (k8, kd, kf), (v8, vd, vf) = (
        (torch.cat(parts[n][0]), torch.cat(parts[n][1]).contiguous(), torch.cat(parts[n][2])) for n in "qkv"
    )
    out_ref, lse_ref = attention_ref(qf, kf, vf, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu)
    out_emul = _emulated_varlen(qf, kf, vf, lens, cu, causal, 1.0 / math.sqrt(d))
    out, lse = flash_attn_varlen_func(q8, k8, v8, cu, cu, max_len, max_len, causal=causal, q_descale=qd,
                                      k_descale=kd, v_descale=vd, return_lse=True)
    _check(out, lse, out_ref, lse_ref, out_emul, f"varlen block scales causal={causal}",
           _score_magnitude(qf[None], kf[None], 1.0 / math.sqrt(d)), d)
    with pytest.raises(TypeError, match="max_seqlen_q and max_seqlen_k as Python ints"):
        flash_attn_varlen_func(q8, k8, v8, cu, cu, None, None, q_descale=qd, k_descale=kd, v_descale=vd)


@pytest.mark.gpu
@pytest.mark.sm90
def test_fp8_compiled_call_matches_eager_bitwise():
    """torch.compile(fullgraph=True) of an FP8 call (the ``fwd_fp8`` custom op) runs the same kernel as eager."""
    from flashattn_hopper import fp8

    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (torch.randn(2, 300, h, 128, generator=gen, device="cuda").bfloat16() for h in (4, 2, 2))
    quant = fp8.quantize_qkv(q, k, v, block=True, hadamard_qk=True)

    def call(q8, k8, v8, qd, kd, vd):
        return flash_attn_func(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)

    args = (quant.q, quant.k, quant.v, quant.q_descale, quant.k_descale, quant.v_descale)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(call, fullgraph=True)(*args), call(*args))
