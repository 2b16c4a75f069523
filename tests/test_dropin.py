"""What a flash-attn 3 user does every day, on a GPU: windows in any integer-pair form, and keys with
many flags through a disk cache whose own path is long (the file names once ran past 255 bytes).

Also v head dims other than q/k's (64/256 and the like) at their own widths, forward and backward.

GPU tier. The CPU side (name lengths of every key, unwritable caches) is in tests/test_jit_cache.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashattn_hopper import api, configs, dispatch, flash_attn_func, flash_attn_varlen_func
from flashattn_hopper.env import settings
from flashattn_hopper.jit import compile_cache, target_arch

from ._parity import (
    check_features_dense, check_features_varlen, check_parity, check_poisoned_outputs, make_qkv, make_varlen, problem,
)
from .test_bwd import check_grads_api, check_poisoned_grads, make_inputs

pytestmark = pytest.mark.gpu

WINDOW_FORMS = {
    "tuple": (40, 7),
    "list": [40, 7],
    "cpu_tensor": torch.tensor([40, 7]),
    "cuda_tensor_int32": torch.tensor([40, 7], dtype=torch.int32, device="cuda") if torch.cuda.is_available() else None,
    "numpy": np.array([40, 7]),
    "numpy_scalars": (np.int64(40), np.int32(7)),
}


@pytest.mark.parametrize("backend", [None, "sm80"], ids=["default", "sm80"])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_window_forms_give_the_same_output_bitwise(backend, varlen):
    if varlen:
        q, k, v, cu_q, cu_k, _, _ = make_varlen([(113, 203), (17, 17), (130, 64)], 4, 2, 128, 128, torch.bfloat16)

        def call(window):
            return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 203, 203, window_size=window, backend=backend)
    else:
        q, k, v = make_qkv(2, 113, 203, 4, 2, 128)

        def call(window):
            return flash_attn_func(q, k, v, window_size=window, backend=backend)

    expected = call((40, 7))
    for name, window in WINDOW_FORMS.items():
        assert torch.equal(call(window), expected), f"window_size as {name} gives another output"


@pytest.fixture
def long_cache_dir(tmp_path, monkeypatch):
    """A disk cache whose own path is over 150 characters."""
    cache = tmp_path / ("deeply-nested-cache-directory-" * 3) / ("another-long-level-" * 3) / "flashattn_hopper"
    assert len(str(cache)) >= 150
    monkeypatch.setenv("FLASHATTN_HOPPER_CACHE_DIR", str(cache))
    monkeypatch.delenv("FLASHATTN_HOPPER_CACHE", raising=False)
    settings.cache_clear()
    compile_cache.clear_memory()  # an earlier test's in-memory kernel would skip the disk cache
    yield cache
    settings.cache_clear()


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_many_flag_varlen_key_through_a_long_cache_dir(long_cache_dir, head_dim):
    """Causal softcap varlen with seqused_q/seqused_k (the key that crashed with Errno 36): correct,
    published under short names, and loaded back from disk once the memory cache is cleared."""
    lens = [(113, 203), (1, 17), (130, 130)]
    q, k, v, cu_q, cu_k, used_q, used_k = make_varlen(lens, 4, 2, head_dim, head_dim, torch.bfloat16,
                                                      slack_q=5, slack_k=3)
    args = dict(used_q=used_q, used_k=used_k, causal=True, softcap=30.0)
    first, _ = check_features_varlen(q, k, v, cu_q, cu_k, None, **args)
    names = [p.name for p in long_cache_dir.rglob("*") if p.is_file()]
    assert names and max(len(n) for n in names) <= 100, names
    compile_cache.clear_memory()
    api.clear_plans()  # (a kept varlen plan holds the compiled function: configs.VARLEN_PLANS)
    disk_hits = compile_cache.stats.disk_hits
    again, _ = check_features_varlen(q, k, v, cu_q, cu_k, None, **args)
    assert compile_cache.stats.disk_hits > disk_hits, "nothing was loaded from the disk cache"
    assert torch.equal(again, first)


# v's head dim other than q/k's (flash-attn 3's tests try head_dim_v 256 and 512 against q/k 64 first):
# each runs at its own width, forward on both arches (the sm90 forward keeps an own sO when v is
# wider) and the sm80 backward (the default path's backward until the sm90 one lands).
HEAD_DIM_PAIRS = [(64, 128), (64, 256), (128, 256), (96, 192), (192, 128)]
BACKENDS = [None, "sm80"]


def _assert_native(q, k, v, backend):
    """The forward keys both head dims at their own (row) widths, on sm90 by default."""
    p = problem(q, k, v, causal=True)[0]
    fwd = dispatch.fwd_kernel_for(q.device, backend, p)
    assert backend is not None or fwd.backend == "sm90"
    key = fwd.key(p, target_arch(), None)
    assert (key.head_dim, key.head_dim_v) == configs.kernel_head_dims(fwd.tiles, q.shape[-1], v.shape[-1])


@pytest.mark.parametrize("backend", BACKENDS, ids=["default", "sm80"])
@pytest.mark.parametrize("dims", HEAD_DIM_PAIRS, ids=lambda d: f"d{d[0]}_{d[1]}")
def test_v_head_dim_forward(backend, dims):
    """Causal and not, GQA, windows (with and without causal), varlen + seqused, poisoned outputs."""
    d, dv = dims
    q, k, v = make_qkv(2, 300, 333, 8, 2, d, dv=dv)
    _assert_native(q, k, v, backend)
    for causal in (False, True):
        check_parity(q, k, v, causal, backend)
    check_poisoned_outputs(q, k, v, True, backend)
    check_features_dense(q, k, v, backend, window=(60, 20))
    check_features_dense(q, k, v, backend, causal=True, window=(40, -1))
    q, k, v, cu_q, cu_k, used_q, used_k = make_varlen([(113, 203), (17, 17), (130, 64)], 4, 2, d, dv, torch.bfloat16,
                                                      slack_q=3, slack_k=5)
    check_features_varlen(q, k, v, cu_q, cu_k, backend, used_q, used_k, causal=True)


@pytest.mark.parametrize("backend", BACKENDS, ids=["default", "sm80"])
@pytest.mark.parametrize("dims", HEAD_DIM_PAIRS, ids=lambda d: f"d{d[0]}_{d[1]}")
def test_v_head_dim_backward(backend, dims):
    """Gradients against the fp32 reference: causal GQA with NaN-poisoned dq/dk/dv (the launcher
    writes every element at v's own width), a window (MHA), varlen causal GQA, and fp16 causal."""
    d, dv = dims
    q, k, v, dout = make_inputs(2, 239, 300, 8, 2, d, dv=dv)
    check_poisoned_grads(q, k, v, dout, backend, causal=True)
    q, k, v, dout = make_inputs(2, 300, 257, 4, 4, d, dv=dv, seed=1)
    check_grads_api(q, k, v, dout, backend=backend, window_size=(50, 10))
    q, k, v, dout = make_inputs(2, 300, 257, 4, 4, d, dv=dv, dtype=torch.float16, seed=2)
    check_grads_api(q, k, v, dout, backend=backend, causal=True)
    q, k, v, cu_q, cu_k, _, _ = make_varlen([(113, 203), (17, 17), (130, 64)], 4, 2, d, dv, torch.bfloat16)
    dout = torch.randn(*q.shape[:-1], dv, dtype=q.dtype, device=q.device)
    varlen = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    check_grads_api(q, k, v, dout, varlen=varlen, backend=backend, causal=True)
