"""Chunked causal attention against plain causal attention over the same attended area (not a test).

    python perf/bench_chunk.py [--seqlen 32768] [--chunk 8192] [--hdims 64 128] [--repeat 3] [--bwd]

Issue 21 item 4: a chunked call must cost about what its attended area costs. ``attention_chunk=c``
at ``seqlen`` (batch 1) attends ``seqlen / c`` causal c x c blocks: the same work as plain causal
attention at seqlen c with batch ``seqlen / c``. Both columns count that area's FLOPs (4 * b * h * c^2
* d / 2 per forward, x2.5 with ``--bwd``: forward + backward by ``torch.autograd.grad``), so their
TFLOP/s compare directly; the chunked column runs through the varlen kernels (``chunk.py``).
bf16, nheads * hdim = 2048. Timing: do_bench medians, interleaved (``bench_fwd_sm90.time_interleaved``).
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench_fwd_sm90 import format_cells, make_timer, time_interleaved


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--bwd", action="store_true", help="forward + backward")
    args = ap.parse_args(argv)
    if args.seqlen % args.chunk:
        ap.error("--seqlen must be a multiple of --chunk (equal areas)")

    from flashattn_hopper import flash_attn_func

    timer = make_timer()
    pieces = args.seqlen // args.chunk
    print(f"# {'fwd+bwd' if args.bwd else 'fwd'}, bf16, causal, chunk {args.chunk} at {args.seqlen} vs plain causal "
          f"at {args.chunk} x batch {pieces}, {torch.cuda.get_device_name()}, repeat={args.repeat}\n")
    cols = ["chunked", "plain"]
    print("| hdim | " + " | ".join(cols) + " | chunked/plain |")
    print("|---|---|---|---|")
    for hdim in args.hdims:
        nheads = 2048 // hdim
        gen = torch.Generator(device="cuda").manual_seed(0)

        def inputs(batch: int, seqlen: int) -> list[torch.Tensor]:
            return [torch.randn(batch, seqlen, nheads, hdim, dtype=torch.bfloat16, device="cuda", generator=gen)
                    .requires_grad_(args.bwd) for _ in range(3)]

        chunked, plain = inputs(1, args.seqlen), inputs(pieces, args.chunk)
        flops = 4 * pieces * nheads * args.chunk ** 2 * hdim / 2 * (2.5 if args.bwd else 1.0)

        def call(tensors: list[torch.Tensor], **options) -> object:
            out = flash_attn_func(*tensors, causal=True, **options)
            if args.bwd:
                return torch.autograd.grad(out, tensors, torch.ones_like(out))
            return out

        fns = {"chunked": lambda: call(chunked, attention_chunk=args.chunk), "plain": lambda: call(plain)}
        for fn in fns.values():
            fn()
        tflops = time_interleaved(timer, fns, cols, args.repeat, flops)
        print(f"| {hdim} | " + " | ".join(format_cells(tflops, cols)) + f" | {tflops['chunked'] / tflops['plain']:.2f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
