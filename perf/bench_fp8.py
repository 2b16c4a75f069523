"""The FP8 (e4m3) forward against our bf16 forward and cuDNN's bf16 SDPA (not a test).

    python perf/bench_fp8.py [--hdims 64 128 256] [--seqlens 512 1024 2048 4096 8192 16384] [--repeat 3] \
        [--systems fp8_vt fp8_vt_block bf16] [--no-quantize]

Issue 25: TFLOP/s of ``flash_attn_func`` on e4m3 q, k, v with per-(batch, kv head) descales (bf16 out),
and with per-block descales (``fp8_block``), each also with v's keys contiguous (``fp8_vt``, ``fp8_vt_block``:
``quantize_qkv(v_layout="keys")``, the kernel's TMA-loaded V^T, no in-kernel transpose),
beside the same call on bf16 inputs and ``F.scaled_dot_product_attention`` with the cuDNN backend, causal
and not; 16k tokens, hidden 2048 (batch = 16384 / seqlen, nheads = 2048 / hdim), 4 * b * h * s^2 * d
FLOPs per forward (half causal). do_bench medians, rounds interleaved. Then the quantize helper
(``fp8.quantize_qkv``, per block with the Hadamard transform, and per tensor; the torch path and the
Triton kernel) in GB/s (bf16 in, e4m3 out), beside a device-to-device copy's bandwidth in the same run.
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench_fwd_sm90 import format_cells, make_timer, time_interleaved


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-quantize", action="store_true")
    ap.add_argument("--systems", nargs="+", default=None,
                    help="time only these columns (fp8 fp8_vt fp8_block fp8_vt_block bf16 cudnn_bf16; default all): "
                         "fewer systems interleaved keep each cell's power state closer to a lone run's")
    args = ap.parse_args(argv)

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashattn_hopper import flash_attn_func, fp8

    timer = make_timer()
    print(f"# FP8 forward, 16k tokens, hidden 2048, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"repeat={args.repeat}\n")
    systems = ["fp8", "fp8_vt", "fp8_block", "fp8_vt_block", "bf16", "cudnn_bf16"]
    print("| hdim | causal | seqlen | " + " | ".join(systems) + " | fp8 / our bf16 | fp8_vt / our bf16 | fp8_vt / cuDNN bf16"
          " | vt / rows | vt_block / block |")
    print("|---|---|---|" + "---|" * len(systems) + "---|---|---|---|---|")
    for hdim in args.hdims:
        nheads = 2048 // hdim
        for causal in (False, True):
            for seqlen in args.seqlens:
                batch = max(16384 // seqlen, 1)
                gen = torch.Generator(device="cuda").manual_seed(0)
                q, k, v = (torch.randn(batch, seqlen, nheads, hdim, dtype=torch.bfloat16, device="cuda", generator=gen)
                           for _ in range(3))
                quant = fp8.quantize_qkv(q, k, v, block=False, hadamard_qk=False)
                blocks = fp8.quantize_qkv(q, k, v, block=True, hadamard_qk=False)
                quant_vt = fp8.quantize_qkv(q, k, v, block=False, hadamard_qk=False, v_layout="keys")
                blocks_vt = fp8.quantize_qkv(q, k, v, block=True, hadamard_qk=False, v_layout="keys")
                qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

                def cudnn():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

                fns = {
                    "fp8": lambda: flash_attn_func(quant.q, quant.k, quant.v, causal=causal, q_descale=quant.q_descale,
                                                   k_descale=quant.k_descale, v_descale=quant.v_descale),
                    "fp8_block": lambda: flash_attn_func(blocks.q, blocks.k, blocks.v, causal=causal,
                                                         q_descale=blocks.q_descale, k_descale=blocks.k_descale,
                                                         v_descale=blocks.v_descale),
                    "fp8_vt": lambda: flash_attn_func(quant_vt.q, quant_vt.k, quant_vt.v, causal=causal,
                                                      q_descale=quant_vt.q_descale, k_descale=quant_vt.k_descale,
                                                      v_descale=quant_vt.v_descale),
                    "fp8_vt_block": lambda: flash_attn_func(blocks_vt.q, blocks_vt.k, blocks_vt.v, causal=causal,
                                                            q_descale=blocks_vt.q_descale,
                                                            k_descale=blocks_vt.k_descale,
                                                            v_descale=blocks_vt.v_descale),
                    "bf16": lambda: flash_attn_func(q, k, v, causal=causal),
                    "cudnn_bf16": cudnn,
                }
                if args.systems:
                    fns = {name: fn for name, fn in fns.items() if name in args.systems}
                notes: dict[str, object] = {}
                for name in list(fns):
                    try:
                        fns[name]()
                    except Exception as exc:  # noqa: BLE001 - a failure is reported, not fatal
                        notes[name] = f"ERR({type(exc).__name__}: {str(exc)[:60]})"
                        del fns[name]
                flops = 4 * batch * nheads * seqlen ** 2 * hdim / (2 if causal else 1)
                tflops: dict[str, object] = dict(notes)
                tflops.update(time_interleaved(timer, fns, list(fns), args.repeat, flops))

                def ratio(a: str, b: str) -> str:
                    x, y = tflops.get(a), tflops.get(b)
                    return f"{x / y:.2f}" if isinstance(x, float) and isinstance(y, float) else "-"

                print(f"| {hdim} | {int(causal)} | {seqlen} | " + " | ".join(format_cells(tflops, systems))
                      + f" | {ratio('fp8', 'bf16')} | {ratio('fp8_vt', 'bf16')} | {ratio('fp8_vt', 'cudnn_bf16')}"
                      f" | {ratio('fp8_vt', 'fp8')} | {ratio('fp8_vt_block', 'fp8_block')} |", flush=True)
    if not args.no_quantize:
        print("\n| quantize (bf16 -> e4m3, q, k, v of 16k x 2048) | ms | GB/s |\n|---|---|---|")
        q, k, v = (torch.randn(8, 2048, 16, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        moved = 3 * q.numel() * (2 + 1)  # read bf16, write e4m3 (scales are negligible)
        copy_src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
        copy_dst = torch.empty_like(copy_src)
        for name, fn, nbytes in (
            ("device copy (bandwidth yardstick)", lambda: copy_dst.copy_(copy_src), 2 * copy_src.numel()),
            ("per block + Hadamard, torch", lambda: fp8.quantize_qkv(q, k, v, hadamard_qk=True, impl="torch"), moved),
            ("per tensor, torch", lambda: fp8.quantize_qkv(q, k, v, block=False, hadamard_qk=False, impl="torch"), moved),
            ("per block + Hadamard, triton", lambda: fp8.quantize_qkv(q, k, v, hadamard_qk=True, impl="triton"), moved),
            ("per block, triton", lambda: fp8.quantize_qkv(q, k, v, hadamard_qk=False, impl="triton"), moved),
            ("per block + Hadamard, triton, v keys-major", lambda: fp8.quantize_qkv(
                q, k, v, hadamard_qk=True, impl="triton", v_layout="keys"), moved),
            ("per tensor, triton", lambda: fp8.quantize_qkv(q, k, v, block=False, hadamard_qk=False, impl="triton"),
             moved),
        ):
            ms = timer(fn)
            print(f"| {name} | {ms:.3f} | {nbytes / ms / 1e6:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
