"""Hopper FA3 forward (backend='sm90') against the fp32 reference (GPU tier, Hopper only).

Rule (flash-attn's): max|ours - ref_fp32| <= 2 * max|pytorch_same_dtype - ref_fp32| + atol, for out and lse
(3x for softcap, whose tanh.approx differs from torch.tanh by a few ulp before the exponent amplifies it).
Covers dtypes x head dims the sm90 table serves (64, 96, 128, 192, 256 natively; others zero-padded) x causal x
seqlens (tests/shapes.py) x MHA/GQA/MQA; sliding windows (one- and two-sided, causal + left window),
softcap, varlen (cu_seqlens, seqused, zero-length sequences, a 0-d tensor max_seqlen); NaN-poisoned
output buffers and bitwise determinism. The fast subset runs in well under a minute; the full
product is marked ``slow``.

Poisoned outputs: ``_parity.poisoned_fwd`` hands the launcher out/lse buffers it NaN-fills just before
the call and checks the results are those buffers, so a row the kernel does not write stays NaN. The
bitwise-repeat checks compare such calls (a fresh output could sit in the memory of an earlier identical
call and match without being written). Calls compared with each other run the same kernel; results of
different kernels (sm90 vs sm80) are each held to the fp32 reference instead.
"""

from __future__ import annotations

import pytest
import torch

from flashattn_hopper import flash_attn_func, validate
from flashattn_hopper.api import _fwd
from flashattn_hopper.backends.common import VarlenArgs
from flashattn_hopper.testing import attention_ref, capture_cuda_graph

from ._parity import check_parity as _check_parity
from ._parity import (
    check_features_dense, check_features_varlen, check_out_lse, check_poisoned_outputs, make_qkv, make_varlen,
    poisoned_fwd, seqused_pad_rows,
)
from .shapes import HEADS, SEQLENS_FAST, SEQLENS_SLOW
from .test_fwd_sm80_features import VARLEN_LENS, WINDOWS

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]
DTYPES = [torch.bfloat16, torch.float16]
HEAD_DIMS_SM90_FAST = [64, 96, 128, 192, 256]  # one per row of configs.FWD_SM90_TILES
HEAD_DIMS_SM90_SLOW = [32, 64, 80, 96, 128, 192, 256]  # 32/80 are padded up to a table row


def check_parity(q, k, v, causal, backend="sm90", **kwargs):
    return _check_parity(q, k, v, causal, backend, **kwargs)


def check_bitwise_repeats(q, k, v, repeats, causal=False):
    """``repeats`` more calls give the first call's out and LSE bit for bit (no races). Every call is
    poisoned (``_parity.poisoned_fwd``: NaN-filled out/lse made before the call, the launcher must write
    exactly them), so a repeat that skips writes cannot match by reusing an earlier call's memory."""
    first, first_lse = poisoned_fwd(q, k, v, "sm90", causal=causal)
    for _ in range(repeats):
        out, lse = poisoned_fwd(q, k, v, "sm90", causal=causal)
        assert torch.equal(out, first) and torch.equal(lse, first_lse)


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
    check_poisoned_outputs(q, k, v, causal, "sm90")


def test_fwd_sm90_rows_with_no_keys_are_zero_with_minus_inf_lse():
    q, k, v = make_qkv(1, 300, 40, 2, 2, 128)
    out, lse = check_parity(q, k, v, causal=True)
    assert (out[:, :260] == 0).all() and torch.isneginf(lse[:, :, :260]).all()


@pytest.mark.parametrize("head_dim", HEAD_DIMS_SM90_FAST)
def test_fwd_sm90_tiles_without_keys_after_tiles_with_keys(head_dim):
    """Causal seqlen_q >> seqlen_k: a persistent CTA takes a tile with keys, then tiles without
    (no Q load) whose zero output still goes through sO, which is sQ at head dims 192/256: the
    next Q must not be loaded into it before those epilogues are done (found by the slow tier)."""
    q, k, v = make_qkv(2, 3131, 2, 8, 2, head_dim)
    out, lse = check_parity(q, k, v, causal=True)
    assert (out[:, :3129] == 0).all() and torch.isneginf(lse[:, :, :3129]).all()


@pytest.mark.parametrize("head_dim,head_dim_v", [(128, 64), (80, 80), (192, 128)])
def test_fwd_sm90_padded_head_dims(head_dim, head_dim_v):
    q, k, v = make_qkv(2, 77, 150, 4, 4, head_dim, dv=head_dim_v)
    out, _ = check_parity(q, k, v, causal=False)
    assert out.shape[-1] == head_dim_v


