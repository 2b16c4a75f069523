"""Test tiers: the CPU tier runs everywhere (CI); the GPU tier needs a CUDA GPU and says so when skipped."""

from __future__ import annotations

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
