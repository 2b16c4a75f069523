"""JIT compile cache: in memory, and persistent on disk (on by default).

A kernel is compiled once per ``KernelKey`` — a frozen dataclass of Python primitives (arch, dtype,
head dims, tile configuration, flags), never a tensor and never a batch size or sequence length:
every shape and stride is a dynamic value of the compiled function, so one compile serves all shapes.

On disk (``FLASHATTN_HOPPER_CACHE_DIR``, default ``~/.cache/flashattn_hopper``) entries live under a
fingerprint of the kernel sources, the DSL version, the Python version and the ``CUTE_DSL_*`` codegen
settings, so an upgrade never loads a stale binary. Each entry is an object file exported by the DSL
plus a ``.sha256`` sidecar written after it:

- one ``flock`` per key, held through load-or-compile-and-publish, so N processes starting at once
  compile each kernel once and the others load it (timeout ``FLASHATTN_HOPPER_LOCK_TIMEOUT``);
- publish is write-to-temp then ``os.replace`` (atomic on POSIX), object first, checksum last;
- an entry whose checksum is missing or wrong, or that fails to load, is moved aside
  (``*.corrupt``) and recompiled, never loaded.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .env import settings

log = logging.getLogger("flashattn_hopper.jit")

_PRIMITIVES = (bool, int, float, str, type(None))
# CUTE_DSL_* variables that only affect logging or artifact dumps, plus the target arch, which every key
# carries itself (so a cache filled by `precompile --arch sm90` serves a process that autodetects sm_90a).
# Everything else may change codegen and goes into the fingerprint.
_DSL_ENV_IGNORED = (
    "CUTE_DSL_KEEP", "CUTE_DSL_DUMP_DIR", "CUTE_DSL_LOG", "CUTE_DSL_SHOW", "CUTE_DSL_CACHE_DIR", "CUTE_DSL_ARCH",
)


@dataclass(frozen=True)
class KernelKey:
    """Base of every compile key. Subclasses add fields; all must be Python primitives."""

    kernel: str
    arch: str

    def __post_init__(self) -> None:
        for name, value in vars(self).items():  # (vars: dataclasses.fields() is slow on the hot path)
            if not isinstance(value, _PRIMITIVES):
                raise TypeError(
                    f"compile key field {name!r} must be a Python primitive, got {type(value).__name__} "
                    "(a tensor in a compile key recompiles on every call)"
                )

    @property
    def name(self) -> str:
        """Readable name for logs and cache files, e.g. ``fwd_sm80-sm_90a-bf16-hdim128-...``."""
        parts = [self.kernel, self.arch]
        for f in dataclasses.fields(self)[2:]:
            value = getattr(self, f.name)
            if isinstance(value, bool):
                if value:
                    parts.append(f.name)
            else:
                parts.append(f"{f.name}{value}")
        return "-".join(parts)

    @property
    def digest(self) -> str:
        canon = repr((type(self).__name__, dataclasses.astuple(self)))
        return hashlib.sha256(canon.encode()).hexdigest()


@functools.cache
def source_fingerprint() -> str:
    """Hash of everything that can change a compiled binary other than the key itself."""
    from . import kernels

    h = hashlib.sha256()
    h.update(f"python{sys.version_info.major}.{sys.version_info.minor}".encode())
    h.update(dsl_version().encode())
    for name in sorted(os.environ):
        if name.startswith("CUTE_DSL_") and not name.startswith(_DSL_ENV_IGNORED):
            h.update(f"{name}={os.environ[name]}".encode())
    package_dirs = [Path(__file__).parent, *(Path(p) for p in kernels.__path__)]
    for root in package_dirs:
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def dsl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nvidia-cutlass-dsl")
    except PackageNotFoundError:
        import cutlass

        return str(getattr(cutlass, "__version__", "unknown"))


def target_arch() -> str:
    """The arch the CuTe DSL compiles for in this process (``CUTE_DSL_ARCH`` or the detected GPU)."""
    from cutlass.base_dsl.dsl import BaseDSL

    return str(BaseDSL._get_dsl().get_arch_enum())


@dataclass
class CacheStats:
    memory_hits: int = 0
    disk_hits: int = 0
    compiles: int = 0
    corrupt_entries: int = 0
    events: list[tuple[str, str, float]] = field(default_factory=list)
    """(key name, source: 'disk' | 'compile', seconds) for every kernel obtained in this process."""


class CompileCache:
    def __init__(self) -> None:
        self._memory: dict[KernelKey, Any] = {}
        self._lock = threading.RLock()
        self.stats = CacheStats()

    def get(self, key: KernelKey, build: Callable[[KernelKey], Any]) -> Any:
        """The compiled function for ``key``: memory, then disk, then ``build(key)`` (a cute.compile)."""
        fn = self._memory.get(key)
        if fn is not None:
            self.stats.memory_hits += 1
            return fn
        with self._lock:  # the DSL compiler is not re-entrant; one compile at a time per process
            fn = self._memory.get(key)
            if fn is None:
                fn = self._load_or_compile(key, build)
                self._memory[key] = fn
            return fn

    def _load_or_compile(self, key: KernelKey, build: Callable[[KernelKey], Any]) -> Any:
        cfg = settings()
        if not cfg.disk_cache:
            return self._compile(key, build)
        entry = _DiskEntry(cfg.cache_dir / source_fingerprint()[:16], key)
        with _FileLock(entry.lock_path, cfg.lock_timeout_s, key.name):
            start = time.perf_counter()
            fn = entry.load()
            if fn is not None:
                seconds = time.perf_counter() - start
                self.stats.disk_hits += 1
                self.stats.events.append((key.name, "disk", seconds))
                log.info("flashattn_hopper: loaded %s from the disk cache in %.3f s", key.name, seconds)
                return fn
            if entry.was_corrupt:
                self.stats.corrupt_entries += 1
            compiled = self._compile(key, build)
            try:
                entry.publish(compiled)
            except OSError as e:  # a read-only or full cache dir must not break the call
                log.warning("flashattn_hopper: could not write %s to the disk cache: %s", key.name, e)
            return compiled

    def _compile(self, key: KernelKey, build: Callable[[KernelKey], Any]) -> Any:
        start = time.perf_counter()
        compiled = build(key)
        seconds = time.perf_counter() - start
        self.stats.compiles += 1
        self.stats.events.append((key.name, "compile", seconds))
        log.info("flashattn_hopper: compiled %s in %.1f s", key.name, seconds)
        return compiled

    def clear_memory(self) -> None:
        with self._lock:
            self._memory.clear()


class _DiskEntry:
    """One key's files: ``<name>-<digest12>.o``, its ``.sha256`` sidecar and its lock file."""

    def __init__(self, directory: Path, key: KernelKey) -> None:
        self.directory = directory
        self.key = key
        stem = f"{key.name}-{key.digest[:12]}"
        self.object_path = directory / f"{stem}.o"
        self.sum_path = directory / f"{stem}.sha256"
        self.lock_path = directory / "locks" / f"{stem}.lock"
        self.symbol = f"fah_{key.digest[:24]}"  # C identifier the object exports its function under
        self.was_corrupt = False

    def load(self) -> Any | None:
        if not self.object_path.exists():
            return None
        try:
            data = self.object_path.read_bytes()
            expected = self.sum_path.read_text().strip() if self.sum_path.exists() else None
            if expected != hashlib.sha256(data).hexdigest():
                raise ValueError("checksum missing or wrong (partial or corrupt write)")
            import cutlass.cute as cute

            module = cute.runtime.load_module(str(self.object_path))
            return getattr(module, self.symbol)
        except Exception as e:  # any failure means: never trust this entry
            self._quarantine(e)
            return None

    def _quarantine(self, reason: Exception) -> None:
        self.was_corrupt = True
        log.warning("flashattn_hopper: cache entry %s is unusable (%s); recompiling", self.object_path.name, reason)
        stamp = f"{os.getpid()}-{time.time_ns()}"
        for path in (self.object_path, self.sum_path):
            if path.exists():
                try:
                    os.replace(path, path.with_name(f"{path.name}.{stamp}.corrupt"))
                except OSError:
                    pass

    def publish(self, compiled: Any) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.directory, prefix=".tmp-") as tmp:
            compiled.export_to_c(tmp, "kernel", function_prefix=self.symbol)
            tmp_object = Path(tmp) / "kernel.o"
            digest = hashlib.sha256(tmp_object.read_bytes()).hexdigest()
            os.replace(tmp_object, self.object_path)
            tmp_sum = Path(tmp) / "kernel.sha256"
            tmp_sum.write_text(digest + "\n")
            os.replace(tmp_sum, self.sum_path)


