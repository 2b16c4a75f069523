"""Clock and power per kernel (not a test): each kernel loops ~2 s while ``nvidia-smi -lms 50`` samples
the SM clock, board power and the clock-event reasons; prints TFLOP/s, median clock and power, and the
fraction of the dense bf16 tensor peak reached per clock (132 SMs x 4096 FLOP/clk on H100/H200).

    python perf/power_probe.py [OUT_DIR]      # OUT_DIR (default .) receives smi.csv

Cases: ours (the shipped sm90 key), ours with the O rescale on every block (``eager``), cuDNN SDPA, at
hdim 128 / 256 16k non-causal and hdim 64 512 causal (bf16, 16k tokens, hidden 2048), then an
8192^3 matmul. perf/results/*-s13/power.md has its output (perf/NOTES.md, session 13).
"""
import csv
import datetime
import os
import subprocess
import sys
import time

import torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fwd_sm90 import sm90_variant_fn
from torch.nn.attention import sdpa_kernel, SDPBackend
import torch.nn.functional as F


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,power.limit,temperature.gpu,clocks_event_reasons.active",
                            "--format=csv,noheader,nounits", "-lms", "50"], stdout=open(f"{out}/smi.csv", "w"))
    time.sleep(1)
    segs = []
    def loop(name, fn, flops, secs=2.0):
        for _ in range(3): fn()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.time(); n = 0
        e0.record()
        while time.time() - t0 < secs:
            for _ in range(10): fn()
            n += 10
            torch.cuda.synchronize()
        e1.record(); torch.cuda.synchronize(); t1 = time.time()
        ms = e0.elapsed_time(e1) / n
        segs.append((name, t0 + 0.5, t1, flops / ms / 1e9))
        time.sleep(0.5)

    cases = [(128, 16384, False), (256, 16384, False), (64, 512, True)]
    for d, s, causal in cases:
        b, h = 16384 // s, 2048 // d
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * b * h * s * s * d * (0.5 if causal else 1)
        ours = sm90_variant_fn(q, k, v, causal, {})
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        def cud():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        eager = sm90_variant_fn(q, k, v, causal, {"lazy_rescale": False})
        for rep in range(2):
            loop(f"ours d{d} s{s} c{int(causal)}", ours, flops)
            loop(f"eager d{d} s{s} c{int(causal)}", eager, flops)
            loop(f"cudnn d{d} s{s} c{int(causal)}", cud, flops)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); bm = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    loop("matmul 8192^3", lambda: a @ bm, 2 * 8192**3)
    time.sleep(0.3); smi.terminate(); time.sleep(0.2)
    rows = []
    for r in csv.reader(open(f"{out}/smi.csv")):
        try:
            ts = datetime.datetime.strptime(r[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append((ts, float(r[1]), float(r[2]), float(r[3]), float(r[4]), r[5].strip()))
        except Exception: pass
    print(f"{'kernel':28s} {'TFLOP/s':>8s} {'MHz':>6s} {'W':>6s} {'limit':>6s} {'C':>4s} reasons  TFLOP/s per GHz  % of 4096 FLOP/clk/SM peak")
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    for name, t0, t1, tf in segs:
        sel = [x for x in rows if t0 <= x[0] <= t1]
        if not sel: print(name, "no samples"); continue
        mhz = sorted(x[1] for x in sel)[len(sel)//2]; w = sorted(x[2] for x in sel)[len(sel)//2]
        reasons = sorted({x[5] for x in sel})
        peak = nsm * 4096 * mhz * 1e6 / 1e12
        print(f"{name:28s} {tf:8.1f} {mhz:6.0f} {w:6.0f} {sel[0][3]:6.0f} {sel[0][4]:4.0f} {','.join(reasons)[:40]:40s} {tf/mhz*1000:7.1f} {100*tf/peak:6.1f}%")


if __name__ == "__main__":
    main()
