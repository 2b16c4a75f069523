"""The dense gated call's G scan: torch's ops against the CuTe DSL kernel, in one process (not a test).

    python perf/ab_gate_scan.py [--rounds 3] [--calls 1000] [--seqlens 1024 2048 4096 16384] [--varlen]

Issue 24: ``gate.SCAN_KERNEL`` off (torch's transposing scan, the division into the bias rows, the slice build)
or on (``backends/gate_scan.py``: one TVM-FFI launch), alternated round by round so that host speed reaches both
alike. Cells: a tiny causal shape (1 x 128 x 8 x 128 bf16; us per call over ``--calls`` calls, host-bound) and
the causal FA3-paper cells (16k tokens, hidden 2048) at hdim 64 / 128 and 1k / 4k / 16k keys: do_bench wall of
the gated forward and of forward + backward (g with a gradient: since session 37 the kernel route takes it too, its
backward since session 38 with the dg scan kernel), beside the plain (ungated) call of the same shape. Medians.
``--varlen``: the same cells as packed self-attention (one cu_seqlens of equal sequences through
``flash_attn_varlen_func``), ``gate.SCAN_KERNEL_VARLEN`` off (``cumulative``'s torch ops and their autograd) or on
(the kernels' varlen mode).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from triton.testing import do_bench


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 16384])
    ap.add_argument("--varlen", action="store_true", help="packed self-attention, SCAN_KERNEL_VARLEN off / on")
    args = ap.parse_args(argv)

    from flashattn_hopper import flash_attn_func, flash_attn_varlen_func, gate

    flag = "SCAN_KERNEL_VARLEN" if args.varlen else "SCAN_KERNEL"
    default = getattr(gate, flag)

    def attention(q, k, v, g=None):
        if not args.varlen:
            return flash_attn_func(q, k, v, causal=True, log_decay=g)
        b, s = q.shape[:2]
        cu = cu_seqlens[(b, s)]
        packed = (t.reshape(b * s, *t.shape[2:]) for t in (q, k, v))
        out = flash_attn_varlen_func(*packed, cu, cu, s, s, causal=True,
                                     log_decay=None if g is None else g.reshape(b * s, -1))
        return out.view(q.shape[:3] + out.shape[-1:])

    gen = torch.Generator(device="cuda").manual_seed(0)
    cells = {"tiny": (1, 128, 8, 128)}
    for hdim in (64, 128):
        for seqlen in args.seqlens:
            cells[f"h{hdim}_{seqlen // 1024}k"] = (16384 // seqlen, seqlen, 2048 // hdim, hdim)
    inputs = {}
    cu_seqlens = {(b, s): torch.arange(0, b * s + 1, s, dtype=torch.int32, device="cuda") for b, s, _, _ in cells.values()}
    for name, (b, s, h, d) in cells.items():
        q, k, v, dout = (torch.randn(b, s, h, d, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(4))
        g = torch.nn.functional.logsigmoid(torch.randn(b, s, h, device="cuda", generator=gen) * 2 + 4)
        leaves = tuple(t.clone().requires_grad_() for t in (q, k, v, g))
        inputs[name] = (q, k, v, g, leaves, dout)

    def fwd(name: str, gated: bool = True) -> torch.Tensor:
        q, k, v, g, _, _ = inputs[name]
        return attention(q, k, v, g if gated else None)

    def fwd_bwd(name: str, gated: bool = True) -> tuple[torch.Tensor, ...]:
        *_, leaves, dout = inputs[name]
        out = attention(*leaves[:3], leaves[3] if gated else None)
        return torch.autograd.grad(out, leaves if gated else leaves[:3], dout)

    def per_call_us(fn) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(args.calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / args.calls

    def measure(fn, name: str) -> float:
        fn()
        return per_call_us(fn) if name == "tiny" else do_bench(fn, warmup=25, rep=200) * 1e3

    settings = ("torch", "kernel")
    times: dict[tuple[str, str, str], list[float]] = {}
    for _ in range(args.rounds):
        for name in cells:
            times.setdefault(("plain", name, "fwd"), []).append(measure(lambda: fwd(name, False), name))
            times.setdefault(("plain", name, "fwd_bwd"), []).append(measure(lambda: fwd_bwd(name, False), name))
        for setting in settings:
            setattr(gate, flag, setting == "kernel")
            for name in cells:
                times.setdefault((setting, name, "fwd"), []).append(measure(lambda: fwd(name), name))
                times.setdefault((setting, name, "fwd_bwd"), []).append(measure(lambda: fwd_bwd(name), name))
    setattr(gate, flag, default)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"# gated causal calls{' (packed, varlen)' if args.varlen else ''}, G by torch's ops / the scan kernel, "
          f"{torch.cuda.get_device_name()}, "
          f"rounds={args.rounds}; us (tiny: per call, host-bound; others: do_bench wall)\n")
    print("| cell | fwd plain | fwd torch | fwd kernel | gated/plain torch -> kernel | fwd+bwd plain | fwd+bwd torch "
          "| fwd+bwd kernel | gated/plain torch -> kernel |\n|---|---|---|---|---|---|---|---|---|")
    for name in cells:
        row = [name]
        for what in ("fwd", "fwd_bwd"):
            plain, t, k = (med[(s, name, what)] for s in ("plain", "torch", "kernel"))
            row += [f"{plain:.1f}", f"{t:.1f}", f"{k:.1f}", f"{plain / t:.3f} -> {plain / k:.3f}"]
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
