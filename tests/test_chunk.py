"""``attention_chunk`` (chunked local attention, Llama 4): query ``i`` sees the keys ``j`` with
``j // c == (i + seqlen_k - seqlen_q) // c``, with causal and the window on top.

CPU tier: the chunk segments (``flashattn_hopper/chunk.py``) are the chunk mask. Attention over the
segments as varlen sequences equals attention with the chunk mask built explicitly from its
definition (``testing.attention_ref``, fp32 on the CPU), for dense and varlen batches, seqused,
``seqlen_q`` above and below ``seqlen_k``, causal and windows, GQA; the segment tables themselves;
the argument's errors.

GPU tier: out, lse and dq/dk/dv through the public API on both backends against the fp32 reference
with the chunk mask (the parity rule of the other tests), causal, window, GQA, varlen + seqused,
``seqlen_q != seqlen_k``, odd lengths, fp16; poisoned outputs come from the varlen tests' launchers.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from flashattn_hopper import chunk, flash_attn_func, flash_attn_varlen_func
from flashattn_hopper.testing import assert_close_to_ref, attention_ref



def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)


def _segment_ref(q, k, v, cu_q, cu_k, used_q, used_k, c, num_segments=None, **options):
    """attention_ref over the chunk segments of a varlen batch, as the API runs them (``num_segments``: the
    API's bound from the shapes by default)."""
    if num_segments is None:
        num_segments = chunk.varlen_num_segments(cu_k.shape[0] - 1, k.shape[0], c)
    seg = chunk.segments(cu_q, cu_k, used_q, used_k, c, num_segments)
    return attention_ref(q, k, v, cu_seqlens_q=seg[0], cu_seqlens_k=seg[1], seqused_q=seg[2], seqused_k=seg[3],
                         **options)


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# (lens_q, lens_k, chunk): equal lengths, s_q < s_k (offset > chunk: leading key chunks nobody sees),
# s_q > s_k (rows with a negative chunk index see no key), lengths 0 and 1, a chunk longer than all.
VARLEN_CASES = [
    ([40, 17, 64], [40, 17, 64], 16),
    ([5, 30, 1], [70, 45, 33], 16),
    ([50, 23, 9], [20, 7, 3], 8),
    ([0, 12, 1], [9, 0, 1], 4),
    ([33, 8], [33, 50], 100),
]
OPTIONS = [dict(), dict(causal=True), dict(window_size=(5, 3)), dict(causal=True, window_size=(6, -1))]


@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: f"c{c[2]}-{c[0]}x{c[1]}")
@pytest.mark.parametrize("options", OPTIONS, ids=["full", "causal", "window", "causal_window"])
def test_segments_are_the_chunk_mask(case, options):
    lens_q, lens_k, c = case
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    q, k, v = _rand(int(cu_q[-1]), 4, 16, seed=1), _rand(int(cu_k[-1]), 2, 16, seed=2), _rand(int(cu_k[-1]), 2, 8, seed=3)
    want = attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, attention_chunk=c, **options)
    got = _segment_ref(q, k, v, cu_q, cu_k, None, None, c, **options)
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-5)  # -inf rows equal too


@pytest.mark.parametrize("options", OPTIONS[:2], ids=["full", "causal"])
def test_segments_with_seqused_and_a_loose_bound(options):
    """Chunks of the used lengths; rows past seqused_q stay out of every segment (0 / -inf); a longer table
    than the shapes' bound only adds empty segments."""
    slots_q, slots_k = [30, 9, 20], [40, 5, 26]
    used_q, used_k = torch.tensor([25, 0, 20], dtype=torch.int32), torch.tensor([31, 5, 11], dtype=torch.int32)
    cu_q, cu_k = _cu(slots_q), _cu(slots_k)
    q, k, v = _rand(sum(slots_q), 2, 16, seed=4), _rand(sum(slots_k), 2, 16, seed=5), _rand(sum(slots_k), 2, 16, seed=6)
    want = attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q, seqused_k=used_k,
                         attention_chunk=8, **options)
    for num_segments in (None, 3 * (1 + sum(slots_k))):
        got = _segment_ref(q, k, v, cu_q, cu_k, used_q, used_k, 8, num_segments, **options)
        torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("s_q,s_k", [(64, 64), (20, 64), (64, 20), (1, 37)])
