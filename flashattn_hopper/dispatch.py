"""Backend choice and the explicit table of kernel families.

Backends: ``sm90`` (Hopper kernels: TMA + WGMMA) and ``sm80`` (Ampere FA2 kernels: cp.async +
mma.sync; they also run on Hopper, which is how one H100 tests both). Compute capability 9.0 picks
sm90, 8.x picks sm80. With no backend requested, a problem the sm90 kernels cannot take yet runs on
the sm80 kernels; an explicitly requested backend (argument or ``FLASHATTN_HOPPER_BACKEND``) never
falls back: it raises and says why.

Each kernel family is an object of ``backends/`` (interface in ``backends/common.py``):
``can_implement(problem)`` returns None or the reason it cannot, ``compile(key)`` gives the compiled
function (fake tensors, no GPU needed), ``forward(...)`` launches it.
"""

from __future__ import annotations

import functools

import torch

from .backends.common import BwdFamily, FwdFamily
from .backends.sm80_bwd import BwdSm80
from .backends.sm80_fwd import FwdSm80
from .backends.sm90_bwd import BwdSm90
from .backends.sm90_fwd import FwdSm90
from .env import settings
from .jit import target_arch
from .validate import AttnProblem

BACKENDS = ("sm90", "sm80")
SUPPORTED_ARCHS_TEXT = "compute capability 8.x (Ampere/Ada, backend 'sm80') or 9.0 (Hopper, backend 'sm90')"
# Compile targets of the CuTe DSL for each backend when compiling ahead of time (precompile).
PRECOMPILE_TARGETS = {"sm90": "sm_90a", "sm80": "sm_80"}
# Kernel families that run on each compile target: Hopper runs its own and the Ampere kernels.
BACKENDS_FOR_TARGET = {"sm_90a": ("sm90", "sm80"), "sm_80": ("sm80",)}



def device_capability(device: torch.device) -> tuple[int, int]:
    return _device_facts(device.index if device.index is not None else torch.cuda.current_device())[0]


@functools.cache
def _device_facts(index: int) -> tuple[tuple[int, int], str]:
    """(compute capability, name) of a device; fixed for the process, read once (hot path)."""
    return torch.cuda.get_device_capability(index), torch.cuda.get_device_name(index)


def select_backend(device: torch.device, requested: str | None) -> tuple[str, bool]:
    """Returns (backend, explicit): the kernel family for ``device`` and whether the user forced it."""
    requested = requested if requested is not None else settings().backend
    major, minor = device_capability(device)
    if (major, minor) < (8, 0) or major > 9:
        name = torch.cuda.get_device_name(device)
        raise RuntimeError(
            f"flashattn_hopper does not support {name} (compute capability {major}.{minor}); "
            f"supported: {SUPPORTED_ARCHS_TEXT}"
        )
    if requested is None:
        return ("sm90" if major == 9 else "sm80"), False
    if requested == "sm90" and major != 9:
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"backend='sm90' needs a Hopper GPU (compute capability 9.0), but {device} is {name} "
            f"(compute capability {major}.{minor}); use backend='sm80' or None"
        )
    return requested, True


# Without a backend, Hopper's backward runs on the Hopper kernels (kernels/sm90/bwd.py) where they
# implement the problem, else on the Ampere kernels. The switch stays for bisecting: the writer-warp
# build passed tests/test_bwd_sm90.py (212/212) and racecheck on an H100 on 2026-11-25 (session 17).
SM90_BWD_BY_DEFAULT = True

FWD_KERNELS: dict[str, FwdFamily] = {"sm90": FwdSm90(), "sm80": FwdSm80()}
BWD_KERNELS: dict[str, BwdFamily] = {"sm90": BwdSm90(), "sm80": BwdSm80()}


def families(backend: str) -> list[FwdFamily | BwdFamily]:
    """Every kernel family of a backend, for precompile and the compile-only tests."""
    return [FWD_KERNELS[backend], BWD_KERNELS[backend]]


def fwd_kernel_for(device: torch.device, requested: str | None, p: AttnProblem) -> FwdFamily:
    backend, explicit = select_backend(device, requested)
    family = FWD_KERNELS[backend]
    reason = family.can_implement(p)
    if reason is not None and not explicit and backend == "sm90":
        family = FWD_KERNELS["sm80"]  # auto on Hopper: the Ampere kernels run there too
        reason = family.can_implement(p)
    if reason is not None:
        raise NotImplementedError(reason)
    check_target_arch(device)
    return family


def bwd_kernel_for(device: torch.device, requested: str | None, p: AttnProblem, deterministic: bool) -> BwdFamily:
    backend, explicit = select_backend(device, requested)
    if backend == "sm90" and not explicit and not SM90_BWD_BY_DEFAULT:
        backend = "sm80"
    family = BWD_KERNELS[backend]
    reason = family.can_implement(p, deterministic)
    if reason is not None and not explicit and backend == "sm90":
        family = BWD_KERNELS["sm80"]
        reason = family.can_implement(p, deterministic)
    if reason is not None:
        raise NotImplementedError(reason)
    check_target_arch(device)
    return family


def check_target_arch(device: torch.device) -> str:
    """The DSL compiles for one arch per process; it must be the device's, or kernels fail to load."""
    return _checked_target_arch(device_capability(device))


@functools.cache
def _checked_target_arch(capability: tuple[int, int]) -> str:
    arch = target_arch()
    major, minor = capability
    expected_prefix = f"sm_{major}{minor}"
    if not arch.startswith(expected_prefix):
        raise RuntimeError(
            f"the CuTe DSL in this process compiles for {arch} (CUTE_DSL_ARCH), but the GPU has compute "
            f"capability {major}.{minor}; unset CUTE_DSL_ARCH or set it to {expected_prefix}{'a' if major == 9 else ''}"
        )
    return arch
