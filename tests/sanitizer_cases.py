"""Small calls of every kernel family, run under compute-sanitizer by tests/test_sanitizer.py.

    python -m tests.sanitizer_cases [CASE ...]     # all cases when none is named; --list names them

Each case is a few tiny launches (short sequences, one or two heads) so that racecheck, which
slows shared-memory-heavy kernels by orders of magnitude, finishes in seconds. The process prints
``case <name>`` before each one, so a sanitizer report can be matched to the case that launched it.
Kernels compile on first use (the disk cache keeps them for the next tool's run).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

import torch

from flashattn_hopper import flash_attn_func, flash_attn_varlen_func

# Sequences of odd lengths around a tile edge, one of them empty (varlen).
VARLEN_LENS = (17, 130, 0, 1)


def _qkv(s_q: int, s_k: int, h: int = 2, h_k: int = 1, d: int = 128, batch: int = 1, grad: bool = False,
         dv: int | None = None):
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(s: int, heads: int, width: int = d) -> torch.Tensor:
        x = torch.randn(batch, s, heads, width, dtype=torch.bfloat16, device="cuda", generator=gen)
        return x.requires_grad_(grad)

    return rand(s_q, h), rand(s_k, h_k), rand(s_k, h_k, dv or d)


def _packed(lens: tuple[int, ...], h: int = 2, h_k: int = 1, d: int = 128, grad: bool = False):
    gen = torch.Generator(device="cuda").manual_seed(0)
    total = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")

    def rand(heads: int) -> torch.Tensor:
        x = torch.randn(total, heads, d, dtype=torch.bfloat16, device="cuda", generator=gen)
        return x.requires_grad_(grad)

    return rand(h), rand(h_k), rand(h_k), cu, max(lens)


def _dense(backend: str | None, backward: bool = False, d: int = 128, dv: int | None = None, h: int = 2,
           h_k: int = 1, **kwargs) -> Callable[[], None]:
    def run() -> None:
        for s_q, s_k in ((113, 203), (256, 256)):
            q, k, v = _qkv(s_q, s_k, h=h, h_k=h_k, d=d, grad=backward, dv=dv)
            out = flash_attn_func(q, k, v, backend=backend, **kwargs)
            if backward:
                out.backward(torch.randn_like(out))
    return run


def _varlen(backend: str | None, backward: bool = False, d: int = 128, **kwargs) -> Callable[[], None]:
    def run() -> None:
        q, k, v, cu, max_len = _packed(VARLEN_LENS, d=d, grad=backward)
        out = flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, backend=backend, **kwargs)
        if backward:
            out.backward(torch.randn_like(out))
    return run


def _gated() -> None:
    """The gate's bias in the sm90 forward (by TMA beside each K block), odd lengths, GQA, and
    its backward (in the sm90 backward kernel: the bias per key, dG's sums)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    for s_q, s_k in ((113, 203), (256, 256)):
        q, k, v = _qkv(s_q, s_k, d=64, grad=True)
        g = torch.nn.functional.logsigmoid(torch.randn(1, s_k, 2, device="cuda", generator=gen)).requires_grad_()
        out = flash_attn_func(q, k, v, causal=True, log_decay=g)
        out.backward(torch.randn_like(out))


def _gated_varlen() -> None:
    """The gate's bias in the sm90 forward with varlen keys: sequences at offsets that are not
    multiples of 4 (each TMA box starts at the 16-byte boundary before its block), GQA; and its backward."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, cu, max_len = _packed((333, 17, 130, 0, 1), d=64, grad=True)
    g = torch.nn.functional.logsigmoid(torch.randn(q.shape[0], 2, device="cuda", generator=gen)).requires_grad_()
    out = flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=True, log_decay=g)
    out.backward(torch.randn_like(out))


def _gated_slice() -> None:
    """The gate's bias as K's 8-column slice in the QK^T GEMM (from 1024 keys: the scan builds it, the sm90
    forward runs as the scan's programmatic dependent and zeroes sKx's other columns once), dense and packed."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = _qkv(1024, 1024, d=64, grad=True)
    g = torch.nn.functional.logsigmoid(torch.randn(1, 1024, 2, device="cuda", generator=gen)).requires_grad_()
    out = flash_attn_func(q, k, v, causal=True, log_decay=g)
    out.backward(torch.randn_like(out))
    q, k, v, cu, max_len = _packed((1100, 1030), d=64, grad=True)
    g = torch.nn.functional.logsigmoid(torch.randn(q.shape[0], 2, device="cuda", generator=gen)).requires_grad_()
    out = flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=True, log_decay=g)
    out.backward(torch.randn_like(out))


