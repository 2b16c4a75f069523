"""What a flash-attn 3 user does every day, on a GPU: windows in any integer-pair form, and keys with
many flags through a disk cache whose own path is long (the file names once ran past 255 bytes).

GPU tier. The CPU side (name lengths of every key, unwritable caches) is in tests/test_jit_cache.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashattn_hopper import flash_attn_func, flash_attn_varlen_func
from flashattn_hopper.env import settings
from flashattn_hopper.jit import compile_cache

from ._parity import check_features_varlen, make_qkv, make_varlen

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
    disk_hits = compile_cache.stats.disk_hits
    again, _ = check_features_varlen(q, k, v, cu_q, cu_k, None, **args)
    assert compile_cache.stats.disk_hits > disk_hits, "nothing was loaded from the disk cache"
    assert torch.equal(again, first)
