"""Host overhead per call (not a test): tiny shapes, so the GPU waits on Python.

    python perf/call_overhead.py [--calls 2000] [--out FILE.md]

Per system: ``--calls`` back-to-back calls of a tiny attention (batch 1, seqlen 128, 8 heads of 128,
bf16, causal) after a warm-up, one CUDA event pair around them; us per call = elapsed / calls,
which is the host's time per call whenever it exceeds the kernel's (a few us here). Forward alone
and forward + backward (``torch.autograd.grad``). Systems: ours (default backend), ours
``backend="sm80"``, and PyTorch SDPA with each backend it has (flash, cuDNN, efficient); on Hopper,
ours on e4m3 inputs with per-tensor descales (forward only), cached and through the general route
(``fp8.attention``, what every FP8 call did before its plans); packed varlen calls of the same tokens as two
64-token sequences (``flash_attn_varlen_func``: plain, plain with ``configs.VARLEN_PLANS`` on, gated). Also: the
time ``import flashattn_hopper`` adds to ``import torch``, and a new process's time from start to
its first result with a warm disk cache.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPE = (1, 128, 8, 128)


def per_call_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def systems():
    from flashattn_hopper import flash_attn_func

    def ours(backend):
        return lambda q, k, v: flash_attn_func(q, k, v, causal=True, backend=backend)

    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
                ).transpose(1, 2)
        return run

    yield "ours", ours(None)
    yield "ours sm80", ours("sm80")
    gates = torch.nn.functional.logsigmoid(torch.randn(SHAPE[0], SHAPE[1], SHAPE[2], device="cuda"))
    sinks = torch.randn(SHAPE[2], device="cuda")
    yield "ours log_decay", lambda q, k, v: flash_attn_func(q, k, v, causal=True, log_decay=gates)
    yield "ours learnable_sink", lambda q, k, v: flash_attn_func(q, k, v, causal=True, learnable_sink=sinks)
    yield from varlen_systems(gates)
    for name, backend in (("SDPA flash", SDPBackend.FLASH_ATTENTION), ("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION),
                          ("SDPA efficient", SDPBackend.EFFICIENT_ATTENTION)):
        yield name, sdpa(backend)


def varlen_systems(gates: torch.Tensor):
    """Ours on the tiny shape's tokens packed as two sequences (one cu_seqlens for q and k): plain with the
    varlen plans off and on (``configs.VARLEN_PLANS``, set per call; restored by ``main``) and gated."""
    from flashattn_hopper import configs, flash_attn_varlen_func

    half = SHAPE[1] // 2
    cu = torch.tensor([0, half, SHAPE[1]], dtype=torch.int32, device="cuda")

    def ours_varlen(plans: bool, **options):
        def run(q, k, v):
            configs.VARLEN_PLANS = plans
            packed = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
            out = flash_attn_varlen_func(*packed, cu, cu, half, half, causal=True, **options)
            return out.view(*q.shape[:3], out.shape[-1])
        return run

    yield "ours varlen (2 x 64)", ours_varlen(False)
    yield "ours varlen, VARLEN_PLANS", ours_varlen(True)
    yield "ours varlen log_decay", ours_varlen(False, log_decay=gates.reshape(-1, SHAPE[2]))


def startup_seconds() -> tuple[float, float, str]:
    """(import flashattn_hopper on top of import torch, new process to first result, that process's
    split), warm cache. The split: import torch, CUDA context + inputs, import flashattn_hopper, first
    call; and whether the DSL (``cutlass``) was imported on the way (a warm disk cache needs none)."""
    code_import = (
        "import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); "
        "import flashattn_hopper; print(time.perf_counter() - t1)"
    )
    code_first = (
        "import time, sys; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); "
        f"q = torch.randn(*{SHAPE}, dtype=torch.bfloat16, device='cuda'); torch.cuda.synchronize(); "
        "t2 = time.perf_counter(); from flashattn_hopper import flash_attn_func; t3 = time.perf_counter(); "
        "flash_attn_func(q, q, q, causal=True); torch.cuda.synchronize(); t4 = time.perf_counter(); "
        "from flashattn_hopper.jit import compile_cache as c; "
        "print(f'import torch {t1 - t0:.2f} s, CUDA context + inputs {t2 - t1:.2f} s, import flashattn_hopper "
        "{t3 - t2:.2f} s, first call {t4 - t3:.2f} s; DSL imported: {\"cutlass\" in sys.modules}, '"
        "f'disk hits {c.stats.disk_hits}, compiles {c.stats.compiles}')"
    )
    subprocess.run([sys.executable, "-c", code_first], check=True, capture_output=True)  # fills the disk cache
    imported = float(subprocess.run([sys.executable, "-c", code_import], check=True, capture_output=True,
                                    text=True).stdout.strip())
    start = time.perf_counter()
    split = subprocess.run([sys.executable, "-c", code_first], check=True, capture_output=True, text=True).stdout
    return imported, time.perf_counter() - start, split.strip().splitlines()[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    q, k, v = (torch.randn(*SHAPE, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(3))
    dout = torch.randn(*SHAPE, dtype=torch.bfloat16, device="cuda")
    lines = [f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, shape {SHAPE} bf16 causal, "
             f"{args.calls} calls", "", "| system | forward us/call | forward + backward us/call |", "|---|---|---|"]
    from flashattn_hopper import configs

    varlen_plans = configs.VARLEN_PLANS
    for name, fn in systems():
        with torch.no_grad():
            fwd = per_call_us(lambda: fn(q, k, v), args.calls)
        both = per_call_us(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout), args.calls // 4)
        lines.append(f"| {name} | {fwd:.1f} | {both:.1f} |")
        print(lines[-1], flush=True)
    configs.VARLEN_PLANS = varlen_plans
    if torch.cuda.get_device_capability() == (9, 0):
        from flashattn_hopper import flash_attn_func, fp8

        q8, k8, v8 = (t.detach().to(torch.float8_e4m3fn) for t in (q, k, v))
        scales = {name: torch.ones(SHAPE[0], SHAPE[2], device="cuda") for name in fp8.DESCALE_NAMES}
        for name, fn in (
            ("ours e4m3 (cached plan)", lambda: flash_attn_func(q8, k8, v8, causal=True, **scales)),
            ("ours e4m3 (general route)", lambda: fp8.attention(q8, k8, v8, dict(scales), None, True, (-1, -1), 0.0, None)),
        ):
            lines.append(f"| {name} | {per_call_us(fn, args.calls):.1f} | - |")
            print(lines[-1], flush=True)
    imported, first, split = startup_seconds()
    lines += ["", f"import flashattn_hopper on top of import torch: {imported:.3f} s; "
              f"new process to first result (warm disk cache): {first:.2f} s", f"({split})"]
    print("\n".join(lines[-2:]))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
