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

from ._parity import check_parity, make_qkv

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


def test_backward_on_two_devices():
    """fwd + bwd (sm80 backward: pre, main, post launches; GQA adds the dK/dV postprocess) on
    device 1 then 0, current device 0: gradients equal those of the same inputs on device 0."""
    torch.cuda.set_device(0)
    grads = {}
    for index in (1, 0):
        q, k, v = (t.requires_grad_() for t in make_qkv(2, 257, 257, 4, 2, 64, device=f"cuda:{index}"))
        out = flash_attn_func(q, k, v, causal=True, backend="sm80")
        gen = torch.Generator(device=out.device).manual_seed(1)
        dout = torch.randn(out.shape, dtype=out.dtype, device=out.device, generator=gen)
        grads[index] = torch.autograd.grad(out, (q, k, v), dout)
        assert all(g.device == q.device and torch.isfinite(g).all() for g in grads[index])
        assert torch.cuda.current_device() == 0
    for name, a, b in zip(("dq", "dk", "dv"), grads[1], grads[0]):
        # (not bitwise: dQ and the GQA dK/dV are fp32 reduce-adds in any order)
        assert torch.allclose(a.cpu().float(), b.cpu().float(), rtol=1e-2, atol=1e-2), f"{name} differs between devices"
