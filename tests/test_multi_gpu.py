"""One process, several GPUs (GPU tier, needs 2): the same compiled kernels run on every device.

Model-parallel code drives several GPUs from one process, often without ``torch.cuda.set_device``:
a call must run on the inputs' device, whatever the current device is, and leave the current device
as it found it. The DSL's compiled functions load their kernels for every device at first use
(context-free CUDA libraries), and the launchers run under ``torch.cuda.device(q.device)``.
"""

from __future__ import annotations

import pytest
import torch

from flashattn_hopper import flash_attn_func
from flashattn_hopper.testing import assert_close_to_ref, attention_ref, rounding_atol

from ._parity import check_parity, make_qkv, poisoned_bwd

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs in one process"
    ),
    # The DSL compiles for one arch per process (dispatch.check_target_arch refuses a second).
    pytest.mark.skipif(
        torch.cuda.device_count() >= 2 and torch.cuda.get_device_capability(0) != torch.cuda.get_device_capability(1),
        reason="GPUs 0 and 1 differ in compute capability",
    ),
]


def _backends() -> list[str]:
    return ["sm80", "sm90"] if torch.cuda.get_device_capability(0) == (9, 0) else ["sm80"]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_on_a_device_that_is_not_current(causal):
    """The first call of a key on device 1 while device 0 is current, then the same key on 0 and
    on 1 again: every output matches the fp32 reference, the current device stays 0."""
    torch.cuda.set_device(0)
    for backend in _backends():
        for index in (1, 0, 1):
            q, k, v = make_qkv(2, 333, 333, 4, 2, 128, device=f"cuda:{index}", seed=index)
            out, _ = check_parity(q, k, v, causal, backend)
            assert out.device == q.device
            assert torch.cuda.current_device() == 0, f"{backend} on cuda:{index} changed the current device"


def _reference_grads(q, k, v, dout, upcast):
    leaves = tuple((t.detach().float() if upcast else t.detach().clone()).requires_grad_() for t in (q, k, v))
    out, _ = attention_ref(*leaves, causal=True, upcast=upcast)
    return torch.autograd.grad(out, leaves, dout.to(out.dtype))


@pytest.mark.parametrize("backend", [None, "sm80"], ids=["default", "sm80"])
def test_backward_on_two_devices(backend):
    """fwd + bwd (sm80 backward: pre, main, post launches; GQA adds the dK/dV postprocess) on device 1
    then 0, current device 0. Through the API (dQ and the GQA dK/dV are fp32 reduce-adds in any order):
    every gradient against the fp32 reference on its device. Deterministic launches into NaN-filled
    buffers made just before the call (``_parity.poisoned_bwd``): bit for bit the same on both devices
    (the same kernels on the same inputs)."""
    torch.cuda.set_device(0)
    deterministic = {}
    inputs = make_qkv(2, 257, 257, 4, 2, 64, device="cuda:0")
    inputs += (torch.randn_like(inputs[0]),)
    for index in (1, 0):
        q, k, v, dout = (t.to(f"cuda:{index}") for t in inputs)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flash_attn_func(*leaves, causal=True, backend=backend)
        grads = torch.autograd.grad(out, leaves, dout)
        assert torch.cuda.current_device() == 0
        ref, pt = _reference_grads(q, k, v, dout, True), _reference_grads(q, k, v, dout, False)
        for name, g, r, p in zip(("dq", "dk", "dv"), grads, ref, pt):
            assert g.device == q.device, f"{name} on {g.device}"
            assert_close_to_ref(f"cuda:{index} {name}", g, r, p, atol=rounding_atol(r, q.dtype))
        deterministic[index] = [g.cpu() for g in poisoned_bwd(q, k, v, dout, backend, backend, None, True, causal=True)]
        assert torch.cuda.current_device() == 0
    for name, a, b in zip(("dq", "dk", "dv"), deterministic[1], deterministic[0]):
        assert torch.equal(a, b), f"{name}: deterministic gradients differ between devices"


def test_gated_forward_on_a_device_that_is_not_current():
    """A gated forward (``log_decay``) with 1024 keys builds K's k16 slice by a Triton kernel before the launch
    (``sm90_fwd.gate_k_slice``): on device 1 while device 0 is current it must run there too, and give what
    the same call on device 0 gives, bit for bit (same kernels, same inputs); the current device stays 0."""
    if torch.cuda.get_device_capability(0) != (9, 0):
        pytest.skip("needs Hopper GPUs: only the sm90 forward builds the gate's k16 slice (sm80 adds the bias as columns)")
    torch.cuda.set_device(0)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1024, 4, 64, generator=gen).bfloat16() for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(1, 1024, 4, generator=gen) * 2 + 4)
    outs = [flash_attn_func(*(t.to(f"cuda:{i}") for t in (q, k, v)), causal=True, log_decay=g.to(f"cuda:{i}"))
            for i in (1, 0)]
    assert outs[0].device == torch.device("cuda:1")
    assert torch.equal(outs[0].cpu(), outs[1].cpu())
    assert torch.cuda.current_device() == 0
