"""Compile ``bench_bwd.py --tiles`` candidates into the disk cache in parallel processes (not a benchmark).

    python perf/precompile_tiles.py [--jobs 8] SPEC [SPEC ...]

``bench_bwd.py`` compiles each tile column's keys one at a time in its process when it first reaches them;
on the 16-core GPU machines the same keys compile several at once here first (one process per spec and
causal flag, a tiny MHA shape of the benchmark's heads), so a tile A/B spends its call's minutes timing.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor


def compile_one(spec: str, causal: bool) -> str:
    import torch

    from bench_bwd import parse_tile, tile_column

    hdim, family = parse_tile(spec)
    q, k, v, dout = (torch.randn(1, 256, 2048 // hdim, hdim, dtype=torch.bfloat16, device="cuda") for _ in range(4))
    tile_column(family, q, k, v, dout, causal, False)()
    torch.cuda.synchronize()
    return f"{spec} causal={causal}: compiled"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("specs", nargs="+")
    args = ap.parse_args(argv)
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for line in pool.map(compile_one, *zip(*[(s, c) for s in args.specs for c in (False, True)])):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
