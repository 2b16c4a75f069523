"""The gated sm90 forward's skips of decayed work, off and on, in one process (not a test).

    python perf/ab_gate_skip.py [--rounds 3] [--hdims 64 128] [--seqlens 1024 4096 16384] [--shift 4.0]

Issue 24 (gated forward >= 2x FLA's): ``configs.FWD_SM90_GATE_SKIP_ZERO_PV`` ("pv": each MMA warpgroup votes after a
block's softmax and skips the block's P.V where all its P underflowed to 0, ``kernels/sm90/fwd_steps.py``) and
``configs.FWD_SM90_GATE_SKIP_DECAYED`` ("blocks": each tile starts at the first key block the launcher's bound keeps,
``backends/gate_blocks.py``; dense, from ``FWD_SM90_GATE_SKIP_DECAYED_MIN_SEQLEN_K`` keys, lowered to 1024 here):
off / pv / blocks / both alternated round by round, the plain causal forward of the same shape beside them; bf16,
causal, 16k tokens, hidden 2048, MHA, ``g = logsigmoid(2 x + shift)`` with x standard normal (``bench_gate.py``'s
gates at the default shift 4: ~-0.06 per step on average, so keys ~1.5k back are decayed to 0), do_bench medians,
TFLOP/s of the causal forward (the skipped work counted: the same FLOPs as the plain call).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from triton.testing import do_bench


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--shift", type=float, default=4.0)
    args = ap.parse_args(argv)

    from bench_gate import gated_inputs
    from flashattn_hopper import api, configs, flash_attn_func

    gen = torch.Generator(device="cuda").manual_seed(0)
    cells = {}
    for hdim in args.hdims:
        for seqlen in args.seqlens:
            b, h = 16384 // seqlen, 2048 // hdim
            q, k, v, g = gated_inputs(hdim, seqlen, gen, shift=args.shift)
            cells[(hdim, seqlen)] = (q, k, v, g, 4 * b * h * seqlen ** 2 * hdim / 2)

    def forward_ms(q, k, v, g) -> float:
        fn = (lambda: flash_attn_func(q, k, v, causal=True, log_decay=g))
        fn()
        return do_bench(fn, warmup=25, rep=100)

    defaults = (configs.FWD_SM90_GATE_SKIP_ZERO_PV, configs.FWD_SM90_GATE_SKIP_DECAYED,
                configs.FWD_SM90_GATE_SKIP_DECAYED_MIN_SEQLEN_K)
    configs.FWD_SM90_GATE_SKIP_DECAYED_MIN_SEQLEN_K = 1024
    settings = {"off": (False, False), "pv": (True, False), "blocks": (False, True), "both": (True, True)}
    names = list(settings)
    times: dict[tuple, list[float]] = {}
    for r in range(args.rounds):
        for cell, (q, k, v, _, _) in cells.items():
            times.setdefault((cell, "plain"), []).append(forward_ms(q, k, v, None))
        for name in names[r % len(names):] + names[:r % len(names)]:
            configs.FWD_SM90_GATE_SKIP_ZERO_PV, configs.FWD_SM90_GATE_SKIP_DECAYED = settings[name]
            api.clear_plans()  # (the kept plans hold the gated keys)
            for cell, (q, k, v, g, _) in cells.items():
                times.setdefault((cell, name), []).append(forward_ms(q, k, v, g))
    (configs.FWD_SM90_GATE_SKIP_ZERO_PV, configs.FWD_SM90_GATE_SKIP_DECAYED,
     configs.FWD_SM90_GATE_SKIP_DECAYED_MIN_SEQLEN_K) = defaults
    api.clear_plans()
    print(f"# gated causal forward, skips of decayed work off / pv / blocks / both, "
          f"g = logsigmoid(2 x + {args.shift}), {torch.cuda.get_device_name()}, rounds={args.rounds}; "
          "TFLOP/s at the plain call's FLOPs (gated / plain)\n")
    print("| hdim | seqlen | plain | " + " | ".join(names) + " |\n|---|---|---|" + "---|" * len(names))
    for cell, (*_, flops) in cells.items():
        tf = {name: flops / statistics.median(times[(cell, name)]) / 1e9 for name in ["plain", *names]}
        row = [f"{tf[n]:.0f} ({tf[n] / tf['plain']:.3f})" for n in names]
        print(f"| {cell[0]} | {cell[1]} | {tf['plain']:.0f} | " + " | ".join(row) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