def _sink_varlen() -> None:
    """A learnable sink in the sm90 forward (its logit loaded at each tile's start) and its gradient in
    the backward's preprocess (one part per warp of each CTA, some varlen CTAs past the last sequence),
    odd lengths and an empty sequence, GQA."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, cu, max_len = _packed((333, 17, 130, 0, 1), grad=True)
    sink = torch.randn(2, device="cuda", generator=gen).requires_grad_()
    out = flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=True, learnable_sink=sink)
    out.backward(torch.randn_like(out))


def _clusters() -> None:
    """The hdim 256 row's clusters of 2 (shipped from 8k tokens), forced at a short length."""
    from flashattn_hopper import configs
    from flashattn_hopper.backends import sm90_fwd

    tile_of, pack_of = configs.sm90_fwd_tile, sm90_fwd.pack_gqa_factor
    configs.sm90_fwd_tile = lambda *a, **kw: dataclasses.replace(tile_of(*a, **kw), cluster_m=2)
    sm90_fwd.pack_gqa_factor = lambda *a, **kw: 1
    try:
        q, k, v = _qkv(300, 300, d=256)
        flash_attn_func(q, k, v, backend="sm90")
    finally:
        configs.sm90_fwd_tile, sm90_fwd.pack_gqa_factor = tile_of, pack_of


def _few_sms(case: Callable[[], None]) -> Callable[[], None]:
    """``case`` with the sm90 launcher told the GPU has 2 SMs: each persistent CTA walks many tiles,
    so the dynamic scheduler's handoff runs in its steady state (the producer waits for every
    consumer's read of one index before it publishes the next), not only its first publish."""
    def run() -> None:
        from flashattn_hopper.backends import sm90_fwd

        num_sms = sm90_fwd.num_sms
        sm90_fwd.num_sms = lambda index: 2
        try:
            case()
        finally:
            sm90_fwd.num_sms = num_sms
    return run


def _pack_gqa() -> None:
    """Decode-style GQA: 8 query heads per KV head packed into one tile's rows."""
    q, k, v = _qkv(4, 300, h=8, h_k=1)
    flash_attn_func(q, k, v, causal=True, backend="sm90")


def _fp8(causal: bool, varlen: bool, d: int = 128) -> Callable[[], None]:
    """The FP8 forward: V transposed by the producer warpgroup's spare warps into sVt (generic stores
    the WGMMA reads), GQA 2:1, odd lengths, several key blocks per tile. ``d`` 256: 64-byte sVt
    swizzle atoms (tile_n 64), the widest transpose."""
    def run() -> None:
        ones = torch.ones(len(VARLEN_LENS) if varlen else 1, 1, device="cuda")
        if varlen:
            q, k, v, cu, max_len = _packed(VARLEN_LENS, d=d)
            q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
            flash_attn_varlen_func(q8, k8, v8, cu, cu, max_len, max_len, causal=causal, q_descale=ones,
                                   k_descale=ones, v_descale=ones)
        else:
            q, k, v = _qkv(300, 300, d=d)
            q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
            flash_attn_func(q8, k8, v8, causal=causal, q_descale=ones, k_descale=ones, v_descale=ones)
    return run


WINDOW = {"window_size": (40, 7)}

