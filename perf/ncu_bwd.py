"""Backwards of ours (default, deterministic) and FA4's on the same inputs, for Nsight Compute (not a test).

    ncu --clock-control none --profile-from-start off --set full --page details \
        python perf/ncu_bwd.py HDIM SEQLEN CAUSAL(0|1) [MODES]

MODES: comma-separated among ``default``, ``deterministic`` (ours, ``backend="sm90"``) and ``fa4``
(FA4's sm90 backward, a benchmark-only peer; ``perf/bench_bwd.fa4_func``); default
``default,deterministic``. bf16, 16k tokens, nheads * hdim = 2048 (the bench sizes). Each mode runs
three times unprofiled first (compiles), then every forward runs, and only the backwards between
cudaProfilerStart/Stop, so ncu sees each mode's kernels in MODES order (ours: preprocess, main,
postprocess). Questions it answers (perf/NOTES.md, sessions 18 and 21): where the deterministic main
kernel's extra time goes, and what FA4's main kernel does per cycle that ours does not (issue slots,
tensor-pipe utilization, stall reasons).
"""

import sys

import torch

from bench_bwd import fa4_func
from flashattn_hopper import flash_attn_func


def main(argv: list[str]) -> None:
    hdim, seqlen, causal = int(argv[0]), int(argv[1]), bool(int(argv[2]))
    modes = argv[3].split(",") if len(argv) > 3 else ["default", "deterministic"]
    batch, nheads = max(16384 // seqlen, 1), 2048 // hdim
    q, k, v, dout = (torch.randn(batch, seqlen, nheads, hdim, dtype=torch.bfloat16, device="cuda")
                     for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    fa4 = fa4_func() if "fa4" in modes else None

    def forward(mode: str) -> torch.Tensor:
        if mode == "fa4":
            out = fa4(*leaves, causal=causal)
            return out[0] if isinstance(out, tuple) else out
        return flash_attn_func(*leaves, causal=causal, deterministic=mode == "deterministic", backend="sm90")

    for _ in range(3):
        for mode in modes:
            torch.autograd.grad(forward(mode), leaves, dout)
    outs = [forward(mode) for mode in modes]
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for out in outs:
        torch.autograd.grad(out, leaves, dout)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main(sys.argv[1:])
