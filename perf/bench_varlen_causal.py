"""Causal varlen forward timing (not a test): packed sequences of mixed lengths, 16k tokens.

    python perf/bench_varlen_causal.py [--hdims 64 128 256] [--reps 5] [--label NAME]

Used to compare two builds of the package in one session (run it alternately from each, the
package on PYTHONPATH): bf16, nheads * hdim = 2048, total 16k tokens per call, causal. Per cell:
the median over ``--reps`` windows of 20 back-to-back calls timed with CUDA events (after a
warm-up window), in ms per call and TFLOP/s counting the causal half of each sequence's square.
Prints one Markdown row per cell prefixed by ``--label``.
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

from flashattn_hopper import flash_attn_varlen_func

TOTAL = 16384
MIXES = {
    "8x2048": [2048] * 8,
    "2x8192": [8192] * 2,
    "mixed": None,  # random lengths 1..4096 (seed 0) filling 16k tokens
}


def lengths(mix: str) -> list[int]:
    if MIXES[mix] is not None:
        return MIXES[mix]
    rng, lens = random.Random(0), []
    while sum(lens) < TOTAL:
        lens.append(min(rng.randint(1, 4096), TOTAL - sum(lens)))
    return lens


def time_cell(hdim: int, mix: str, reps: int) -> tuple[float, float]:
    lens = lengths(mix)
    nheads = 2048 // hdim
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(TOTAL, nheads, hdim, dtype=torch.bfloat16, device="cuda") for _ in range(3))

    def call() -> None:
        flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)

    def window() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 20

    window()  # compile / load, warm-up
    ms = statistics.median(window() for _ in range(reps))
    flops = sum(4 * n * n * nheads * hdim / 2 for n in lens)
    return ms, flops / (ms * 1e-3) / 1e12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--label", default="ours")
    args = ap.parse_args()
    for hdim in args.hdims:
        for mix in MIXES:
            ms, tflops = time_cell(hdim, mix, args.reps)
            print(f"| {args.label} | {hdim} | {mix} | {ms:.3f} | {tflops:.1f} |", flush=True)


if __name__ == "__main__":
    main()
