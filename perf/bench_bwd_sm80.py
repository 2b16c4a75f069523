"""Backward benchmark of the Ampere FA2 path (kernels/common/bwd_pre.py, bwd_sm80.py, bwd_post.py; not a test).

    python perf/bench_bwd_sm80.py [--hdims 64 128 256] [--seqlens 512 ... 16384] [--causal off on]
                                  [--repeat N] [--deterministic] [--variants scalar-red ...]

FA3-paper sizes: bf16, batch * seqlen = 16k tokens, nheads * hdim = 2048, MHA. Times the backward
alone: ``torch.autograd.grad`` of a retained forward graph, for ours (``backend="sm80"``: preprocess,
main kernel, postprocess and their scratch allocations) and for SDPA pinned to FLASH_ATTENTION (FA2,
the issue's baseline) and CUDNN_ATTENTION, on BHSD copies of the same inputs. Before timing, our
gradients are checked against SDPA flash's on the same inputs (max abs difference per gradient
below 0.1: a wrong kernel gets no speed). Timing: triton ``do_bench`` median (warm-up 25 ms, 100 ms
of reps) when triton imports, else CUDA events; ``--repeat N`` times every column N times,
interleaved (a clock drift hits all alike), and reports the median. FLOPs = 2.5 * 4 * b * h * s^2 * d
(x 1/2 causal). Prints a Markdown table of TFLOP/s and ours / FA2, ours / cuDNN. ``--variants``
adds columns of our backward with key fields overridden (A/B runs; each is
checked like ours and reported against FA2).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from bench_fwd_sm90 import format_cells, make_timer, time_interleaved

GRAD_TOLERANCE = 0.1  # bf16 gradients of O(1) inputs: kernels that agree differ by ~1e-2
# Key fields overridden per variant column, in every key of the call that has them (main kernel:
# backends/sm80_bwd.BwdKey; dq_red_vec also in the dQ postprocess's key); a variant whose buffers
# exceed shared memory reports ERR in its column.
VARIANTS = {
    "scalar-red": {"dq_red_vec": 1},  # one fp32 per dQ reduce-add (sm_90 ships 4)
    "stsm-pds": {"stmatrix_pds": True},  # P and dS stored by stmatrix (sm_90; shipped at hdim 64)
    "sts32-pds": {"stmatrix_pds": False},  # P and dS stored with 32-bit shared stores
    "scalar-sts32": {"dq_red_vec": 1, "stmatrix_pds": False},  # both (the sm_90 kernel before 2026-11-21)
    "dv-first": {"dv_first": True},  # dV GEMM before dQ (FA2's order)
    "dq-first": {"dv_first": False},
    "stages-1-1": {"stages_q": 1, "stages_do": 1},  # one Q and one dO buffer
    "stages-2-1": {"stages_q": 2, "stages_do": 1},
    "stages-2-2": {"stages_q": 2, "stages_do": 2},
    "no-tail": {"tail_split": False},  # the launch's last wave of key blocks not split (shipped: split)
}


def with_keys(fn, overrides: dict):
    """``fn`` run with the fields in ``overrides`` replaced in every key ``BwdSm80.keys`` returns
    that has them."""
    from flashattn_hopper.backends.sm80_bwd import BwdSm80

    def override(key):
        names = {f.name for f in dataclasses.fields(key)}
        return dataclasses.replace(key, **{k: v for k, v in overrides.items() if k in names})

    def run():
        shipped = BwdSm80.keys

        def keys(self, *args, **kwargs):
            return tuple(override(key) for key in shipped(self, *args, **kwargs))

        BwdSm80.keys = keys
        try:
            return fn()
        finally:
            BwdSm80.keys = shipped

    return run


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--causal", nargs="+", default=["off", "on"], choices=["off", "on"])
    ap.add_argument("--repeat", type=int, default=1,
                    help="time every column this many times, interleaved, and report the median")
    ap.add_argument("--deterministic", action="store_true", help="our backward with deterministic=True")
    ap.add_argument("--variants", nargs="*", default=[], choices=list(VARIANTS),
                    help="extra columns: our backward with key fields overridden")
    args = ap.parse_args(argv)

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from flashattn_hopper import flash_attn_func

    timer = make_timer()
    print(f"# bwd, bf16, 16k tokens, nheads*hdim=2048, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"deterministic={args.deterministic}, repeat={args.repeat}\n")
    ours_cols = ["sm80", *(f"sm80-{name}" for name in args.variants)]
    cols = [*ours_cols, "flash", "cudnn"]
    ratio_cols = [f"{c}/flash" for c in ours_cols] + ["sm80/cudnn"]
    print("| hdim | seqlen | causal | " + " | ".join(cols + ratio_cols) + " |")
    print("|" + "---|" * (len(cols) + len(ratio_cols) + 3))
    for hdim in args.hdims:
        for seqlen in args.seqlens:
            for causal in (c == "on" for c in args.causal):
                batch, nheads = max(16384 // seqlen, 1), 2048 // hdim
                gen = torch.Generator(device="cuda").manual_seed(0)
                q, k, v, dout = (torch.randn(batch, seqlen, nheads, hdim, dtype=torch.bfloat16, device="cuda",
                                             generator=gen) for _ in range(4))
                flops = 2.5 * 4 * batch * nheads * seqlen * seqlen * hdim * (0.5 if causal else 1.0)
                leaves = tuple(t.clone().requires_grad_() for t in (q, k, v))
                out = flash_attn_func(*leaves, causal=causal, deterministic=args.deterministic, backend="sm80")
                fns = {"sm80": lambda o=out, x=leaves: torch.autograd.grad(o, x, dout, retain_graph=True)}
                for name in args.variants:
                    fns[f"sm80-{name}"] = with_keys(fns["sm80"], VARIANTS[name])
                bhsd = tuple(t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
                dout_bhsd = dout.transpose(1, 2).contiguous()
                for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                    with sdpa_kernel(backend):
                        o = sdpa(*bhsd, is_causal=causal)
                    fns[name] = lambda o=o: torch.autograd.grad(o, bhsd, dout_bhsd, retain_graph=True)
                tflops, timed = {}, []
                for name, fn in fns.items():
                    try:
                        fn()
                        timed.append(name)
                    except Exception as e:  # report and keep going: one broken cell must not hide the rest
                        tflops[name] = f"ERR({type(e).__name__})"
                        print(f"note: {name} hdim{hdim} s{seqlen} causal={causal}: {e}", file=sys.stderr)
                for col in ours_cols:
                    if col in timed and "flash" in timed:
                        ours, theirs = fns[col](), fns["flash"]()
                        err = max((a - b.transpose(1, 2)).abs().max().item() for a, b in zip(ours, theirs))
                        if not err < GRAD_TOLERANCE:
                            tflops[col] = f"WRONG({err:.2g})"
                            timed.remove(col)
                tflops.update(time_interleaved(timer, fns, timed, args.repeat, flops))
                cells = format_cells(tflops, cols)
                ratios = []
                for col, base in [(col, "flash") for col in ours_cols] + [("sm80", "cudnn")]:
                    a, b = tflops.get(col), tflops.get(base)
                    ratios.append(f"{a / b:.2f}" if isinstance(a, float) and isinstance(b, float) else "-")
                print(f"| {hdim} | {seqlen} | {'on' if causal else 'off'} | " + " | ".join(cells + ratios) + " |",
                      flush=True)
                del out, fns
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
