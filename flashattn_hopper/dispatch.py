"""Backend choice and the explicit table of kernel families.

Backends: ``sm90`` (Hopper kernels: TMA + WGMMA) and ``sm80`` (Ampere FA2 kernels: cp.async +
mma.sync; they also run on Hopper, which is how one H100 tests both). Compute capability 9.0 picks
sm90, 8.x picks sm80. With no backend requested, a problem the sm90 kernels cannot take yet runs on
the sm80 kernels; an explicitly requested backend (argument or ``FLASHATTN_HOPPER_BACKEND``) never
falls back: it raises and says why.

Each kernel family is a spec object: ``can_implement(problem)`` returns None or the reason it cannot,
``key(problem)`` the static compile key, ``compile(key)`` the compiled function (fake tensors, no
GPU needed) and ``launch(...)`` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import configs
from .env import settings
from .jit import KernelKey, target_arch
from .validate import AttnProblem

BACKENDS = ("sm90", "sm80")
SUPPORTED_ARCHS_TEXT = "compute capability 8.x (Ampere/Ada, backend 'sm80') or 9.0 (Hopper, backend 'sm90')"
# Compile targets of the CuTe DSL for each backend when compiling ahead of time (precompile).
PRECOMPILE_TARGETS = {"sm90": "sm_90a", "sm80": "sm_80"}

_MAX_GRID_YZ = 65535  # the sm80 forward puts heads on grid y and batch on grid z
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def device_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def select_backend(device: torch.device, requested: str | None) -> tuple[str, bool]:
    """Returns (backend, explicit): the kernel family for ``device`` and whether the user forced it."""
    requested = requested if requested is not None else settings().backend
    major, minor = device_capability(device)
    name = torch.cuda.get_device_name(device)
    if (major, minor) < (8, 0) or major > 9:
        raise RuntimeError(
            f"flashattn_hopper does not support {name} (compute capability {major}.{minor}); "
            f"supported: {SUPPORTED_ARCHS_TEXT}"
        )
    if requested is None:
        return ("sm90" if major == 9 else "sm80"), False
    if requested == "sm90" and major != 9:
        raise ValueError(
            f"backend='sm90' needs a Hopper GPU (compute capability 9.0), but {device} is {name} "
            f"(compute capability {major}.{minor}); use backend='sm80' or None"
        )
    return requested, True


@dataclass(frozen=True)
class FwdKey(KernelKey):
    dtype: str
    head_dim: int
    head_dim_v: int
    tile_m: int
    tile_n: int
    num_threads: int
    causal: bool


def _cutlass_dtype(name: str) -> Any:
    import cutlass

    return {"fp16": cutlass.Float16, "bf16": cutlass.BFloat16}[name]


def _fake_attention_tensors(dtype: Any, head_dim: int, head_dim_v: int) -> tuple[Any, ...]:
    """Fake Q, K, V, O, LSE with the exact ABI of ``to_cute`` tensors at call time.

    Every shape is dynamic (so batch, seqlens and heads never enter the key), every stride but the
    last is dynamic; strides are declared multiples of 8 elements, which the launcher guarantees.
    """
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    b, s_q, s_k, h, h_k, d, d_v = (cute.sym_int() for _ in range(7))

    def bshd(seqlen: Any, heads: Any, dim: Any) -> Any:
        strides = tuple(cute.sym_int64(divisibility=8) for _ in range(3))
        return make_fake_tensor(dtype, (b, seqlen, heads, dim), stride=(*strides, 1), assumed_align=16)

    lse = make_fake_tensor(cutlass.Float32, (b, h, s_q), stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=16)
    return bshd(s_q, h, d), bshd(s_k, h_k, d), bshd(s_k, h_k, d_v), bshd(s_q, h, d_v), lse


def to_cute(t: torch.Tensor) -> Any:
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t.detach(), assumed_align=16).mark_layout_dynamic(leading_dim=t.dim() - 1)


def current_stream(device: torch.device) -> Any:
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)


class FwdSm80:
    """FA2-style forward (kernels/fwd_sm80.py)."""

    backend = "sm80"
    kind = "fwd_sm80"
    tiles = configs.FWD_SM80_TILES

    def can_implement(self, p: AttnProblem) -> str | None:
        if configs.kernel_head_dim(self.tiles, p.head_dim, p.head_dim_v) is None:
            return (
                f"head dims ({p.head_dim}, {p.head_dim_v}) are not implemented yet on the sm80 backend; "
                f"supported: head dims up to {max(self.tiles)}"
            )
        if p.is_varlen:
            return "varlen (cu_seqlens_q/cu_seqlens_k) is not implemented yet on the sm80 backend"
        if p.is_local and not (p.causal and p.window_left < 0):
            return "window_size (sliding-window attention) is not implemented yet on the sm80 backend"
        if p.softcap != 0.0:
            return "softcap is not implemented yet on the sm80 backend"
        if p.nheads > _MAX_GRID_YZ or p.batch > _MAX_GRID_YZ:
            return f"nheads ({p.nheads}) and batch ({p.batch}) must each be <= {_MAX_GRID_YZ} (CUDA grid y/z limit)"
        return None

    def key(self, p: AttnProblem, arch: str) -> FwdKey:
        hdim = configs.kernel_head_dim(self.tiles, p.head_dim, p.head_dim_v)
        assert hdim is not None  # can_implement() ran first
        tile = self.tiles[hdim]
        return FwdKey(
            kernel=self.kind, arch=arch, dtype=_DTYPE_NAMES[p.dtype], head_dim=hdim, head_dim_v=hdim,
            tile_m=tile.tile_m, tile_n=tile.tile_n, num_threads=tile.num_threads, causal=p.causal,
        )

    def compile(self, key: FwdKey, options: str | None = None) -> Any:
        import cutlass
        import cutlass.cute as cute

        from .kernels.fwd_sm80 import FlashFwdSm80

        dtype = _cutlass_dtype(key.dtype)
        kernel = FlashFwdSm80(dtype, key.head_dim, key.head_dim_v, key.tile_m, key.tile_n, key.num_threads, key.causal)
        fakes = _fake_attention_tensors(dtype, key.head_dim, key.head_dim_v)
        stream = cute.runtime.make_fake_stream()
        kwargs = {"options": options} if options else {}
        return cute.compile(kernel, *fakes, cutlass.Float32(1.0), stream, **kwargs)

    def all_keys(self, arch: str) -> list[FwdKey]:
        """Every variant, for precompile and the compile-only tests."""
        keys = []
        for hdim, tile in self.tiles.items():
            for dtype in ("bf16", "fp16"):
                for causal in (False, True):
                    keys.append(FwdKey(
                        kernel=self.kind, arch=arch, dtype=dtype, head_dim=hdim, head_dim_v=hdim,
                        tile_m=tile.tile_m, tile_n=tile.tile_n, num_threads=tile.num_threads, causal=causal,
                    ))
        return keys


class FwdSm90:
    """FA3-style forward for Hopper. Not written yet (issue 4): every problem is refused with a reason."""

    backend = "sm90"
    kind = "fwd_sm90"

    def can_implement(self, p: AttnProblem) -> str | None:
        return "the Hopper (sm90) forward kernel is not implemented yet; backend='sm80' runs on Hopper"

    def all_keys(self, arch: str) -> list[KernelKey]:
        return []


FWD_KERNELS = {"sm90": FwdSm90(), "sm80": FwdSm80()}


def fwd_kernel_for(device: torch.device, requested: str | None, p: AttnProblem) -> FwdSm80:
    backend, explicit = select_backend(device, requested)
    spec = FWD_KERNELS[backend]
    reason = spec.can_implement(p)
    if reason is not None and not explicit and backend == "sm90":
        spec, backend = FWD_KERNELS["sm80"], "sm80"
        reason = spec.can_implement(p)
    if reason is not None:
        raise NotImplementedError(reason)
    check_target_arch(device)
    return spec  # type: ignore[return-value]


def check_target_arch(device: torch.device) -> str:
    """The DSL compiles for one arch per process; it must be the device's, or kernels fail to load."""
    arch = target_arch()
    major, minor = device_capability(device)
    expected_prefix = f"sm_{major}{minor}"
    if not arch.startswith(expected_prefix):
        raise RuntimeError(
            f"the CuTe DSL in this process compiles for {arch} (CUTE_DSL_ARCH), but {device} has compute "
            f"capability {major}.{minor}; unset CUTE_DSL_ARCH or set it to {expected_prefix}{'a' if major == 9 else ''}"
        )
    return arch
