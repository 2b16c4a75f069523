"""Mutation runs (not a test): break the kernels' launches on purpose and check the GPU tests fail.

    python -m pytest -p tests.mutate --mutation fwd_skip tests/test_fwd.py -k poisoned ...
    python -m tests.mutate [--jobs 4]     # every mutation below on its selection, a table of results

Issue 26 asks for evidence that the fixed checks can fail: each mutation here stands for a kernel bug
(a launch skipped, half of the rows left unwritten, a wrong scale, an LSE off by a little, a launch on
another stream, a backward kernel skipped), applied in-process by wrapping the compiled functions the
compile cache hands out (``jit.CompileCache.get``), so the source tree is never edited. A mutation
*passes* when its selection has at least one failing test; the run lists which tests caught it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import subprocess
import sys
from typing import Any, Callable


# mutation -> (what it stands for, the tests expected to catch it)
SELECTIONS: dict[str, tuple[str, list[str]]] = {
    "fwd_skip": ("the forward kernel is never launched", [
        "tests/test_fwd.py::test_poisoned_outputs_are_fully_overwritten",
        "tests/test_fwd_sm90.py", "-k", "poisoned or tile_counter"]),
    "fwd_half_rows": ("the forward writes only the first half of each output's rows", [
        "tests/test_fwd.py::test_poisoned_outputs_are_fully_overwritten", "tests/test_fwd.py::test_fwd_parity",
        "-k", "poisoned or (h4k4 and 128-bf16)"]),
    "fwd_scale": ("the forward's softmax scale is 1 % off", [
        "tests/test_fwd.py::test_fwd_parity", "tests/test_fwd.py::test_softmax_scale_and_default",
        "-k", "default or (h4k4 and causal-64-bf16)"]),
    # (1e-3 passes the LSE check: PyTorch's own bf16 LSE error, the rule's yardstick, is ~5e-3)
    "fwd_lse": ("the forward's LSE is 0.01 off", [
        "tests/test_fwd.py::test_poisoned_outputs_are_fully_overwritten", "tests/test_bwd_sm90.py::test_bwd_sm90_parity",
        "-k", "poisoned or (bf16 and causal and 113x203 and mha)"]),
    "fwd_default_stream": ("the forward launches on the default stream, not the caller's", [
        "tests/test_fwd.py::test_non_default_stream"]),
    "bwd_skip_post": ("the backward's postprocess (dQ, GQA dK/dV sums) is never launched", [
        "tests/test_bwd_sm90.py::test_bwd_sm90_parity", "tests/test_bwd.py::test_bwd_under_cuda_graph",
        "-k", "(bf16 and causal and 113x203) or under_cuda_graph"]),
    "bwd_skip_main": ("the backward's main kernel is never launched", [
        "tests/test_bwd_sm90.py::test_bwd_sm90_parity", "tests/test_bwd.py::test_bwd_default_path_parity",
        "-k", "bf16 and causal and 113x203"]),
    "bwd_scale": ("the backward's softmax scale is 1 % off", [
        "tests/test_bwd_sm90.py::test_bwd_sm90_parity", "tests/test_bwd_sm90.py::test_bwd_sm90_softmax_scale",
        "tests/test_bwd.py::test_bwd_parity", "-k", "(bf16 and full and 113x203) or softmax_scale"]),
}


def _is_fwd(kernel: str) -> bool:
    return kernel.startswith("fwd_")


def _is_bwd_main(kernel: str) -> bool:
    return kernel in ("bwd_sm90", "bwd_sm80")


def _first_float(args: tuple[Any, ...]) -> int:
    return next(i for i, a in enumerate(args) if isinstance(a, float))


def _wrap(mutation: str, kernel: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a compiled kernel's callable) with the mutation applied, where it concerns ``kernel``."""
    import torch

    if mutation == "fwd_skip" and _is_fwd(kernel):
        return lambda *args: None
    if mutation == "fwd_half_rows" and _is_fwd(kernel):
        def half(*args: Any) -> Any:
            out = args[3]  # (batch, seqlen, heads, d) or packed (total, heads, d)
            rows = out.shape[-3]
            tail = out.narrow(-3, rows // 2, rows - rows // 2)
            before = tail.clone()
            fn(*args)
            tail.copy_(before)  # as if the kernel had never written these rows
        return half
    if mutation == "fwd_scale" and _is_fwd(kernel):
        return lambda *args: fn(*args[:5], args[5] * 1.01, *args[6:])
    if mutation == "fwd_lse" and _is_fwd(kernel):
        def lse_off(*args: Any) -> Any:
            fn(*args)
            args[4].add_(1e-2)
        return lse_off
    if mutation == "fwd_default_stream" and _is_fwd(kernel):
        def on_default(*args: Any) -> Any:
            with torch.cuda.stream(torch.cuda.default_stream(args[0].device)):
                fn(*args)
        return on_default
    if mutation == "bwd_skip_post" and kernel.startswith("bwd_post"):
        return lambda *args: None
    if mutation == "bwd_skip_main" and _is_bwd_main(kernel):
        return lambda *args: None
    if mutation == "bwd_scale" and _is_bwd_main(kernel):
        def scaled(*args: Any) -> Any:
            i = _first_float(args)
            return fn(*args[:i], args[i] * 1.01, *args[i + 1:])
        return scaled
    return fn


def pytest_addoption(parser: Any) -> None:
    parser.addoption("--mutation", choices=sorted(SELECTIONS), help="the kernel bug to simulate (tests/mutate.py)")


def pytest_configure(config: Any) -> None:
    mutation = config.getoption("--mutation")
    if not mutation:
        return
    from flashattn_hopper import jit

    get = jit.CompileCache.get

    def mutated_get(self: Any, key: Any, build: Any) -> Any:
        return _wrap(mutation, key.kernel, get(self, key, build))

    jit.CompileCache.get = mutated_get  # (this process only; the plans built after this hold the wrapped calls)


def _run(mutation: str, timeout: int) -> tuple[str, int, list[str], str]:
    what, selection = SELECTIONS[mutation]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.mutate",
           "--mutation", mutation, "-rf", "-m", "not slow", *selection]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        log, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        log, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), 124
    failed = re.findall(r"^FAILED (\S+)", log, flags=re.M)
    summary = next((line for line in reversed(log.splitlines()) if " in " in line and ("passed" in line or "failed" in line)), "")
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, f"mutation_{mutation}.log"), "w") as f:
            f.write(log)
    return mutation, rc, failed, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("mutations", nargs="*", default=list(SELECTIONS))
    args = ap.parse_args()
    print("| mutation | stands for | caught | tests that failed (first 3) | pytest summary |")
    print("|---|---|---|---|---|")
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for mutation, rc, failed, summary in pool.map(lambda m: _run(m, args.timeout), args.mutations):
            caught = "yes" if rc == 1 and failed else f"NO (rc={rc})"
            shown = ", ".join(f.split("::", 1)[-1] for f in failed[:3])
            print(f"| {mutation} | {SELECTIONS[mutation][0]} | {caught} | {shown} | {summary.strip('= ')} |", flush=True)


if __name__ == "__main__":
    main()
