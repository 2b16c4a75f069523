"""The compile cache across processes: disk hits, concurrent compiles, corrupt entries (CPU tier).

Each scenario runs ``tests/_tiny_kernel.py`` (a tiny real CuTe DSL kernel compiled for sm_80 with
fake tensors) in fresh processes against a private cache directory.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashattn_hopper import cli, dispatch, jit
from flashattn_hopper.backends.sm90_fwd import FwdSm90
from flashattn_hopper.env import settings

from ._subprocess import REPO, subprocess_env
from ._variant_keys import variant_keys


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
    assert "tiny-sm_80-scale_by_two" in info.stdout, "the listing shows each entry's full key"
    bare = subprocess.run([sys.executable, "-m", "flashattn_hopper", "cache"], env=env, cwd=REPO, capture_output=True, text=True)
    assert bare.returncode == 0 and bare.stdout == info.stdout, bare.stderr
    cleared = subprocess.run([sys.executable, "-m", "flashattn_hopper", "cache", "clear"], env=env, cwd=REPO, capture_output=True, text=True)
    assert cleared.returncode == 0 and "cleared" in cleared.stdout
    assert not tmp_path.exists() or objects(tmp_path) == []


def test_cli_info_runs_without_gpu(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "flashattn_hopper", "info"], env=_env(tmp_path), cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    for field in ("torch", "nvidia-cutlass-dsl", "cache dir", "gpu"):
        assert field in proc.stdout


# --- file names and an unusable cache directory (in process, stand-in objects: no compile) -------


class _FakeCompiled:
    """Stands in for a compiled function: exports a small object file as the DSL's export_to_c would."""

    def export_to_c(self, directory: str, name: str, function_prefix: str) -> None:
        (Path(directory) / f"{name}.o").write_bytes(f"stand-in object {function_prefix}".encode())


def _fake_build(key):
    return _FakeCompiled()


@pytest.fixture
def fake_loader(monkeypatch):
    """Loading an entry returns what its object file holds instead of loading it with the DSL."""
    monkeypatch.setattr(jit, "_load_module", lambda path, symbol: ("loaded", path.read_bytes(), symbol))


@pytest.fixture
def cache_at(monkeypatch):
    def use(path: Path) -> Path:
        monkeypatch.setenv("FLASHATTN_HOPPER_CACHE_DIR", str(path))
        monkeypatch.delenv("FLASHATTN_HOPPER_CACHE", raising=False)
        settings.cache_clear()
        return path

    yield use
    settings.cache_clear()


def _issue_21_key():
    """The key of issue 21's crash: varlen causal softcap with seqused_q/seqused_k (fp16, hdim 128)."""
    return FwdSm90()._key("sm_90a", "fp16", 128, causal=True, softcap=True, varlen=True, seqused_q=True, seqused_k=True)


def every_key() -> list:
    """Every key the package compiles: all_keys of every family for sm_80 and sm_90a (what precompile
    builds), the variants the compile-only tier builds, and issue 21's key."""
    keys = []
    for arch in ("sm_80", "sm_90a"):
        for backend in dispatch.BACKENDS_FOR_TARGET[arch]:
            for family in dispatch.families(backend):
                keys += family.all_keys(arch)
                keys += variant_keys(family, arch)
    keys.append(_issue_21_key())
    return list(dict.fromkeys(keys))


def test_every_key_maps_to_short_file_names(tmp_path):
    keys = every_key()
    assert len(keys) > 250
    directory = tmp_path / ("long-cache-dir-" * 12) / "0123456789abcdef"
    assert len(str(directory)) >= 150
    stems = set()
    for key in keys:
        entry = jit._DiskEntry(directory, key)
        paths = [entry.object_path, entry.key_path, entry.sum_path, entry.lock_path]
        paths += [entry.quarantine_path(p) for p in (entry.object_path, entry.sum_path)]
        for path in paths:
            assert len(path.name) <= 100, (key.name, path.name)
        assert entry.object_path.name.startswith(key.kernel + "-")
        stems.add(entry.object_path.stem)
    assert len(stems) == len(keys), "two keys would share cache files"
    assert max(len(k.name) for k in keys) > 200  # what the file names used to be built from


def test_display_names_short_distinct_and_readable():
    keys = every_key()
    names = [k.display_name for k in keys]
    assert len(set(names)) == len(keys), "two kernels would print the same progress line"
    assert max(len(n) for n in names) <= 100, max(names, key=len)  # the shipped ones fit a progress line: test_cli
    key = _issue_21_key()
    assert key.display_name == (
        "fwd_sm90-sm_90a-fp16-hdim128-tile128x128-causal-softcap-varlen-seqused_q-seqused_k-persistent"
    )
    mla = FwdSm90()._key("sm_90a", "bf16", 192, None, 128, causal=False)
    assert "-hdim192/128-" in mla.display_name and "no_pingpong" in mla.display_name


