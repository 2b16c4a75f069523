"""Per-block timeline of the sm90 backward's two MMA warpgroups, from clock() stamps (not a test).

    python perf/trace_bwd.py [--hdims 64 128] [--seqlen 4096] [--causal]

The table tile of each head dim built with ``BwdSm90Tile.trace`` (kernels/sm90/bwd_loop.py ``stamp``): each MMA
warpgroup's leader reads clock() at 10 points of two consecutive blocks of its CTA's loop (``TRACE_BLOCK`` and the
next) and the first two CTAs print them after their loop (printf at the end, so the traced blocks run
unperturbed). Points, in SM cycles from the first block's start: 1 S^T landed, 2 exp2 pass done (P^T in
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
        for run in range(3):  # (the first compiles; the last is printed warm)
            print(f"# hdim {hdim} seqlen {args.seqlen} causal {args.causal} tile {family.tiles[hdim]} run {run}",
                  flush=True)
            family.backward(dout, q, k, v, out, lse, p, None, False)
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()
