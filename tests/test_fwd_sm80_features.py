"""sm80 forward features through the public API (GPU tier): sliding window, softcap, varlen
(cu_seqlens, seqused, zero-length sequences, a 0-d tensor max_seqlen), native head dims 96/192/256
and 192/128, each with causal/non-causal, MHA/GQA, bf16/fp16 and odd lengths; poisoned outputs.

Oracle: the fp32 reference (flash-attn rule ``max|ours - ref| <= 2 * max|pt - ref| + atol``; 3x for
softcap, whose tanh.approx differs from torch.tanh by a few ulp before the exponent amplifies it).
The fast subset runs in seconds; the full product is marked ``slow``.
"""

from __future__ import annotations

import pytest
import torch

from flashattn_hopper import validate
from flashattn_hopper.api import _fwd
from flashattn_hopper.backends.common import VarlenArgs
from flashattn_hopper.testing import attention_ref

from ._parity import check_features_dense, check_features_varlen, check_out_lse, make_varlen, seqused_pad_rows
from .shapes import HEADS

pytestmark = pytest.mark.gpu
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# (left, right): symmetric, diagonal only, left only, right only, wider than the sequence
WINDOWS = [(16, 16), (0, 0), (64, -1), (-1, 32), (5000, 3)]
SEQLENS = [(113, 203), (239, 77), (1023, 1024)]  # partial tiles both ways, s_q > s_k, long
HEAD_DIMS = [(96, 96), (192, 192), (256, 256), (192, 128)]
# Per-sequence (len_q, len_k) of a varlen batch: empty q, empty k, both empty, one token, partial
# and multi-tile sequences, s_q > s_k (causal rows with no key).
VARLEN_LENS = [(17, 40), (0, 30), (128, 128), (30, 0), (0, 0), (1, 1), (300, 77), (64, 513)]


def _rand(shape, dtype, gen):
    return torch.randn(*shape, dtype=dtype, device="cuda", generator=gen)


