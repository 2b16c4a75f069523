"""The main job: the perf sweep on a GPU; on a machine without one, compile and report every kernel.

    python perf/run.py [sweep options...]

With a CUDA GPU this is ``python -m flashattn_hopper sweep`` (options pass through, e.g. ``--quick``).
Without one it says so, then runs ``python -m flashattn_hopper precompile`` for each target arch
(sm90, then sm80), which fills the disk cache and prints one line per kernel.
"""

from __future__ import annotations

import subprocess
import sys


def main(argv: list[str]) -> int:
    import torch

    if torch.cuda.is_available() or "-h" in argv or "--help" in argv:
        from flashattn_hopper.cli import main as cli_main

        return cli_main(["sweep", *argv])
    print(
        "No CUDA GPU found (torch.cuda.is_available() is False): the perf sweep needs one.\n"
        "Doing the CPU part instead: compiling every kernel for sm90 and sm80 into the disk cache "
        "(GPU nodes sharing that cache directory will load them instead of compiling).",
        flush=True,
    )
    status = 0
    for arch in ("sm90", "sm80"):
        print(f"\n== precompile --arch {arch}", flush=True)
        # One process per arch: the CuTe DSL fixes its target arch when it is first imported.
        status |= subprocess.call([sys.executable, "-m", "flashattn_hopper", "precompile", "--arch", arch])
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
