"""One sm90 forward of ours and one of SDPA cuDNN on the same inputs, for Nsight Compute (not a test).

    ncu --clock-control none --profile-from-start off --set full --page details \
        python perf/ncu_fwd.py HDIM SEQLEN CAUSAL(0|1) [fp8 | fp8_vt | sink]

bf16 (or, with ``fp8``, our e4m3 forward with per-tensor descales beside cuDNN's bf16; ``fp8_vt``: the same with v's
keys contiguous, the V^T kernel), 16k tokens, nheads * hdim = 2048 (the bench sizes). Both run three times unprofiled first (our
compile, cuDNN's plan), then once each between cudaProfilerStart/Stop, so ncu sees two kernels. ``sink``: our
forward with a learnable sink (in the kernel's finalize) beside our plain one instead of cuDNN's (issue 24: the
sinked kernel ran +4.8 % at hdim 128 1k causal on an H200, perf/NOTES.md session 40).
"""

import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

from flashattn_hopper import flash_attn_func


def main(argv: list[str]) -> None:
    hdim, seqlen, causal = int(argv[0]), int(argv[1]), bool(int(argv[2]))
    use_fp8 = len(argv) > 3 and argv[3] in ("fp8", "fp8_vt")
    keys_major = len(argv) > 3 and argv[3] == "fp8_vt"
    use_sink = len(argv) > 3 and argv[3] == "sink"
    batch, nheads = max(16384 // seqlen, 1), 2048 // hdim
    q, k, v = (torch.randn(batch, seqlen, nheads, hdim, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    if keys_major:  # (v's keys contiguous: the layout ``fp8.quantize_qkv(v_layout="keys")`` writes)
        from flashattn_hopper import fp8

        v8_keys = fp8.keys_major_empty(v8.shape, v8.device)
        v8_keys.view(torch.uint8).copy_(v8.view(torch.uint8))
        v8 = v8_keys

    def ours():
        if use_fp8:
            return flash_attn_func(q8, k8, v8, causal=causal, backend="sm90")
        return flash_attn_func(q, k, v, causal=causal, backend="sm90")

    sink = torch.randn(nheads, device="cuda")

    def cudnn():
        if use_sink:  # (the peer: our sinked forward)
            return flash_attn_func(q, k, v, causal=causal, backend="sm90", learnable_sink=sink)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(qt, kt, vt, is_causal=causal)

    for _ in range(3):
        ours()
        cudnn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    ours()
    cudnn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main(sys.argv[1:])