def make_qkv(b, s_q, s_k, h, h_k, d, dv, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return _rand((b, s_q, h, d), dtype, gen), _rand((b, s_k, h_k, d), dtype, gen), _rand((b, s_k, h_k, dv), dtype, gen)


def check_dense(q, k, v, causal=False, window=(-1, -1), softcap=0.0):
    return check_features_dense(q, k, v, "sm80", causal=causal, window=window, softcap=softcap)


def check_varlen(q, k, v, cu_q, cu_k, used_q=None, used_k=None, **kwargs):
    return check_features_varlen(q, k, v, cu_q, cu_k, "sm80", used_q, used_k, **kwargs)


# ----------------------------------------------------------------------------- fast subset


@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_window(window, causal):
    q, k, v = make_qkv(2, 239, 203, 4, 2, 128, 128, torch.bfloat16)
    check_dense(q, k, v, causal=causal, window=window)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softcap(head_dim, causal):
    softcap = 15.0
    q, k, v = make_qkv(2, 113, 203, 4, 4, head_dim, head_dim, torch.bfloat16)
    check_dense(q * softcap / 4, k, v, causal=causal, softcap=softcap)


@pytest.mark.parametrize("dims", HEAD_DIMS, ids=lambda d: f"d{d[0]}v{d[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_head_dims(dims, causal):
    q, k, v = make_qkv(2, 239, 203, 4, 2, *dims, torch.bfloat16)
    out, _ = check_dense(q, k, v, causal=causal)
    assert out.shape[-1] == dims[1]


@pytest.mark.parametrize("dims", [(80, 80), (160, 160), (224, 224), (256, 64)], ids=lambda d: f"d{d[0]}v{d[1]}")
def test_padded_head_dims(dims):
    q, k, v = make_qkv(1, 77, 150, 2, 2, *dims, torch.float16)
    check_dense(q, k, v, causal=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_varlen(causal, dtype):
    q, k, v, cu_q, cu_k, _, _ = make_varlen(VARLEN_LENS, 4, 2, 128, 128, dtype)
    check_varlen(q, k, v, cu_q, cu_k, causal=causal, max_seqlen_q=300)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_seqused_and_tensor_max_seqlen(causal):
    q, k, v, cu_q, cu_k, used_q, used_k = make_varlen(VARLEN_LENS, 4, 4, 64, 64, torch.bfloat16, slack_q=5, slack_k=9)
    max_seqlen_q = torch.tensor(305, dtype=torch.int32, device="cuda")  # 0-d: never read on the host
    out, lse = check_varlen(q, k, v, cu_q, cu_k, used_q, used_k, causal=causal, max_seqlen_q=max_seqlen_q)
    pad_rows = seqused_pad_rows(cu_q, used_q)
    assert (out[pad_rows] == 0).all() and torch.isneginf(lse[:, pad_rows]).all()


def test_varlen_window_softcap_hdim192():
    q, k, v, cu_q, cu_k, _, _ = make_varlen(VARLEN_LENS, 6, 2, 192, 128, torch.bfloat16)
    check_varlen(q, k, v, cu_q, cu_k, causal=True, window=(50, 0))
    check_varlen(q * 2.5, k, v, cu_q, cu_k, softcap=10.0)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_window_fp16(head_dim, causal):
    """fp16 varlen with a sliding window (fast tier; the full product is slow), seqused, a custom scale."""
    q, k, v, cu_q, cu_k, used_q, used_k = make_varlen(VARLEN_LENS, 4, 2, head_dim, head_dim, torch.float16,
                                                      slack_q=3, slack_k=5)
    check_varlen(q, k, v, cu_q, cu_k, causal=causal, window=(32, -1 if causal else 8))
    check_varlen(q, k, v, cu_q, cu_k, used_q, used_k, causal=causal, window=(20, 0 if causal else 40),
                 softmax_scale=0.1)


def test_varlen_many_sequences():
    """More than 32 sequences: the tile scan walks several warp-wide steps."""
    gen = torch.Generator().manual_seed(3)
    lens = [(int(a), int(b)) for a, b in torch.randint(0, 200, (75, 2), generator=gen)]
    q, k, v, cu_q, cu_k, _, _ = make_varlen(lens, 2, 1, 64, 64, torch.float16)
    check_varlen(q, k, v, cu_q, cu_k, causal=True)


@pytest.mark.parametrize("mode", ["window", "varlen_seqused"])
def test_poisoned_outputs_are_fully_overwritten(mode):
    if mode == "window":
        q, k, v = make_qkv(2, 239, 113, 4, 2, 96, 96, torch.bfloat16)
        p = validate.validate_dense(q, k, v, None, False, (20, 7), 0.0)
        varlen, refs = None, dict(window_size=(20, 7))
        out = torch.full((2, 239, 4, 96), float("nan"), dtype=q.dtype, device="cuda")
        lse = torch.full((2, 4, 239), float("nan"), dtype=torch.float32, device="cuda")
    else:
        q, k, v, cu_q, cu_k, used_q, used_k = make_varlen(VARLEN_LENS, 4, 2, 128, 128, torch.bfloat16, 3, 2)
        p = validate.validate_varlen(q, k, v, cu_q, cu_k, None, None, used_q, used_k, None, True, (-1, -1), 0.0)
        varlen = VarlenArgs(cu_q, cu_k, used_q, used_k, None, None)
        refs = dict(causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q, seqused_k=used_k)
        out = torch.full((q.shape[0], 4, 128), float("nan"), dtype=q.dtype, device="cuda")
        lse = torch.full((4, q.shape[0]), float("nan"), dtype=torch.float32, device="cuda")
    _fwd(q, k, v, p, "sm80", varlen, out=out, lse=lse)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    check_out_lse(mode, out, lse, attention_ref(q, k, v, **refs), attention_ref(q, k, v, upcast=False, **refs), 2.0)


# ----------------------------------------------------------------------------- full product


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("dims", [(64, 64), (128, 128), *HEAD_DIMS], ids=lambda d: f"d{d[0]}v{d[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", [(-1, -1), *WINDOWS], ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}k{h[1]}")
def test_dense_full(dtype, dims, causal, window, seqlens, heads):
    q, k, v = make_qkv(2, *seqlens, *heads, *dims, dtype, seed=1)
    check_dense(q, k, v, causal=causal, window=window)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", [(-1, -1), (64, -1), (16, 16)], ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_softcap_full(dtype, head_dim, causal, window, seqlens):
    softcap = 30.0
    q, k, v = make_qkv(2, *seqlens, 4, 2, head_dim, head_dim, dtype, seed=2)
    check_dense(q * softcap / 4, k, v, causal=causal, window=window, softcap=softcap)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("dims", [(64, 64), (128, 128), *HEAD_DIMS], ids=lambda d: f"d{d[0]}v{d[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", [(-1, -1), (32, 8)], ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("seqused", [False, True], ids=["cu", "seqused"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}k{h[1]}")
def test_varlen_full(dtype, dims, causal, window, seqused, heads):
    slack = 7 if seqused else 0
    q, k, v, cu_q, cu_k, used_q, used_k = make_varlen(VARLEN_LENS, *heads, *dims, dtype, slack, slack, seed=3)
    check_varlen(q, k, v, cu_q, cu_k, used_q, used_k, causal=causal, window=window)