class _FileLock:
    """Exclusive ``flock`` with a timeout (POSIX); released when the block exits or the process dies."""

    def __init__(self, path: Path, timeout_s: float, what: str) -> None:
        self.path, self.timeout_s, self.what = path, timeout_s, what
        self._fd = -1

    def __enter__(self) -> _FileLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if time.monotonic() > deadline:
                os.close(self._fd)
                raise TimeoutError(
                    f"waited {self.timeout_s:.0f} s for another process compiling {self.what} "
                    f"(lock {self.path}); raise FLASHATTN_HOPPER_LOCK_TIMEOUT or delete a stale lock"
                )
            time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)


compile_cache = CompileCache()


def cache_dir() -> Path:
    return settings().cache_dir


def cache_info() -> dict[str, Any]:
    """Disk cache location and size, and this process's in-memory statistics."""
    root = cache_dir()
    files = [p for p in root.rglob("*.o") if p.is_file()] if root.exists() else []
    current = root / source_fingerprint()[:16] if root.exists() else None
    return {
        "cache_dir": str(root),
        "disk_cache_enabled": settings().disk_cache,
        "entries": len(files),
        "entries_current_fingerprint": sum(1 for p in files if current is not None and p.parent == current),
        "bytes": sum(p.stat().st_size for p in files),
        "fingerprint": source_fingerprint()[:16],
        "memory_entries": len(compile_cache._memory),
        "stats": dataclasses.asdict(compile_cache.stats),
    }


def clear_disk_cache() -> int:
    """Deletes the whole cache directory; returns the number of bytes freed."""
    root = cache_dir()
    if not root.exists():
        return 0
    freed = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    shutil.rmtree(root)
    return freed
