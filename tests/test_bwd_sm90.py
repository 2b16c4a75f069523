"""The Hopper backward (kernels/sm90/bwd.py; bwd_wide.py for head dim 256, bwd_wide96.py for 192) through the public
API with ``backend="sm90"`` (GPU tier, Hopper only): dq, dk, dv against the fp32 reference with the parity rule of
``test_bwd.py`` (whose helpers and oracles these tests use), on NaN-poisoned gradient buffers where the launcher
takes them.

Matrix: both dtypes, head dims 64, 96, 128, 192 and 256 (the sm90 rows), causal or not, odd and unequal seqlens,
MHA/GQA/MQA; windows; softcap; a custom softmax_scale; varlen with zero-length sequences and
seqused; deterministic mode (bf16 and fp16) bitwise stable over repeats and batch-invariant (a
sequence alone gives the same bits as inside a varlen batch). hdim 64 runs its 128 x 128 tile (dQ
split by rows), with softcap the 64 x 128 tile (test_bwd_sm90_softmax_scale). GQA by one CTA per KV head
(``gqa_loop``, forced on by a fixture for masked problems too; its chunked grid; the ``loop_desc`` order; the
table's rule through the API).
"""

from __future__ import annotations

import pytest
import torch

from flashattn_hopper import dispatch

from ._parity import poisoned_bwd
from .test_bwd import (
    SEQLENS_BWD_FAST, SOFTCAP, VARLEN_CASES, WINDOWS_FAST, _softcap_case, _varlen_case, _window_case,
    check_against_refs, check_grads_api, check_poisoned_grads, make_inputs, make_varlen,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="the sm90 backward needs a Hopper GPU",
    ),
]
DTYPES = [torch.bfloat16, torch.float16]
HEAD_DIMS = [64, 96, 128, 192, 256]


