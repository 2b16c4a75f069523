"""One sm90 backward of ours, default and deterministic, on the same inputs, for Nsight Compute (not a test).

    ncu --clock-control none --profile-from-start off --set full --page details \
        python perf/ncu_bwd.py HDIM SEQLEN CAUSAL(0|1)

bf16, 16k tokens, nheads * hdim = 2048 (the bench sizes). Each mode runs three times unprofiled first
(compiles); then both forwards run, and only the two backwards between cudaProfilerStart/Stop, so
ncu sees the default mode's kernels and then the deterministic mode's (preprocess, main,
postprocess each). The question it answers
(perf/NOTES.md, session 18): where the deterministic main kernel's extra time goes, the dQ writer
warp's spin on its turn (semaphore loads in a loop) or the MMA warpgroups' wait for sdQ (DQ_EMPTY);
compare the two main kernels' warp-state samples (``--set full``: source counters per SASS line).
"""

import sys

import torch

from flashattn_hopper import flash_attn_func


def main(argv: list[str]) -> None:
    hdim, seqlen, causal = int(argv[0]), int(argv[1]), bool(int(argv[2]))
    batch, nheads = max(16384 // seqlen, 1), 2048 // hdim
    q, k, v, dout = (torch.randn(batch, seqlen, nheads, hdim, dtype=torch.bfloat16, device="cuda")
                     for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def forward(deterministic: bool) -> torch.Tensor:
        return flash_attn_func(*leaves, causal=causal, deterministic=deterministic, backend="sm90")

    for _ in range(3):
        for deterministic in (False, True):
            torch.autograd.grad(forward(deterministic), leaves, dout)
    outs = [forward(False), forward(True)]
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for out in outs:
        torch.autograd.grad(out, leaves, dout)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main(sys.argv[1:])
