"""Pack GQA benchmark (not a test): decode and short-prefill GQA shapes, packed vs one head per tile.

    python perf/bench_pack_gqa.py

bf16, hdim 128, 32 query heads over 4 KV heads (g = 8) and 32 over 8 (g = 4). ``packed`` is what the
sm90 launcher picks for these shapes (configs: ``backends/sm90_fwd.pack_gqa_factor``), ``unpacked``
forces one head per tile; ``flash`` is SDPA's flash backend (FA2) on K/V repeated to 32 heads.
Timing: triton ``do_bench`` median. Reports microseconds and the packed speed-up.
"""

from __future__ import annotations

import sys

import torch


def main() -> int:
    from triton.testing import do_bench
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from flashattn_hopper import flash_attn_func
    from flashattn_hopper.backends import sm90_fwd

    choose = sm90_fwd.pack_gqa_factor
    print(f"# pack GQA, bf16, hdim 128, {torch.cuda.get_device_name()}\n")
    print("| batch | seqlen_q | seqlen_k | h / h_k | causal | packed us | unpacked us | flash us | unpacked/packed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for batch, s_q, s_k, h, h_k, causal in [
        (64, 1, 4096, 32, 4, False), (64, 1, 16384, 32, 4, False), (16, 1, 8192, 32, 8, False),
        (8, 16, 8192, 32, 4, True), (8, 64, 8192, 32, 4, True), (4, 128, 4096, 32, 8, True),
    ]:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(batch, s_q, h, 128, dtype=torch.bfloat16, device="cuda", generator=gen)
        k, v = (torch.randn(batch, s_k, h_k, 128, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(2))
        times = {}
        for name, rule in (("packed", choose), ("unpacked", lambda p, tile_m, varlen: 1)):
            sm90_fwd.pack_gqa_factor = rule
            fn = lambda: flash_attn_func(q, k, v, causal=causal, backend="sm90")  # noqa: E731
            out = fn()
            times[name] = do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
            times[name + "_out"] = out
        sm90_fwd.pack_gqa_factor = choose
        assert (times["packed_out"].float() - times["unpacked_out"].float()).abs().max().item() < 2e-2
        qt, kt, vt = q.transpose(1, 2), *(t.repeat_interleave(h // h_k, dim=2).transpose(1, 2) for t in (k, v))
        times["flash"] = float("nan")  # SDPA flash has no bottom-right causal for seqlen_q != seqlen_k
        if not causal:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                times["flash"] = do_bench(lambda: sdpa(qt, kt, vt), warmup=25, rep=100, return_mode="median") * 1e3
        print(f"| {batch} | {s_q} | {s_k} | {h}/{h_k} | {'on' if causal else 'off'} | {times['packed']:.1f} | "
              f"{times['unpacked']:.1f} | {times['flash']:.1f} | {times['unpacked'] / times['packed']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
