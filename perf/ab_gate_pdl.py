"""The gated forward with and without programmatic dependent launch after the gate's scan, in one process (not a
test).

    python perf/ab_gate_pdl.py [--rounds 5] [--hdims 64 128] [--seqlens 1024 4096 16384]

Issue 24 (gated forward >= 0.9x our plain one; hdim 128 1k read 0.889 on an H100, perf/NOTES.md session 41):
``configs.FWD_GATE_PDL`` off / on alternated round by round (the scan's second pass and the gated forward launched
as programmatic dependents, ``kernels/common/gate_scan.py``), the plain causal forward of the same shape beside them;
bf16, causal, 16k tokens, hidden 2048, ``bench_gate.py``'s gates ``logsigmoid(2 x + 4)``, no grad, do_bench medians
(us) and each one's ratio to the plain call. The setting is switched by patching the flag and forgetting the kept
plans that hold the gated keys (``api.clear_plans``; the gated key and the scan's compiled variant follow the flag).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from triton.testing import do_bench


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    args = ap.parse_args(argv)

    from bench_gate import gated_inputs
    from flashattn_hopper import api, configs, flash_attn_func

    default = configs.FWD_GATE_PDL
    names = {"off": False, "on": True}
    print(f"# gated causal forward, FWD_GATE_PDL off / on, {torch.cuda.get_device_name()}, rounds={args.rounds}; us "
          "(plain / gated)\n")
    print("| hdim | seqlen | plain | off | on | plain / off | plain / on |")
    print("|---|---|---|---|---|---|---|")
    for hdim in args.hdims:
        for seqlen in args.seqlens:
            q, k, v, g = gated_inputs(hdim, seqlen, torch.Generator(device="cuda").manual_seed(0))
            times: dict[str, list[float]] = {"plain": [], **{name: [] for name in names}}
            for r in range(args.rounds):
                times["plain"].append(do_bench(lambda: flash_attn_func(q, k, v, causal=True), warmup=10, rep=50))
                for name in (list(names) if r % 2 == 0 else list(names)[::-1]):
                    configs.FWD_GATE_PDL = names[name]
                    api.clear_plans()
                    times[name].append(do_bench(lambda: flash_attn_func(q, k, v, causal=True, log_decay=g),
                                                warmup=10, rep=50))
            med = {name: 1000 * statistics.median(t) for name, t in times.items()}
            print(f"| {hdim} | {seqlen} | {med['plain']:.1f} | {med['off']:.1f} | {med['on']:.1f} | "
                  f"{med['plain'] / med['off']:.3f} | {med['plain'] / med['on']:.3f} |", flush=True)
    configs.FWD_GATE_PDL = default
    api.clear_plans()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
