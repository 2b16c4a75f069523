"""Per-block timeline of the sm90 backward's two MMA warpgroups, from clock() stamps (not a test).

    python perf/trace_bwd.py [--hdims 64 128] [--seqlen 4096] [--causal] [--pingpong table|on|off] [--flags NAME[=INT] ...]

The table tile of each head dim built with ``BwdSm90Tile.trace`` (kernels/sm90/bwd_loop.py ``stamp``): each MMA
warpgroup's leader reads clock() at 16 points of two consecutive blocks of its CTA's loop (``TRACE_BLOCK`` and the
next) and the first two CTAs store them after their loop into an int32 buffer this script prints (stored, not
printed by the kernel: a printf anywhere in it made ptxas serialize every WGMMA, C7510, so the printf traces of
sessions 29-31 timed a serialized kernel; check the trace key's SASS for C75xx before trusting a timeline). Points, in SM cycles from the first block's start: 1 S^T landed, 2 exp2 pass done (P^T in
registers), 3 dP^T landed, 4 dS^T stored (before DS_READY), 5 past DS_READY, 6 dV and dQ done, 7 dK done (block
end), then (in parentheses) Q's and dO's TMA landed (the ring's waits before S^T's and dP^T's issue), then [10 before
dS^T's smem store (ping-pong: past the other warpgroup's arrival), 11 stored (before the fence), 12 past dQ's
DQ_EMPTY wait, 13 dQ stored (before the fence), 14 the block's last GEMM issued, 15 dV issued]; then the second
block's. The two warpgroups of a CTA share the SM clock, so their lines compare
directly: where one's exp2 pass (1 -> 2) overlaps the other's GEMM waits, the tensor pipe is fed. bf16, 16k tokens,
nheads * hdim = 2048, as ``bench_bwd.py``.

Every CTA also stores its span (``store_cta_span``: SM, m_blocks, %globaltimer at entry, K/V landed, loop done,
epilogue done); the last line of each run fits a CTA's duration as a fixed cost plus a per-block one and splits the
fixed part into prologue, the loop's own and epilogue (NOTES session 32: 4.3-5.8 us per CTA on an H100).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from flashattn_hopper import flash_attn_func, validate
from flashattn_hopper.backends.sm90_bwd import BWD_SM90_TILES, BwdSm90
from flashattn_hopper.kernels.sm90.bwd_loop import TRACE_BLOCK

POINTS = 16  # kernels/sm90/bwd_loop.py _TRACE_POINTS
CTA_BASE = 128  # kernels/sm90/bwd_loop.py TRACE_CTA_BASE


def print_stamps(stamps: torch.Tensor) -> None:
    """One line per (CTA, warpgroup) and traced block: its t0 (raw clock) and the points relative to it,
    ``1-7 (q 8 do 9) [10-15]``; the second block's line starts with its point 0."""
    raw = stamps.view(-1)[: 8 * POINTS].view(2, 2, 2, POINTS).cpu().to(torch.int64)  # (cta, warpgroup, block, point)
    for cta in range(2):
        for wg in range(2):
            t0 = int(raw[cta, wg, 0, 0])
            rel = ((raw[cta, wg] - t0) % (1 << 32)).tolist()  # (32-bit clocks)
            for blk in range(2):
                r = rel[blk]
                main = " ".join(str(x) for x in r[blk == 0:8])
                print(f"trace cta {cta} wg {wg} block {blk} t0 {t0 % (1 << 32)}: {main} (q {r[8]} do {r[9]}) "
                      f"[dS-in {r[10]} dS-st {r[11]} dQ-empty {r[12]} dQ-st {r[13]} issued {r[14]} dV-iss {r[15]}]",
                      flush=True)


