"""Kernel time per backward call of our sm90 backward, by kernel, under torch.profiler (not a test).

    python perf/prof_bwd.py [--hdims 64 128] [--seqlens 1024 4096 16384] [--causal off on]
                            [--group G] [--calls 20] [--sustained SECONDS] [--peer fa4] [--warm SECONDS]

Prints one line per shape: the sum of all kernels' time per call and the main kernel's (the longest);
``--sustained``: also the wall time per call, joules, watts and SM clock over SECONDS of back-to-back calls
(``ab_trees.py --metric sustained``): at the power cap a change's effect on energy per FLOP shows there, not
in the profiler's short burst. ``--peer fa4``: FA4's backward of the same call too (benchmark-only wheels, as
``bench_bwd.py``), with every kernel's time per call for both and the wall time per call under the profiler
(CUDA events), so kernels and the gaps between them compare; ``--warm``: SECONDS of back-to-back calls just before
the profiled ones (the GPU then at its power cap and steady clock, as in the bench, not in a cold burst).
It is how source trees are compared (perf/NOTES.md, sessions 24-25): once per tree on the same GPU
machine in one call, the trees alternated over a few rounds, which ``perf/ab_trees.py`` does:

    python perf/ab_trees.py --tree base=. --tree new=.device/new -- perf/prof_bwd.py --hdims 64 128

(a tree that is not the installed checkout must be first on the path with the editable install's finder
out of the way, or the package not installed). Unlike ``bench_bwd.py``'s wall-clock medians it reads the
kernels' own durations, so the host's Python time (which varies up to 2x between hosts) does not enter.
The main kernel's duration includes its PDL wait for the preprocess (it launches while the preprocess runs):
fine between our trees, not against a peer that launches plainly. Sizes as in the FA3 paper: bf16, 16k tokens, nheads * hdim = 2048, ``--group`` query heads per kv head.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from flashattn_hopper import flash_attn_func


def kernel_times(fn, calls: int, warm: float = 0.0) -> tuple[list[tuple[float, str]], float]:
    """((us per call, kernel name) of every kernel ``fn`` launches, longest first; wall us per call under the
    profiler). ``warm``: seconds of back-to-back calls first."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    while time.perf_counter() - start < warm:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        begin.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
    rows = [(e.device_time_total / calls, e.key) for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, reverse=True), begin.elapsed_time(end) * 1000 / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--causal", choices=["off", "on"], nargs="+", default=["off", "on"])
    ap.add_argument("--group", type=int, default=1, help="query heads per kv head")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--peer", choices=["fa4"], default=None, help="also FA4's backward, every kernel listed")
    ap.add_argument("--warm", type=float, default=0.0, help="seconds of back-to-back calls before profiling")
    ap.add_argument("--sustained", type=float, default=0.0,
                    help="also SECONDS of back-to-back calls per shape: wall us per call, joules, SM clock "
                         "(from 4k the H100 backward runs at its power cap, where the profiler's 20 calls are too short)")
    args = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()}, bf16, group {args.group}, {args.calls} calls per shape")
    for hdim in args.hdims:
        for seqlen in args.seqlens:
            for causal in (c == "on" for c in args.causal):
                batch, nheads = max(16384 // seqlen, 1), 2048 // hdim
                torch.manual_seed(0)
                q, dout = (torch.randn(batch, seqlen, nheads, hdim, dtype=torch.bfloat16, device="cuda")
                           for _ in range(2))
                k, v = (torch.randn(batch, seqlen, nheads // args.group, hdim, dtype=torch.bfloat16, device="cuda")
                        for _ in range(2))
                leaves = tuple(t.requires_grad_() for t in (q, k, v))
                out = flash_attn_func(*leaves, causal=causal, backend="sm90")
                def fn():
                    return torch.autograd.grad(out, leaves, dout, retain_graph=True)

                rows, wall = kernel_times(fn, args.calls, args.warm)
                if args.peer == "fa4":
                    from bench_bwd import fa4_func

                    fa4 = fa4_func()
                    peer_out = fa4(*leaves, causal=causal)
                    peer_out = peer_out[0] if isinstance(peer_out, tuple) else peer_out

                    def peer_fn():
                        return torch.autograd.grad(peer_out, leaves, dout, retain_graph=True)

                    for name, (kernels, per_call) in (("ours", (rows, wall)), ("fa4", kernel_times(peer_fn, args.calls,
                                                                                                   args.warm))):
                        listed = ", ".join(f"{t:.1f} {k[:40]}" for t, k in kernels)
                        print(f"  {name}: wall {per_call:.1f} us/call, kernels {sum(t for t, _ in kernels):.1f}: {listed}")
                sustained = ""
                if args.sustained > 0:
                    from bench_bwd import energy_per_call

                    joules, watts, clock = energy_per_call(fn, args.sustained)
                    if watts > 0:  # (an energy counter that did not move gives no time)
                        sustained = (f" sustained {joules / watts * 1e6:.1f} us, {joules * 1e3:.1f} mJ, "
                                     f"{watts:.0f} W, {clock:.0f} MHz")
                print(f"g{args.group} hdim{hdim} s{seqlen} c{int(causal)}: total {sum(t for t, _ in rows):.1f} "
                      f"main {rows[0][0]:.1f} us{sustained}", flush=True)


if __name__ == "__main__":
    main()
