"""The main job: the perf sweep on a GPU; on a machine without one, compile and report every kernel.

    python perf/run.py [sweep options...]

With a CUDA GPU this is ``python -m flashattn_hopper sweep`` (options pass through, e.g. ``--quick``).
Without one it says so, then runs ``python -m flashattn_hopper precompile`` for each target arch
(sm90, then sm80), which fills the disk cache and prints one line per kernel, and ends with the
total: ~290 kernels in 10-15 minutes on 2 CPU cores the first time (10.5 min in issue 21, 14 min on a
busy 2-core machine), seconds once they are cached.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# What each precompile section holds. On Hopper the Ampere kernels are built too (fwd_sm80/bwd_sm80
# for sm_90a): they run the backward (no Hopper backward yet), problems the Hopper forward does not
# cover, and backend="sm80".
SECTIONS = (
    ("sm90", "the Hopper forward (fwd_sm90), then the Ampere kernels built for Hopper (fwd_sm80, bwd_sm80\n"
             "   for sm_90a): they run the backward and the problems the Hopper forward does not cover"),
    ("sm80", "the Ampere kernels (fwd_sm80, bwd_sm80) for sm_80 GPUs (A100, A10, L4, RTX 30/40)"),
)


def summary_line(reports: dict[str, list[dict]], seconds: float) -> str:
    """The job's last line: every kernel of every section, and the whole time."""
    from flashattn_hopper.cli import human_seconds

    rows = [row for report in reports.values() for row in report]
    compiled = sum(1 for r in rows if r["source"] == "compile")
    cached = sum(1 for r in rows if r["source"] in ("disk", "memory"))
    failed = sum(1 for r in rows if r["status"] != "ok")
    per_arch = ", ".join(f"{arch}: {len(report)}" for arch, report in reports.items())
    return (
        f"== total: {len(rows)} kernels ({per_arch}) in {human_seconds(seconds)}: {compiled} compiled, "
        f"{cached} already cached, {failed} failed"
    )


def precompile_all() -> int:
    print(
        "No CUDA GPU found (torch.cuda.is_available() is False): the perf sweep needs one.\n"
        "Doing the CPU part instead: compiling every kernel for sm90 and sm80 into the disk cache (GPU nodes\n"
        "sharing that cache directory load them instead of compiling). Expect 10-15 minutes on 2 CPU cores\n"
        "the first time, seconds once the kernels are cached.",
        flush=True,
    )
    start = time.perf_counter()
    status = 0
    reports: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="flashattn-hopper-run-") as tmp:
        for arch, what in SECTIONS:
            print(f"\n== precompile --arch {arch}: {what}", flush=True)
            report_path = Path(tmp) / f"{arch}.json"
            # One process per arch: the CuTe DSL fixes its target arch when it is first imported.
            status |= subprocess.call(
                [sys.executable, "-m", "flashattn_hopper", "precompile", "--arch", arch, "--report", str(report_path)]
            )
            reports[arch] = json.loads(report_path.read_text())["kernels"] if report_path.exists() else []
    print("\n" + summary_line(reports, time.perf_counter() - start), flush=True)
    return status


def main(argv: list[str]) -> int:
    import torch

    if torch.cuda.is_available() or "-h" in argv or "--help" in argv:
        from flashattn_hopper.cli import main as cli_main

        return cli_main(["sweep", *argv])
    return precompile_all()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
