"""The gated call's per-call passes, in one process: settings A/B'd against each other (not a test).

    python perf/ab_gate_slice.py [--hdims 64 128] [--seqlens 1024 2048 4096 16384] [--rounds 3] [--compile-only]
                                 [--grad]

Issue 24: times ``flash_attn_func(..., causal=True, log_decay=g)`` (no grad unless ``--grad``; bf16, 16k tokens, hidden 2048,
``logsigmoid`` of N(4, 2) gates as ``bench_gate.py``) under three settings, interleaved round by round in one
process so the power cap's drift reaches all alike: ``rows`` (no slice at any length: the fp32 bias rows added per
score), ``slice_4k`` (K's k16 slice from 4096 keys), ``slice_1k`` (from 1024 keys, the default), beside the plain
causal call. Where the scan kernel serves the call (``gate.SCAN_KERNEL``) it builds the slice; else Triton or torch
ops do (``sm90_fwd._has_triton``, patched on here). The settings are switched by patching
``configs.FWD_SM90_GATE_SLICE_MIN_SEQLEN_K`` and forgetting the kept plans and the problem memos that hold the
gated keys and the scan's variant (``api.clear_plans``, ``sm90_fwd._GATE_SCAN_ARGS``).
``--grad``: forward + backward (``autograd.grad`` to q,
k, v and g; the plain call's to q, k, v), not the forward alone.
Prints a Markdown table of do_bench medians (us) and each setting's ratio to the plain call.
``--compile-only``: one call per setting, nothing timed (run cells in parallel processes to fill the cache).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from triton.testing import do_bench

SETTINGS = {"rows": (True, 1 << 30), "slice_4k": (True, 4096), "slice_1k": (True, 1024)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 16384])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--grad", action="store_true")
    args = ap.parse_args(argv)

    from bench_gate import gated_inputs
    from flashattn_hopper import api, configs, flash_attn_func
    from flashattn_hopper.backends import sm90_fwd

    def use(setting: str) -> None:
        triton_on, min_keys = SETTINGS[setting]
        sm90_fwd._has_triton = (lambda: True) if triton_on else (lambda: False)
        configs.FWD_SM90_GATE_SLICE_MIN_SEQLEN_K = min_keys
        api.clear_plans()  # (the kept plans hold the gated keys, _GATE_SCAN_ARGS the scan's slice choice per problem)
        sm90_fwd._GATE_SCAN_ARGS.clear()

    if not args.compile_only:
        print(f"# gated forward's slice settings, {torch.cuda.get_device_name()}, rounds={args.rounds}\n")
        print("| hdim | seqlen | plain | " + " | ".join(SETTINGS) + " | " + " | ".join(f"plain / {s}" for s in SETTINGS) + " |")
        print("|---|---|---|" + "---|" * (2 * len(SETTINGS)))
    for hdim in args.hdims:
        for seqlen in args.seqlens:
            q, k, v, g = gated_inputs(hdim, seqlen, torch.Generator(device="cuda").manual_seed(0))
            if args.grad:
                q, k, v, g = (t.requires_grad_() for t in (q, k, v, g))
                dout = torch.randn_like(q)

                def plain():
                    return torch.autograd.grad(flash_attn_func(q, k, v, causal=True), (q, k, v), dout)

                def gated():
                    return torch.autograd.grad(flash_attn_func(q, k, v, causal=True, log_decay=g), (q, k, v, g), dout)
            else:
                def plain():
                    return flash_attn_func(q, k, v, causal=True)

                def gated():
                    return flash_attn_func(q, k, v, causal=True, log_decay=g)
            calls = {"plain": (None, plain)}
            for setting in SETTINGS:
                calls[setting] = (setting, gated)
            for setting, fn in calls.values():
                if setting is not None:
                    use(setting)
                fn()
            torch.cuda.synchronize()
            if args.compile_only:
                continue
            times: dict[str, list[float]] = {name: [] for name in calls}
            for _ in range(args.rounds):
                for name, (setting, fn) in calls.items():
                    if setting is not None:
                        use(setting)
                    times[name].append(do_bench(fn, warmup=25, rep=200) * 1e3)
            med = {name: statistics.median(t) for name, t in times.items()}
            print(f"| {hdim} | {seqlen} | " + " | ".join(f"{med[n]:.1f}" for n in calls) + " | "
                  + " | ".join(f"{med['plain'] / med[s]:.3f}" for s in SETTINGS) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
