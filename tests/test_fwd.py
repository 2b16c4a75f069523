"""Forward parity through the public API against the fp32 reference (GPU tier).

Rule (flash-attn's): max|ours - ref_fp32| <= 2 * max|pytorch_same_dtype - ref_fp32| + atol, for out and lse.
The sm80 forward, forced with backend='sm80' (it runs on Ampere and on Hopper), plus the API's own
behaviour through the default backend (return values, empty inputs, devices, streams, the disk cache).
The sm90 forward's tests are in test_fwd_sm90.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from flashattn_hopper import flash_attn_func
from flashattn_hopper.testing import assert_close_to_ref, attention_ref

from ._subprocess import subprocess_env
from ._parity import check_parity as _check_parity
from ._parity import check_poisoned_outputs, make_qkv
from .shapes import HEAD_DIMS_FAST, HEAD_DIMS_SLOW, HEADS, SEQLENS_FAST, SEQLENS_SLOW

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16]



def check_parity(q, k, v, causal, backend="sm80", **kwargs):
    return _check_parity(q, k, v, causal, backend, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS_FAST)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS_FAST, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}k{h[1]}")
def test_fwd_parity(dtype, head_dim, causal, seqlens, heads):
    (s_q, s_k), (h, h_k) = seqlens, heads
    q, k, v = make_qkv(2, s_q, s_k, h, h_k, head_dim, dtype=dtype)
    check_parity(q, k, v, causal)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS_SLOW)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS_SLOW, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}k{h[1]}")
def test_fwd_parity_full(dtype, head_dim, causal, seqlens, heads):
    (s_q, s_k), (h, h_k) = seqlens, heads
    q, k, v = make_qkv(3, s_q, s_k, h, h_k, head_dim, dtype=dtype, seed=1)
    check_parity(q, k, v, causal)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_poisoned_outputs_are_fully_overwritten(head_dim, causal):
    q, k, v = make_qkv(2, 239, 113, 4, 2, head_dim)
    check_poisoned_outputs(q, k, v, causal, "sm80")


def test_rows_with_no_keys_are_zero_with_minus_inf_lse():
    q, k, v = make_qkv(1, 300, 40, 2, 2, 64)
    out, lse = check_parity(q, k, v, causal=True)
    assert (out[:, :260] == 0).all() and torch.isneginf(lse[:, :, :260]).all()


@pytest.mark.parametrize("head_dim,head_dim_v", [(32, 32), (80, 80), (96, 96), (128, 64), (72, 40)])
def test_padded_head_dims(head_dim, head_dim_v):
    q, k, v = make_qkv(2, 77, 150, 4, 4, head_dim, dv=head_dim_v)
    out, _ = check_parity(q, k, v, causal=False)
    assert out.shape[-1] == head_dim_v


def test_strided_views_of_packed_qkv():
    qkv = torch.randn(2, 200, 3, 4, 128, dtype=torch.bfloat16, device="cuda")
    q, k, v = qkv.unbind(dim=2)
    check_parity(q, k, v, causal=True)


def test_softmax_scale_and_default():
    q, k, v = make_qkv(1, 64, 64, 2, 2, 64)
    check_parity(q, k, v, causal=False, softmax_scale=0.3)
    out_default = flash_attn_func(q, k, v, backend="sm80")
    out_explicit = flash_attn_func(q, k, v, softmax_scale=64**-0.5, backend="sm80")
    torch.testing.assert_close(out_default, out_explicit, atol=0, rtol=0)


@pytest.mark.parametrize("backend", [None, "sm80"], ids=["default", "sm80"])
def test_return_values(backend):
    """out alone by default; (out, lse) with return_attn_probs (flash-attn's name) as with return_lse,
    both checked against the fp32 reference."""
    q, k, v = make_qkv(1, 16, 16, 2, 2, 64)
    out_ref, lse_ref = attention_ref(q, k, v)
    out_pt, lse_pt = attention_ref(q, k, v, upcast=False)
    out = flash_attn_func(q, k, v, backend=backend)
    assert isinstance(out, torch.Tensor)
    assert_close_to_ref("out", out, out_ref, out_pt)
    for flag in ("return_attn_probs", "return_lse"):
        out, lse = flash_attn_func(q, k, v, backend=backend, **{flag: True})
        assert lse.shape == (1, 2, 16) and lse.dtype == torch.float32, flag
        assert_close_to_ref(f"{flag} out", out, out_ref, out_pt)
        assert_close_to_ref(f"{flag} lse", lse, lse_ref, lse_pt, atol=1e-4)


@pytest.mark.parametrize("shape", [(0, 16, 16), (2, 0, 16), (2, 16, 0)], ids=["batch0", "seqlen_q0", "seqlen_k0"])
def test_empty_inputs_return_without_launch(shape):
    b, s_q, s_k = shape
    q, k, v = make_qkv(b, s_q, s_k, 2, 2, 64)
    out, lse = flash_attn_func(q, k, v, return_lse=True)
    assert out.shape == (b, s_q, 2, 64) and lse.shape == (b, 2, s_q)
    if s_k == 0:
        assert (out == 0).all() and torch.isneginf(lse).all()


def test_auto_backend_runs_on_this_gpu():
    q, k, v = make_qkv(2, 100, 100, 4, 4, 128)
    out_auto = flash_attn_func(q, k, v, causal=True)
    out_ref, _ = attention_ref(q, k, v, causal=True)
    out_pt, _ = attention_ref(q, k, v, causal=True, upcast=False)
    assert_close_to_ref("out", out_auto, out_ref, out_pt)


@pytest.mark.sm90
def test_explicit_sm90_does_not_fall_back():
    """backend='sm90' runs the Hopper kernels or raises; it never quietly uses the sm80 ones (here: the
    sm90 backward at q/k head dim 64 with v at 256, which it does not implement; the default backend would
    run sm80's)."""
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 16, 16, 2, 2, 64, dv=256))
    out = flash_attn_func(q, k, v, backend="sm90")
    with pytest.raises(NotImplementedError, match="sm90"):
        out.sum().backward()


