"""The in-kernel learnable sink against the plain call, many rounds in one process (not a test).

    python perf/ab_sink.py [--rounds 9] [--hdims 64 128] [--seqlens 1024 4096 16384]

Issue 24 asks the call with sinks on to run within 3 % of the same call without. ``bench_gate.py``'s table times
each system three times per cell among eight systems, and its plain and in-kernel sink columns drift apart by up to
+-5 % from cell to cell (perf/NOTES.md session 40: 0.96 at 4k, 1.05 at hdim 128 16k): here only the two are timed,
alternated round by round (the order flipped every round), forward alone and forward + backward (``autograd.grad``
to q, k, v and the sink; the plain call's to q, k, v). bf16, causal, 16k tokens, hidden 2048, MHA, sink logits N(0, 1);
do_bench medians over rounds, TFLOP/s of the causal forward (backward 2.5x), and the sink / plain ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from triton.testing import do_bench


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    args = ap.parse_args(argv)

    from flashattn_hopper import flash_attn_func

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for hdim in args.hdims:
        for seqlen in args.seqlens:
            b, h = 16384 // seqlen, 2048 // hdim
            q, k, v, dout = (torch.randn(b, seqlen, h, hdim, dtype=torch.bfloat16, device="cuda", generator=gen,
                                         requires_grad=True) for _ in range(4))
            sink = torch.randn(h, device="cuda", generator=gen, requires_grad=True)
            flops = 4 * b * h * seqlen ** 2 * hdim / 2
            calls = {"plain": lambda: flash_attn_func(q, k, v, causal=True),
                     "sink": lambda: flash_attn_func(q, k, v, causal=True, learnable_sink=sink)}
            inputs = {"plain": (q, k, v), "sink": (q, k, v, sink)}
            times: dict[tuple[str, str], list[float]] = {}
            for r in range(args.rounds):
                for name in (("plain", "sink") if r % 2 == 0 else ("sink", "plain")):
                    fn = calls[name]
                    times.setdefault((name, "fwd"), []).append(do_bench(fn, warmup=10, rep=50))
                    out = fn()
                    grad = (lambda out=out, name=name: torch.autograd.grad(out, inputs[name], dout,
                                                                           retain_graph=True))
                    times.setdefault((name, "bwd"), []).append(do_bench(grad, warmup=10, rep=50))
            tf = {key: (2.5 if key[1] == "bwd" else 1.0) * flops / statistics.median(ms) / 1e9
                  for key, ms in times.items()}
            rows.append(f"| {hdim} | {seqlen} | {tf['plain', 'fwd']:.0f} | {tf['sink', 'fwd']:.0f} | "
                        f"{tf['sink', 'fwd'] / tf['plain', 'fwd']:.3f} | {tf['plain', 'bwd']:.0f} | "
                        f"{tf['sink', 'bwd']:.0f} | {tf['sink', 'bwd'] / tf['plain', 'bwd']:.3f} |")
    print(f"# in-kernel sink vs plain, causal, {torch.cuda.get_device_name()}, rounds={args.rounds}; TFLOP/s\n")
    print("| hdim | seqlen | fwd plain | fwd sink | sink / plain | bwd plain | bwd sink | sink / plain |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
