"""Host time of the gated forward with and without its kept plan, in one process (not a test).

    python perf/ab_gate_plan.py [--rounds 5] [--calls 1000]

Issue 24: ``forward_with_gate``'s ``GatePlan`` (``flashattn_hopper/backends/sm90_fwd.py``) against the
general launch (``gate_plan`` patched to None), alternated round by round in one process, so that host
speed, which varies 1.5-2x between processes on the GPU nodes (perf/NOTES.md session 28), reaches both
alike. Per setting: us per call of ``flash_attn_func(..., causal=True, log_decay=g)`` over ``--calls``
back-to-back calls of a tiny shape (1 x 128 x 8 x 128 bf16: host-bound; CUDA events around the calls),
and do_bench wall of the 1k-key causal cell (16 x 1024 x 16 x 128) as in ``ab_gate_slice.py``. Medians.
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
    ap.add_argument("--calls", type=int, default=1000)
    args = ap.parse_args(argv)

    from flashattn_hopper import flash_attn_func
    from flashattn_hopper.backends import sm90_fwd

    planned = sm90_fwd.FwdSm90.gate_plan

    def use(setting: str) -> None:
        sm90_fwd._GATE_PLANS.clear()
        sm90_fwd.FwdSm90.gate_plan = planned if setting == "plan" else (lambda self, q, p, key: None)

    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = {"tiny": (1, 128, 8, 128), "h128_1k": (16, 1024, 16, 128), "h64_1k": (16, 1024, 32, 64)}
    inputs = {}
    for name, (b, s, h, d) in shapes.items():
        q, k, v = (torch.randn(b, s, h, d, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(3))
        g = torch.nn.functional.logsigmoid(torch.randn(b, s, h, device="cuda", generator=gen) * 2 + 4)
        inputs[name] = (q, k, v, g)

    def call(name: str) -> torch.Tensor:
        q, k, v, g = inputs[name]
        return flash_attn_func(q, k, v, causal=True, log_decay=g)

    def per_call_us(name: str) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(args.calls):
            call(name)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / args.calls

    settings = ("general", "plan")
    times: dict[tuple[str, str], list[float]] = {}
    for setting in settings:
        use(setting)
        for name in shapes:
            call(name)
    for _ in range(args.rounds):
        for setting in settings:
            use(setting)
            for name in shapes:
                call(name)
                t = per_call_us(name) if name == "tiny" else do_bench(lambda: call(name), warmup=25, rep=200) * 1e3
                times.setdefault((setting, name), []).append(t)
    print(f"# gated forward with / without its plan, {torch.cuda.get_device_name()}, rounds={args.rounds}\n")
    print("| cell | general us | plan us | plan / general |\n|---|---|---|---|")
    for name in shapes:
        g_med, p_med = (statistics.median(times[(s, name)]) for s in settings)
        label = "tiny (us per call, host)" if name == "tiny" else f"{name} (do_bench wall)"
        print(f"| {label} | {g_med:.1f} | {p_med:.1f} | {p_med / g_med:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
