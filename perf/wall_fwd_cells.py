"""Wall time of a few forward cells, one line each, for ``perf/ab_trees.py --metric wall`` (not a test).

    python perf/wall_fwd_cells.py [--dtype fp8|fp8_block|bf16] [--hdims 128 256] [--seqlens 4096 16384]
                                  [--causal 0 1] [--gate]

16k tokens, hidden 2048 (batch = 16384 / seqlen, nheads = 2048 / hdim), ``flash_attn_func`` on the sm90
backend; fp8: e4m3 inputs (``fp8.quantize_qkv`` per tensor, or per block with ``fp8_block``); ``--gate``
(bf16): with ``log_decay`` (``logsigmoid`` of N(4, 2) gates, as ``bench_gate.py``), no grad. Prints
``h{hdim}_s{seqlen}_c{causal}_{dtype}: wall US us TFLOPS tflops`` per cell (triton ``do_bench`` median).
"""

from __future__ import annotations

import argparse
import sys

import torch
from triton.testing import do_bench


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="fp8", choices=["fp8", "fp8_block", "bf16"])
    ap.add_argument("--hdims", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--gate", action="store_true", help="bf16 with log_decay (the gated forward)")
    args = ap.parse_args(argv)
    if args.gate and args.dtype != "bf16":
        ap.error("--gate times the bf16 gated forward (FP8 has no gate)")

    from flashattn_hopper import flash_attn_func, fp8

    for hdim in args.hdims:
        nheads = 2048 // hdim
        for causal in map(bool, args.causal):
            for seqlen in args.seqlens:
                batch = max(16384 // seqlen, 1)
                gen = torch.Generator(device="cuda").manual_seed(0)
                q, k, v = (torch.randn(batch, seqlen, nheads, hdim, dtype=torch.bfloat16, device="cuda",
                                       generator=gen) for _ in range(3))
                g = torch.nn.functional.logsigmoid(
                    torch.randn(batch, seqlen, nheads, device="cuda", generator=gen) * 2 + 4) if args.gate else None
                if args.dtype == "bf16":
                    def call():
                        return flash_attn_func(q, k, v, causal=causal, backend="sm90", log_decay=g)
                else:
                    t = fp8.quantize_qkv(q, k, v, block=args.dtype == "fp8_block", hadamard_qk=False)

                    def call():
                        return flash_attn_func(t.q, t.k, t.v, causal=causal, q_descale=t.q_descale,
                                               k_descale=t.k_descale, v_descale=t.v_descale, backend="sm90")
                us = do_bench(call, warmup=50, rep=300) * 1e3
                flops = 4 * batch * nheads * seqlen ** 2 * hdim / (2 if causal else 1)
                label = f"{args.dtype}_gate" if args.gate else args.dtype
                print(f"h{hdim}_s{seqlen}_c{int(causal)}_{label}: wall {us:.1f} us {flops / us / 1e6:.0f} tflops",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
