"""The gated call's G by the Triton scan against torch's scans, in one process (not a test).

    python perf/ab_gate_scan.py [--rounds 5] [--hdims 64 128] [--seqlens 1024 4096 16384]

Issue 24: ``gate.cumulative``'s dense ``G`` (and its gradient) by ``kernels/triton/gate_scan.py`` (setting
``triton``) or by torch's transposing copy + scan (forward) and flip + scan + flip (backward) (setting ``torch``:
``gate.SCAN_KERNEL_MAX_SEQLEN`` set to 0), alternated round by round. Per cell (bf16, 16k tokens, nheads * hdim =
2048, causal, g = logsigmoid(2x + 4)): do_bench wall of the gated forward and of forward + backward
(``torch.autograd.grad`` of out through q, k, v, g), the plain causal call's beside them (gated / plain is
issue 24's ">= 0.9x"), and the GPU time of the scan kernels alone (torch.profiler: every kernel but the
attention forward / backward ones, summed per call). Medians over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench


def small_kernels_us(fn, calls: int = 10) -> float:
    """us per call of every kernel ``fn`` launches but the attention ones (names with Sm90 / Sm80 / Bwd / Fwd)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    big = ("Sm90", "Sm80", "sm90", "Bwd", "Fwd", "bwd", "fwd")
    return sum(e.device_time_total for e in prof.key_averages()
               if e.device_time_total > 0 and not any(b in e.key for b in big)) / calls


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    args = ap.parse_args(argv)

    from flashattn_hopper import flash_attn_func, gate

    limit = gate.SCAN_KERNEL_MAX_SEQLEN
    settings = ("torch", "triton")
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"# gated causal attention, G by torch's scans / the Triton scan, {torch.cuda.get_device_name()}, "
          f"rounds={args.rounds}\n")
    print("| hdim | seqlen | fwd torch us | fwd triton us | fwd plain us | fwd gated/plain torch -> triton | "
          "fwd+bwd torch us | fwd+bwd triton us | fwd+bwd plain us | fwd+bwd gated/plain torch -> triton | "
          "small kernels fwd+bwd torch -> triton us |")
    print("|" + "---|" * 11)
    for hdim in args.hdims:
        for seqlen in args.seqlens:
            b, h = max(16384 // seqlen, 1), 2048 // hdim
            q, k, v = (torch.randn(b, seqlen, h, hdim, dtype=torch.bfloat16, device="cuda", generator=gen)
                       .requires_grad_() for _ in range(3))
            g = torch.nn.functional.logsigmoid(torch.randn(b, seqlen, h, device="cuda", generator=gen) * 2 + 4)
            g.requires_grad_()
            dout = torch.randn_like(q)

            def fwd(gated: bool) -> torch.Tensor:
                return flash_attn_func(q, k, v, causal=True, log_decay=g if gated else None)

            def fwd_bwd(gated: bool):
                out = fwd(gated)
                return torch.autograd.grad(out, (q, k, v, g) if gated else (q, k, v), dout)

            times: dict[tuple[str, str], list[float]] = {}
            for _ in range(args.rounds):
                for setting in settings:
                    gate.SCAN_KERNEL_MAX_SEQLEN = limit if setting == "triton" else 0
                    with torch.no_grad():
                        times.setdefault((setting, "fwd"), []).append(do_bench(lambda: fwd(True), warmup=25, rep=200))
                    times.setdefault((setting, "fb"), []).append(do_bench(lambda: fwd_bwd(True), warmup=10, rep=200))
                    times.setdefault((setting, "small"), []).append(small_kernels_us(lambda: fwd_bwd(True)))
                with torch.no_grad():
                    times.setdefault(("plain", "fwd"), []).append(do_bench(lambda: fwd(False), warmup=25, rep=200))
                times.setdefault(("plain", "fb"), []).append(do_bench(lambda: fwd_bwd(False), warmup=10, rep=200))
            gate.SCAN_KERNEL_MAX_SEQLEN = limit
            m = {key: statistics.median(v) * (1 if key[1] == "small" else 1e3) for key, v in times.items()}
            row = [hdim, seqlen]
            for part in ("fwd", "fb"):
                t, n, p = m[("torch", part)], m[("triton", part)], m[("plain", part)]
                row += [f"{t:.1f}", f"{n:.1f}", f"{p:.1f}", f"{p / t:.3f} -> {p / n:.3f}"]
            row.append(f"{m[('torch', 'small')]:.1f} -> {m[('triton', 'small')]:.1f}")
            print("| " + " | ".join(str(x) for x in row) + " |", flush=True)
            del q, k, v, g, dout
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
