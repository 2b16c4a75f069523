"""The gated sm90 backward's dG sums: the threads' adds and shuffles against WGMMAs with tiles of ones (not a test).

    python perf/ab_gate_sums.py [--rounds 3] [--hdims 64 128] [--seqlens 1024 2048 4096 16384]

Issue 24 (gated backward >= 0.9x our plain one): ``configs.BWD_SM90_GATE_KEY_MMA`` / ``BWD_SM90_GATE_QUERY_MMA``
(``kernels/sm90/bwd_gate.py``): off / key / query / both (at hdim 128 "both" is "query": the two together serialize
its WGMMAs, so the key builder drops the key half there), with the plain causal backward of the same shape beside
them, in one process, the settings alternated round by round. bf16, causal, 16k tokens, hidden 2048, MHA; the
backward of a retained graph (q, k, v and g), do_bench medians, TFLOP/s at 2.5x the forward's causal FLOPs.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from triton.testing import do_bench

SETTINGS = {"off": (False, False), "key": (True, False), "query": (False, True), "both": (True, True)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 16384])
    args = ap.parse_args(argv)

    from bench_gate import gated_inputs
    from flashattn_hopper import api, configs, flash_attn_func
    from flashattn_hopper.backends import sm80_bwd

    gen = torch.Generator(device="cuda").manual_seed(0)
    cells = {}
    for hdim in args.hdims:
        for seqlen in args.seqlens:
            b, h = 16384 // seqlen, 2048 // hdim
            q, k, v, dout, g = gated_inputs(hdim, seqlen, gen, tensors=4)
            leaves = [t.requires_grad_() for t in (q, k, v, g)]
            cells[(hdim, seqlen)] = (leaves, dout, 2.5 * 4 * b * h * seqlen ** 2 * hdim / 2)

    def backward_ms(leaves, dout, gated: bool) -> float:
        out = flash_attn_func(*leaves[:3], causal=True, log_decay=leaves[3] if gated else None)
        inputs = leaves if gated else leaves[:3]
        torch.autograd.grad(out, inputs, dout, retain_graph=True)
        return do_bench(lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True), warmup=25, rep=100)

    times: dict[tuple, list[float]] = {}
    names = list(SETTINGS)
    defaults = configs.BWD_SM90_GATE_KEY_MMA, configs.BWD_SM90_GATE_QUERY_MMA
    for r in range(args.rounds):
        for cell, (leaves, dout, _) in cells.items():
            times.setdefault((cell, "plain"), []).append(backward_ms(leaves, dout, False))
        for name in names[r % len(names):] + names[:r % len(names)]:
            configs.BWD_SM90_GATE_KEY_MMA, configs.BWD_SM90_GATE_QUERY_MMA = SETTINGS[name]
            sm80_bwd._PLAN_MEMO.clear()  # (the backward plans hold the keys)
            api.clear_plans()
            for cell, (leaves, dout, _) in cells.items():
                times.setdefault((cell, name), []).append(backward_ms(leaves, dout, True))
    configs.BWD_SM90_GATE_KEY_MMA, configs.BWD_SM90_GATE_QUERY_MMA = defaults
    print(f"# gated causal backward, dG sums by the threads (off) or by WGMMA (key / query / both), "
          f"{torch.cuda.get_device_name()}, rounds={args.rounds}; TFLOP/s (gated / plain)\n")
    print("| hdim | seqlen | plain | " + " | ".join(names) + " |\n|---|---|---|" + "---|" * len(names))
    for cell, (_, _, flops) in cells.items():
        tf = {name: flops / statistics.median(times[(cell, name)]) / 1e9 for name in ["plain", *names]}
        row = [f"{tf['plain']:.0f}"] + [f"{tf[n]:.0f} ({tf[n] / tf['plain']:.3f})" for n in names]
        print(f"| {cell[0]} | {cell[1]} | " + " | ".join(row) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
