"""Clock and power per kernel (not a test): each kernel loops ~2 s while ``nvidia-smi -lms 50`` samples
the SM clock, board power and the clock-event reasons; prints TFLOP/s, median clock and power, and the
fraction of the dense bf16 tensor peak reached per clock (132 SMs x 4096 FLOP/clk on H100/H200).

    python perf/power_probe.py [--out DIR] [--secs S] [--rounds N] [CASE ...]

A CASE is ``impl/hdim/batch/seqlen_q/seqlen_k/causal[/field=value ...]``: impl ``ours`` (the shipped
sm90 key for the shape, FwdSm90Key fields overridden by ``field=value``, ``tile=MxN`` for the tile) or
``cudnn`` (SDPA); nheads = 2048 / hdim. Every case loops once per round, rounds interleave the cases.
Without cases: ours, ours with the O rescale on every block (``eager``) and cuDNN at hdim 128 / 256 16k
non-causal and hdim 64 512 causal, then an 8192^3 matmul (perf/results/*-s13/power.md has that output,
perf/NOTES.md session 13; since session 14 ours at hdim 256 16k runs clusters of 2, as shipped). DIR
(default .) receives smi.csv.
"""
import argparse
import csv
import datetime
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fwd_sm90 import sm90_variant_fn, visible_pairs  # noqa: E402

DEFAULT_CASES = [f"{impl}/{d}/{16384 // s}/{s}/{s}/{c}{extra}"
                 for d, s, c in ((128, 16384, 0), (256, 16384, 0), (64, 512, 1))
                 for impl, extra in (("ours", ""), ("ours", "/lazy_rescale=False"), ("cudnn", ""))]


def parse_value(text: str):
    return {"True": True, "False": False}.get(text, int(text) if text.lstrip("-").isdigit() else text)


def make_case(spec: str):
    """(name, callable, flops) of one CASE spec."""
    impl, d, b, sq, sk, causal, *fields = spec.split("/")
    d, b, sq, sk, causal = int(d), int(b), int(sq), int(sk), causal in ("1", "on", "True")
    h = 2048 // d
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, sk, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    flops = 4 * b * h * visible_pairs(sq, sk, causal, (-1, -1)) * d  # (bottom-right causal when sq != sk)
    if impl == "cudnn":
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def fn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    else:
        overrides = dict(f.split("=") for f in fields)
        tile = overrides.pop("tile", None)
        fn = sm90_variant_fn(q, k, v, causal, {f: parse_value(x) for f, x in overrides.items()},
                             tuple(int(x) for x in tile.split("x")) if tile else None)
        if fn is None:
            raise SystemExit(f"{spec}: that variant does not apply to this shape")
    return spec, fn, flops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", default=DEFAULT_CASES)
    ap.add_argument("--out", default=".")
    ap.add_argument("--secs", type=float, default=2.0, help="looping time per case and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-matmul", action="store_true")
    args = ap.parse_args()
    cases = [make_case(spec) for spec in args.cases]
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,power.limit,temperature.gpu,"
                            "clocks_event_reasons.active", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=open(f"{args.out}/smi.csv", "w"))
    time.sleep(1)
    segs = []

    def loop(name, fn, flops):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0, n = time.time(), 0
        e0.record()
        while time.time() - t0 < args.secs:
            for _ in range(10):
                fn()
            n += 10
            torch.cuda.synchronize()
        e1.record()
        torch.cuda.synchronize()
        segs.append((name, t0 + 0.5, time.time(), flops / (e0.elapsed_time(e1) / n) / 1e9))
        time.sleep(0.5)

    for _ in range(args.rounds):
        for name, fn, flops in cases:
            loop(name, fn, flops)
    if not args.no_matmul:
        a, bm = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        loop("matmul 8192^3", lambda: a @ bm, 2 * 8192**3)
    time.sleep(0.3)
    smi.terminate()
    time.sleep(0.2)
    rows = []
    for r in csv.reader(open(f"{args.out}/smi.csv")):
        try:
            ts = datetime.datetime.strptime(r[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append((ts, float(r[1]), float(r[2]), float(r[3]), float(r[4]), r[5].strip()))
        except (ValueError, IndexError):
            pass
    if not segs:
        raise SystemExit("nothing to probe: give cases, or drop --no-matmul")
    width = max(len(s[0]) for s in segs)
    print(f"{'kernel':{width}s} {'TFLOP/s':>8s} {'MHz':>6s} {'W':>6s} {'limit':>6s} {'C':>4s} reasons"
          f"{'':34s} TFLOP/s per GHz, % of 4096 FLOP/clk/SM peak")
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    for name, t0, t1, tf in segs:
        sel = [x for x in rows if t0 <= x[0] <= t1]
        if not sel:
            print(name, "no samples")
            continue
        mhz = sorted(x[1] for x in sel)[len(sel) // 2]
        watts = sorted(x[2] for x in sel)[len(sel) // 2]
        reasons = ",".join(sorted({x[5] for x in sel}))[:40]
        peak = nsm * 4096 * mhz * 1e6 / 1e12
        print(f"{name:{width}s} {tf:8.1f} {mhz:6.0f} {watts:6.0f} {sel[0][3]:6.0f} {sel[0][4]:4.0f} {reasons:40s} "
              f"{tf / mhz * 1000:7.1f} {100 * tf / peak:6.1f}%")


if __name__ == "__main__":
    main()