def test_dense_segments_are_the_chunk_mask(s_q, s_k):
    b, c = 2, 16
    q, k, v = _rand(b, s_q, 4, 16, seed=7), _rand(b, s_k, 1, 16, seed=8), _rand(b, s_k, 1, 16, seed=9)
    want_out, want_lse = attention_ref(q, k, v, causal=True, attention_chunk=c)
    cu_q, cu_k = chunk.dense_segments(b, s_q, s_k, c, q.device)
    out, lse = attention_ref(q.reshape(b * s_q, 4, 16), k.reshape(b * s_k, 1, 16), v.reshape(b * s_k, 1, 16),
                             causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    torch.testing.assert_close(out.view(b, s_q, 4, 16), want_out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse.view(4, b, s_q).transpose(0, 1), want_lse, atol=1e-6, rtol=1e-5)


def test_segment_table_shape():
    """The shapes' bound (two per sequence plus one per chunk of the packed keys); offsets non-decreasing,
    ending at the packed length; every segment at most one chunk long; the entries past the batch's own
    (1 + 2 chunks, 1 + 3 chunks) empty at the end."""
    cu_q, cu_k = _cu([10, 3]), _cu([25, 40])
    seg_q, seg_k, used_q, used_k = chunk.segments(cu_q, cu_k, None, None, 16, chunk.varlen_num_segments(2, 65, 16))
    assert used_q is None and used_k is None
    assert seg_q.dtype == seg_k.dtype == torch.int32
    assert seg_q.numel() == seg_k.numel() == 2 * 2 + 5 + 1
    assert seg_k.tolist() == [0, 0, 16, 25, 25, 41, 57, 65, 65, 65]
    for seg, total in ((seg_q, 13), (seg_k, 65)):
        assert int(seg[0]) == 0 and int(seg[-1]) == total
        assert bool((seg[1:] >= seg[:-1]).all())
        assert int((seg[1:] - seg[:-1]).max()) <= 16


@pytest.mark.parametrize("options", OPTIONS[:2], ids=["full", "causal"])
def test_segments_need_no_max_seqlen(options):
    """The table's length comes from the shapes, so one long sequence among short ones (whose
    ``max_seqlen_k`` a caller might understate) still gets one segment per chunk: its last segment once
    held several chunks when the table was sized by ``max_seqlen_k`` (a silent wrong answer)."""
    lens_q, lens_k, c = [3, 70, 2], [4, 90, 1], 8
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    q, k, v = _rand(sum(lens_q), 2, 16, seed=10), _rand(sum(lens_k), 2, 16, seed=11), _rand(sum(lens_k), 2, 16, seed=12)
    want = attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, attention_chunk=c, **options)
    got = _segment_ref(q, k, v, cu_q, cu_k, None, None, c, **options)
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-5)
    # The tightest table (this batch's own count) gives the same segments with no empty ones past them.
    tight = chunk.segments(cu_q, cu_k, None, None, c, 3 + 1 + 12 + 1)
    assert int(tight[1][-2]) < int(tight[1][-1]) == sum(lens_k)