def test_sm90_backward_takes_the_common_problems():
    from ._parity import problem

    q, k, v, _ = make_inputs(1, 8, 8, 2, 2, 128)
    assert dispatch.BWD_KERNELS["sm90"].can_implement(problem(q, k, v)[0], False) is None


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS_BWD_FAST, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
def test_bwd_sm90_parity(dtype, head_dim, causal, seqlens, heads):
    (s_q, s_k), (h, h_k) = seqlens, heads
    q, k, v, dout = make_inputs(2, s_q, s_k, h, h_k, head_dim, dtype=dtype)
    check_poisoned_grads(q, k, v, dout, "sm90", causal=causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal_window", WINDOWS_FAST, ids=lambda c: f"c{int(c[0])}w{c[1][0]}_{c[1][1]}")
@pytest.mark.parametrize("seqlens", [(113, 203), (239, 100), (1023, 1024)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_bwd_sm90_window(dtype, causal_window, seqlens, heads):
    _window_case(dtype, 128 if dtype == torch.bfloat16 else 64, causal_window, seqlens, heads, backend="sm90")


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(113, 203), (1023, 1024)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_bwd_sm90_softcap(dtype, causal, seqlens):
    _softcap_case(dtype, 128, causal, seqlens, (8, 2), backend="sm90")


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", VARLEN_CASES, ids=["zero_len", "long", "seqused"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_bwd_sm90_varlen(dtype, causal, case, heads):
    _varlen_case(dtype, 128 if dtype == torch.bfloat16 else 64, causal, case, heads, backend="sm90")


@pytest.mark.parametrize("dims", [(192, 128), (256, 128), (256, 192), (160, 104)], ids=lambda d: f"d{d[0]}_{d[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_bwd_sm90_head_dim_v(dims, causal, heads):
    """v narrower than q/k on the wide kernel (bwd_wide.py: V, dO and dV at v's width; 160/104 runs
    padded to 192/128, through the API: poisoned buffers need native widths), odd seqlens."""
    (head_dim, head_dim_v), (h, h_k) = dims, heads
    q, k, v, dout = make_inputs(2, 239, 300, h, h_k, head_dim, dv=head_dim_v, seed=7)
    if head_dim % 64 == 0 and head_dim_v % 64 == 0:
        check_poisoned_grads(q, k, v, dout, "sm90", causal=causal)
    else:
        check_grads_api(q, k, v, dout, backend="sm90", causal=causal)


def test_bwd_sm90_head_dim_v_deterministic():
    """192/128 GQA deterministic: parity, then 5 repeats bit for bit."""
    q, k, v, dout = make_inputs(2, 500, 700, 8, 2, 192, dv=128, seed=8)
    first = check_poisoned_grads(q, k, v, dout, "sm90", deterministic=True, causal=True)
    for _ in range(5):
        again = poisoned_bwd(q, k, v, dout, "sm90", "sm90", deterministic=True, causal=True)
        for name, a, b in zip(("dq", "dk", "dv"), again, first):
            assert torch.equal(a, b), f"{name} differs between deterministic runs"


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("scale", [0.05, 0.3], ids=["below", "above"])
def test_bwd_sm90_softmax_scale(head_dim, scale):
    """A softmax_scale other than 1/sqrt(head_dim) (it enters P's recomputation and dK's scale): dense
    causal GQA, and with a window and softcap (scores over the softcap's range: factor 3)."""
    q, k, v, dout = make_inputs(2, 333, 300, 8, 2, head_dim, seed=5)
    check_poisoned_grads(q, k, v, dout, "sm90", causal=True, softmax_scale=scale)
    check_poisoned_grads(q, k, v, dout, "sm90", causal=False, window_size=(40, 10), softmax_scale=scale)
    check_poisoned_grads(q * 10, k, v, dout, "sm90", factor=3.0, causal=True, softcap=SOFTCAP, softmax_scale=scale)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_bwd_sm90_deterministic_fp16(head_dim):
    """deterministic=True in fp16 (the bitwise tests above run bf16): parity, then 5 repeats bit for bit."""
    q, k, v, dout = make_inputs(2, 500, 700, 8, 2, head_dim, dtype=torch.float16, seed=6)
    first = check_poisoned_grads(q, k, v, dout, "sm90", deterministic=True, causal=True)
    for _ in range(5):
        again = poisoned_bwd(q, k, v, dout, "sm90", "sm90", deterministic=True, causal=True)
        for name, a, b in zip(("dq", "dk", "dv"), again, first):
            assert torch.equal(a, b), f"{name} differs between deterministic runs"


@pytest.mark.parametrize("head_dim_v", [192, 128])
@pytest.mark.parametrize("seqlens", [(113, 203), (239, 100), (1023, 1024)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_bwd_sm90_d192_mha_masks(head_dim_v, seqlens):
    """hdim 192 MHA runs the 96-key kernel (bwd_wide96.py: scores by query rows, dK^T / dV^T): a left and a
    right window, causal with a left window, and causal softcap (scores over its range: factor 3)."""
    s_q, s_k = seqlens
    q, k, v, dout = make_inputs(2, s_q, s_k, 4, 4, 192, dv=head_dim_v, seed=11)
    check_poisoned_grads(q, k, v, dout, "sm90", window_size=(40, 17))
    check_poisoned_grads(q, k, v, dout, "sm90", causal=True, window_size=(70, -1))
    check_poisoned_grads(q * SOFTCAP / 4, k, v, dout, "sm90", factor=3.0, causal=True, softcap=SOFTCAP)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", VARLEN_CASES, ids=["zero_len", "long", "seqused"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_bwd_sm90_d192_varlen(causal, case, heads):
    """The 96-key kernel on varlen batches (zero-length sequences, seqused): a sequence's key blocks of 96
    rows end at its own length; GQA's sums are added below it only (their rows are padded to 128 per sequence)."""
    _varlen_case(torch.bfloat16, 192, causal, case, heads, backend="sm90")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_bwd_sm90_d96_masks_varlen(causal, heads):
    """hdim 96 runs natively (the 64 x 128 tile; K swizzled in 48-column halves for the dQ GEMM), not padded to
    128: a window, softcap (factor 3), varlen with seqused; and 96 beside 128 (v padded to 128, as before)."""
    q, k, v, dout = make_inputs(2, 239, 300, *heads, 96, seed=13)
    check_poisoned_grads(q, k, v, dout, "sm90", causal=causal, window_size=(40, 17))
    check_poisoned_grads(q * SOFTCAP / 4, k, v, dout, "sm90", factor=3.0, causal=causal, softcap=SOFTCAP)
    _varlen_case(torch.bfloat16, 96, causal, VARLEN_CASES[2], heads, backend="sm90")
    q, k, v, dout = make_inputs(2, 113, 203, *heads, 128, dv=96, seed=14)
    check_grads_api(q, k, v, dout, backend="sm90", causal=causal)


def test_bwd_sm90_d64_varlen_window():
    """hdim 64 runs the 128 x 128 tile (dQ split by rows): varlen with a window, and fp16 varlen."""
    _varlen_case(torch.bfloat16, 64, True, VARLEN_CASES[0], (4, 2), window=(30, -1), backend="sm90")
    _varlen_case(torch.float16, 64, False, VARLEN_CASES[2], (8, 2), backend="sm90")


def test_bwd_sm90_varlen_window_softcap():
    _varlen_case(torch.bfloat16, 128, True, VARLEN_CASES[0], (4, 2), window=(30, -1), backend="sm90")
    _varlen_case(torch.bfloat16, 128, False, VARLEN_CASES[1], (8, 2), softcap=SOFTCAP, backend="sm90")


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_bwd_sm90_deterministic_bitwise(head_dim, causal, heads):
    """deterministic=True: 20 poisoned launches give the same bits; the first passes the parity rule."""
    h, h_k = heads
    q, k, v, dout = make_inputs(2, 1000, 1100, h, h_k, head_dim)
    first = check_poisoned_grads(q, k, v, dout, "sm90", deterministic=True, causal=causal)
    for _ in range(19):
        again = poisoned_bwd(q, k, v, dout, "sm90", "sm90", deterministic=True, causal=causal)
        for name, a, b in zip(("dq", "dk", "dv"), again, first):
            assert torch.equal(a, b), f"{name} differs between deterministic runs"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dims", [(128, 128), (192, 192), (256, 128)], ids=lambda d: f"d{d[0]}_{d[1]}")
def test_bwd_sm90_deterministic_batch_invariant(causal, dims):
    """A sequence's gradients are bitwise the same computed alone and inside a varlen batch of other
    sequences (deterministic=True, GQA): 64 x 128 blocks, and the 96-key kernel's (its dK/dV turns per 96-key
    block, the sequences' sums at 128-row offsets)."""
    lens = [300, 777, 64]
    q, k, v, dout, varlen = make_varlen(lens, lens, 8, 2, dims[0], torch.bfloat16, None, None, 3, dv=dims[1])
    batch = poisoned_bwd(q, k, v, dout, "sm90", "sm90", varlen, deterministic=True, causal=causal)
    start = lens[0]
    one = slice(start, start + lens[1])
    alone_varlen = {
        "cu_seqlens_q": torch.tensor([0, lens[1]], dtype=torch.int32, device="cuda"),
        "cu_seqlens_k": torch.tensor([0, lens[1]], dtype=torch.int32, device="cuda"),
    }
    alone = poisoned_bwd(
        q[one].contiguous(), k[one].contiguous(), v[one].contiguous(), dout[one].contiguous(), "sm90", "sm90",
        alone_varlen, deterministic=True, causal=causal,
    )
    for name, a, b in zip(("dq", "dk", "dv"), alone, batch):
        assert torch.equal(a, b[one]), f"{name}: the sequence alone differs from inside the batch"


@pytest.mark.parametrize("seqlens", [(113, 203), (1023, 1024)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa"])
def test_bwd_sm90_opt_in_tile_80(seqlens, heads):
    """The opt-in 80 x 128 tile (``BWD_SM90_TILE_80``: dQ^T = K^T dS^T, the transposed dQ postprocess, query
    scratch padded to 640 rows), not in the launcher's table: dq, dk, dv against the fp32 reference
    with the parity rule, hdim 128, dense non-causal, odd lengths (a partial last block of 80 rows)."""
    from flashattn_hopper import flash_attn_func, validate
    from flashattn_hopper.backends.sm90_bwd import BWD_SM90_TILE_80, BwdSm90

    from .test_bwd import reference_grads

    (s_q, s_k), (h, h_k) = seqlens, heads
    q, k, v, dout = make_inputs(2, s_q, s_k, h, h_k, 128)
    family = BwdSm90()
    family.tiles = {128: BWD_SM90_TILE_80}
    p = validate.validate_dense(q, k, v, None, False, (-1, -1), 0.0)
    out, lse = flash_attn_func(q, k, v, return_lse=True, backend="sm90")
    assert family.plan(p, None, False, q.device).main_key.tile_m == 80  # (not cached_plan: its memo is per kind)
    grads = family.backward(dout, q, k, v, out, lse, p, None, False)
    _, *ref = reference_grads(q, k, v, dout, False)
    _, *pt = reference_grads(q, k, v, dout, False, upcast=False)
    check_against_refs(grads, (q, k, v), ref, pt)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(113, 203), (1023, 1024)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa"])
def test_bwd_sm90_256_128_on_96_keys(causal, seqlens, heads):
    """256 / 128 on the 96-key kernel (``bwd_wide96.py``, one Q/dO stage; the launcher's ``BWD_SM90_PAIR_TILES``):
    dq, dk, dv against the fp32 reference with the parity rule, odd lengths, GQA."""
    from flashattn_hopper import flash_attn_func, validate
    from flashattn_hopper.backends.sm90_bwd import BwdSm90

    from .test_bwd import reference_grads

    (s_q, s_k), (h, h_k) = seqlens, heads
    q, k, v, dout = make_inputs(2, s_q, s_k, h, h_k, 256, dv=128, seed=15)
    family = BwdSm90()
    p = validate.validate_dense(q, k, v, None, causal, (-1, -1), 0.0)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True, backend="sm90")
    assert family.plan(p, None, False, q.device).main_key.tile_n == 96
    grads = family.backward(dout, q, k, v, out, lse, p, None, False)
    _, *ref = reference_grads(q, k, v, dout, causal)
    _, *pt = reference_grads(q, k, v, dout, causal, upcast=False)
    check_against_refs(grads, (q, k, v), ref, pt)


@pytest.fixture
def gqa_loop(monkeypatch):
    """The table's tile_n 128 rows with ``gqa_loop`` (one CTA per KV head walking its query heads), the plan memos
    emptied before and after."""
    import dataclasses

    from flashattn_hopper import api
    from flashattn_hopper.backends import sm80_bwd
    from flashattn_hopper.backends.sm90_bwd import BWD_SM90_TILES

    for hdim in (64, 96, 128):
        monkeypatch.setitem(BWD_SM90_TILES, hdim, dataclasses.replace(BWD_SM90_TILES[hdim], gqa_loop="all"))
    monkeypatch.setattr(sm80_bwd, "_PLAN_MEMO", {})
    api.clear_plans()
    yield
    api.clear_plans()


@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(17, 17), (113, 203), (239, 1), (1023, 1024)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("heads", [(8, 2), (6, 1)], ids=["gqa", "mqa"])
def test_bwd_sm90_gqa_loop(gqa_loop, head_dim, causal, seqlens, heads):
    """``gqa_loop``: dq, dk, dv (stored once per KV head in 16 bits) against the fp32 reference with the parity
    rule; rows no key sees give zeros."""
    from ._parity import problem

    (s_q, s_k), (h, h_k) = seqlens, heads
    q, k, v, dout = make_inputs(2, s_q, s_k, h, h_k, head_dim)
    assert dispatch.BWD_KERNELS["sm90"].keys(problem(q, k, v, causal=causal)[0], "sm_90a")[1].gqa_loop
    check_poisoned_grads(q, k, v, dout, "sm90", causal=causal)


@pytest.mark.parametrize("shape", [(3, 1500, 2100, 8, 2, 64, True, (-1, -1)),
                                   (2, 1000, 2200, 8, 2, 128, False, (100, 0))], ids=["chunks", "empty_blocks"])
def test_bwd_sm90_gqa_loop_chunks(gqa_loop, shape):
    """``gqa_loop``'s chunked grid past one chunk of 8 key blocks (a partial last one: its extra CTAs exit), and key
    blocks that no query sees (a window (100, 0) with seqlen_k > seqlen_q: zero dK/dV)."""
    b, s_q, s_k, h, h_k, d, causal, window = shape
    q, k, v, dout = make_inputs(b, s_q, s_k, h, h_k, d, seed=6)
    check_poisoned_grads(q, k, v, dout, "sm90", causal=causal, window_size=window)


@pytest.mark.parametrize("shape", [(16, 1024, 16, 4, 128, True, True), (16, 1024, 32, 8, 64, True, True),
                                   (4, 1024, 16, 1, 128, False, True), (4, 1024, 16, 1, 128, True, False)],
                         ids=["causal_gqa_d128", "causal_gqa_d64", "mqa", "causal_mqa"])
def test_bwd_sm90_gqa_loop_table_rule(shape):
    """The table's ``gqa_loop`` rule ("balanced") through the public API with this GPU's SM count: causal GQA at 1k
    keys with >= 3 CTAs per SM on the chunked loop, unmasked MQA on the loop, causal MQA (32 CTAs) on the fp32 sums;
    dq, dk, dv against the fp32 reference."""
    from flashattn_hopper.backends.common import num_sms

    from ._parity import problem

    b, s, h, h_k, d, causal, loop = shape
    q, k, v, dout = make_inputs(b, s, s, h, h_k, d, seed=3)
    key = dispatch.BWD_KERNELS["sm90"].keys(problem(q, k, v, causal=causal)[0], "sm_90a", sms=num_sms(0))[1]
    assert key.gqa_loop == loop
    check_poisoned_grads(q, k, v, dout, "sm90", causal=causal)


@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("shape", [(2, 1023, 1024, 8, 2, (-1, 0)), (3, 1500, 2100, 8, 2, (-1, 0)),
                                   (2, 700, 1300, 6, 1, (-1, 0)), (2, 1000, 2200, 8, 2, (100, 0)),
                                   (2, 300, 333, 6, 2, (40, 10))], ids=["causal", "chunks", "mqa", "empty", "window"])
def test_bwd_sm90_gqa_loop_desc(gqa_loop, monkeypatch, head_dim, shape):
    """``loop_desc`` (forced at every seqlen): masked ``gqa_loop`` with the heads innermost and the query blocks
    descending (no dq_claim), causal (bottom-right: seqlen_k > seqlen_q), MQA, key blocks no query sees, a local
    window."""
    import dataclasses

    from flashattn_hopper.backends.sm90_bwd import BWD_SM90_TILES

    from ._parity import problem

    monkeypatch.setitem(BWD_SM90_TILES, head_dim, dataclasses.replace(BWD_SM90_TILES[head_dim], loop_desc_above=0))
    b, s_q, s_k, h, h_k, window = shape
    q, k, v, dout = make_inputs(b, s_q, s_k, h, h_k, head_dim, seed=7)
    key = dispatch.BWD_KERNELS["sm90"].keys(problem(q, k, v, window_size=window)[0], "sm_90a")[1]
    assert key.gqa_loop and key.loop_desc and not key.dq_claim
    check_poisoned_grads(q, k, v, dout, "sm90", window_size=window)


@pytest.mark.parametrize("case", [0, 2])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bwd_sm90_gqa_loop_varlen_window(gqa_loop, case, causal):
    """``gqa_loop`` with varlen (zero-length sequences, seqused), a window and fp16; deterministic calls (which keep
    the fp32 sums) bitwise stable beside it."""
    _varlen_case(torch.bfloat16, 128, causal, VARLEN_CASES[case], (8, 2), backend="sm90")
    _window_case(torch.float16, 64, (causal, (40, 10) if not causal else (30, -1)), (300, 333), (6, 2),
                 backend="sm90")
    q, k, v, dout = make_inputs(2, 500, 700, 8, 2, 128, seed=4)
    first = check_poisoned_grads(q, k, v, dout, "sm90", deterministic=True, causal=causal)
    for _ in range(4):
        again = poisoned_bwd(q, k, v, dout, "sm90", "sm90", deterministic=True, causal=causal)
        for name, a, b in zip(("dq", "dk", "dv"), again, first):
            assert torch.equal(a, b), f"{name} differs between deterministic runs"


@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
@pytest.mark.parametrize("seqlens", [(113, 203), (1023, 1024), (64, 300)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("hdim", [64, 128])
def test_bwd_sm90_pingpong(seqlens, hdim, causal):
    """Ping-pong (``BwdSm90Tile.pingpong``, hdim 64's default, opt-in at 128: the MMA warpgroups do not meet per block, dQ lags one block and
    is flushed after the loop, warpgroup 1 starts half a block late) at the table's tile of each head dim: dq,
    dk, dv against the fp32 reference with the parity rule, odd lengths, GQA, one-block CTAs (64 x 300)."""
    import dataclasses

    from flashattn_hopper import flash_attn_func, validate
    from flashattn_hopper.backends.sm90_bwd import BWD_SM90_TILES, BwdSm90

    from .test_bwd import reference_grads

    s_q, s_k = seqlens
    q, k, v, dout = make_inputs(2, s_q, s_k, 4, 2, hdim)
    family = BwdSm90()
    family.tiles = {hdim: dataclasses.replace(BWD_SM90_TILES[hdim], pingpong=True)}
    p = validate.validate_dense(q, k, v, None, causal, (-1, -1), 0.0)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True, backend="sm90")
    assert family.plan(p, None, False, q.device).main_key.pingpong
    grads = family.backward(dout, q, k, v, out, lse, p, None, False)
    _, *ref = reference_grads(q, k, v, dout, causal)
    _, *pt = reference_grads(q, k, v, dout, causal, upcast=False)
    check_against_refs(grads, (q, k, v), ref, pt)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
@pytest.mark.parametrize("seqlens", [(113, 203), (1023, 1024)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("hdim,pingpong", [(64, True), (64, False), (128, False)], ids=["64", "64_lockstep", "128"])
def test_bwd_sm90_ds_packed(seqlens, hdim, pingpong, causal, dtype):
    """dS^T by packed 16-bit products of the 16-bit P^T (``BwdSm90Tile.ds_packed``, kernels/sm90/bwd_loop.py
    ``ds16_from_probs16``; hdim 64's default, opt-in at 128) at the table's tile of each head dim and hdim 64's
    lockstep loop: dq, dk, dv against the fp32 reference with the parity rule, odd lengths, GQA. bf16 keys take it;
    fp16 keys do not (the 16-bit difference's range), and their gradients are checked the same way."""
    import dataclasses

    from flashattn_hopper import flash_attn_func, validate
    from flashattn_hopper.backends.sm90_bwd import BWD_SM90_TILES, BwdSm90

    from .test_bwd import reference_grads

    s_q, s_k = seqlens
    q, k, v, dout = make_inputs(2, s_q, s_k, 4, 2, hdim, dtype=dtype)
    family = BwdSm90()
    family.tiles = {hdim: dataclasses.replace(BWD_SM90_TILES[hdim], ds_packed=True, pingpong=pingpong)}
    p = validate.validate_dense(q, k, v, None, causal, (-1, -1), 0.0)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True, backend="sm90")
    assert family.plan(p, None, False, q.device).main_key.ds_packed == (dtype == torch.bfloat16)
    grads = family.backward(dout, q, k, v, out, lse, p, None, False)
    _, *ref = reference_grads(q, k, v, dout, causal)
    _, *pt = reference_grads(q, k, v, dout, causal, upcast=False)
    check_against_refs(grads, (q, k, v), ref, pt)


@pytest.mark.parametrize("hdim", [64, 128])
def test_bwd_sm90_dq_claim_unclaimed_tiles(hdim):
    """``dq_claim`` (the preprocess no longer zeroes dQaccum; each tile is zeroed by the first CTA to claim it):
    a tile no key block adds into reads as zeros in the postprocess. Causal with more queries than keys (the first
    500 rows see no key: whole tiles of them), on memory the caching allocator hands back full of NaN; the parity
    rule against the fp32 reference on poisoned buffers (those rows' dq must be exactly the reference's zeros)."""
    from flashattn_hopper import validate

    q, k, v, dout = make_inputs(2, 700, 200, 4, 4, hdim)
    p = validate.validate_dense(q, k, v, None, True, (-1, -1), 0.0)
    assert dispatch.BWD_KERNELS["sm90"].plan(p, None, False, q.device).main_key.dq_claim
    recycled = torch.full((64 << 20,), float("nan"), device="cuda")  # 256 MB of NaN back to the cache
    del recycled
    dq, _, _ = check_poisoned_grads(q, k, v, dout, "sm90", causal=True)
    assert torch.equal(dq[:, :500], torch.zeros_like(dq[:, :500])), "rows that see no key must get dq = 0"
