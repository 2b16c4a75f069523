"""FP8 forward tile and schedule variants at one shape (not a test): which row of
``configs.FWD_SM90_FP8_TILES`` to ship.

    python perf/bench_fp8_tiles.py [--seqlen 16384] [--repeat 3]

Each variant is the shipped key with some fields replaced (``dataclasses.replace``), launched the way
``FwdSm90.forward_fp8`` launches it; e4m3 inputs with per-(batch, kv head) descales, 16k tokens,
hidden 2048, causal and not; TFLOP/s, do_bench medians, variants interleaved.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from bench_fwd_sm90 import make_timer, time_interleaved

VARIANTS = {
    64: {"shipped": {}, "tile_m 128": {"tile_m": 128}, "no pingpong": {"pingpong": False}},
    128: {"shipped": {}, "tile_n 128": {"tile_n": 128}, "tile_n 160": {"tile_n": 160},
          "tile_n 192": {"tile_n": 192}, "tile_n 192, no pingpong": {"tile_n": 192, "pingpong": False}},
    256: {"shipped": {}, "not persistent": {"persistent": False}},
}
# --v-layout keys (the V^T kernel, ``fp8_v_colmajor``): shared memory the transposing kernel spent on sVt is free
VARIANTS_KEYS = {
    64: {"shipped": {}, "3 stages": {"num_stages": 3}},
    128: {"shipped": {}, "192 x 96": {"tile_m": 192, "tile_n": 96},
          "192 x 96, 3 stages": {"tile_m": 192, "tile_n": 96, "num_stages": 3}},
    256: {"shipped": {}},
}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--hdims", type=int, nargs="+", default=list(VARIANTS))
    ap.add_argument("--v-layout", choices=["rows", "keys"], default="rows",
                    help="keys: v with contiguous keys, the V^T kernel (fp8_v_colmajor) and VARIANTS_KEYS")
    args = ap.parse_args(argv)

    from flashattn_hopper import dispatch, fp8
    from flashattn_hopper.backends.common import compile_cache, launch_forward, target_arch
    from flashattn_hopper.validate import validate_dense

    family = dispatch.FWD_KERNELS["sm90"]
    timer = make_timer()
    print(f"# FP8 forward variants, seqlen {args.seqlen}, 16k tokens, hidden 2048, {torch.cuda.get_device_name()}\n")
    print("| hdim | causal | variant | key | TFLOP/s |\n|---|---|---|---|---|")
    for hdim in args.hdims:
        keys_major = args.v_layout == "keys"
        variants = (VARIANTS_KEYS if keys_major else VARIANTS)[hdim]
        nheads, seqlen = 2048 // hdim, args.seqlen
        batch = max(16384 // seqlen, 1)
        q, k, v = (torch.randn(batch, seqlen, nheads, hdim, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        quant = fp8.quantize_qkv(q, k, v, block=False, hadamard_qk=False, v_layout=args.v_layout)
        for causal in (False, True):
            p = validate_dense(quant.q, quant.k, quant.v, None, causal, (-1, -1), 0.0, fp8=True)
            descale = torch.stack([quant.q_descale, quant.k_descale, quant.v_descale]).contiguous()
            base = family.fp8_key(p, target_arch(), v_colmajor=keys_major)
            fns, names = {}, {}
            for name, fields in variants.items():
                key = dataclasses.replace(base, **fields)
                try:
                    compiled = compile_cache.get(key, family.compile)
                except Exception as exc:  # noqa: BLE001 - a variant that cannot be built is reported
                    print(f"| {hdim} | {int(causal)} | {name} | {key.display_name} | ERR({type(exc).__name__}: {str(exc)[:80]}) |")
                    continue
                extra = family.extra_args(key, q.device)
                u8 = [t.view(torch.uint8) for t in (quant.q, quant.k, quant.v)]
                fns[name] = (lambda c=compiled, kk=key, e=extra: launch_forward(
                    c, kk, *u8, p, None, None, None, (*e[:3], descale, *e[4:]), out_dtype=torch.bfloat16))
                names[name] = key.display_name
                fns[name]()
            flops = 4 * batch * nheads * seqlen ** 2 * hdim / (2 if causal else 1)
            for name, tf in time_interleaved(timer, fns, list(fns), args.repeat, flops).items():
                print(f"| {hdim} | {int(causal)} | {name} | {names[name]} | {tf:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
