"""Run a selection of tests as parallel pytest processes on one GPU machine (not a test).

    python -m tests.shards [--jobs 6] [--timeout 420] [--smoke] [pytest selection args ...]

The GPU tier is mostly compile time (CPU-bound, one compile at a time per process): on the 16-core
GPU machines, 4-6 processes sharing the GPU finish a selection several times faster than one. The
selection's node ids are collected here (``pytest --collect-only``), dealt round-robin to ``--jobs``
shards (so each shard gets a mix of kernels to compile), and each shard runs under ``timeout``
with its log in ``$OUT/shard_<i>.log`` (or ``./shards/``); the summary lines and failures are
printed as shards finish. ``--smoke``: first one small sm90 forward + backward under a 90 s limit,
and nothing else if it fails or hangs (a hung kernel would otherwise eat every shard's time).
Set ``FLASHATTN_HOPPER_TEST_TIMEOUT`` (the per-test watchdog, README) as well.

    python -m tests.shards --smoke -m "gpu and not slow" tests/test_bwd.py tests/test_bwd_sm90.py
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path


def collect(selection: list[str]) -> list[str]:
    """Node ids of the selection, as pytest collects them."""
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *selection],
                         capture_output=True, text=True)
    return [line for line in run.stdout.splitlines() if "::" in line]


def smoke(out_dir: Path) -> bool:
    """One sm90 forward + backward (``tests.sanitizer_cases``) within 90 s."""
    log = out_dir / "smoke.log"
    with log.open("w") as f:
        try:
            rc = subprocess.run([sys.executable, "-m", "tests.sanitizer_cases", "sm90_fwd_bwd_dense"],
                                stdout=f, stderr=subprocess.STDOUT, timeout=90).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    print(f"smoke: rc={rc}", flush=True)
    return rc == 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=6)
    ap.add_argument("--timeout", type=int, default=420, help="seconds per shard")
    ap.add_argument("--smoke", action="store_true")
    args, selection = ap.parse_known_args(argv)
    out_dir = Path(os.environ.get("OUT", "shards"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.smoke and not smoke(out_dir):
        return 1
    ids = collect(selection)
    print(f"{len(ids)} tests in {args.jobs} shards", flush=True)
    if not ids:
        return 1
    start, procs = time.time(), []
    for i in range(args.jobs):
        shard = ids[i::args.jobs]
        if not shard:
            continue
        log = (out_dir / f"shard_{i}.log").open("w")
        # --maxfail: a shard stops after 12 failures (a broken build would otherwise spend the device
        # time on failing compiles); the shard's rc and log still say it failed.
        cmd = ["timeout", str(args.timeout), sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider",
               "--maxfail=12", *shard]
        procs.append((i, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
    worst = 0
    for i, proc, log in procs:
        rc = proc.wait()
        log.close()
        worst = max(worst, rc)
        lines = (out_dir / f"shard_{i}.log").read_text(errors="replace").splitlines()
        keep = [line for line in lines if line.startswith("FAILED") or " passed" in line or " failed" in line]
        print(f"shard {i}: rc={rc} ({'timed out' if rc == 124 else 'done'}) at {time.time() - start:.0f}s", flush=True)
        print("\n".join(keep[-10:]), flush=True)
    return worst


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
