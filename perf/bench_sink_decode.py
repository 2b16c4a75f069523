"""Learnable sink at GQA decode shapes: which forward route to take (not a test).

    python perf/bench_sink_decode.py

bf16, hdim 128, the shapes of ``bench_pack_gqa.py``. Columns (microseconds, do_bench medians):
``plain`` our forward without a sink (packs the query heads of a KV head into one tile at these
shapes); ``join`` the sink joined after that kernel (``sinks.IN_KERNEL`` off); ``in_kernel`` the sink
in the finalize of a kernel that cannot pack (``IN_KERNEL_UNPACKED``); ``default`` what the API does
(``forward_with_sink`` declines where its key would not pack: the join).
"""

from __future__ import annotations

import sys

import torch


def main() -> int:
    from triton.testing import do_bench

    from flashattn_hopper import flash_attn_func, sinks

    routes = {"join": (False, False), "in_kernel": (True, True), "default": (True, False)}
    print(f"# sink at GQA decode shapes, bf16, hdim 128, {torch.cuda.get_device_name()}\n")
    print("| batch | seqlen_q | seqlen_k | h / h_k | causal | plain us | join us | in_kernel us | default us |")
    print("|---|---|---|---|---|---|---|---|---|")
    for batch, s_q, s_k, h, h_k, causal in [
        (64, 1, 4096, 32, 4, False), (16, 1, 8192, 32, 8, False), (8, 64, 8192, 32, 4, True),
        (4, 128, 4096, 32, 8, True), (2, 2048, 2048, 32, 8, True),
    ]:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(batch, s_q, h, 128, dtype=torch.bfloat16, device="cuda", generator=gen)
        k, v = (torch.randn(batch, s_k, h_k, 128, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(2))
        sink = torch.randn(h, device="cuda", generator=gen)
        times = {"plain": do_bench(lambda: flash_attn_func(q, k, v, causal=causal), warmup=25, rep=100,
                                   return_mode="median") * 1e3}
        outs = {}
        for name, (on, unpacked) in routes.items():
            sinks.IN_KERNEL, sinks.IN_KERNEL_UNPACKED = on, unpacked
            fn = lambda: flash_attn_func(q, k, v, causal=causal, learnable_sink=sink)  # noqa: E731
            outs[name] = fn()
            times[name] = do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
        sinks.IN_KERNEL, sinks.IN_KERNEL_UNPACKED = True, False
        assert (outs["join"].float() - outs["in_kernel"].float()).abs().max().item() < 2e-2
        print(f"| {batch} | {s_q} | {s_k} | {h}/{h_k} | {'on' if causal else 'off'} | "
              + " | ".join(f"{times[c]:.1f}" for c in ("plain", "join", "in_kernel", "default")) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