CASES: dict[str, Callable[[], None]] = {
    "sm90_fwd_dense": _dense("sm90"),
    "sm90_fwd_dense_causal": _dense("sm90", causal=True),
    "sm90_fwd_dense_local": _dense("sm90", **WINDOW),
    "sm90_fwd_varlen": _varlen("sm90"),
    "sm90_fwd_varlen_causal": _varlen("sm90", causal=True),
    "sm90_fwd_varlen_local": _varlen("sm90", **WINDOW),
    "sm90_fwd_softcap": _dense("sm90", causal=True, softcap=30.0),
    "sm90_fwd_dense_causal_2sms": _few_sms(_dense("sm90", causal=True)),
    "sm90_fwd_varlen_causal_2sms": _few_sms(_varlen("sm90", causal=True)),
    "sm90_fwd_varlen_local_2sms": _few_sms(_varlen("sm90", **WINDOW)),
    "sm90_fwd_clusters": _clusters,
    "sm90_fwd_pack_gqa": _pack_gqa,
    "sm80_fwd_bwd_dense": _dense("sm80", backward=True),
    "sm80_fwd_bwd_dense_causal": _dense("sm80", backward=True, causal=True),
    "sm80_fwd_bwd_dense_local": _dense("sm80", backward=True, **WINDOW),
    "sm80_fwd_bwd_varlen_causal": _varlen("sm80", backward=True, causal=True),
    "sm80_fwd_bwd_softcap": _dense("sm80", backward=True, causal=True, softcap=30.0),
    # The Hopper backward (its dQ writer warp's barriers and TMA reduce-adds, the deterministic turns,
    # GQA's dK/dV sums): GQA 2:1 in every case.
    "sm90_fwd_bwd_dense": _dense("sm90", backward=True),
    "sm90_fwd_bwd_mha_dense": _dense("sm90", backward=True, h=2, h_k=2),
    "sm90_fwd_bwd_dense_causal": _dense("sm90", backward=True, causal=True),
    "sm90_fwd_bwd_dense_local": _dense("sm90", backward=True, **WINDOW),
    "sm90_fwd_bwd_varlen_causal": _varlen("sm90", backward=True, causal=True),
    "sm90_fwd_bwd_softcap": _dense("sm90", backward=True, causal=True, softcap=30.0),
    "sm90_fwd_bwd_deterministic": _dense("sm90", backward=True, causal=True, deterministic=True),
    # hdim 64: the 128 x 128 tile, dQ split by rows between the MMA warpgroups.
    "sm90_fwd_bwd_d64_dense_causal": _dense("sm90", backward=True, d=64, causal=True),
    "sm90_fwd_bwd_d64_varlen_local": _varlen("sm90", backward=True, d=64, window_size=(20, 0)),
    "sm90_fwd_bwd_d64_deterministic": _dense("sm90", backward=True, d=64, deterministic=True),
    # hdim 192/256: the wide kernel (64 x 64, head_dim split between the MMA warpgroups).
    "sm90_fwd_bwd_d256_dense_causal": _dense("sm90", backward=True, d=256, causal=True),
    "sm90_fwd_bwd_d192_varlen_local": _varlen("sm90", backward=True, d=192, window_size=(20, 0)),
    "sm90_fwd_bwd_d256_deterministic": _dense("sm90", backward=True, d=256, deterministic=True),
    "sm90_fwd_bwd_d192_128_dense": _dense("sm90", backward=True, d=192, dv=128),
    "sm90_fwd_bwd_d256_mha_causal": _dense("sm90", backward=True, d=256, h=2, h_k=2, causal=True),
    # Gated log-decay: the bias inside the sm90 forward.
    "default_gated_causal": _gated,
    "default_gated_varlen_causal": _gated_varlen,
    "default_gated_slice_causal": _gated_slice,
    # A learnable sink: in the sm90 forward, its gradient in the backward's preprocess.
    "default_sink_varlen_causal": _sink_varlen,
    # The FP8 forward (dense non-causal: static persistent walk; varlen causal: dynamic handoff).
    "sm90_fp8_dense": _fp8(causal=False, varlen=False),
    "sm90_fp8_varlen_causal": _few_sms(_fp8(causal=True, varlen=True)),
    "sm90_fp8_wide_dense": _few_sms(_fp8(causal=False, varlen=False, d=256)),
    "sm90_fp8_wide_varlen_causal": _few_sms(_fp8(causal=True, varlen=True, d=256)),
    # The default path: the sm90 forward, then the backward that serves sm90.
    "default_fwd_bwd_varlen_causal": _varlen(None, backward=True, causal=True),
}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--list"]:
        print("\n".join(CASES))
        return 0
    for name in argv or list(CASES):
        print(f"case {name}", flush=True)
        CASES[name]()
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
