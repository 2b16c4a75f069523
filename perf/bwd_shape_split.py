"""Ours against FA4's sm90 backward by kernel time, at shapes that split per-CTA cost from per-block cost
(not a test).

    python perf/bwd_shape_split.py [--hdims 64 128] [--calls 20] [--rounds 3] [--shapes 1x16384x1024 ...]
                                   [--tiles 128:80x128:2:transposed ...]

Both backwards launch one CTA per key block (tile_n keys) that walks every query block: a CTA's time is a fixed
part (launch, barrier init, K/V load, pipeline fill, dK/dV epilogue, the last dQ add's drain) plus the
per-block work times seqlen_q / tile_m. Shapes (non-causal, bf16, nheads * hdim = 2048), each as
``batch x seqlen_q x seqlen_k``: 4x4k x4k and 1x4k x16k run 32 query blocks per CTA (at tile_m 128), 1x16k x4k and
1x16k x16k run 128. If our / FA4's time ratio follows seqlen_q and not seqlen_k, the difference is in the
fixed part per CTA (perf/NOTES.md, session 29). Prints, per shape, the sum of each system's kernels and its
longest (main) kernel in us per call (torch.profiler, ``prof_bwd.kernel_times``), the systems alternated
over ``--rounds``, medians. Caveat: our main kernel is a programmatic dependent (PDL) of the preprocess and waits
for it inside the kernel, so its profiler duration includes part of the preprocess; FA4's does not (no PDL).
Against FA4, take the kernels' own times from ncu (serialized; perf/NOTES.md session 29) or compare walls. ``--tiles`` (``bench_bwd.parse_tile``'s specs): one more column per spec, that sm90
backward tile's main kernel on our forward's out and lse (its time ratio to ours in the last column).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench_bwd import fa4_func, parse_tile, tile_column
from prof_bwd import kernel_times

from flashattn_hopper import flash_attn_func

SHAPES = ((4, 4096, 4096), (1, 4096, 16384), (1, 16384, 4096), (1, 16384, 16384), (16, 1024, 1024),
          (1, 16384, 1024))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shapes", nargs="+", default=None, help="BATCHxSEQLEN_QxSEQLEN_K (default: SHAPES)")
    ap.add_argument("--tiles", nargs="+", default=[], help="HDIM:MxN[:STAGES][:rows|:transposed] sm90 tiles")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes] if args.shapes else SHAPES
    tile_cols = {spec: parse_tile(spec) for spec in args.tiles}
    fa4 = fa4_func()
    print(f"# {torch.cuda.get_device_name()}, bf16, non-causal, kernel us per backward call, median of "
          f"{args.rounds} alternated rounds of {args.calls} calls\n")
    print("| hdim | batch x s_q x s_k | ours total | ours main | fa4 total | fa4 main | main time ours/fa4 | total time ours/fa4 |"
          " tiles: main us (time / ours main) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for hdim in args.hdims:
        nheads = 2048 // hdim
        for batch, s_q, s_k in shapes:
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, dout = (torch.randn(batch, s_q, nheads, hdim, dtype=torch.bfloat16, device="cuda", generator=gen)
                       for _ in range(2))
            k, v = (torch.randn(batch, s_k, nheads, hdim, dtype=torch.bfloat16, device="cuda", generator=gen)
                    for _ in range(2))
            fns = {}
            leaves = tuple(t.clone().requires_grad_() for t in (q, k, v))
            out = flash_attn_func(*leaves, backend="sm90")
            fns["ours"] = lambda o=out, x=leaves: torch.autograd.grad(o, x, dout, retain_graph=True)
            if fa4 is not None:
                leaves4 = tuple(t.clone().requires_grad_() for t in (q, k, v))
                o4 = fa4(*leaves4)
                o4 = o4[0] if isinstance(o4, tuple) else o4
                fns["fa4"] = lambda o=o4, x=leaves4: torch.autograd.grad(o, x, dout, retain_graph=True)
            for spec, (tile_hdim, family) in tile_cols.items():
                if tile_hdim == hdim:
                    fns[spec] = tile_column(family, q, k, v, dout, False, False)
            totals: dict[str, list[float]] = {n: [] for n in fns}
            mains: dict[str, list[float]] = {n: [] for n in fns}
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    rows = kernel_times(fn, args.calls)
                    totals[name].append(sum(t for t, _ in rows))
                    mains[name].append(rows[0][0])
            med = {n: (statistics.median(totals[n]), statistics.median(mains[n])) for n in fns}
            ours = med["ours"]
            peer = med.get("fa4", (float("nan"), float("nan")))
            extra = "; ".join(f"{n} {med[n][1]:.1f} ({med[n][1] / ours[1]:.3f})" for n in fns if n in tile_cols)
            print(f"| {hdim} | {batch}x{s_q}x{s_k} | {ours[0]:.1f} | {ours[1]:.1f} | {peer[0]:.1f} | {peer[1]:.1f} | "
                  f"{ours[1] / peer[1]:.3f} | {ours[0] / peer[0]:.3f} | {extra or '-'} |", flush=True)
            del fns
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
