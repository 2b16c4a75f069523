"""Gated log-decay attention and attention sinks against flash-linear-attention (not a test).

    python perf/bench_gate.py [--hdims 64 128] [--seqlens 1024 4096 16384] [--repeat 3] [--fresh]

Issue 24: ``log_decay`` (Forgetting Transformer) and ``learnable_sink`` against FLA's Triton
``parallel_attn(q, k, v, g, sink_bias=...)`` (PyPI ``fla-core``; imported here only, never by the
package), beside our plain causal call at the same shape; ``ours_sink``: the sink joined after the kernel
(``sinks.IN_KERNEL`` off for that system's calls), ``ours_sink_k``: the sink inside the forward kernel (the default),
``fa4_sink``: FA4's ``learnable_sink`` (benchmark-only wheels; its column and the last ratio "vs FA4" read '-' without them);
``ours_gate``: the gate's bias inside the sm90 forward kernel (the default), ``ours_gate_a``: the augmented problem
(``gate.IN_KERNEL`` off). bf16, causal, 16k tokens, nheads * hdim =
2048 (batch = 16384 / seqlen). TFLOP/s count the causal half of 4 * b * h * s^2 * d per forward and
2.5x that per backward, whatever a system computes extra (our gate runs q/k 3 columns wider).
Forward: the call; backward: ``torch.autograd.grad`` of a retained graph (q, k, v and the gate or
sink), timed alone. do_bench medians, rounds interleaved (``bench_fwd_sm90.time_interleaved``).
A system that fails prints ERR(...); without ``fla`` its columns read '-'.
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch

from bench_fwd_sm90 import format_cells, make_timer, time_interleaved


# The order systems are timed in within a round: the in-kernel variants next to our plain call, each peer
# next to ours.
TIMING_ORDER = ["ours", "ours_sink_k", "ours_gate", "fla_gate", "ours_gate_a", "ours_sink", "fla_sink", "fa4_sink"]


SYSTEMS = ["ours", "ours_gate", "ours_gate_a", "fla_gate", "ours_sink", "ours_sink_k", "fla_sink", "fa4_sink"]


def _print_table_head() -> None:
    cols = [f"{d}:{s}" for d in ("fwd", "bwd") for s in SYSTEMS]
    print("| hdim | seqlen | " + " | ".join(cols)
          + " | gate fwd / bwd vs FLA | sink fwd / bwd vs FLA | in-kernel sink fwd / bwd vs FLA | vs FA4 |")
    print("|---|---|" + "---|" * len(cols) + "---|---|---|---|", flush=True)


def _fresh_cells(args: argparse.Namespace) -> int:
    """The table with each cell run by a child process of this script (its rows only)."""
    import subprocess

    print(f"# causal, bf16, 16k tokens, hidden 2048, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"repeat={args.repeat}, a process per cell\n")
    _print_table_head()
    for hdim in args.hdims:
        for seqlen in args.seqlens:
            child = subprocess.run([sys.executable, __file__, "--hdims", str(hdim), "--seqlens", str(seqlen),
                                    "--repeat", str(args.repeat), "--rows-only"], capture_output=True, text=True)
            rows = [line for line in child.stdout.splitlines() if line.startswith("|")]
            print("\n".join(rows) if rows else f"| {hdim} | {seqlen} | ERR(exit {child.returncode}) |", flush=True)
    return 0


def sink_path(fn, in_kernel: bool, module: str = "sinks"):
    """``fn`` with ``flashattn_hopper.<module>.IN_KERNEL`` set to ``in_kernel`` while it runs (the sink
    in the forward kernel's finalize or joined after it; the gate's bias in the sm90 forward kernel or
    the augmented problem; the backward is the same either way)."""
    import importlib

    flags = importlib.import_module(f"flashattn_hopper.{module}")

    def run():
        was, flags.IN_KERNEL = flags.IN_KERNEL, in_kernel
        try:
            return fn()
        finally:
            flags.IN_KERNEL = was
    return run


def gated_inputs(hdim: int, seqlen: int, gen: torch.Generator, tensors: int = 3,
                 shift: float = 4.0) -> tuple[torch.Tensor, ...]:
    """The bench sizes' inputs (16k tokens, hidden 2048): ``tensors`` bf16 ``(batch, seqlen, nheads, hdim)`` of
    N(0, 1) (q, k, v[, dout]), then the gates ``g = logsigmoid(2 x + shift)`` ``(batch, seqlen, nheads)`` fp32 (x
    N(0, 1); at shift 4 ~-0.06 per step on average), all from ``gen`` in that order."""
    batch, nheads = max(16384 // seqlen, 1), 2048 // hdim
    made = [torch.randn(batch, seqlen, nheads, hdim, dtype=torch.bfloat16, device="cuda", generator=gen)
            for _ in range(tensors)]
    g = torch.nn.functional.logsigmoid(torch.randn(batch, seqlen, nheads, device="cuda", generator=gen) * 2 + shift)
    return (*made, g)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--fresh", action="store_true",
                    help="each (hdim, seqlen) cell in its own process: host-bound columns (ours_gate, the sink "
                         "routes, FLA) read up to 35 %% lower late in a long process (perf/NOTES.md session 38)")
    ap.add_argument("--rows-only", action="store_true", help=argparse.SUPPRESS)  # (--fresh's cells)
    args = ap.parse_args(argv)
    if args.fresh:
        return _fresh_cells(args)

    from flashattn_hopper import flash_attn_func

    try:
        from fla.ops.attn.parallel import parallel_attn
    except ImportError:
        parallel_attn = None
    timer = make_timer()
    if not args.rows_only:
        print(f"# causal, bf16, 16k tokens, hidden 2048, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"repeat={args.repeat}\n")
    try:  # FA4's learnable_sink (a benchmark-only peer, its wheels carried to the GPU machine)
        from flash_attn.cute import flash_attn_func as fa4
    except Exception as exc:  # noqa: BLE001 - absent is fine
        print(f"note: FA4 not available ({type(exc).__name__}: {exc})", file=sys.stderr)
        fa4 = None
    cols = [f"{d}:{s}" for d in ("fwd", "bwd") for s in SYSTEMS]
    if not args.rows_only:
        _print_table_head()
    for hdim in args.hdims:
        nheads = 2048 // hdim
        for seqlen in args.seqlens:
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, dout, g = gated_inputs(hdim, seqlen, gen, tensors=4)
            sink = torch.randn(nheads, device="cuda", generator=gen)
            leaves = [t.requires_grad_() for t in (q, k, v)]
            g_leaf, sink_leaf = g.requires_grad_(), sink.requires_grad_()
            calls = {
                "ours": (lambda: flash_attn_func(*leaves, causal=True), leaves),
                "ours_gate": (lambda: flash_attn_func(*leaves, causal=True, log_decay=g_leaf), [*leaves, g_leaf]),
                "ours_gate_a": (sink_path(lambda: flash_attn_func(*leaves, causal=True, log_decay=g_leaf), False, "gate"),
                                [*leaves, g_leaf]),
                "ours_sink": (sink_path(lambda: flash_attn_func(*leaves, causal=True, learnable_sink=sink_leaf), False),
                              [*leaves, sink_leaf]),
                "ours_sink_k": (sink_path(lambda: flash_attn_func(*leaves, causal=True, learnable_sink=sink_leaf), True),
                                [*leaves, sink_leaf]),
            }
            if parallel_attn is not None:
                calls["fla_gate"] = (lambda: parallel_attn(*leaves, g=g_leaf), [*leaves, g_leaf])
                calls["fla_sink"] = (lambda: parallel_attn(*leaves, sink_bias=sink_leaf), [*leaves, sink_leaf])
            if fa4 is not None:
                def fa4_sink():
                    out = fa4(*leaves, causal=True, learnable_sink=sink_leaf)
                    return out[0] if isinstance(out, tuple) else out

                calls["fa4_sink"] = (fa4_sink, [*leaves, sink_leaf])
            fns: dict[str, object] = {}
            notes: dict[str, str] = {}
            for name, (fwd, inputs) in calls.items():
                try:
                    out = fwd()
                    torch.autograd.grad(out, inputs, dout, retain_graph=True)
                except Exception as exc:  # noqa: BLE001 - a peer's failure is reported, not fatal
                    notes[f"fwd:{name}"] = notes[f"bwd:{name}"] = f"ERR({type(exc).__name__})"
                    continue
                fns[f"fwd:{name}"] = fwd
                fns[f"bwd:{name}"] = (lambda o=out, i=inputs: torch.autograd.grad(o, i, dout, retain_graph=True))
            fwd_flops = 4 * q.shape[0] * nheads * seqlen ** 2 * hdim / 2
            # The earlier cells' graphs and the compile caches out of the collector's way: a gated 1k call is
            # host-bound, and a later cell of the same process read up to 35 % lower (perf/NOTES.md session 37; a
            # reading, not yet confirmed: the collector walking a grown heap)
            gc.collect()
            gc.freeze()
            tflops: dict[str, object] = dict(notes)
            for part, flops in (("fwd", fwd_flops), ("bwd", 2.5 * fwd_flops)):
                # Timed in TIMING_ORDER (the table keeps its columns): each variant right after the call
                # it is a ratio to, so a clock drift under the power cap between columns timed seconds
                # apart does not enter those ratios (16k cells read 4-6 % apart otherwise, session 26).
                names = sorted((c for c in fns if c.startswith(part)), key=lambda c: TIMING_ORDER.index(c.split(":")[1]))
                tflops.update(time_interleaved(timer, fns, names, args.repeat, flops))

            def ratio(a: str, b: str) -> str:
                x, y = tflops.get(a), tflops.get(b)
                return f"{x / y:.2f}" if isinstance(x, float) and isinstance(y, float) else "-"

            gate_r = f"{ratio('fwd:ours_gate', 'fwd:fla_gate')} / {ratio('bwd:ours_gate', 'bwd:fla_gate')}"
            sink_r = f"{ratio('fwd:ours_sink', 'fwd:fla_sink')} / {ratio('bwd:ours_sink', 'bwd:fla_sink')}"
            sink_k = f"{ratio('fwd:ours_sink_k', 'fwd:fla_sink')} / {ratio('bwd:ours_sink_k', 'bwd:fla_sink')}"
            sink_4 = f"{ratio('fwd:ours_sink_k', 'fwd:fa4_sink')} / {ratio('bwd:ours_sink_k', 'bwd:fa4_sink')}"
            print(f"| {hdim} | {seqlen} | " + " | ".join(format_cells(tflops, cols))
                  + f" | {gate_r} | {sink_r} | {sink_k} | {sink_4} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
