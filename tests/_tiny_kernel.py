"""A tiny CuTe DSL kernel that goes through the real compile cache; run as a script by test_jit_cache.

Usage: python -m tests._tiny_kernel TAG  -> prints one JSON line with the cache statistics.
"""

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass

os.environ.setdefault("CUTE_DSL_ARCH", "sm_80")

import cuda.bindings.driver as cuda  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor  # noqa: E402

from flashattn_hopper.jit import KernelKey, compile_cache, target_arch  # noqa: E402


@dataclass(frozen=True)
class TinyKey(KernelKey):
    scale_by_two: bool


@cute.kernel
def scale_kernel(m_in: cute.Tensor, m_out: cute.Tensor, factor: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    if tidx < m_in.shape[0]:
        m_out[tidx] = m_in[tidx] * factor


@cute.jit
def launch(m_in: cute.Tensor, m_out: cute.Tensor, factor: cutlass.Constexpr, stream: cuda.CUstream):
    scale_kernel(m_in, m_out, factor).launch(grid=[1, 1, 1], block=[128, 1, 1], stream=stream)


def build(key: TinyKey):
    factor = 2.0 if key.scale_by_two else 1.0
    n = cute.sym_int()
    fake = make_fake_tensor(cutlass.Float32, (n,), stride=(1,), assumed_align=16)
    return cute.compile(launch, fake, fake, factor, make_fake_stream())


def main() -> None:
    tag = sys.argv[1] if len(sys.argv) > 1 else ""
    start = time.perf_counter()
    key = TinyKey(kernel="tiny", arch=target_arch(), scale_by_two=True)
    fn = compile_cache.get(key, build)
    seconds = time.perf_counter() - start
    stats = dataclasses.asdict(compile_cache.stats)
    print(json.dumps({"tag": tag, "pid": os.getpid(), "seconds": seconds, "type": type(fn).__name__, **stats}))


if __name__ == "__main__":
    main()
