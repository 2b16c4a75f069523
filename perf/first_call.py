"""First-call latency of the JIT path: a cold compile, then a fresh process that loads from the disk cache.

    python perf/first_call.py [--hdim 128] [--causal]

Runs itself twice in child processes against a private, empty cache directory and prints, for each,
how long the first ``flash_attn_func`` call took (compile or disk load included) and where the time
went, plus the steady-state host overhead of one call on a tiny problem (launch path, not the kernel).
Needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def child(hdim: int, causal: bool) -> dict:
    t0 = time.perf_counter()
    import torch

    q, k, v = (torch.randn(2, 1024, 16, hdim, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    import cutlass.cute  # noqa: F401  (the DSL import is part of every process's first call)

    from flashattn_hopper import flash_attn_func
    from flashattn_hopper.jit import compile_cache

    t2 = time.perf_counter()
    flash_attn_func(q, k, v, causal=causal)
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    tiny = [t[:, :16, :2].contiguous() for t in (q, k, v)]
    for _ in range(20):
        flash_attn_func(*tiny, causal=causal)
    torch.cuda.synchronize()
    n = 200
    t4 = time.perf_counter()
    for _ in range(n):
        flash_attn_func(*tiny, causal=causal)
    torch.cuda.synchronize()
    per_call_us = (time.perf_counter() - t4) / n * 1e6
    events = compile_cache.stats.events
    return {
        "gpu": torch.cuda.get_device_name(),
        "torch_and_inputs_s": t1 - t0,
        "dsl_and_package_import_s": t2 - t1,
        "first_call_s": t3 - t2,
        "kernel_source": events[0][1] if events else "memory",
        "compile_or_load_s": events[0][2] if events else 0.0,
        "steady_call_us": per_call_us,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hdim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.hdim, args.causal)))
        return 0
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, FLASHATTN_HOPPER_CACHE_DIR=cache, FLASHATTN_HOPPER_CACHE="1")
        cmd = [sys.executable, __file__, "--child", "--hdim", str(args.hdim)] + (["--causal"] if args.causal else [])
        rows = []
        for label in ("cold (empty cache)", "warm (disk cache)"):
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            rows.append((label, json.loads(out.strip().splitlines()[-1])))
    print(f"GPU: {rows[0][1]['gpu']}; hdim {args.hdim}, {'causal' if args.causal else 'non-causal'}, bf16")
    print(f"{'process':20} {'DSL+pkg import':>15} {'first call':>11} {'source':>8} {'compile/load':>13} {'steady call':>12}")
    for label, r in rows:
        print(f"{label:20} {r['dsl_and_package_import_s']:14.2f}s {r['first_call_s']:10.2f}s {r['kernel_source']:>8} "
              f"{r['compile_or_load_s']:12.2f}s {r['steady_call_us']:10.1f}us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
