"""Timing for the perf sweep: medians of GPU-timed calls, first-call time, the dense matmul rate.

Two timers with one contract (`timer(fn, grad_to_none) -> Timing`, milliseconds):
- `triton.testing.do_bench` when triton imports: median with p20/p80, warm-up excluded, a 256 MB
  L2 flush before every timed call (outside the timed region).
- `CudaEventTimer` otherwise: the same method written out with CUDA events, so a machine without
  triton gets comparable numbers.

Compile time never enters a median: `timed_first_call` measures the first call of a config (JIT
compile or disk-cache load included) on the wall clock, and the sweep reports it in its own column.
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

# H100's L2 is 50 MB; flushing 256 MB evicts it several times over (the size do_bench uses).
L2_FLUSH_BYTES = 256 * 1024 * 1024
# 8192^3 saturates the tensor cores on A100/H100 without being limited by memory or launch overhead.
MATMUL_N = 8192


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p20_ms: float = math.nan
    p80_ms: float = math.nan


class Timer(Protocol):
    description: str

    def __call__(self, fn: Callable[[], object], grad_to_none: Sequence[torch.Tensor] = ()) -> Timing: ...


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (torch.quantile's default), for the CUDA-event timer."""
    if not values:
        raise ValueError("quantile of no values")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_first_call(fn: Callable[[], object], device: torch.device) -> tuple[object, float]:
    """Run `fn` once and return (its result, wall-clock ms including any JIT compile)."""
    _synchronize(device)
    start = time.perf_counter()
    result = fn()
    _synchronize(device)
    return result, (time.perf_counter() - start) * 1e3


def clear_grads(tensors: Sequence[torch.Tensor]) -> None:
    for t in tensors:
        t.grad = None


class DoBenchTimer:
    """`triton.testing.do_bench`, asked for the median and p20/p80 in whatever form its version takes."""

    def __init__(self, do_bench: Callable, warmup_ms: float, rep_ms: float, version: str = "?"):
        self._do_bench = do_bench
        self._warmup_ms = warmup_ms
        self._rep_ms = rep_ms
        params = inspect.signature(do_bench).parameters
        self._extra = {}
        if "quantiles" in params:
            self._extra["quantiles"] = [0.5, 0.2, 0.8]
        if "return_mode" in params:
            self._extra["return_mode"] = "median"
        self.description = (
            f"triton.testing.do_bench (triton {version}): median of timed calls, warm-up {warmup_ms:g} ms "
            f"excluded, {rep_ms:g} ms of reps, L2 flushed before each call"
        )

    def __call__(self, fn: Callable[[], object], grad_to_none: Sequence[torch.Tensor] = ()) -> Timing:
        out = self._do_bench(
            fn, warmup=self._warmup_ms, rep=self._rep_ms, grad_to_none=list(grad_to_none) or None, **self._extra
        )
        # Old triton returns (median, p20, p80) unasked; new triton returns the requested quantiles in order.
        if isinstance(out, (list, tuple)):
            values = [float(x) for x in out]
            if len(values) >= 3:
                return Timing(values[0], values[1], values[2])
            return Timing(values[0])
        return Timing(float(out))


class CudaEventTimer:
    """do_bench's method with CUDA events: per-call events, L2 flushed between calls, median and p20/p80."""

    def __init__(self, warmup_ms: float, rep_ms: float, device: torch.device, max_reps: int = 10_000):
        self._warmup_ms = warmup_ms
        self._rep_ms = rep_ms
        self._device = device
        self._max_reps = max_reps
        self.description = (
            f"CUDA events (triton not importable): median of timed calls, warm-up {warmup_ms:g} ms excluded, "
            f"{rep_ms:g} ms of reps, L2 flushed before each call"
        )

    def __call__(self, fn: Callable[[], object], grad_to_none: Sequence[torch.Tensor] = ()) -> Timing:
        flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=self._device)
        clear_grads(grad_to_none)
        fn()
        torch.cuda.synchronize(self._device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            clear_grads(grad_to_none)
            fn()
        end.record()
        torch.cuda.synchronize(self._device)
        estimate_ms = max(start.elapsed_time(end) / 5, 1e-3)
        for _ in range(max(1, int(self._warmup_ms / estimate_ms))):
            clear_grads(grad_to_none)
            fn()
        reps = min(self._max_reps, max(10, int(self._rep_ms / estimate_ms)))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            clear_grads(grad_to_none)
            flush.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize(self._device)
        times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
        return Timing(quantile(times, 0.5), quantile(times, 0.2), quantile(times, 0.8))


def make_timer(warmup_ms: float, rep_ms: float, device: torch.device) -> Timer:
    """do_bench when triton imports, CUDA events otherwise (the GPU machine may lack triton)."""
    try:
        import triton
        from triton.testing import do_bench
    except Exception:  # ImportError, or a triton build that fails to load its driver
        return CudaEventTimer(warmup_ms, rep_ms, device)
    return DoBenchTimer(do_bench, warmup_ms, rep_ms, getattr(triton, "__version__", "?"))


def matmul_tflops(timer: Timer, device: torch.device, dtype: torch.dtype, n: int = MATMUL_N) -> float:
    """Dense n^3 matmul rate in `dtype`, timed like the attention cells: the yardstick for % of peak."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    timing = timer(lambda: torch.mm(a, b, out=c))
    return 2.0 * n**3 / (timing.median_ms * 1e-3) / 1e12
