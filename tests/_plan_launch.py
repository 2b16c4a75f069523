"""CPU stand-ins for comparing a kept plan's kernel call with the general launch's (``launch_forward``).

``record_sm90_launches`` makes every compiled sm90 forward a recorder and the device lookups (stream, device index,
SM count, tile counter) constants; ``assert_same_launch`` compares two recorded argument lists slot by slot."""

from __future__ import annotations

import torch


def record_sm90_launches(monkeypatch) -> list:
    """The list each compiled sm90 forward's call (its argument tuple) is appended to, instead of launching; device 0
    with 132 SMs, stream 0 and one CPU tile counter for every dynamic schedule."""
    from flashattn_hopper.backends import common, sm90_fwd

    calls: list = []
    counter = torch.zeros(1, dtype=torch.int32)
    monkeypatch.setattr(common.compile_cache, "get", lambda key, build: lambda *args: calls.append(args))
    for module in (common, sm90_fwd):
        monkeypatch.setattr(module, "current_stream_handle", lambda index: 0)
        monkeypatch.setattr(module, "device_index", lambda device: 0)
        monkeypatch.setattr(module, "tile_counter", lambda index, stream=None: counter)
    monkeypatch.setattr(sm90_fwd, "num_sms", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return calls


def assert_same_launch(planned: tuple, general: tuple, rebuilt: tuple[int, ...] = ()) -> None:
    """``planned`` hands the kernel what ``general`` does: out and lse (slots 3 and 4) fresh buffers of the same shape
    and dtype, the ``rebuilt`` slots' tensors built per call with equal contents, every other tensor the same object,
    every scalar equal and of the same type, and None where the other has None."""
    assert len(planned) == len(general)
    for i, (a, b) in enumerate(zip(planned, general)):
        if i in (3, 4):  # out and lse: fresh buffers of the same shape and dtype
            assert a.shape == b.shape and a.dtype == b.dtype
        elif i in rebuilt and isinstance(b, torch.Tensor):
            assert torch.equal(a, b), i
        elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            assert a is b, i
        else:
            assert a == b and type(a) is type(b), (i, a, b)