@pytest.mark.parametrize("backend", [None, "sm80"], ids=["default", "sm80"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cached_calls_take_their_plan(monkeypatch, backend, causal):
    """A dense call with plain options runs through its signature's plan (``api._PLANS``), forward and
    backward, never the general path (patched here to fail): a plan whose call raises (an argument
    missing: the non-causal sm90 plan did, until session 18) falls back to the general path on every
    call, silently, at several times the host time. Results against the fp32 reference."""
    from flashattn_hopper import api

    def general_path(*args, **kwargs):
        raise AssertionError("the call took the general path, not its plan")

    monkeypatch.setattr(api, "_attention", general_path)
    q, k, v = make_qkv(1, 77, 77, 2, 2, 128)
    dout = torch.randn_like(q)
    out_ref, _ = attention_ref(q, k, v, causal=causal)
    out_pt, _ = attention_ref(q, k, v, causal=causal, upcast=False)
    for grad in (False, True, True):  # the first call of each signature makes its plan
        leaves = [t.clone().requires_grad_(grad) for t in (q, k, v)]
        out = flash_attn_func(*leaves, causal=causal, backend=backend)
        assert_close_to_ref("out", out, out_ref, out_pt)
        if grad:
            assert type(out.grad_fn).__name__ == "PlannedAttnFuncBackward"
            dq, _, _ = torch.autograd.grad(out, leaves, dout)
            assert torch.isfinite(dq).all()


@pytest.mark.parametrize("backend", [None, "sm80"], ids=["default", "sm80"])
@pytest.mark.parametrize("seqused", [False, True], ids=["cu", "seqused"])
def test_varlen_calls_take_their_plan(monkeypatch, backend, seqused):
    """``configs.VARLEN_PLANS`` (session 39, on since session 40): a repeated plain varlen call runs its signature's
    plan (``PackedFwdPlan``, the backward's plan kept on it) with its own cu_seqlens and seqused, never the general
    path: out and lse bit for bit, and the gradients within the atomic dQ rounding, of the general path's on the
    same packing (another packing of as many tokens and sequences than the plan's first call's), GQA, causal."""
    from flashattn_hopper import api, configs, flash_attn_varlen_func

    gen = torch.Generator(device="cuda").manual_seed(3)
    q, dout = (torch.randn(700, 4, 128, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(2))
    k, v = (torch.randn(700, 2, 128, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(2))
    packings = [torch.tensor(c, dtype=torch.int32, device="cuda") for c in ([0, 300, 650, 700], [0, 17, 400, 700])]
    used = torch.tensor([10, 300, 50], dtype=torch.int32, device="cuda") if seqused else None

    def call(cu):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = flash_attn_varlen_func(*leaves, cu, cu, 400, 400, causal=True, seqused_q=used, seqused_k=used,
                                          return_lse=True, backend=backend)
        return out, lse, *torch.autograd.grad(out, leaves, dout), type(out.grad_fn).__name__

    want = call(packings[1])  # (the general path: no varlen plans)
    monkeypatch.setattr(configs, "VARLEN_PLANS", True)
    call(packings[0])  # (makes the plan)
    general, attention = [], api._attention
    monkeypatch.setattr(api, "_attention", lambda *a, **kw: general.append(1) or attention(*a, **kw))
    got = call(packings[1])
    assert not general and got[-1] == "PlannedAttnFuncBackward"
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for name, a, b in zip(("dq", "dk", "dv"), got[2:5], want[2:5]):
        torch.testing.assert_close(a, b, msg=name)


def test_mixed_devices_named():
    q, k, v = make_qkv(1, 16, 16, 2, 2, 64)
    with pytest.raises(ValueError, match="k must be on the same device as q"):
        flash_attn_func(q, k.cpu(), v)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs to check that cuda:1 inputs run on cuda:1")
def test_second_device():
    q, k, v = make_qkv(1, 100, 100, 2, 2, 64, device="cuda:1")
    out = flash_attn_func(q, k, v)
    assert out.device == q.device
    out_ref, _ = attention_ref(q, k, v)
    out_pt, _ = attention_ref(q, k, v, upcast=False)
    assert_close_to_ref("out", out, out_ref, out_pt)


# ~0.1 s at the H100/H200 clocks (1.6-2 GHz): far longer than a launch's host time once compiled.
SLEEP_CYCLES = 200_000_000


@pytest.mark.parametrize("backend", [None, "sm80"], ids=["default", "sm80"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_non_default_stream(backend, causal):
    """The kernel runs on the caller's current stream, in its order, without synchronizing. On a side
    stream a ~0.1 s sleep kernel runs first, then the copy that makes q valid (it is NaN before); a
    kernel launched on any other stream (the default stream does not wait for PyTorch's side streams)
    would read the NaNs. The sleep must still be running when the call returns (no synchronization),
    and the result, read after an event recorded behind it on the side stream, matches the reference.
    Causal on the default backend also takes the sm90 forward's per-stream tile counter."""
    q, k, v = make_qkv(2, 512, 512, 4, 4, 128)
    flash_attn_func(q, k, v, causal=causal, backend=backend)  # compiled: the launch below takes microseconds
    q_late = torch.full_like(q, float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # q, k, v and the NaN fill are done
    slept, done = torch.cuda.Event(), torch.cuda.Event()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        slept.record(stream)
        q_late.copy_(q)
        out = flash_attn_func(q_late, k, v, causal=causal, backend=backend)
        done.record(stream)
    assert not slept.query(), "the sleep ended before the call returned: the call synchronized"
    done.synchronize()
    assert not torch.isnan(out).any(), "the kernel read q before the side stream's copy: it ran on another stream"
    out_ref, _ = attention_ref(q, k, v, causal=causal)
    out_pt, _ = attention_ref(q, k, v, causal=causal, upcast=False)
    assert_close_to_ref("out", out, out_ref, out_pt)


def test_fresh_process_runs_kernel_loaded_from_disk(tmp_path):
    """Process 1 compiles into an empty disk cache; process 2 loads the object file and must compute right."""
    script = (
        "import torch, json, time; from flashattn_hopper import flash_attn_func; from flashattn_hopper.jit import compile_cache;"
        "from flashattn_hopper.testing import attention_ref, max_err_check;"
        "g=torch.Generator(device='cuda').manual_seed(0);"
        "q,k,v=(torch.randn(2,300,4,128,dtype=torch.bfloat16,device='cuda',generator=g) for _ in range(3));"
        "t=time.perf_counter(); out=flash_attn_func(q,k,v,causal=True,backend='sm80'); torch.cuda.synchronize(); dt=time.perf_counter()-t;"
        "ok=max_err_check(out, attention_ref(q,k,v,causal=True)[0], attention_ref(q,k,v,causal=True,upcast=False)[0])[0];"
        "s=compile_cache.stats; print(json.dumps(dict(ok=ok, first_call_s=dt, compiles=s.compiles, disk_hits=s.disk_hits)))"
    )
    env = subprocess_env(FLASHATTN_HOPPER_CACHE_DIR=str(tmp_path))
    env.pop("FLASHATTN_HOPPER_CACHE", None)
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    print(f"cold first call {cold['first_call_s']:.2f} s (compile), warm first call {warm['first_call_s']:.3f} s (disk cache)")
    assert cold["ok"] and cold["compiles"] == 1
    assert warm["ok"] and warm["compiles"] == 0 and warm["disk_hits"] == 1


@pytest.mark.parametrize("backend", [None, "sm80"], ids=["default", "sm80"])
@pytest.mark.parametrize("expanded", ["batch", "heads"])
def test_expanded_inputs_give_the_contiguous_result(backend, expanded):
    """k and v expanded (stride 0) over the batch (a shared prefix) or over kv heads, q expanded over the batch:
    the same bits as the contiguous copies, forward and backward (the kernels' TMA / cp.async address every row
    by its strides; a stride of 0 must not be taken for a packed layout), through the plan's fast path too
    (the second call)."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    b, s, h, h_k, d = 3, 77, 4, 2, 64

    def rand(*shape):
        return torch.randn(*shape, dtype=torch.bfloat16, device="cuda", generator=gen)

    if expanded == "batch":
        q = rand(1, s, h, d).expand(b, s, h, d)
        k, v = (rand(1, s, h_k, d).expand(b, s, h_k, d) for _ in range(2))
    else:
        q = rand(b, s, h, d)
        k, v = (rand(b, s, 1, d).expand(b, s, h_k, d) for _ in range(2))
    dout = rand(b, s, h, d)
    for _ in range(2):
        views = [t.detach().requires_grad_() for t in (q, k, v)]  # (still expanded: stride 0)
        assert 0 in views[1].stride()
        got = flash_attn_func(*views, causal=True, backend=backend)
        want_in = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
        want = flash_attn_func(*want_in, causal=True, backend=backend)
        assert torch.equal(got, want), f"{expanded}: forward differs from the contiguous copies'"
        got_grads = torch.autograd.grad(got, views, dout)
        want_grads = torch.autograd.grad(want, want_in, dout)
        for name, a, w in zip("qkv", got_grads, want_grads):
            assert torch.equal(a, w), f"{expanded}: d{name} differs from the contiguous copies'"
