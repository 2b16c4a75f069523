"""JIT compile cache: in memory, and persistent on disk (on by default).

A kernel is compiled once per ``KernelKey`` — a frozen dataclass of Python primitives (arch, dtype,
head dims, tile configuration, flags), never a tensor and never a batch size or sequence length:
every shape and stride is a dynamic value of the compiled function, so one compile serves all shapes.

On disk (``FLASHATTN_HOPPER_CACHE_DIR``, default ``~/.cache/flashattn_hopper``) entries live under a
fingerprint of the kernel sources, the DSL version, the Python version and the ``CUTE_DSL_*`` codegen
settings, so an upgrade never loads a stale binary. Each entry is the DSL's export of the kernel: for a
TVM-FFI function (the launchers' calling path) a shared library linked against the DSL's runtime
library and ``libtvm_ffi`` (``.so``; ``.ffi.o`` where no C compiler driver links it), which a new
process loads with ``tvm_ffi`` alone, without importing the DSL; otherwise an object file (``.o``);
a ``.key`` sidecar with the key's full name (for ``python -m flashattn_hopper cache info``) and a
``.sha256`` sidecar written last. File names are ``<kernel>-<digest16>`` whatever the key holds: a key's
full name runs past 250 characters, more than a file system allows in one name (ext4: 255 bytes).

- one ``flock`` per key, held through load-or-compile-and-publish, so N processes starting at once
  compile each kernel once and the others load it (timeout ``FLASHATTN_HOPPER_LOCK_TIMEOUT``);
- publish is write-to-temp then ``os.replace`` (atomic on POSIX), object first, checksum last;
- an entry whose checksum is missing or wrong, or that fails to load, is moved aside
  (``*.corrupt``) and recompiled, never loaded;
- a cache directory that cannot be locked or written (read-only, full, permissions, a bad path) costs
  one warning per process, never the call: from then on the process only reads entries already there
  and keeps what it compiles in memory.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import functools
import hashlib
import logging
import os
import re
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
        """Every field, e.g. ``fwd_sm80-sm_90a-dtypebf16-head_dim128-...`` (cache listings; up to ~270
        characters, so never a file name: see ``_DiskEntry``)."""
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
    def display_name(self) -> str:
        """Short name for logs and progress lines, e.g. ``fwd_sm90-sm_90a-bf16-hdim192/128-tile128x128-causal``:
        kind, arch, dtype, head dims, the tile, the bool fields that are set and the fields that differ
        from their defaults (a bool field without a default counts as default False; an int field
        without one is tile configuration, left to ``name``; a field whose metadata says ``display=False``, one
        another field implies, is left out too; ``display="..."`` shows it by that name)."""
        return _display_name(self)

    @property
    def digest(self) -> str:
        canon = repr((type(self).__name__, dataclasses.astuple(self)))
        return hashlib.sha256(canon.encode()).hexdigest()


_DISPLAY_LEAD = ("dtype", "head_dim", "head_dim_v", "tile_m", "tile_n")


def _display_name(key: KernelKey) -> str:
    fields = dataclasses.fields(key)[2:]
    values = {f.name: getattr(key, f.name) for f in fields}
    parts = [key.kernel, key.arch]
    if "dtype" in values:
        parts.append(str(values["dtype"]))
    if "head_dim" in values:
        head_dim_v = values.get("head_dim_v", values["head_dim"])
        parts.append(f"hdim{values['head_dim']}" + (f"/{head_dim_v}" if head_dim_v != values["head_dim"] else ""))
    if "tile_m" in values and "tile_n" in values:
        parts.append(f"tile{values['tile_m']}x{values['tile_n']}")
    for f in fields:
        value = values[f.name]
        if f.name in _DISPLAY_LEAD or f.metadata.get("display") is False:
            continue
        default = f.default
        if default is dataclasses.MISSING:
            if not isinstance(value, bool):
                continue
            default = False
        if value == default:
            continue
        name = f.metadata.get("display") or f.name  # (a string: a shorter display name)
        if isinstance(value, bool):
            parts.append(name if value else f"no_{name}")
        else:
            parts.append(f"{name}{value}")
    return "-".join(parts)


@functools.cache
def source_fingerprint() -> str:
    """Hash of everything that can change a compiled binary other than the key itself."""
    from . import kernels

    h = hashlib.sha256()
    h.update(f"python{sys.version_info.major}.{sys.version_info.minor}".encode())
    h.update(dsl_version().encode())
    h.update(_version("apache-tvm-ffi").encode())
    for name in sorted(os.environ):
        if name.startswith("CUTE_DSL_") and not name.startswith(_DSL_ENV_IGNORED):
            h.update(f"{name}={os.environ[name]}".encode())
    package_dirs = [Path(__file__).parent, *(Path(p) for p in kernels.__path__)]
    for root in package_dirs:
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "none"


def dsl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nvidia-cutlass-dsl")
    except PackageNotFoundError:
        import cutlass

        return str(getattr(cutlass, "__version__", "unknown"))


def target_arch() -> str:
    """The arch the CuTe DSL compiles for in this process (``CUTE_DSL_ARCH`` or the detected GPU).

    Asks the DSL once it is imported (it fixes its arch per process); before that, derives the same
    answer without importing it (importing the DSL costs seconds, and a warm disk cache needs no
    compiler): ``CUTE_DSL_ARCH``, else the current GPU's compute capability as the DSL names it
    (``sm_90a`` for 9.0, ``sm_86`` for 8.6; ``sm_100a`` without a GPU, as the DSL defaults)."""
    if "cutlass" in sys.modules:
        return _dsl_arch()
    return os.environ.get("CUTE_DSL_ARCH") or _detected_arch()


@functools.cache
def _dsl_arch() -> str:
    """The imported DSL's arch, fixed for the process: asked once (asking took ~15 us, on every gated
    or sinked call through ``variant_key``)."""
    from cutlass.base_dsl.dsl import BaseDSL

    return str(BaseDSL._get_dsl().get_arch_enum())


@functools.cache
def _detected_arch() -> str:
    import torch

    major, minor = torch.cuda.get_device_capability() if torch.cuda.is_available() else (10, 0)
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


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
        self.disk_error: str | None = None
        """Set at the first disk failure (lock, read or write); from then on this process only reads
        entries already on disk and publishes nothing."""

    def get(self, key: KernelKey, build: Callable[[KernelKey], Any]) -> Any:
        """The compiled function for ``key``: memory, then disk, then ``build(key)`` (a cute.compile)."""
        fn = self._memory.get(key)
        if fn is not None:
            self.stats.memory_hits += 1
            return fn
        with self._lock:  # the DSL compiler is not re-entrant; one compile at a time per process
            fn = self._memory.get(key)
            if fn is None:
                fn = callable_of(self._load_or_compile(key, build))
                self._memory[key] = fn
            return fn

    def _load_or_compile(self, key: KernelKey, build: Callable[[KernelKey], Any]) -> Any:
        cfg = settings()
        if not cfg.disk_cache:
            return self._compile(key, build)
        entry = _DiskEntry(cfg.cache_dir / source_fingerprint()[:16], key)
        if self.disk_error is None:
            lock = _FileLock(entry.lock_path, cfg.lock_timeout_s, key.display_name)
            try:
                lock.acquire()
            except TimeoutError:  # another process is compiling this key: the message names the setting
                raise
            except OSError as e:
                self._disk_failed(entry, "locked", e)
            else:
                try:
                    fn = self._load(entry)
                    if fn is not None:
                        return fn
                    compiled = self._compile(key, build)
                    if self.disk_error is None:
                        try:
                            entry.publish(compiled)
                        except OSError as e:
                            self._disk_failed(entry, "written", e)
                    return compiled
                finally:
                    lock.release()
        fn = self._load(entry)  # read-only from here on: a shared, pre-filled cache still serves
        return fn if fn is not None else self._compile(key, build)

    def _load(self, entry: _DiskEntry) -> Any | None:
        start = time.perf_counter()
        try:
            fn = entry.load()
        except OSError as e:
            self._disk_failed(entry, "read", e)
            return None
        if entry.was_corrupt:
            self.stats.corrupt_entries += 1
        if fn is None:
            return None
        seconds = time.perf_counter() - start
        self.stats.disk_hits += 1
        self.stats.events.append((entry.key.name, "disk", seconds))
        log.info("flashattn_hopper: loaded %s from the disk cache in %.3f s", entry.key.display_name, seconds)
        return fn

    def _disk_failed(self, entry: _DiskEntry, what: str, error: OSError) -> None:
        if self.disk_error is not None:
            return
        self.disk_error = f"{what}: {error}"
        log.warning(
            "flashattn_hopper: the disk cache could not be %s (%s: %s); this process keeps the kernels it "
            "compiles in memory only. Point FLASHATTN_HOPPER_CACHE_DIR at a writable directory, or set "
            "FLASHATTN_HOPPER_CACHE=0 to silence this.", what, type(error).__name__, error,
        )

    def _compile(self, key: KernelKey, build: Callable[[KernelKey], Any]) -> Any:
        start = time.perf_counter()
        compiled = build(key)
        seconds = time.perf_counter() - start
        self.stats.compiles += 1
        self.stats.events.append((key.name, "compile", seconds))
        log.info("flashattn_hopper: compiled %s in %.1f s", key.display_name, seconds)
        return compiled

    def clear_memory(self) -> None:
        with self._lock:
            self._memory.clear()


_KIND_IN_FILE_NAME = 32  # characters of the key's kind kept in its file names (kinds are ~13)


def _load_module(path: Path, symbol: str) -> Any:
    """The compiled function an object file exports (tests replace this to use stand-in objects)."""
    import cutlass.cute as cute

    return getattr(cute.runtime.load_module(str(path)), symbol)


def _load_ffi_library(path: Path, symbol: str) -> Any:
    """The ``tvm_ffi.Function`` a linked TVM-FFI entry exports, loaded without the DSL: the library
    names ``libcute_dsl_runtime.so`` and ``libtvm_ffi.so`` as dependencies (with their directories as
    its rpath), so one ``dlopen`` resolves the CUDA helpers the host code calls."""
    import tvm_ffi

    return tvm_ffi.load_module(str(path))[symbol]


def _load_ffi_object(path: Path, symbol: str) -> Any:
    """A TVM-FFI entry kept as an object file (no linker when it was written): the DSL links it."""
    import cutlass.cute as cute

    return getattr(cute.runtime.load_module(str(path), enable_tvm_ffi=True), symbol)


def is_ffi_function(compiled: Any) -> bool:
    """Whether ``compiled`` is a TVM-FFI function (``cute.compile(..., options="--enable-tvm-ffi")``,
    or one loaded from the disk cache) rather than a function of the DSL's own calling convention."""
    return hasattr(compiled, "__tvm_ffi_object__") or hasattr(compiled, "__chandle__")


