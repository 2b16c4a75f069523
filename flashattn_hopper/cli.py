"""Command line: ``python -m flashattn_hopper {info,precompile,cache,sweep}``.

``precompile`` fills the disk cache for a target arch without a GPU (fake tensors), so a build node
can warm the cache that GPU nodes then load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from .env import settings


def _pkg_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{n} B"


def cmd_info(args: argparse.Namespace) -> int:
    import torch

    print(f"flashattn_hopper {_pkg_version('flashattn-hopper')}")
    print(f"python           {platform.python_version()}")
    print(f"torch            {torch.__version__} (CUDA {torch.version.cuda})")
    print(f"nvidia-cutlass-dsl {_pkg_version('nvidia-cutlass-dsl')}")
    print(f"cuda-python      {_pkg_version('cuda-python')}")
    if torch.cuda.is_available():
        from . import dispatch

        for i in range(torch.cuda.device_count()):
            device = torch.device("cuda", i)
            major, minor = torch.cuda.get_device_capability(device)
            try:
                backend, explicit = dispatch.select_backend(device, None)
                chosen = backend + (" (forced by FLASHATTN_HOPPER_BACKEND)" if explicit else "")
            except (RuntimeError, ValueError) as e:
                chosen = f"none: {e}"
            print(f"gpu {i}            {torch.cuda.get_device_name(device)}, compute capability {major}.{minor}, backend {chosen}")
    else:
        print("gpu              none found (kernels can still be compiled: python -m flashattn_hopper precompile)")
    from .jit import cache_info

    info = cache_info()
    state = "on" if info["disk_cache_enabled"] else "off (FLASHATTN_HOPPER_CACHE=0)"
    print(f"cache dir        {info['cache_dir']} ({state})")
    print(
        f"cache size       {info['entries']} kernels, {_human_bytes(info['bytes'])} "
        f"({info['entries_current_fingerprint']} for this version, fingerprint {info['fingerprint']}; "
        "list: python -m flashattn_hopper cache)"
    )
    return 0


def _set_target_arch(arch: str) -> None:
    """The DSL reads CUTE_DSL_ARCH once, at import: set it before cutlass is imported."""
    if "cutlass" in sys.modules:
        from .jit import target_arch

        if target_arch() != arch:
            raise SystemExit(f"precompile: the CuTe DSL is already set up for {target_arch()} in this process; run precompile in a fresh process")
        return
    os.environ["CUTE_DSL_ARCH"] = arch


def precompile(
    arch_name: str, head_dims: list[int] | None, dtypes: list[str] | None, quiet: bool = False,
) -> list[dict[str, Any]]:
    """Compiles (or finds in the disk cache) every kernel variant for ``arch_name``; returns a report.
    Prints a line per kernel family saying what it serves, then a line per kernel (``progress_line``)."""
    from . import dispatch

    target = dispatch.PRECOMPILE_TARGETS[arch_name]
    _set_target_arch(target)
    from .jit import compile_cache

    # On a Hopper target, compile the Ampere kernels too: they serve backend='sm80' on Hopper.
    backends = dispatch.BACKENDS_FOR_TARGET[target]
    keys = []
    for backend in backends:
        for family in dispatch.families(backend):
            for key in family.all_keys(target):
                head_dim = getattr(key, "head_dim", None)
                if head_dims and head_dim is not None and not any(_serves(family, head_dim, d) for d in head_dims):
                    continue
                if dtypes and getattr(key, "dtype", None) not in (None, *dtypes):
                    continue
                keys.append((family, key))
    report = []
    family_seen = None
    for i, (family, key) in enumerate(keys, 1):
        if family is not family_seen and not quiet:
            print(family_header(family, target, [k for f, k in keys if f is family]), flush=True)
        family_seen = family
        events_before = len(compile_cache.stats.events)
        start = time.perf_counter()
        status, error = "ok", ""
        try:
            compile_cache.get(key, family.compile)
        except Exception as e:  # report every kernel, even when one fails
            status, error = "FAILED", f"{type(e).__name__}: {e}".splitlines()[0]
        seconds = time.perf_counter() - start
        new_events = compile_cache.stats.events[events_before:]
        source = new_events[-1][1] if new_events else "memory"
        row = {"kernel": key.name, "display_name": key.display_name, "status": status,
               "source": source if status == "ok" else "-", "seconds": seconds, "error": error}
        report.append(row)
        if not quiet:
            print(progress_line(i, len(keys), row), flush=True)
            if error:
                print(f"    {error}", flush=True)
    return report


def progress_line(i: int, total: int, row: dict[str, Any]) -> str:
    """``[  7/179] ok     compile    9.81 s  fwd_sm90-sm_90a-bf16-hdim128-tile128x128-causal-persistent``:
    at most 120 columns for every kernel the package ships (tests/test_cli.py)."""
    width = len(str(total))
    return (
        f"[{i:>{width}}/{total}] {row['status']:6} {row['source']:7} {row['seconds']:7.2f} s  {row['display_name']}"
    )


def family_header(family: Any, target: str, keys: list[Any]) -> str:
    """What a kernel family is for, printed before its ``keys``: on a Hopper target the Ampere
    kernels appear too, and a reader should not have to guess why."""
    from . import dispatch

    kinds = sorted({key.kernel for key in keys} - {family.kind})
    also = f" (with {', '.join(kinds)})" if kinds else ""
    head = f"-- {family.kind}{also} for {target}: {len(keys)} kernels"
    hopper_target = family.backend == "sm80" and "sm90" in dispatch.BACKENDS_FOR_TARGET[target]
    if family.kind.startswith("fwd"):
        if hopper_target:
            return (f"{head}\n   the Ampere forward built for Hopper: it runs what the Hopper forward does not "
                    "cover, and backend='sm80'")
        return f"{head}, the {'Hopper' if family.backend == 'sm90' else 'Ampere'} forward"
    if hopper_target:
        hopper_bwd = dispatch.BWD_KERNELS["sm90"].all_keys(target)
        serves = "what the Hopper backward does not cover" if hopper_bwd else "every backward on Hopper"
        return f"{head}\n   the Ampere backward built for Hopper: it runs {serves}, and backend='sm80'"
    return f"{head}, the {'Hopper' if family.backend == 'sm90' else 'Ampere'} backward"


def _serves(family: Any, kernel_head_dim: int, head_dim: int) -> bool:
    """Whether a kernel compiled for ``kernel_head_dim`` is the one used for a user's ``head_dim``."""
    from . import configs

    tiles = getattr(family, "tiles", None)
    if not tiles:
        return kernel_head_dim == head_dim
    return configs.kernel_head_dim(tiles, head_dim, head_dim) == kernel_head_dim


