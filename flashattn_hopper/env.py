"""Every environment variable the package reads, in one frozen settings object.

All names share the ``FLASHATTN_HOPPER_`` prefix and are documented in the README. They are read
once, on first use; tests that change them call ``settings.cache_clear()``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

_PREFIX = "FLASHATTN_HOPPER_"
_VALID_BACKENDS = ("sm90", "sm80")


@dataclass(frozen=True)
class Settings:
    backend: str | None
    """Forced kernel family (``sm90`` or ``sm80``); None picks by compute capability."""
    disk_cache: bool
    """Persistent on-disk compile cache on/off (on by default)."""
    cache_dir: Path
    """Root of the on-disk compile cache."""
    lock_timeout_s: float
    """How long a process waits for another process compiling the same kernel."""


def _default_cache_dir() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "flashattn_hopper"


def _read_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(_PREFIX + name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{_PREFIX}{name} must be 0 or 1, got {raw!r}")


@functools.cache
def settings() -> Settings:
    backend = os.environ.get(_PREFIX + "BACKEND") or None
    if backend is not None and backend not in _VALID_BACKENDS:
        raise ValueError(
            f"{_PREFIX}BACKEND must be one of {', '.join(_VALID_BACKENDS)} (or unset), got {backend!r}"
        )
    cache_dir_raw = os.environ.get(_PREFIX + "CACHE_DIR")
    cache_dir = Path(cache_dir_raw).expanduser() if cache_dir_raw else _default_cache_dir()
    timeout_raw = os.environ.get(_PREFIX + "LOCK_TIMEOUT", "1800")
    try:
        lock_timeout_s = float(timeout_raw)
    except ValueError:
        raise ValueError(f"{_PREFIX}LOCK_TIMEOUT must be a number of seconds, got {timeout_raw!r}") from None
    return Settings(
        backend=backend,
        disk_cache=_read_bool("CACHE", True),
        cache_dir=cache_dir,
        lock_timeout_s=lock_timeout_s,
    )
