"""Per-block timeline of the sm90 backward's two MMA warpgroups, from clock() stamps (not a test).

    python perf/trace_bwd.py [--hdims 64 128] [--seqlen 4096] [--causal]

The table tile of each head dim built with ``BwdSm90Tile.trace`` (kernels/sm90/bwd_loop.py ``stamp``): each MMA
warpgroup's leader reads clock() at 10 points of two consecutive blocks of its CTA's loop (``TRACE_BLOCK`` and the
next) and the first two CTAs store them after their loop into an int32 buffer this script prints (stored, not
printed by the kernel: a printf anywhere in it made ptxas serialize every WGMMA, C7510, so the printf traces of
sessions 29-31 timed a serialized kernel; check the trace key's SASS for C75xx before trusting a timeline). Points, in SM cycles from the first block's start: 1 S^T landed, 2 exp2 pass done (P^T in
registers), 3 dP^T landed, 4 dS^T stored (before DS_READY), 5 past DS_READY, 6 dV and dQ done, 7 dK done (block
end), then (in parentheses) Q's and dO's TMA landed (the ring's waits before S^T's and dP^T's issue); then the second
block's. The two warpgroups of a CTA share the SM clock, so their lines compare
directly: where one's exp2 pass (1 -> 2) overlaps the other's GEMM waits, the tensor pipe is fed. bf16, 16k tokens,
nheads * hdim = 2048, as ``bench_bwd.py``.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from flashattn_hopper import flash_attn_func, validate
from flashattn_hopper.backends.sm90_bwd import BWD_SM90_TILES, BwdSm90


def print_stamps(stamps: torch.Tensor) -> None:
    """One line per (CTA, warpgroup): its t0 (raw clock) and the 2 x 10 points relative to it, as
    ``(block 0: points 1-7 (q 8 do 9) | block 1: points 0-7 (q 8 do 9))``."""
    raw = stamps.view(2, 2, 2, 10).cpu().to(torch.int64)  # (cta, warpgroup, block, point)
    for cta in range(2):
        for wg in range(2):
            t0 = int(raw[cta, wg, 0, 0])
            rel = ((raw[cta, wg] - t0) % (1 << 32)).tolist()  # (32-bit clocks)
            first = " ".join(str(x) for x in rel[0][1:8]) + f" (q {rel[0][8]} do {rel[0][9]})"
            second = " ".join(str(x) for x in rel[1][0:8]) + f" (q {rel[1][8]} do {rel[1][9]})"
            print(f"trace cta {cta} wg {wg} t0 {t0 % (1 << 32)}: {first} | {second}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--pingpong", choices=["table", "on", "off"], default="table",
                    help="the table tile's ping-pong flag (hdim 64: on), or forced on / off")
    args = ap.parse_args()
    for hdim in args.hdims:
        batch, nheads = max(16384 // args.seqlen, 1), 2048 // hdim
        family = BwdSm90()
        pingpong = BWD_SM90_TILES[hdim].pingpong if args.pingpong == "table" else args.pingpong == "on"
        family.tiles = {hdim: dataclasses.replace(BWD_SM90_TILES[hdim], trace=True, pingpong=pingpong)}
        q, k, v, dout = (torch.randn(batch, args.seqlen, nheads, hdim, dtype=torch.bfloat16, device="cuda")
                         for _ in range(4))
        p = validate.validate_dense(q, k, v, None, args.causal, (-1, -1), 0.0)
        out, lse = flash_attn_func(q, k, v, causal=args.causal, return_lse=True, backend="sm90")
        plan = family.plan(p, None, False, q.device)
        for run in range(3):  # (the first compiles; every run is printed, the last warm)
            print(f"# hdim {hdim} seqlen {args.seqlen} causal {args.causal} tile {family.tiles[hdim]} run {run}",
                  flush=True)
            plan(dout, q, k, v, out, lse)
            torch.cuda.synchronize()
            print_stamps(plan.trace_stamps)


if __name__ == "__main__":
    main()