def callable_of(compiled: Any) -> Any:
    """What a launcher calls: the plain ``tvm_ffi.Function`` under a DSL wrapper (the DSL wraps
    kernels whose ``__call__`` has defaults in a Python keyword layer that launchers do not need:
    they pass every argument by position), else ``compiled`` itself."""
    inner = getattr(compiled, "__tvm_ffi_object__", None)
    return compiled if inner is None else inner()


def _link_shared(object_path: Path, library_path: Path) -> bool:
    """Links a TVM-FFI object file into a shared library that needs neither the DSL nor its linker
    at load time. False when no C compiler driver is found (the entry then stays an object file)."""
    import subprocess

    from cutlass.cute.runtime import find_runtime_libraries

    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return False
    libs = [str(Path(lib).resolve()) for lib in find_runtime_libraries(enable_tvm_ffi=True)]
    rpaths = sorted({f"-Wl,-rpath,{Path(lib).parent}" for lib in libs})
    subprocess.run([cc, "-shared", "-o", str(library_path), str(object_path), *libs, *rpaths],
                   check=True, capture_output=True)
    return True


class _DiskEntry:
    """One key's files: ``<kind>-<digest16>.o``, its ``.key`` and ``.sha256`` sidecars and its lock
    file, each name under 100 characters whatever the key holds (``*.corrupt`` copies included)."""

    def __init__(self, directory: Path, key: KernelKey) -> None:
        self.directory = directory
        self.key = key
        kind = re.sub(r"[^A-Za-z0-9_.]", "_", key.kernel)[:_KIND_IN_FILE_NAME]
        stem = f"{kind}-{key.digest[:16]}"
        self.object_path = directory / f"{stem}.o"
        self.library_path = directory / f"{stem}.so"  # TVM-FFI entries, linked
        self.ffi_object_path = directory / f"{stem}.ffi.o"  # TVM-FFI entries where no linker was found
        self.key_path = directory / f"{stem}.key"
        self.sum_path = directory / f"{stem}.sha256"
        self.lock_path = directory / "locks" / f"{stem}.lock"
        self.symbol = f"fah_{key.digest[:24]}"  # C identifier the object exports its function under
        self.was_corrupt = False

    def load(self) -> Any | None:
        """The entry's function, or None when there is none or it is unusable (then quarantined).
        File-system errors other than a missing entry raise OSError: the cache itself is unusable."""
        for path, loader in ((self.library_path, _load_ffi_library), (self.ffi_object_path, _load_ffi_object),
                             (self.object_path, _load_module)):
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                continue
            try:
                expected: str | None = self.sum_path.read_text().strip()
            except FileNotFoundError:
                expected = None
            try:
                if expected != hashlib.sha256(data).hexdigest():
                    raise ValueError("checksum missing or wrong (partial or corrupt write)")
                return loader(path, self.symbol)
            except Exception as e:  # any failure means: never trust this entry
                self._quarantine(e, path)
                return None
        return None

    def quarantine_path(self, path: Path) -> Path:
        return path.with_name(f"{path.name}.{os.getpid()}-{time.time_ns()}.corrupt")

    def _quarantine(self, reason: Exception, entry_path: Path | None = None) -> None:
        self.was_corrupt = True
        entry_path = self.object_path if entry_path is None else entry_path
        log.warning("flashattn_hopper: cache entry %s (%s) is unusable (%s); recompiling",
                    entry_path.name, self.key.display_name, reason)
        for path in (entry_path, self.sum_path):
            try:
                os.replace(path, self.quarantine_path(path))
            except OSError:
                pass

    def publish(self, compiled: Any) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.directory, prefix=".tmp-") as tmp:
            tmp_object = Path(tmp) / "kernel.o"
            if is_ffi_function(compiled):
                compiled.export_to_c(str(tmp_object), self.symbol)
                tmp_library = Path(tmp) / "kernel.so"
                if _link_shared(tmp_object, tmp_library):
                    tmp_object, target = tmp_library, self.library_path
                else:
                    target = self.ffi_object_path
            else:
                compiled.export_to_c(tmp, "kernel", function_prefix=self.symbol)
                target = self.object_path
            digest = hashlib.sha256(tmp_object.read_bytes()).hexdigest()
            os.replace(tmp_object, target)
            tmp_key = Path(tmp) / "kernel.key"
            tmp_key.write_text(self.key.name + "\n")
            os.replace(tmp_key, self.key_path)
            tmp_sum = Path(tmp) / "kernel.sha256"
            tmp_sum.write_text(digest + "\n")
            os.replace(tmp_sum, self.sum_path)


