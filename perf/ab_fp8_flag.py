"""The e4m3 forward under values of one ``configs`` flag, alternated in one process (not a test).

    python perf/ab_fp8_flag.py [--flag FWD_SM90_FP8_LAZY_RESCALE] [--values 0 1] [--rounds 5] [--hdims 64 128 256] \
        [--seqlens 2048 8192 16384] [--causal 0 1] [--descales tensor block]

Issue 25 (FP8 >= 1.6x our bf16 forward at hdim 128 and 256 from 4k, >= 1,200 TFLOP/s at hdim 256 16k). The flags
(perf/NOTES.md session 42): ``FWD_SM90_FP8_LAZY_RESCALE`` (0 / 1: every row's max renewed and O multiplied every
block, or a row's max kept within 2**1.8 and the multiply skipped where a warp's rows kept theirs; session 42 also
ran a since-reverted ``FWD_SM90_FP8_FMA_EXP2_EVERY`` through it). Values alternated round by
round (forward, then backward order) for both v layouts (rows: the transposing kernel; keys: v's keys contiguous,
``quantize_qkv(v_layout="keys")``), our bf16 forward of the same inputs beside them; 16k tokens, hidden 2048,
N(0, 1) inputs, do_bench medians as TFLOP/s; each value's ratio to the first. ``--descales block``: per-block
descales (``quantize_qkv(block=True)``, the issue's setting for its 1,200 TFLOP/s). The setting is switched by
patching the flag and forgetting the kept plans (``api.clear_plans``; the FP8 key follows the flag).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from triton.testing import do_bench


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flag", default="FWD_SM90_FP8_LAZY_RESCALE")
    ap.add_argument("--values", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[2048, 8192, 16384])
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--descales", choices=["tensor", "block"], default="tensor")
    ap.add_argument("--layouts", nargs="+", choices=["rows", "keys"], default=["rows", "keys"])
    args = ap.parse_args(argv)

    from flashattn_hopper import api, configs, flash_attn_func, fp8

    default = getattr(configs, args.flag)
    settings = {str(value): type(default)(value) for value in args.values}
    names = [f"{layout} {value}" for layout in args.layouts for value in settings]
    ratios = [f"{layout} {value} / {args.values[0]}" for layout in args.layouts for value in list(settings)[1:]]
    print(f"# e4m3 forward, {args.flag} = {' / '.join(settings)}, {torch.cuda.get_device_name()}, rounds={args.rounds}; "
          f"TFLOP/s, {args.descales} descales\n")
    print("| hdim | causal | seqlen | bf16 | " + " | ".join(names + ratios) + f" | best {args.layouts[-1]} / bf16 |")
    print("|---|---|---|---|" + "---|" * (len(names) + len(ratios) + 1))
    for hdim in args.hdims:
        nheads = 2048 // hdim
        for causal in args.causal:
            for seqlen in args.seqlens:
                batch = max(16384 // seqlen, 1)
                gen = torch.Generator(device="cuda").manual_seed(0)
                q, k, v = (torch.randn(batch, seqlen, nheads, hdim, dtype=torch.bfloat16, device="cuda", generator=gen)
                           for _ in range(3))
                block = args.descales == "block"
                layouts = {layout: fp8.quantize_qkv(q, k, v, block=block, hadamard_qk=False, v_layout=layout)
                           for layout in args.layouts}

                def fp8_call(t):
                    return lambda: flash_attn_func(t.q, t.k, t.v, causal=bool(causal), q_descale=t.q_descale,
                                                   k_descale=t.k_descale, v_descale=t.v_descale)

                flops = 4 * batch * nheads * seqlen ** 2 * hdim / (2 if causal else 1)
                ms: dict[str, list[float]] = {"bf16": []}
                for r in range(args.rounds):
                    ms["bf16"].append(do_bench(lambda: flash_attn_func(q, k, v, causal=bool(causal)), warmup=10, rep=50))
                    for name in (list(settings) if r % 2 == 0 else list(settings)[::-1]):
                        setattr(configs, args.flag, settings[name])
                        api.clear_plans()
                        for layout, t in layouts.items():
                            ms.setdefault(f"{layout} {name}", []).append(do_bench(fp8_call(t), warmup=10, rep=50))
                tf = {name: flops / statistics.median(t) / 1e9 for name, t in ms.items()}
                first = args.values[0]
                cells = [f"{tf[name]:.0f}" for name in names] + [
                    f"{tf[f'{layout} {value}'] / tf[f'{layout} {first}']:.3f}"
                    for layout in args.layouts for value in list(settings)[1:]]
                best = max(tf[f"{args.layouts[-1]} {value}"] for value in settings)
                print(f"| {hdim} | {causal} | {seqlen} | {tf['bf16']:.0f} | " + " | ".join(cells)
                      + f" | {best / tf['bf16']:.2f} |", flush=True)
    setattr(configs, args.flag, default)
    api.clear_plans()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