def test_segments_random_batches():
    """Random varlen batches (0-4 sequences, lengths 0-30, seqused below the slots, q above and below k, chunks
    1-8) through the shapes' table: attention over the segments equals the chunk mask's on the used rows."""
    gen = np.random.default_rng(5)
    for case in range(24):
        batch, c = int(gen.integers(0, 5)), int(gen.choice([1, 3, 8]))
        slots_q, slots_k = (gen.integers(0, 31, batch).tolist() for _ in range(2))
        used_q = torch.tensor([int(gen.integers(0, n + 1)) for n in slots_q], dtype=torch.int32)
        used_k = torch.tensor([int(gen.integers(0, n + 1)) for n in slots_k], dtype=torch.int32)
        cu_q, cu_k = _cu(slots_q), _cu(slots_k)
        q = _rand(sum(slots_q), 2, 8, seed=case)
        k, v = _rand(sum(slots_k), 2, 8, seed=100 + case), _rand(sum(slots_k), 2, 8, seed=200 + case)
        seg = chunk.segments(cu_q, cu_k, used_q, used_k, c, chunk.varlen_num_segments(batch, k.shape[0], c))
        assert int(seg[0][-1]) == sum(slots_q) and int(seg[1][-1]) == sum(slots_k)
        if batch == 0:
            continue
        causal = bool(case % 2)
        want = attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q, seqused_k=used_k,
                             attention_chunk=c, causal=causal)
        got = attention_ref(q, k, v, cu_seqlens_q=seg[0], cu_seqlens_k=seg[1], seqused_q=seg[2], seqused_k=seg[3],
                            causal=causal)
        rows = [int(cu_q[i]) + r for i in range(batch) for r in range(int(used_q[i]))]
        torch.testing.assert_close(got[0][rows], want[0][rows], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got[1][:, rows], want[1][:, rows], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("value,error,match", [
    (-1, ValueError, "attention_chunk must be >= 0"),
    (8.0, TypeError, "attention_chunk must be an int, got float"),
    (True, TypeError, "attention_chunk must be an int, got bool"),
    (torch.tensor(8), TypeError, "attention_chunk must be an int, got Tensor"),
])
def test_bad_attention_chunk_is_named(value, error, match):
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(error, match=match):
        flash_attn_func(q, q, q, attention_chunk=value)
    with pytest.raises(error, match=match):
        flash_attn_varlen_func(q[0], q[0], q[0], _cu([8]), _cu([8]), 8, 8, attention_chunk=value)


def test_numpy_chunk_and_zero_are_accepted():
    """numpy integers are integers; 0 is "off" (the dense call then fails on the CPU device, after
    the chunk check, like any call)."""
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    for value in (np.int64(8), 0):
        with pytest.raises(ValueError, match="CUDA device"):
            flash_attn_func(q, q, q, attention_chunk=value)


# ---------------------------------------------------------------- GPU tier

BACKENDS = [None, "sm80"]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS, ids=["default", "sm80"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("seqlens,c", [((300, 300), 64), ((113, 300), 128), ((300, 113), 48), ((1023, 1024), 256)],
                         ids=lambda x: str(x))
@pytest.mark.parametrize("options", OPTIONS, ids=["full", "causal", "window", "causal_window"])
def test_chunk_forward_backward(backend, dtype, seqlens, c, options):
    from .test_bwd import check_grads_api, make_inputs

    s_q, s_k = seqlens
    q, k, v, dout = make_inputs(2, s_q, s_k, 8, 2, 128, dtype=dtype)
    out, lse = flash_attn_func(q, k, v, attention_chunk=c, return_lse=True, backend=backend, **options)
    out_ref, lse_ref = attention_ref(q, k, v, attention_chunk=c, **options)
    out_pt, lse_pt = attention_ref(q, k, v, attention_chunk=c, upcast=False, **options)
    assert out.shape == out_ref.shape and lse.shape == lse_ref.shape and lse.is_contiguous()
    assert_close_to_ref("out", out, out_ref, out_pt)
    assert_close_to_ref("lse", lse, lse_ref, lse_pt, atol=1e-4)
    check_grads_api(q, k, v, dout, backend=backend, attention_chunk=c, **options)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS, ids=["default", "sm80"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_chunk_varlen_seqused(backend, causal):
    from .test_bwd import check_grads_api

    slots_q, slots_k = [130, 0, 257, 17], [200, 33, 250, 1]
    used_q = torch.tensor([120, 0, 257, 9], dtype=torch.int32, device="cuda")
    used_k = torch.tensor([200, 30, 101, 1], dtype=torch.int32, device="cuda")
    cu_q, cu_k = _cu(slots_q).cuda(), _cu(slots_k).cuda()
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(sum(slots_q), 4, 64, dtype=torch.bfloat16, device="cuda", generator=gen)
    k, v = (torch.randn(sum(slots_k), 2, 64, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(2))
    args = dict(seqused_q=used_q, seqused_k=used_k, causal=causal, attention_chunk=64)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 257, 250, return_lse=True, backend=backend, **args)
    ref = attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **args)
    pt = attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, upcast=False, **args)
    rows = torch.cat([torch.arange(int(cu_q[i]), int(cu_q[i]) + int(used_q[i])) for i in range(4)]).cuda()
    assert_close_to_ref("out", out[rows], ref[0][rows], pt[0][rows])
    assert_close_to_ref("lse", lse[:, rows], ref[1][:, rows], pt[1][:, rows], atol=1e-4)
    # A tensor max_seqlen, or an int one below the longest sequence (64 < 250: it once merged that sequence's
    # later chunks into one segment), gives the same bits: the segment table is sized from the shapes.
    for max_q, max_k in ((torch.tensor(257), torch.tensor(250)), (64, 64)):
        again = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, backend=backend, **args)
        assert torch.equal(again[rows], out[rows])
    dout = torch.randn_like(q)
    varlen = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "seqused_q": used_q, "seqused_k": used_k}
    check_grads_api(q, k, v, dout, varlen=varlen, backend=backend, causal=causal, attention_chunk=64)