class _FileLock:
    """Exclusive ``flock`` with a timeout (POSIX); released when the block exits or the process dies."""

    def __init__(self, path: Path, timeout_s: float, what: str) -> None:
        self.path, self.timeout_s, self.what = path, timeout_s, what
        self._fd = -1

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(self._fd)
                    raise
            if time.monotonic() > deadline:
                os.close(self._fd)
                raise TimeoutError(
                    f"waited {self.timeout_s:.0f} s for another process compiling {self.what} "
                    f"(lock {self.path}); raise FLASHATTN_HOPPER_LOCK_TIMEOUT or delete a stale lock"
                )
            time.sleep(0.05)

    def release(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)

    def __enter__(self) -> _FileLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


compile_cache = CompileCache()


def cache_dir() -> Path:
    return settings().cache_dir


@dataclass(frozen=True)
class CacheEntry:
    """One compiled kernel on disk."""

    fingerprint: str  # the directory: kernel sources, DSL, Python and codegen settings it was built with
    file: str  # the entry's file: ``<kind>-<digest16>.so`` (TVM-FFI, linked), ``.ffi.o`` or ``.o``
    key_name: str  # the key's full name (``KernelKey.name``), from the ``.key`` sidecar; "" if missing
    bytes: int


def cache_entries() -> list[CacheEntry]:
    """Every entry of the disk cache, all fingerprints, sorted by fingerprint then key name."""
    entries = []
    try:
        objects = [p for pattern in ("*/*.o", "*/*.so") for p in cache_dir().glob(pattern) if p.is_file()]
    except OSError:  # an unreadable cache directory lists as empty
        return []
    for path in objects:
        try:
            size = path.stat().st_size
        except OSError:
            continue
        try:
            key_name = path.with_name(path.name.split(".")[0] + ".key").read_text().strip()
        except OSError:
            key_name = ""
        entries.append(CacheEntry(path.parent.name, path.name, key_name, size))
    return sorted(entries, key=lambda e: (e.fingerprint, e.key_name, e.file))


def cache_info() -> dict[str, Any]:
    """Disk cache location and size, and this process's in-memory statistics."""
    entries = cache_entries()
    fingerprint = source_fingerprint()[:16]
    return {
        "cache_dir": str(cache_dir()),
        "disk_cache_enabled": settings().disk_cache,
        "disk_error": compile_cache.disk_error,
        "entries": len(entries),
        "entries_current_fingerprint": sum(1 for e in entries if e.fingerprint == fingerprint),
        "bytes": sum(e.bytes for e in entries),
        "fingerprint": fingerprint,
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