def print_cta_spans(stamps: torch.Tensor, label: str) -> None:
    """Every CTA's span (``store_cta_span``: SM, m_blocks, and in ns its entry, K/V landed, loop done, epilogue done):
    the duration fitted as a per-CTA fixed cost plus a per-block one, the mean prologue / loop / epilogue, the gaps
    between one SM's consecutive CTAs, and the SMs' busy share."""
    rows = stamps.view(-1)[CTA_BASE:].view(-1, 6).cpu().to(torch.int64)
    rows = rows[rows[:, 5] != 0]
    if rows.numel() == 0:
        print(f"{label}: no CTA spans", flush=True)
        return
    # (32-bit nanosecond stamps: relative to the first row's entry, wrapped into +-2**31, then from the earliest)
    ref = int(rows[0, 2])
    start, kv, loop, end = ((((rows[:, c] - ref + (1 << 31)) % (1 << 32)) - (1 << 31)) for c in (2, 3, 4, 5))
    t0 = int(start.min())
    start, kv, loop, end = start - t0, kv - t0, loop - t0, end - t0
    dur, blocks, sm = (end - start).double(), rows[:, 1].double(), rows[:, 0]
    if blocks.unique().numel() > 1:  # (a fit needs CTAs of different block counts: causal or local)
        design = torch.stack([torch.ones_like(blocks), blocks], 1)
        fixed, per_block = torch.linalg.lstsq(design, dur[:, None]).solution[:, 0].tolist()
        loop_fixed, loop_block = torch.linalg.lstsq(design, (loop - kv).double()[:, None]).solution[:, 0].tolist()
        fit = f"{fixed / 1e3:.2f} fixed + {per_block / 1e3:.3f} per block (fit)"
        loop_fit = f"= {loop_fixed / 1e3:.2f} + {loop_block / 1e3:.3f} per block"
    else:
        fit, loop_fit = "no fit: every CTA has the same block count", "no fit"
    gaps, busy = [], 0.0
    for s_id in sm.unique().tolist():
        mine = (sm == s_id).nonzero()[:, 0]
        order = mine[start[mine].argsort()]
        busy += float(dur[order].sum())
        gaps += (start[order][1:] - end[order][:-1]).tolist()
    span, n_sm = float(end.max()), len(sm.unique())
    us = lambda t: float(t.double().mean()) / 1e3  # noqa: E731
    print(f"{label}: {rows.shape[0]} CTAs on {n_sm} SMs, span {span / 1e3:.1f} us; CTA {us(end - start):.2f} us "
          f"({float(blocks.mean()):.2f} blocks) = {fit}; prologue to K/V landed {us(kv - start):.2f}, loop "
          f"{us(loop - kv):.2f} ({loop_fit}), epilogue {us(end - loop):.2f}; gap between an SM's CTAs "
          f"{sum(gaps) / max(len(gaps), 1) / 1e3:.2f}; SMs busy {busy / (span * n_sm):.1%}", flush=True)


def _flag(spec: str) -> tuple[str, bool | int]:
    name, _, value = spec.partition("=")
    return name, int(value) if value else True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--pingpong", choices=["table", "on", "off"], default="table",
                    help="the table tile's ping-pong flag (hdim 64: on), or forced on / off")
    ap.add_argument("--flags", nargs="*", default=[],
                    help="extra BwdSm90Tile fields set on the traced tile: NAME (True) or NAME=INT, e.g. ds_packed")
    args = ap.parse_args()
    for hdim in args.hdims:
        batch, nheads = max(16384 // args.seqlen, 1), 2048 // hdim
        family = BwdSm90()
        pingpong = BWD_SM90_TILES[hdim].pingpong if args.pingpong == "table" else args.pingpong == "on"
        family.tiles = {hdim: dataclasses.replace(BWD_SM90_TILES[hdim], **{"trace": True, "pingpong": pingpong,
                                                                             **dict(_flag(f) for f in args.flags)})}
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
            tile = family.tiles[hdim]
            if args.seqlen >= (TRACE_BLOCK + 2) * tile.tile_m + (tile.tile_n if args.causal else 0):
                # (blocks TRACE_BLOCK and the next exist in both traced CTAs)
                print_stamps(plan.trace_stamps)
            print_cta_spans(plan.trace_stamps, f"hdim {hdim} seqlen {args.seqlen} causal {args.causal} run {run}")


if __name__ == "__main__":
    main()