@pytest.mark.parametrize("head_dim,head_dim_v", [(192, 128), (128, 64), (256, 128), (96, 64)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fwd_sm90_smaller_v_head_dim(head_dim, head_dim_v, causal):
    """v's head dim below q's runs at its own width (192/128 with its own tile, sO in sQ's buffer;
    256/128 and 128/64 with their own sO; 96/64 padded, other swizzle atoms): several tiles per CTA,
    GQA, poisoned outputs, varlen with seqused."""
    q, k, v = make_qkv(2, 1041, 1023, 8, 2, head_dim, dv=head_dim_v)
    check_parity(q, k, v, causal)
    check_poisoned_outputs(q, k, v, causal, "sm90")
    check_features_dense(q[:, :300], k, v, "sm90", window=(100, 20), softcap=0.0 if causal else 5.0)
    q, k, v, cu_q, cu_k, used_q, used_k = make_varlen(
        VARLEN_LENS, 4, 2, head_dim, head_dim_v, torch.bfloat16, slack_q=5, slack_k=9
    )
    check_varlen(q, k, v, cu_q, cu_k, used_q, used_k, causal=causal)


def test_fwd_sm90_strided_views_of_packed_qkv():
    qkv = torch.randn(2, 200, 3, 4, 128, dtype=torch.bfloat16, device="cuda")
    q, k, v = qkv.unbind(dim=2)
    check_parity(q, k, v, causal=True)


def test_fwd_sm90_long_causal_many_blocks():
    q, k, v = make_qkv(1, 2048, 2048, 4, 1, 128)
    check_parity(q, k, v, causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fwd_sm90_row_max_growing_across_key_blocks(dtype, head_dim, causal):
    # Key blocks are visited right to left; keys grow in scale towards the left, and query rows
    # differ in scale, so a row's max grows block after block, by less than the lazy rescale's
    # threshold (2**8: P above 1, no O rescale) in some blocks and rows of a warp and by more in
    # others (kernels/common/softmax.py), with a jump of x8 at key 300 that crosses it everywhere.
    gen = torch.Generator(device="cuda").manual_seed(7)
    b, s, h = 2, 1100, 4
    q = torch.randn(b, s, h, head_dim, device="cuda", generator=gen)
    k = torch.randn(b, s, h, head_dim, device="cuda", generator=gen)
    v = torch.randn(b, s, h, head_dim, device="cuda", generator=gen)
    key_scale = 1.0 + 5.0 * torch.linspace(1.0, 0.0, s, device="cuda")
    key_scale[:300] *= 8.0
    row_scale = torch.linspace(0.3, 1.5, s, device="cuda")[torch.randperm(s, device="cuda", generator=gen)]
    q = (q * row_scale[None, :, None, None]).to(dtype)
    k = (k * key_scale[None, :, None, None]).to(dtype)
    check_parity(q, k, v.to(dtype), causal)


@pytest.mark.parametrize("head_dim", HEAD_DIMS_SM90_FAST)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fwd_sm90_more_tiles_than_sms(head_dim, causal):
    # 3 * ceil(1041 / tile_m) * 16 >= 288 tiles: a persistent CTA walks several tiles (states,
    # ping-pong turns and the O buffer carry over), a non-persistent grid runs several waves.
    q, k, v = make_qkv(3, 1041, 1041, 16, 4, head_dim)
    check_parity(q, k, v, causal)
    check_bitwise_repeats(q, k, v, 1, causal)


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=lambda h: f"h{h[0]}k{h[1]}")
def test_fwd_sm90_causal_tiles_in_head_sections(head_dim, heads):
    """Causal/local tiles are walked in L2-sized sections of (batch, head) pairs (kernels/common/
    tile_scheduler.py, 16 MiB of K/V, at most 16 pairs): 5000 keys make sections of 3 (hdim 256)
    or 6 (hdim 128) pairs, 12 or 16 with GQA 8:2; 16 pairs of 9 m_blocks are 144 tiles, more than
    the SMs, so persistent CTAs cross section boundaries into a partial last section (all but the
    16-pair case). Every tile must be computed exactly once."""
    h, h_k = heads
    q, k, v = make_qkv(2, 1100, 5000, h, h_k, head_dim)
    check_parity(q, k, v, causal=True)
    check_poisoned_outputs(q, k, v, True, "sm90")
    check_features_dense(q, k, v, "sm90", window=(2000, 0))
    # mean 4500 keys: sections of 3 pairs at hdim 256 (3 + 3 + 2 heads), of 7 at hdim 128 (7 + 1)
    lens = [(600, 4000), (900, 6000), (0, 3000), (817, 5000)]
    q, k, v, cu_q, cu_k, _, _ = make_varlen(lens, h, h_k, head_dim, head_dim, torch.bfloat16)
    check_varlen(q, k, v, cu_q, cu_k, causal=True)


def _tile_counter_value() -> int:
    from flashattn_hopper.backends.sm90_fwd import tile_counter

    return int(tile_counter(torch.cuda.current_device()).item())


@pytest.mark.parametrize("head_dim", [64, 256])
def test_fwd_sm90_tile_counter_is_left_zero(head_dim):
    # The dynamic schedule's counter is zeroed once per stream and reset by each launch's last
    # fetch; a counter left non-zero would make the next call skip tiles (NaN in poisoned rows).
    q, k, v = make_qkv(3, 1041, 1041, 16, 4, head_dim)
    first = flash_attn_func(q, k, v, causal=True, backend="sm90")
    assert _tile_counter_value() == 0
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # a second stream gets its own counter
        for window in ((-1, 0), (300, 0), (-1, -1)):  # causal, local (both dynamic), dense (static)
            flash_attn_func(q, k, v, window_size=window, backend="sm90")
        on_side = flash_attn_func(q, k, v, causal=True, backend="sm90")
        assert _tile_counter_value() == 0
    torch.cuda.current_stream().wait_stream(side)
    check_poisoned_outputs(q, k, v, True, "sm90")
    with torch.cuda.stream(side):  # poisoned: a call that skipped tiles would leave NaN, not stale rows
        side_poisoned, _ = poisoned_fwd(q, k, v, "sm90", causal=True)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(first, on_side) and torch.equal(first, side_poisoned) and _tile_counter_value() == 0


@pytest.mark.parametrize(
    "causal, shape",
    [(True, (2, 1041, 1041, 16, 4, 128)), (False, (2, 1041, 1041, 16, 4, 128)), (False, (3, 512, 512, 4, 4, 64))],
    ids=["causal-128", "full-128", "full-64-span"],
)
def test_fwd_sm90_under_cuda_graph(causal, shape):
    """Replays match the eager call bit for bit (the same kernel), which matches the fp32 reference;
    the captured output is NaN-filled before every replay (the replay writes into it). Causal: under
    capture each call gets its own zeroed tile counter. hdim 64 at 512 tokens runs the spanning tiles
    (two K/V rings)."""
    q, k, v = make_qkv(*shape)
    eager, _ = check_parity(q, k, v, causal)
    graph, captured = capture_cuda_graph(lambda: flash_attn_func(q, k, v, causal=causal, backend="sm90"))
    for _ in range(3):
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)


def test_fwd_sm90_is_bitwise_deterministic():
    q, k, v = make_qkv(2, 1000, 1500, 8, 2, 128)
    check_bitwise_repeats(q, k, v, 100, causal=True)


def test_fwd_sm90_and_sm80_both_match_the_reference():
    """The two forward kernels on the same inputs, each held to the fp32 reference by the parity rule
    (a tolerance between them would have no reference behind it)."""
    q, k, v = make_qkv(2, 513, 777, 4, 2, 128)
    for causal in (False, True):
        for backend in ("sm90", "sm80"):
            _check_parity(q, k, v, causal, backend)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fwd_sm90_softmax_scale(head_dim, causal):
    """A softmax_scale other than 1/sqrt(head_dim), above and below it, dense and with softcap / window
    (the kernel folds the scale into exp2 and, with softcap, into the tanh argument)."""
    q, k, v = make_qkv(2, 239, 300, 8, 2, head_dim)
    for scale in (0.3, 0.02):
        check_parity(q, k, v, causal, softmax_scale=scale)
    check_features(q, k, v, causal=causal, window=(50, -1 if causal else 20), softmax_scale=0.3)
    check_features(q * 4, k, v, causal=causal, softcap=10.0, softmax_scale=0.2)


# ----------------------------------------------------------------------------- window, softcap, varlen


def check_features(q, k, v, causal=False, window=(-1, -1), softcap=0.0, softmax_scale=None):
    return check_features_dense(q, k, v, "sm90", causal=causal, window=window, softcap=softcap,
                                softmax_scale=softmax_scale)


def check_varlen(q, k, v, cu_q, cu_k, used_q=None, used_k=None, **kwargs):
    return check_features_varlen(q, k, v, cu_q, cu_k, "sm90", used_q, used_k, **kwargs)


@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fwd_sm90_window(window, causal):
    q, k, v = make_qkv(2, 239, 203, 4, 2, 128)
    check_features(q, k, v, causal=causal, window=window)


@pytest.mark.parametrize("head_dim", [64, 192, 256])
def test_fwd_sm90_window_long_other_head_dims(head_dim):
    """Many key blocks: all four mainloop segments (first, right edge, unmasked, left edge) run."""
    q, k, v = make_qkv(1, 1023, 1500, 4, 1, head_dim, dtype=torch.float16)
    check_features(q, k, v, window=(300, 200))
    check_features(q, k, v, causal=True, window=(257, 0))


@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fwd_sm90_softcap(head_dim, causal):
    softcap = 15.0
    q, k, v = make_qkv(2, 113, 203, 4, 4, head_dim)
    check_features(q * softcap / 4, k, v, causal=causal, softcap=softcap)


@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=lambda h: f"h{h[0]}k{h[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_fwd_sm90_varlen(dtype, causal, heads):
    q, k, v, cu_q, cu_k, _, _ = make_varlen(VARLEN_LENS, *heads, 128, 128, dtype)
    check_varlen(q, k, v, cu_q, cu_k, causal=causal, max_seqlen_q=300)


@pytest.mark.parametrize("head_dim", [64, 96, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fwd_sm90_varlen_seqused_and_tensor_max_seqlen(head_dim, causal):
    q, k, v, cu_q, cu_k, used_q, used_k = make_varlen(VARLEN_LENS, 4, 2, head_dim, head_dim, torch.bfloat16,
                                                      slack_q=5, slack_k=9)
    max_seqlen_q = torch.tensor(305, dtype=torch.int32, device="cuda")  # 0-d: never read on the host
    out, lse = check_varlen(q, k, v, cu_q, cu_k, used_q, used_k, causal=causal, max_seqlen_q=max_seqlen_q)
    pad_rows = seqused_pad_rows(cu_q, used_q)
    assert (out[pad_rows] == 0).all() and torch.isneginf(lse[:, pad_rows]).all()


def test_fwd_sm90_varlen_window_softcap():
    q, k, v, cu_q, cu_k, _, _ = make_varlen(VARLEN_LENS, 6, 2, 128, 128, torch.bfloat16)
    check_varlen(q, k, v, cu_q, cu_k, causal=True, window=(50, 0))
    check_varlen(q * 2.5, k, v, cu_q, cu_k, softcap=10.0)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fwd_sm90_varlen_window_fp16(head_dim, causal):
    """fp16 varlen with a sliding window (fast tier; the full product is slow), seqused, a custom scale."""
    q, k, v, cu_q, cu_k, used_q, used_k = make_varlen(VARLEN_LENS, 4, 2, head_dim, head_dim, torch.float16,
                                                      slack_q=3, slack_k=5)
    check_varlen(q, k, v, cu_q, cu_k, causal=causal, window=(32, -1 if causal else 8))
    check_varlen(q, k, v, cu_q, cu_k, used_q, used_k, causal=causal, window=(20, 0 if causal else 40),
                 softmax_scale=0.1)


def test_fwd_sm90_varlen_many_sequences():
    """More than 32 sequences: the tile scan walks several warp-wide steps."""
    gen = torch.Generator().manual_seed(3)
    lens = [(int(a), int(b)) for a, b in torch.randint(0, 400, (75, 2), generator=gen)]
    q, k, v, cu_q, cu_k, _, _ = make_varlen(lens, 2, 1, 64, 64, torch.float16)
    check_varlen(q, k, v, cu_q, cu_k, causal=True)


@pytest.mark.parametrize("mode", ["window", "softcap", "varlen_seqused"])
def test_fwd_sm90_poisoned_feature_outputs_are_fully_overwritten(mode):
    if mode in ("window", "softcap"):
        q, k, v = make_qkv(2, 239, 113, 4, 2, 128)
        window, softcap = ((20, 7), 0.0) if mode == "window" else ((-1, -1), 5.0)
        p = validate.validate_dense(q, k, v, None, False, window, softcap)
        varlen, refs = None, dict(window_size=window, softcap=softcap)
        out = torch.full((2, 239, 4, 128), float("nan"), dtype=q.dtype, device="cuda")
        lse = torch.full((2, 4, 239), float("nan"), dtype=torch.float32, device="cuda")
    else:
        q, k, v, cu_q, cu_k, used_q, used_k = make_varlen(VARLEN_LENS, 4, 2, 128, 128, torch.bfloat16, 3, 2)
        p = validate.validate_varlen(q, k, v, cu_q, cu_k, None, None, used_q, used_k, None, True, (-1, -1), 0.0)
        varlen = VarlenArgs(cu_q, cu_k, used_q, used_k, None, None)
        refs = dict(causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q, seqused_k=used_k)
        out = torch.full((q.shape[0], 4, 128), float("nan"), dtype=q.dtype, device="cuda")
        lse = torch.full((4, q.shape[0]), float("nan"), dtype=torch.float32, device="cuda")
    _fwd(q, k, v, p, "sm90", varlen, out=out, lse=lse)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    check_out_lse(mode, out, lse, attention_ref(q, k, v, **refs), attention_ref(q, k, v, upcast=False, **refs),
           3.0 if mode == "softcap" else 2.0)


def test_fwd_sm90_varlen_does_not_write_across_sequences():
    """Sequences shorter than a tile, back to back: each tile's O rows stop at its sequence's end."""
    lens = [(5, 7), (130, 64), (1, 300), (63, 63), (200, 1)]
    q, k, v, cu_q, cu_k, _, _ = make_varlen(lens, 4, 4, 64, 64, torch.bfloat16, seed=5)
    check_varlen(q, k, v, cu_q, cu_k)
    check_varlen(q, k, v, cu_q, cu_k, causal=True)


def test_fwd_sm90_varlen_is_bitwise_deterministic_and_matches_the_reference():
    """20 poisoned repeats (``_parity.poisoned_fwd``) equal the first bit for bit; sm90 and sm80 are each
    held to the fp32 reference (not to each other)."""
    q, k, v, cu_q, cu_k, _, _ = make_varlen(VARLEN_LENS, 8, 2, 128, 128, torch.bfloat16, seed=4)
    varlen = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    first, first_lse = poisoned_fwd(q, k, v, "sm90", varlen, causal=True)
    for _ in range(20):
        out, lse = poisoned_fwd(q, k, v, "sm90", varlen, causal=True)
        assert torch.equal(out, first) and torch.equal(lse, first_lse)
    refs = dict(causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    check_out_lse("sm90 varlen", first, first_lse, attention_ref(q, k, v, **refs),
                  attention_ref(q, k, v, upcast=False, **refs), 2.0)
    check_features_varlen(q, k, v, cu_q, cu_k, "sm80", causal=True)


# ----------------------------------------------------------------------------- full product of the features


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS_SM90_FAST)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", [(-1, -1), *WINDOWS], ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("softcap", [0.0, 30.0], ids=["nocap", "cap"])
@pytest.mark.parametrize("seqlens", [(113, 203), (239, 77), (1023, 1024)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}k{h[1]}")
def test_fwd_sm90_window_softcap_full(dtype, head_dim, causal, window, softcap, seqlens, heads):
    q, k, v = make_qkv(2, *seqlens, *heads, head_dim, dtype=dtype, seed=1)
    check_features(q * (softcap / 4 if softcap else 1.0), k, v, causal=causal, window=window, softcap=softcap)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS_SM90_SLOW)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", [(-1, -1), (32, 8)], ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("seqused", [False, True], ids=["cu", "seqused"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}k{h[1]}")
def test_fwd_sm90_varlen_full(dtype, head_dim, causal, window, seqused, heads):
    slack = 7 if seqused else 0
    q, k, v, cu_q, cu_k, used_q, used_k = make_varlen(VARLEN_LENS, *heads, head_dim, head_dim, dtype, slack, slack,
                                                      seed=3)
    check_varlen(q, k, v, cu_q, cu_k, used_q, used_k, causal=causal, window=window)


# ---- pack GQA: the g query heads of a KV head share one tile's rows (kernels/common/pack_gqa.py)

PACK_SEQLENS = [(1, 1), (1, 1023), (17, 203), (113, 1023), (239, 1)]  # decode to short prefill


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", PACK_SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("heads", [(16, 2), (8, 2), (6, 3)], ids=lambda h: f"h{h[0]}k{h[1]}")
def test_fwd_sm90_pack_gqa_decode_shapes(head_dim, causal, seqlens, heads):
    """Short seqlen_q with GQA: the launcher packs (g = 8, 4; g = 2 at (6, 3))."""
    (s_q, s_k), (h, h_k) = seqlens, heads
    q, k, v = make_qkv(3, s_q, s_k, h, h_k, head_dim)
    check_parity(q, k, v, causal)


@pytest.fixture
def always_pack(monkeypatch):
    """Force pack_gqa whenever the kernel can pack (g > 1 dividing tile_m, dense)."""
    from flashattn_hopper.backends import sm90_fwd

    def pack_when_possible(p, tile_m, varlen):
        g = p.nheads // p.nheads_k
        return g if g > 1 and not varlen and tile_m % g == 0 else 1

    monkeypatch.setattr(sm90_fwd, "pack_gqa_factor", pack_when_possible)


@pytest.mark.parametrize("head_dim", [64, 128, 192])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fwd_sm90_pack_gqa_forced_many_tiles(always_pack, head_dim, causal):
    """Packed tiles over long sequences: masks by query = row // g, several tiles per CTA."""
    q, k, v = make_qkv(2, 1041, 1500, 16, 4, head_dim)
    check_parity(q, k, v, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(12, 4), (12, 2)], ids=["g3", "g6"])
def test_fwd_sm90_pack_gqa_forced_g_not_dividing_64(always_pack, heads, causal):
    """g = 3, 6 divide the 192-row hdim-64 tile but not a warpgroup's 64 rows: the kernel stores
    O per tile (CTA-wide epilogue). seqlen_q
    above 1536 keeps the 192-row tile under causal (configs.FWD_SM90_SHORT_TILES)."""
    q, k, v = make_qkv(2, 1700, 1900, *heads, 64)
    check_parity(q, k, v, causal)


@pytest.fixture
def key_fields(monkeypatch):
    """``force(**fields)``: every sm90 key the launcher builds gets these fields (after the table's
    and the launcher's own choices)."""
    import dataclasses

    from flashattn_hopper.backends import sm90_fwd

    key_of = sm90_fwd.FwdSm90._key

    def force(**fields):
        monkeypatch.setattr(
            sm90_fwd.FwdSm90, "_key", lambda self, *a, **kw: dataclasses.replace(key_of(self, *a, **kw), **fields)
        )

    return force


@pytest.mark.parametrize(
    "variant",
    [{"persistent": False, "q_stages": 1}, {"wg_local_epilogue": False, "span_heads": False}, {"section_l2_mb": 0},
     {"span_heads": False}],
    ids=["one_cta_per_tile", "cta_wide_epilogue", "head_by_head_order", "tiles_within_heads"],
)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fwd_sm90_unshipped_variants(key_fields, variant, head_dim, causal):
    """Kernel variants no table row ships (perf/bench_fwd_sm90.py's baselines) stay correct."""
    key_fields(**variant)
    q, k, v = make_qkv(3, 1041, 1041, 16, 4, head_dim)
    check_parity(q, k, v, causal)


@pytest.mark.parametrize("q_stages", [1, 2])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen", [200, 1041], ids=lambda s: f"s{s}")
def test_fwd_sm90_q_ring(key_fields, q_stages, head_dim, causal, seqlen):
    """One or two Q buffers (the next tile's Q loading under this tile): many tiles per CTA, so
    the ring wraps, on short and long tiles, with poisoned outputs and a bitwise repeat."""
    key_fields(q_stages=q_stages)
    q, k, v = make_qkv(3, seqlen, seqlen, 16, 4, head_dim)
    check_parity(q, k, v, causal)
    check_poisoned_outputs(q, k, v, causal, "sm90")
    check_bitwise_repeats(q, k, v, 2, causal)


@pytest.mark.parametrize("q_stages", [1, 2])
def test_fwd_sm90_q_ring_features(key_fields, q_stages):
    """Varlen (zero-length sequences: tiles without keys between tiles with), windows, softcap and
    packed GQA with one or two Q buffers."""
    key_fields(q_stages=q_stages)
    lens = [(300, 500), (0, 77), (129, 0), (1041, 1041), (1, 1)]
    for causal in (False, True):
        q, k, v, cu_q, cu_k, _, _ = make_varlen(lens, 8, 2, 128, 128, torch.bfloat16)
        check_varlen(q, k, v, cu_q, cu_k, causal=causal)
    q, k, v = make_qkv(2, 700, 900, 8, 2, 64)
    check_features(q, k, v, window=(100, 37), softcap=20.0)
    q, k, v = make_qkv(4, 1, 4096, 32, 4, 128)  # decode: packed GQA
    check_parity(q, k, v, False)


@pytest.mark.parametrize("window", [(64, 0), (100, 37)], ids=lambda w: f"w{w[0]}_{w[1]}")
def test_fwd_sm90_pack_gqa_forced_window_softcap(always_pack, window):
    q, k, v = make_qkv(2, 333, 517, 8, 2, 128)
    check_features(q, k, v, window=window)
    check_features(q, k, v, causal=True, softcap=30.0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fwd_sm90_pack_gqa_poisoned_outputs(always_pack, causal):
    """Every (query, head) row of a packed tile is written, including the partial last tile."""
    q, k, v = make_qkv(2, 77, 300, 8, 1, 128)
    check_poisoned_outputs(q, k, v, causal, "sm90")


@pytest.fixture
def cluster_of(monkeypatch):
    """Give every sm90 tile the table picks ``cluster_m`` (and optionally ``persistent``), whatever
    the table ships, and turn automatic pack_gqa off (packed calls keep cluster_m = 1): the
    launcher's own rule then keys clusters only for dense, unmasked calls."""
    import dataclasses

    from flashattn_hopper import configs
    from flashattn_hopper.backends import sm90_fwd

    tile_of = configs.sm90_fwd_tile

    def force(cluster_m: int, **fields):
        monkeypatch.setattr(
            configs, "sm90_fwd_tile",
            lambda *a, **kw: dataclasses.replace(tile_of(*a, **kw), cluster_m=cluster_m, **fields),
        )
        monkeypatch.setattr(sm90_fwd, "pack_gqa_factor", lambda *a, **kw: 1)

    return force


@pytest.mark.parametrize("head_dim", HEAD_DIMS_SM90_FAST)
@pytest.mark.parametrize("seqlens", SEQLENS_FAST, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}k{h[1]}")
def test_fwd_sm90_cluster_pairs(cluster_of, head_dim, seqlens, heads):
    """Clusters of 2 CTAs multicasting K/V over short shapes, GQA/MQA heads: one query tile (1, 17,
    113 and 128 rows: the cluster's second CTA computes a tile past the end and stores nothing), a
    few (239, 1023 rows), seqlen_q != seqlen_k."""
    cluster_of(2)
    (s_q, s_k), (h, h_k) = seqlens, heads
    q, k, v = make_qkv(2, s_q, s_k, h, h_k, head_dim, dtype=torch.bfloat16)
    check_parity(q, k, v, causal=False)


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "one_cluster_per_tile"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS_SM90_FAST)
def test_fwd_sm90_cluster_many_tiles(cluster_of, persistent, head_dim):
    """More tile pairs than clusters (persistent: each cluster walks several pairs in lockstep,
    states carried over; else several waves), an odd tile count per head (2100 rows: 17 tiles of
    128, 11 of 192), the table's long-sequence tiles (hdim 192: 128x112, hdim 256: 128x80), fp16,
    poisoned outputs, bitwise equal repeats."""
    cluster_of(2, persistent=persistent)
    q, k, v = make_qkv(3, 2100, 1300, 16, 4, head_dim, dtype=torch.float16)
    check_parity(q, k, v, causal=False)
    check_poisoned_outputs(q, k, v, False, "sm90")
    check_bitwise_repeats(q, k, v, 20)


@pytest.mark.parametrize("seqlen_q,seqlen_k,heads,head_dim_v", [
    (8192, 8192, (2, 2), 256), (8320, 8200, (4, 1), 256), (8192, 8192, (2, 1), 128),
], ids=["64_m_blocks", "65_m_blocks_mqa", "v128"])
def test_fwd_sm90_shipped_clusters(seqlen_q, seqlen_k, heads, head_dim_v):
    """hdim 256's table row ships clusters of 2 for long dense non-causal calls (configs.cluster_pays):
    the launcher's own key, an even m_block count and 65 (the last pair's second CTA computes a tile
    past the end), MQA, v's head dim 128 (run at its own width), poisoned outputs."""
    from flashattn_hopper import dispatch
    from flashattn_hopper.jit import target_arch

    q, k, v = make_qkv(1, seqlen_q, seqlen_k, *heads, 256, head_dim_v, dtype=torch.bfloat16)
    p = validate.validate_dense(q, k, v, None, False, (-1, -1), 0.0)
    assert dispatch.FWD_KERNELS["sm90"].key(p, target_arch()).cluster_m == 2
    check_parity(q, k, v, causal=False)
    check_poisoned_outputs(q, k, v, False, "sm90")


def test_fwd_sm90_cluster_ctas_stay_resident():
    """A persistent cluster launch takes no more CTAs than clusters of that size keep resident at
    once (else clusters would wait for others, and their tiles run after the rest)."""
    from cutlass.utils import HardwareInfo

    from flashattn_hopper.backends.common import cluster_ctas, num_sms

    index = torch.cuda.current_device()
    for size in (2, 4):
        ctas = cluster_ctas(index, size)
        with torch.cuda.device(index):
            torch.cuda.synchronize()  # (HardwareInfo queries in the current context)
            resident = HardwareInfo(index).get_max_active_clusters(size) * size
        assert ctas == min(resident, num_sms(index) // size * size), (size, ctas, resident)


def test_fwd_sm90_clusters_under_graph_capture():
    """A shipped cluster forward captured in a CUDA graph (compiled before capture, as capture needs)
    replays to its eager result, also when its resident-CTA count was never queried before the
    capture (the query would synchronize the device: a capture gets num_sms rounded down)."""
    from flashattn_hopper.backends.common import _resident_cluster_ctas

    q, k, v = make_qkv(1, 8192, 8192, 1, 1, 256, dtype=torch.bfloat16)
    eager = flash_attn_func(q, k, v)
    _resident_cluster_ctas.cache_clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flash_attn_func(q, k, v)
    captured.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


def test_fwd_sm90_cluster_leaves_masked_calls_alone(cluster_of):
    """Causal, window and varlen calls cannot use clusters (the CTAs of one visit different key
    blocks): with every tile offering clusters, the launcher keys them with cluster_m = 1 (the
    kernel would refuse the others) and the results stay right."""
    cluster_of(2)
    q, k, v = make_qkv(2, 333, 517, 8, 2, 128)
    check_parity(q, k, v, causal=True)
    check_features(q, k, v, window=(64, 0))
    q, k, v, cu_q, cu_k, _, _ = make_varlen(VARLEN_LENS, 4, 2, 128, 128, torch.bfloat16)
    check_varlen(q, k, v, cu_q, cu_k, causal=False, max_seqlen_q=300)


@pytest.fixture
def span_heads(monkeypatch):
    """Give every sm90 tile row spanning tiles (and optionally other fields) at every seqlen,
    whatever the table ships; automatic pack_gqa off. The launcher keys them only for dense,
    unmasked calls whose heads have >= tile_m / 64 - 1 blocks of 64 rows."""
    import dataclasses

    from flashattn_hopper import configs
    from flashattn_hopper.backends import sm90_fwd

    tile_of = configs.sm90_fwd_tile

    def force(**fields):
        monkeypatch.setattr(
            configs, "sm90_fwd_tile",
            lambda *a, **kw: dataclasses.replace(tile_of(*a, **kw), span_heads=True, **fields),
        )
        monkeypatch.setattr(sm90_fwd, "pack_gqa_factor", lambda *a, **kw: 1)
        monkeypatch.setattr(configs, "span_pays", lambda *a, **kw: True)

    return force


@pytest.mark.parametrize("head_dim", [64, 96])  # 3 MMA warpgroups (own sO) / 2 (sO in sQ's buffer)
@pytest.mark.parametrize(
    "seqlens", [(65, 65), (113, 517), (512, 512), (1023, 300), (1041, 1041), (17, 200)],
    ids=lambda s: f"{s[0]}x{s[1]}",
)
@pytest.mark.parametrize("heads", [(16, 4), (8, 1), (5, 5)], ids=lambda h: f"h{h[0]}k{h[1]}")
def test_fwd_sm90_span_heads_parity(span_heads, head_dim, seqlens, heads):
    """Spanning tiles: a tile's warpgroups take consecutive 64-row blocks across (batch, head) pairs,
    K/V of a second pair through ring B. Sequences of 2 blocks (65, 113: every tile spans heads),
    whole and partial last blocks, GQA/MQA (ring B may hold the same KV head), seqlen_k != seqlen_q,
    the launch's last tile past the end (hdim 64, batch 2: the block count is never a multiple of
    3 here; hdim 96, batch 3: odd at 5 heads x 17 or 1 blocks). 17 rows: 1 block per head; hdim 64's
    3 warpgroups are not spanned there (the launcher keys the row without), hdim 96's 2 are."""
    span_heads()
    (s_q, s_k), (h, h_k) = seqlens, heads
    q, k, v = make_qkv(2 if head_dim == 64 else 3, s_q, s_k, h, h_k, head_dim, dtype=torch.bfloat16)
    check_parity(q, k, v, causal=False)


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "one_cta_per_tile"])
def test_fwd_sm90_span_heads_many_tiles(span_heads, persistent):
    """More spanning tiles than SMs (persistent: each CTA walks several, both rings' states carried
    over, the rings used unevenly), fp16, poisoned outputs, bitwise equal repeats; causal calls of the
    same shape run the row without spanning."""
    span_heads(persistent=persistent)
    q, k, v = make_qkv(4, 1041, 1300, 16, 4, 64, dtype=torch.float16)
    check_parity(q, k, v, causal=False)
    check_parity(q, k, v, causal=True)
    check_poisoned_outputs(q, k, v, False, "sm90")
    check_bitwise_repeats(q, k, v, 20)
