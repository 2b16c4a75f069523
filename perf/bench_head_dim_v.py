"""Tiles for a v head dim other than q/k's (issue 21 item 3), forward and backward (not a test).

    python perf/bench_head_dim_v.py [--pairs 64/256 128/256 96/192 64/128] [--seqlens 1024 4096 16384]
                                    [--bwd] [--rep-ms 60]

bf16, batch * seqlen = 16k tokens, 16 heads (GQA off). Forward: each sm90 candidate tile of a pair
(``CANDIDATES``, put in ``configs.FWD_SM90_DV_TILES`` for the call), causal and not, beside the sm80
forward, and the same-width problems d/d and dv/dv for scale. ``--bwd``: forward + backward on the default
backend (the sm90 forward; the sm90 backward where it takes the problem, else sm80's) at the pair,
at d/d and at dv/dv. Timing: ``flashattn_hopper.sweep.timing.make_timer``
(do_bench medians, L2 flushed). FLOPs = 2*b*h*s_q*s_k*(d + dv) forward (x1/2 causal), x2.5 with the
backward. Prints Markdown tables of TFLOP/s.
"""

from __future__ import annotations

import argparse

import torch

from flashattn_hopper import configs, flash_attn_func
from flashattn_hopper.configs import FwdTileSm90
from flashattn_hopper.sweep.timing import make_timer

TOKENS, HEADS = 16384, 16


def _tile(tile_n: int, pingpong: bool = False, intra: bool = True) -> FwdTileSm90:
    return FwdTileSm90(tile_m=128, tile_n=tile_n, intra_wg_overlap=intra, pingpong=pingpong, persistent=True)


# Own sO (v above q): smem = 2 * (128 * d + 2 * n * d + 2 * n * dv + 128 * dv) B <= 227 KB. 64/256 at
# 128x112 fits (225 KB, 212 regs) but spills 94 LDL + 112 STL causal (sm_90a, DSL 4.8.1): not a candidate.
CANDIDATES: dict[tuple[int, int], dict[str, FwdTileSm90]] = {
    # 128x80 (the shipped pick) compiles with its WGMMAs serialized (18 of 27 HGMMAs end a gsb0 group);
    # 128x64 and 128x80 without intra-warpgroup overlap do not (6 each): sm_90a SASS, 2026-11-25.
    (64, 256): {"128x80": _tile(80), "128x64": _tile(64), "128x80-serial": _tile(80, intra=False),
                "128x96": _tile(96), "128x96-serial": _tile(96, intra=False)},
    (128, 256): {"128x64": _tile(64), "128x80": _tile(80)},
    (96, 192): {"128x96": _tile(96), "128x112": _tile(112), "128x128": _tile(128)},
    (64, 128): {"128x128-pp": _tile(128, pingpong=True), "128x128": _tile(128), "128x176-pp": _tile(176, pingpong=True)},
}


def flops(s: int, d: int, dv: int, causal: bool, bwd: bool) -> float:
    f = 2 * (TOKENS // s) * HEADS * s * s * (d + dv) * (0.5 if causal else 1.0)
    return f * (3.5 if bwd else 1.0)


def inputs(s: int, d: int, dv: int, grad: bool = False):
    b = TOKENS // s
    q, k = (torch.randn(b, s, HEADS, d, dtype=torch.bfloat16, device="cuda", requires_grad=grad) for _ in range(2))
    v = torch.randn(b, s, HEADS, dv, dtype=torch.bfloat16, device="cuda", requires_grad=grad)
    return q, k, v


def bench_fwd(timer, pair: tuple[int, int], seqlens: list[int]) -> None:
    d, dv = pair
    cols = [*CANDIDATES.get(pair, {}), "shipped", "sm80", f"{d}/{d}", f"{dv}/{dv}"]
    print(f"\n### forward {d}/{dv}, TFLOP/s (bf16, {TOKENS} tokens, {HEADS} heads)\n")
    print("| seqlen | causal | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 2) + "|")
    saved = configs.FWD_SM90_DV_TILES.get(pair)
    for s in seqlens:
        for causal in (False, True):
            row = []
            q, k, v = inputs(s, d, dv)
            for name in cols:
                backend, args = "sm90", (q, k, v)
                if name in CANDIDATES.get(pair, {}):
                    configs.FWD_SM90_DV_TILES[pair] = CANDIDATES[pair][name]
                elif name == "shipped":
                    configs.FWD_SM90_DV_TILES.pop(pair, None)
                    if saved is not None:
                        configs.FWD_SM90_DV_TILES[pair] = saved
                elif name == "sm80":
                    backend = "sm80"
                else:
                    w = int(name.split("/")[0])
                    args = inputs(s, w, w)
                try:
                    t = timer(lambda: flash_attn_func(*args, causal=causal, backend=backend)).median_ms
                    row.append(f"{flops(s, args[0].shape[-1], args[2].shape[-1], causal, False) / t / 1e9:.0f}")
                except Exception as e:  # a candidate that does not fit reports why
                    row.append(f"err {type(e).__name__}")
            print(f"| {s} | {int(causal)} | " + " | ".join(row) + " |", flush=True)
    configs.FWD_SM90_DV_TILES.pop(pair, None)
    if saved is not None:
        configs.FWD_SM90_DV_TILES[pair] = saved


def bench_bwd(timer, pair: tuple[int, int], seqlens: list[int]) -> None:
    d, dv = pair
    cols = [f"{d}/{dv}", f"{d}/{d}", f"{dv}/{dv}"]
    print(f"\n### forward + backward (default backend: the sm90 forward, the backward dispatch picks) {d}/{dv}, TFLOP/s\n")
    print("| seqlen | causal | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 2) + "|")
    for s in seqlens:
        for causal in (False, True):
            row = []
            for name in cols:
                a, b = (int(x) for x in name.split("/"))
                q, k, v = inputs(s, a, b, grad=True)
                dout = torch.randn(*q.shape[:-1], b, dtype=torch.bfloat16, device="cuda")

                def step():
                    flash_attn_func(q, k, v, causal=causal).backward(dout)

                t = timer(step, grad_to_none=(q, k, v)).median_ms
                row.append(f"{flops(s, a, b, causal, True) / t / 1e9:.0f}")
            print(f"| {s} | {int(causal)} | " + " | ".join(row) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", nargs="+", default=["64/256", "128/256", "96/192", "64/128"])
    ap.add_argument("--seqlens", nargs="+", type=int, default=[1024, 4096, 16384])
    ap.add_argument("--bwd", action="store_true")
    ap.add_argument("--rep-ms", type=float, default=60.0)
    args = ap.parse_args()
    timer = make_timer(10.0, args.rep_ms, torch.device("cuda"))
    print(torch.cuda.get_device_name(), "|", timer.description)
    for text in args.pairs:
        pair = tuple(int(x) for x in text.split("/"))
        bench_fwd(timer, pair, args.seqlens)
        if args.bwd:
            bench_bwd(timer, pair, args.seqlens)


if __name__ == "__main__":
    main()
