"""Host time of one backward on a tiny problem, split by piece (needs a GPU; not a test).

    python perf/call_pieces_bwd.py [--backend sm90|sm80] [--calls 300]

Issue 23's target is < 25 us per cached backward call; ``perf/call_overhead.py`` measured ~860 us of
host time for ours (forward + backward 970 us, forward alone 110 us; H100, 2026-11-25, the sm80
backward then). The kernels take microseconds at this shape (2 x 16 x 2 x 128, bf16), so wall time
per call is the host path. Rows, each a per-call average after a warm-up:

- ``autograd.grad`` through the API (forward done once, graph retained), for a planned call (a
  signature's second call on: what a training step pays) and a signature's first call; forward + grad;
- ``BwdPlan call``: the plan's own call (allocations + its 3-5 TVM-FFI launches), no autograd;
- ``plan pieces``: the scratch allocations alone, then each launch with ready arguments;
- ``autograd.grad`` of an identity ``autograd.Function`` of the same tensors: the engine's own cost;
- the top functions of a cProfile of the API path.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch


def per_call_us(fn, calls: int) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        return q.clone()

    @staticmethod
    def backward(ctx, dout):
        return dout, None, None


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default=None, choices=[None, "sm90", "sm80"])
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args(argv)

    from flashattn_hopper import dispatch, flash_attn_func, validate

    q, k, v, dout = (torch.randn(2, 16, 2, 128, dtype=torch.bfloat16, device="cuda") for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    # The first call of a signature makes its plan (FlashAttnFunc); later calls run the plan
    # (PlannedAttnFunc, whose backward keeps its BwdPlan): what a training step pays from step 2 on.
    first = flash_attn_func(*leaves, backend=args.backend)
    out = flash_attn_func(*leaves, backend=args.backend)
    print(f"# backward host pieces, {torch.cuda.get_device_name()}, backend {args.backend or 'default'}, "
          f"{args.calls} calls each\n")
    rows = [
        ("autograd.grad through the API (planned call)",
         lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)),
        ("autograd.grad through the API (first call of a signature)",
         lambda: torch.autograd.grad(first, leaves, dout, retain_graph=True)),
        ("forward + autograd.grad through the API (planned)",
         lambda: torch.autograd.grad(flash_attn_func(*leaves, backend=args.backend), leaves, dout)),
    ]

    p = validate.validate_dense(q, k, v, None, False, (-1, -1), 0.0)
    family = dispatch.bwd_kernel_for(q.device, args.backend, p, False)
    out_d, lse = flash_attn_func(q, k, v, backend=args.backend, return_lse=True)
    plan = family.plan(p, None, False, q.device)
    rows.append((f"BwdPlan call ({family.backend})", lambda: plan(dout, q, k, v, out_d, lse)))
    f32 = torch.float32

    def scratch() -> None:
        torch.empty(plan.rows_shape, dtype=f32, device="cuda")
        torch.empty(plan.rows_shape, dtype=f32, device="cuda")
        torch.empty(plan.acc_shape, dtype=f32, device="cuda")
        for shape in (plan.q_shape, plan.k_shape, plan.v_shape):
            torch.empty(shape, dtype=q.dtype, device="cuda")

    rows.append(("  its 6 allocations", scratch))
    ident_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ident_out = _Identity.apply(*ident_leaves)
    rows.append(("autograd.grad of an identity Function",
                 lambda: torch.autograd.grad(ident_out, ident_leaves[:1], dout, retain_graph=True)))
    for name, fn in rows:
        print(f"| {name} | {per_call_us(fn, args.calls):.1f} us |", flush=True)

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.calls):
        torch.autograd.grad(out, leaves, dout, retain_graph=True)
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(20)
    print(text.getvalue()[-5000:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
