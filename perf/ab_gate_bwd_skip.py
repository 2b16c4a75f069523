"""The gated sm90 backward's skip of decayed query blocks, off and on, in one process (not a test).

    python perf/ab_gate_bwd_skip.py [--rounds 3] [--hdims 64 128] [--seqlens 4096 8192 16384] [--shift 4.0]

Issue 24: ``configs.BWD_SM90_GATE_SKIP_DECAYED`` (each key block's CTA stops at the last query block whose P the
launcher's bound cannot rule out, ``backends/gate_blocks.last_live_rows``; dense causal, from
``BWD_SM90_GATE_SKIP_DECAYED_MIN_SEQLEN_K`` keys, lowered to 1024 here) off and on, alternated round by round, the
plain causal backward of the same shape beside them; bf16, 16k tokens, hidden 2048, MHA, ``bench_gate.py``'s gates
``g = logsigmoid(2 x + shift)`` (x standard normal). The backward alone: ``torch.autograd.grad`` of a retained graph
(q, k, v and g), do_bench medians; TFLOP/s at the plain backward's FLOPs (2.5x the causal forward's).
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
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--shift", type=float, default=4.0)
    args = ap.parse_args(argv)

    from bench_gate import gated_inputs
    from flashattn_hopper import configs, flash_attn_func
    from flashattn_hopper.backends import sm80_bwd

    gen = torch.Generator(device="cuda").manual_seed(0)
    cells = {}
    for hdim in args.hdims:
        for seqlen in args.seqlens:
            b, h = 16384 // seqlen, 2048 // hdim
            q, k, v, dout, g = gated_inputs(hdim, seqlen, gen, tensors=4, shift=args.shift)
            q, k, v, dout, g = (t.requires_grad_() for t in (q, k, v, dout, g))
            cells[(hdim, seqlen)] = (q, k, v, g, dout, 2.5 * 4 * b * h * seqlen ** 2 * hdim / 2)

    def backward_ms(q, k, v, g, dout) -> float:
        out = flash_attn_func(q, k, v, causal=True, **({} if g is None else {"log_decay": g}))
        inputs = (q, k, v) if g is None else (q, k, v, g)
        fn = (lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True))
        fn()
        return do_bench(fn, warmup=10, rep=60)

    defaults = configs.BWD_SM90_GATE_SKIP_DECAYED, configs.BWD_SM90_GATE_SKIP_DECAYED_MIN_SEQLEN_K
    configs.BWD_SM90_GATE_SKIP_DECAYED_MIN_SEQLEN_K = 1024
    names = ["off", "on"]
    times: dict[tuple, list[float]] = {}
    for r in range(args.rounds):
        for cell, (q, k, v, _, dout, _) in cells.items():
            times.setdefault((cell, "plain"), []).append(backward_ms(q, k, v, None, dout))
        for name in (names if r % 2 == 0 else names[::-1]):
            configs.BWD_SM90_GATE_SKIP_DECAYED = name == "on"
            sm80_bwd._PLAN_MEMO.clear()  # (the kept backward plans hold the gated keys)
            for cell, (q, k, v, g, dout, _) in cells.items():
                times.setdefault((cell, name), []).append(backward_ms(q, k, v, g, dout))
    configs.BWD_SM90_GATE_SKIP_DECAYED, configs.BWD_SM90_GATE_SKIP_DECAYED_MIN_SEQLEN_K = defaults
    sm80_bwd._PLAN_MEMO.clear()
    print(f"# gated causal backward, skip of decayed query blocks off / on, g = logsigmoid(2 x + {args.shift}), "
          f"{torch.cuda.get_device_name()}, rounds={args.rounds}; TFLOP/s at the plain backward's FLOPs "
          "(gated / plain)\n")
    print("| hdim | seqlen | plain | off | on | on / off |\n|---|---|---|---|---|---|")
    for cell, (*_, flops) in cells.items():
        tf = {name: flops / statistics.median(times[(cell, name)]) / 1e9 for name in ["plain", *names]}
        print(f"| {cell[0]} | {cell[1]} | {tf['plain']:.0f} | {tf['off']:.0f} ({tf['off'] / tf['plain']:.3f}) | "
              f"{tf['on']:.0f} ({tf['on'] / tf['plain']:.3f}) | {tf['on'] / tf['off']:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
