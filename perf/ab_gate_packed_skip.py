"""Packed self-attention's skips of decayed work, off and on, in one process (not a test).

    python perf/ab_gate_packed_skip.py [--rounds 3] [--hdims 64 128] [--seqlens 1024 4096 16384] [--shift 4.0]

Issue 24: ``configs.GATE_SKIP_DECAYED_VARLEN`` (the forward's and the backward's live-block tables a row per
sequence, ``backends/gate_blocks.py``) off and on, alternated round by round, the plain packed call beside them:
``flash_attn_varlen_func`` over 16k tokens of equal sequences (one cu_seqlens for q and k, ``max_seqlen`` an int),
hidden 2048, bf16, causal, MHA, ``bench_gate.py``'s gates ``g = logsigmoid(2 x + shift)``. The forward alone and the
backward alone (``torch.autograd.grad`` of a retained graph), do_bench medians, TFLOP/s at the plain call's FLOPs
(the causal forward's; 2.5x for the backward). The skips take sequences from their min lengths (4096 keys).
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
    from flashattn_hopper import api, configs, flash_attn_varlen_func
    from flashattn_hopper.backends import sm80_bwd

    gen = torch.Generator(device="cuda").manual_seed(0)
    cells = {}
    for hdim in args.hdims:
        for seqlen in args.seqlens:
            b, h = 16384 // seqlen, 2048 // hdim
            # (packed: the dense draws' rows, the same values in the same order)
            q, k, v, dout, g = (t.flatten(0, 1).requires_grad_()
                                for t in gated_inputs(hdim, seqlen, gen, tensors=4, shift=args.shift))
            cu = torch.arange(0, b * seqlen + 1, seqlen, dtype=torch.int32, device="cuda")
            cells[(hdim, seqlen)] = (q, k, v, g, dout, cu, seqlen, 4 * b * h * seqlen ** 2 * hdim / 2)

    def times_ms(q, k, v, g, dout, cu, seqlen) -> tuple[float, float]:
        def forward():
            return flash_attn_varlen_func(q, k, v, cu, cu, seqlen, seqlen, causal=True,
                                          **({} if g is None else {"log_decay": g}))
        out = forward()
        inputs = (q, k, v) if g is None else (q, k, v, g)
        backward = (lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True))
        backward()
        return do_bench(forward, warmup=10, rep=60), do_bench(backward, warmup=10, rep=60)

    default = configs.GATE_SKIP_DECAYED_VARLEN
    names = ["off", "on"]
    times: dict[tuple, list[tuple[float, float]]] = {}
    for r in range(args.rounds):
        for cell, (q, k, v, _, dout, cu, seqlen, _) in cells.items():
            times.setdefault((cell, "plain"), []).append(times_ms(q, k, v, None, dout, cu, seqlen))
        for name in (names if r % 2 == 0 else names[::-1]):
            configs.GATE_SKIP_DECAYED_VARLEN = name == "on"
            api.clear_plans()  # (the kept plans hold the gated keys)
            sm80_bwd._PLAN_MEMO.clear()
            for cell, (q, k, v, g, dout, cu, seqlen, _) in cells.items():
                times.setdefault((cell, name), []).append(times_ms(q, k, v, g, dout, cu, seqlen))
    configs.GATE_SKIP_DECAYED_VARLEN = default
    api.clear_plans()
    sm80_bwd._PLAN_MEMO.clear()
    print(f"# packed gated causal calls, skips of decayed work off / on (GATE_SKIP_DECAYED_VARLEN), "
          f"g = logsigmoid(2 x + {args.shift}), {torch.cuda.get_device_name()}, rounds={args.rounds}; TFLOP/s at "
          "the plain call's FLOPs (gated / plain)\n")
    print("| hdim | seqlen | fwd plain | fwd off | fwd on | bwd plain | bwd off | bwd on |")
    print("|---|---|---|---|---|---|---|---|")
    for cell, (*_, flops) in cells.items():
        row = []
        for part, scale in ((0, 1.0), (1, 2.5)):
            tf = {name: scale * flops / statistics.median(t[part] for t in times[(cell, name)]) / 1e9
                  for name in ["plain", *names]}
            row += [f"{tf['plain']:.0f}"] + [f"{tf[n]:.0f} ({tf[n] / tf['plain']:.3f})" for n in names]
        print(f"| {cell[0]} | {cell[1]} | " + " | ".join(row) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
