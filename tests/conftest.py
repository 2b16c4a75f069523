"""Test tiers: the CPU tier runs everywhere (CI); the GPU tier needs a CUDA GPU and says so when skipped."""

from __future__ import annotations

import faulthandler
import os

import pytest
import torch

from flashattn_hopper.env import settings

HAS_GPU = torch.cuda.is_available()
NO_GPU_REASON = "needs a CUDA GPU (torch.cuda.is_available() is False); run the GPU tier on a GPU machine, see README"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(pytest.mark.skip(reason=NO_GPU_REASON))
        elif "sm90" in item.keywords and (not HAS_GPU or torch.cuda.get_device_capability() != (9, 0)):
            item.add_marker(pytest.mark.skip(reason="needs a Hopper GPU (compute capability 9.0)"))


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """A private disk cache directory for one test; settings are re-read around it."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("FLASHATTN_HOPPER_CACHE_DIR", str(cache))
    monkeypatch.delenv("FLASHATTN_HOPPER_CACHE", raising=False)
    settings.cache_clear()
    yield cache
    settings.cache_clear()


@pytest.fixture
def clean_settings(monkeypatch):
    for name in ("FLASHATTN_HOPPER_BACKEND", "FLASHATTN_HOPPER_CACHE", "FLASHATTN_HOPPER_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    settings.cache_clear()
    yield monkeypatch
    settings.cache_clear()


@pytest.fixture(autouse=True)
def fresh_call_plans():
    """Each test starts without the API's cached call plans (``api._PLANS``): tests that patch key
    building or dispatch must see those run again."""
    from flashattn_hopper import api

    api.clear_plans()
    yield
    api.clear_plans()


# A GPU test that hangs (a kernel waiting on a barrier that never completes) would hold the whole run,
# and on the lent GPU machine the rest of the call's time with it. A watchdog thread ends the process
# after this many seconds in one GPU test, printing every thread's stack (the test's name is in it).
# 0 turns it off. Compiles count: the rarest kernel variants take about a minute on 2 cores.
GPU_TEST_TIMEOUT_S = float(os.environ.get("FLASHATTN_HOPPER_TEST_TIMEOUT", "600"))


@pytest.fixture(autouse=True)
def gpu_test_watchdog(request):
    if GPU_TEST_TIMEOUT_S <= 0 or "gpu" not in request.keywords or not HAS_GPU:
        yield
        return
    faulthandler.dump_traceback_later(GPU_TEST_TIMEOUT_S, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
