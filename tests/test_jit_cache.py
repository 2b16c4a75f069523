"""The compile cache across processes: disk hits, concurrent compiles, corrupt entries (CPU tier).

Each scenario runs ``tests/_tiny_kernel.py`` (a tiny real CuTe DSL kernel compiled for sm_80 with
fake tensors) in fresh processes against a private cache directory.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flashattn_hopper import jit

from ._subprocess import REPO, subprocess_env




def _env(cache_dir: Path, **extra: str) -> dict[str, str]:
    env = subprocess_env(FLASHATTN_HOPPER_CACHE_DIR=str(cache_dir), CUTE_DSL_ARCH="sm_80")
    env.pop("FLASHATTN_HOPPER_CACHE", None)
    env.update(extra)
    return env


def run_tiny(cache_dir: Path, tag: str = "", **extra: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "tests._tiny_kernel", tag], env=_env(cache_dir, **extra), cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def objects(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.rglob("*.o"))


def test_second_process_hits_disk_cache(tmp_path):
    first = run_tiny(tmp_path, "first")
    assert first["compiles"] == 1 and first["disk_hits"] == 0
    [entry] = objects(tmp_path)
    assert entry.with_suffix(".sha256").exists()
    second = run_tiny(tmp_path, "second")
    assert second["compiles"] == 0 and second["disk_hits"] == 1, second
    assert second["type"] == first["type"]


def test_concurrent_processes_compile_once(tmp_path):
    env = _env(tmp_path)
    procs = [
        subprocess.Popen([sys.executable, "-m", "tests._tiny_kernel", str(i)], env=env, cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(8)  # the README's promise: eight ranks starting at once compile each kernel once
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(r["compiles"] for r in results) == 1, results
    assert sum(r["disk_hits"] for r in results) == 7, results
    assert len(objects(tmp_path)) == 1


@pytest.mark.parametrize("damage", ["garbage", "truncate", "no_checksum"])
def test_corrupt_entry_is_recompiled_never_loaded(tmp_path, damage):
    run_tiny(tmp_path)
    [entry] = objects(tmp_path)
    if damage == "garbage":
        entry.write_bytes(b"\x7fELF this is not an object file")
    elif damage == "truncate":
        entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
    else:
        entry.with_suffix(".sha256").unlink()
    repaired = run_tiny(tmp_path)
    assert repaired["compiles"] == 1 and repaired["corrupt_entries"] == 1, repaired
    assert list(tmp_path.rglob("*.corrupt")), "the bad entry should be kept aside for inspection"
    after = run_tiny(tmp_path)
    assert after["disk_hits"] == 1 and after["compiles"] == 0


def test_disk_cache_off(tmp_path):
    first = run_tiny(tmp_path, FLASHATTN_HOPPER_CACHE="0")
    second = run_tiny(tmp_path, FLASHATTN_HOPPER_CACHE="0")
    assert first["compiles"] == second["compiles"] == 1
    assert objects(tmp_path) == []


def test_lock_timeout_names_the_setting(tmp_path):
    """A process that cannot get the key's lock in time says which setting to raise."""
    run_tiny(tmp_path)
    [entry] = objects(tmp_path)
    lock_path = entry.parent / "locks" / (entry.stem + ".lock")
    import fcntl

    with open(lock_path, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        proc = subprocess.run([sys.executable, "-m", "tests._tiny_kernel"], env=_env(tmp_path, FLASHATTN_HOPPER_LOCK_TIMEOUT="0.5"),
                              cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "FLASHATTN_HOPPER_LOCK_TIMEOUT" in proc.stderr


def test_fingerprint_tracks_codegen_settings_not_arch(monkeypatch):
    jit.source_fingerprint.cache_clear()
    base = jit.source_fingerprint()
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_123")  # arch lives in every key, not in the fingerprint
    jit.source_fingerprint.cache_clear()
    assert jit.source_fingerprint() == base
    monkeypatch.setenv("CUTE_DSL_COMPILER_OPT", "-O1")  # codegen setting: new fingerprint
    jit.source_fingerprint.cache_clear()
    assert jit.source_fingerprint() != base
    monkeypatch.delenv("CUTE_DSL_COMPILER_OPT")
    jit.source_fingerprint.cache_clear()


def test_cli_cache_info_and_clear(tmp_path):
    run_tiny(tmp_path)
    env = _env(tmp_path)
    info = subprocess.run([sys.executable, "-m", "flashattn_hopper", "cache", "info"], env=env, cwd=REPO, capture_output=True, text=True)
    assert info.returncode == 0 and "1 kernels" in info.stdout, info.stdout + info.stderr
    cleared = subprocess.run([sys.executable, "-m", "flashattn_hopper", "cache", "clear"], env=env, cwd=REPO, capture_output=True, text=True)
    assert cleared.returncode == 0 and "cleared" in cleared.stdout
    assert not tmp_path.exists() or objects(tmp_path) == []


def test_cli_info_runs_without_gpu(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "flashattn_hopper", "info"], env=_env(tmp_path), cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    for field in ("torch", "nvidia-cutlass-dsl", "cache dir", "gpu"):
        assert field in proc.stdout