def test_long_cache_dir_round_trip_keeps_the_full_key(tmp_path, cache_at, fake_loader, capsys):
    """Every key, issue 21's among them, in a cache directory whose own path is over 150 characters:
    published with short names, listed with its full key, loaded by the next process (a fresh
    CompileCache)."""
    root = cache_at(tmp_path / ("c" * 100) / ("d" * 100))
    assert len(str(root)) >= 150
    keys = every_key()
    first = jit.CompileCache()
    for key in keys:
        assert isinstance(first.get(key, _fake_build), _FakeCompiled)
    assert first.stats.compiles == len(keys) and first.disk_error is None
    files = [p for p in root.rglob("*") if p.is_file()]
    assert {p.suffix for p in files} == {".o", ".key", ".sha256", ".lock"}
    assert max(len(p.name) for p in files) <= 100
    assert len(objects(root)) == len(keys)
    entry = jit._DiskEntry(root / jit.source_fingerprint()[:16], _issue_21_key())
    assert entry.key_path.read_text().strip() == _issue_21_key().name

    assert sorted(e.key_name for e in jit.cache_entries()) == sorted(k.name for k in keys)
    cli.cmd_cache(argparse.Namespace(action="info"))
    listing = capsys.readouterr().out
    assert all(key.name in listing for key in keys)

    second = jit.CompileCache()
    for key in keys:
        assert second.get(key, _fake_build)[0] == "loaded"
    assert second.stats.disk_hits == len(keys) and second.stats.compiles == 0


def _readonly_by_permissions(tmp_path, monkeypatch):
    if os.geteuid() == 0:
        pytest.skip("root ignores directory permissions; the simulated read-only file system case covers it")
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(0o555)
    return root


def _read_only_file_system(tmp_path, monkeypatch):
    """EROFS for every file created or directory made under the cache (what a read-only mount says;
    works as root, unlike permissions)."""
    root = tmp_path / "cache"
    root.mkdir(exist_ok=True)
    real_open, real_mkdir = os.open, os.mkdir

    def guarded(real):
        def call(path, *args, **kwargs):
            if str(path).startswith(str(root)) and (real is real_mkdir or args[0] & (os.O_CREAT | os.O_WRONLY | os.O_RDWR)):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real(path, *args, **kwargs)
        return call

    monkeypatch.setattr(os, "open", guarded(real_open))
    monkeypatch.setattr(os, "mkdir", guarded(real_mkdir))
    return root


def _below_a_regular_file(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    return blocker / "cache"


def _name_too_long(tmp_path, monkeypatch):
    return tmp_path / ("n" * 300) / "cache"


@pytest.mark.parametrize("unusable",
                         [_readonly_by_permissions, _read_only_file_system, _below_a_regular_file, _name_too_long],
                         ids=["read-only-dir", "read-only-fs", "not-a-directory", "name-too-long"])
def test_unusable_cache_dir_warns_once_and_calls_work(tmp_path, monkeypatch, cache_at, caplog, unusable):
    cache_at(unusable(tmp_path, monkeypatch))
    cache = jit.CompileCache()
    keys = every_key()[:3]
    with caplog.at_level(logging.WARNING, logger="flashattn_hopper.jit"):
        for key in keys + keys:
            assert isinstance(cache.get(key, _fake_build), _FakeCompiled)
    assert cache.stats.compiles == len(keys)
    warnings = [r for r in caplog.records if r.name == "flashattn_hopper.jit"]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "in memory only" in warnings[0].getMessage() and cache.disk_error


def test_read_only_cache_still_serves_its_entries(tmp_path, monkeypatch, cache_at, fake_loader, caplog):
    """A cache filled elsewhere (precompile on a build node) and mounted read-only: entries load."""
    root = cache_at(tmp_path / "cache")
    key, other = every_key()[:2]
    jit.CompileCache().get(key, _fake_build)
    _read_only_file_system(tmp_path, monkeypatch)
    cache = jit.CompileCache()
    with caplog.at_level(logging.WARNING, logger="flashattn_hopper.jit"):
        assert cache.get(key, _fake_build)[0] == "loaded"
        assert isinstance(cache.get(other, _fake_build), _FakeCompiled)
    assert cache.stats.disk_hits == 1 and cache.stats.compiles == 1
    assert len([r for r in caplog.records if r.name == "flashattn_hopper.jit"]) == 1
    assert len(objects(root)) == 1


def test_full_disk_warns_once_then_stops_writing(tmp_path, monkeypatch, cache_at, caplog):
    cache_at(tmp_path / "cache")
    attempts = []

    def disk_full(self, compiled):
        attempts.append(self.key)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(jit._DiskEntry, "publish", disk_full)
    cache = jit.CompileCache()
    with caplog.at_level(logging.WARNING, logger="flashattn_hopper.jit"):
        for key in every_key()[:3]:
            assert isinstance(cache.get(key, _fake_build), _FakeCompiled)
    assert len(attempts) == 1 and cache.stats.compiles == 3
    assert len([r for r in caplog.records if r.name == "flashattn_hopper.jit"]) == 1


def test_compile_errors_are_not_taken_for_cache_errors(tmp_path, cache_at):
    """An OSError raised while compiling is the caller's, not a reason to turn the disk cache off."""
    cache_at(tmp_path / "cache")
    cache = jit.CompileCache()

    def broken(key):
        raise OSError(errno.ENOENT, "a tool the compiler runs is missing")

    with pytest.raises(OSError, match="a tool the compiler runs is missing"):
        cache.get(every_key()[0], broken)
    assert cache.disk_error is None