def human_seconds(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs} s" if minutes else f"{seconds:.1f} s"


def cmd_precompile(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    report = precompile(args.arch, args.hdim, args.dtype)
    seconds = time.perf_counter() - start
    failed = [r for r in report if r["status"] != "ok"]
    compiled = sum(1 for r in report if r["source"] == "compile")
    cached = sum(1 for r in report if r["source"] in ("disk", "memory"))
    print(
        f"precompile --arch {args.arch}: {len(report)} kernels in {human_seconds(seconds)}: {compiled} compiled, "
        f"{cached} already cached, {len(failed)} failed\ncache dir {settings().cache_dir}"
        + ("" if settings().disk_cache else " (disk cache is off: FLASHATTN_HOPPER_CACHE=0, nothing was saved)")
    )
    if args.report:
        with open(args.report, "w") as f:
            json.dump({"arch": args.arch, "seconds": seconds, "kernels": report}, f, indent=1)
    return 1 if failed else 0


def cmd_cache(args: argparse.Namespace) -> int:
    from .jit import cache_entries, cache_info, clear_disk_cache

    if args.action == "clear":
        freed = clear_disk_cache()
        print(f"cleared {settings().cache_dir} ({_human_bytes(freed)})")
        return 0
    info = cache_info()
    print(
        f"{info['cache_dir']}: {info['entries']} kernels, {_human_bytes(info['bytes'])} "
        f"({info['entries_current_fingerprint']} for this version, fingerprint {info['fingerprint']})"
    )
    if not info["disk_cache_enabled"]:
        print("the disk cache is off in this environment (FLASHATTN_HOPPER_CACHE=0)")
    stale: dict[str, int] = {}
    for entry in cache_entries():
        if entry.fingerprint != info["fingerprint"]:
            stale[entry.fingerprint] = stale.get(entry.fingerprint, 0) + 1
            continue
        print(f"  {entry.file}  {_human_bytes(entry.bytes):>9}  {entry.key_name or '(no .key file)'}")
    for fingerprint, count in stale.items():
        print(f"  {count} kernels under fingerprint {fingerprint}: another version of the package, DSL or "
              "Python (never loaded; 'cache clear' deletes them)")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from . import sweep

    return sweep.run(args)


_DESCRIPTION = "FlashAttention-style attention kernels for Hopper (sm90) and Ampere (sm80) GPUs."
_EPILOG = """\
examples:
  python -m flashattn_hopper info
  python -m flashattn_hopper precompile --arch sm90        # no GPU needed
  python -m flashattn_hopper cache                         # list the cached kernels (same as: cache info)
  python -m flashattn_hopper cache clear
  python -m flashattn_hopper sweep --quick                 # needs a GPU
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flashattn_hopper", description=_DESCRIPTION, epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,  # keeps the examples' lines as written
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="GPU, arch, chosen backend, versions, cache dir and size").set_defaults(func=cmd_info)
    pre = sub.add_parser("precompile", help="compile every kernel for an arch into the disk cache (no GPU needed)")
    pre.add_argument("--arch", choices=("sm90", "sm80"), required=True, help="target GPU arch family")
    pre.add_argument("--hdim", type=int, nargs="+", help="only kernels serving these head dims")
    pre.add_argument("--dtype", choices=("bf16", "fp16"), nargs="+", help="only these dtypes")
    pre.add_argument("--report", metavar="PATH", help="also write the per-kernel report (JSON) to PATH")
    pre.set_defaults(func=cmd_precompile)
    cache = sub.add_parser("cache", help="list (info, the default) or delete (clear) the disk cache's kernels")
    cache.add_argument("action", nargs="?", default="info", choices=("info", "clear"),
                       help="info: list the kernels, one line each with its full key; clear: delete the cache")
    cache.set_defaults(func=cmd_cache)
    sweep_parser = sub.add_parser("sweep", help="perf sweep against cuDNN / PyTorch flash (needs a GPU)")
    try:
        from . import sweep

        sweep.add_arguments(sweep_parser)
    except ImportError:
        pass
    sweep_parser.set_defaults(func=cmd_sweep)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
