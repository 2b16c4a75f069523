"""``python -m tests._launch_args ARCH``: each launcher's argument list fits its compiled kernel. For
TVM-FFI kernels (``backends.common.ffi_compile``): TVM-FFI accepts the argument count. For kernels of
the DSL's own calling convention: the launch path's ready-made kernel arguments (scalars,
stream, compiled-as-None slots: ``backends.common.kernel_arg`` / ``current_stream``) marshal to the
same bytes as the DSL's own conversion of plain Python values, and the pointers ``backends.common.launch``
hands the executor are the DSL's own list, for one compiled key per launcher signature of the target
(sm_90a: the sm90 forward; sm_80: the sm80 forward, preprocess, backward and postprocess). The
forwards' cached-call plans (``FwdPlan``), causal and not, and the backwards' plans (``BwdPlan``,
sm90's and sm80's) pass each kernel the count it was compiled with.
Compiles with fake tensors (no GPU); exits non-zero with the differing argument on a mismatch."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys


def check_ffi(compiled, args: tuple, label: str) -> None:
    """A TVM-FFI function (``backends.common.ffi_compile``) takes the launcher's argument list: torch
    tensors, Python scalars and None, no stream. Without a GPU the call stops at the first tensor
    (a CPU tensor where a CUDA one is expected), after TVM-FFI has checked the argument count."""
    import torch

    from flashattn_hopper.jit import callable_of

    fn = callable_of(compiled)
    plain = tuple(a._tensor if hasattr(a, "_tensor") else a for a in args)  # to_cute -> the torch tensor
    try:
        fn(*plain)
    except TypeError as e:
        raise AssertionError(f"{label}: {e}") from None
    except ValueError as e:
        assert "argument #0" in str(e), f"{label}: {e}"
    else:
        assert torch.cuda.is_available(), f"{label}: a CPU tensor was accepted"
    print(f"ok {label}: {len(plain)} arguments (TVM-FFI)")


def check(compiled, args: tuple, stream_handle: int, label: str) -> None:
    """``args``: the call's arguments before the stream; tensors ready-made (``to_cute``), the rest
    plain Python values (float: Float32 slot, int: Int32 slot, None: compiled as None)."""
    import cuda.bindings.driver as cuda

    from flashattn_hopper.backends import common
    from flashattn_hopper.jit import is_ffi_function

    if is_ffi_function(compiled):
        check_ffi(compiled, args, label)
        return

    # Both argument lists stay referenced: the marshalled pointers lead into these objects.
    our_args = (*(common.kernel_arg(x) for x in args), common.current_stream_arg(stream_handle))
    their_args = (*args, cuda.CUstream(stream_handle))
    ours, _ = compiled.generate_execution_args(*our_args)
    theirs, _ = compiled.generate_execution_args(*their_args)
    assert len(ours) == len(theirs), f"{label}: {len(ours)} pointers vs the DSL's {len(theirs)}"

    def address(pointer) -> int:
        return pointer.value if isinstance(pointer, ctypes.c_void_p) else int(pointer)

    def read(pointer, size):
        return ctypes.string_at(address(pointer), size)

    # launch() skips generate_execution_args (except under CUTE_DSL_DEBUG, where absent slots are
    # None): its flattened __c_pointers__ must be that very list.
    if not common._dsl_debug():
        direct = [p for a in our_args for p in a.__c_pointers__()]
        assert direct == [address(p) for p in ours], f"{label}: launch() pointers {direct} vs the DSL's {ours}"

    # bytes each pointer leads to: a tensor descriptor's data pointer, a 4-byte scalar, the stream handle
    sizes = [8 if hasattr(x, "__c_pointers__") else 4 for x in args if x is not None] + [8]
    for index, (a, b, size) in enumerate(zip(ours, theirs, sizes)):
        assert read(a, size) == read(b, size), f"{label}: pointer {index} differs ({read(a, size).hex()} vs {read(b, size).hex()})"
    print(f"ok {label}: {len(ours)} pointers")


@contextlib.contextmanager
def _stand_ins(patches: dict):
    """``{(module, name): stand_in}`` set for the block, the originals put back after it."""
    saved = {target: getattr(*target) for target in patches}
    try:
        for (module, name), stand_in in patches.items():
            setattr(module, name, stand_in)
        yield
    finally:
        for (module, name), original in saved.items():
            setattr(module, name, original)


def check_plans(family, problem, arch: str, label: str) -> None:
    """The cached-call path (``FwdLauncher.plan`` -> ``FwdPlan.__call__``, what every repeated dense
    call runs) passes its kernel the argument count it was compiled with, causal (dynamic schedule:
    a tile counter) and not (no counter: its slot is None). A wrong count is a TypeError inside the
    plan, which the API would answer with the general path on every call, silently (the non-causal
    plan did until session 18). Device lookups are replaced by CPU stand-ins."""
    import dataclasses

    import torch

    from flashattn_hopper.backends import common, sm90_fwd

    counter = torch.zeros(1, dtype=torch.int32)
    with _stand_ins({
        (common, "device_index"): lambda device: 0,
        (common, "current_stream_handle"): lambda index: 0,
        (common, "tile_counter"): lambda index, stream=None: counter,
        (sm90_fwd, "tile_counter"): lambda index, stream=None: counter,
        (sm90_fwd, "num_sms"): lambda index: 132,
        (torch.cuda, "current_device"): lambda: 0,
    }):
        q = torch.zeros(2, 64, 4, 64, dtype=torch.bfloat16)
        for causal in (True, False):
            p = dataclasses.replace(problem, causal=causal, window_right=0 if causal else -1)
            plan = family.plan(q, p)
            assert plan is not None, f"no plan for causal={causal}"
            check_ffi(plan.fn, _PlanArgs(plan, q), f"{label} plan causal={causal}")


def check_bwd_plans(family, problem, arch: str, label: str) -> None:
    """The backward's plans (``BwdPlan.__call__``: preprocess, main, postprocesses) pass each kernel
    the argument count it was compiled with: MHA, and GQA deterministic (the dK/dV sums' postprocess,
    the semaphores). Each launch is recorded on CPU tensors, then replayed against its kernel."""
    import dataclasses

    import torch

    from flashattn_hopper.backends import sm80_bwd

    with _stand_ins({
        (sm80_bwd, "num_sms"): lambda index: 132,
        (sm80_bwd, "_unused_semaphore"): lambda index: torch.zeros(1, 1, 1, dtype=torch.int32),
        (torch.cuda, "current_device"): lambda: 0,
    }):
        for heads_k, deterministic in ((4, False), (2, True)):
            p = dataclasses.replace(problem, nheads_k=heads_k)
            plan = family.plan(p, None, deterministic, torch.device("cpu"))
            b, s, h, d = p.batch, p.seqlen_q, p.nheads, p.head_dim
            q, dout, out = (torch.zeros(b, s, h, d, dtype=torch.bfloat16) for _ in range(3))
            k, v = (torch.zeros(b, p.seqlen_k, heads_k, d, dtype=torch.bfloat16) for _ in range(2))
            lse = torch.zeros(b, h, s)
            calls = []
            names = ("pre", "main", "segments", "post_dq", "post_kv", "post_v")
            real = {name: getattr(plan, name) for name in names}
            for name in names:
                if real[name] is not None:
                    setattr(plan, name, lambda *args, n=name: calls.append((n, args)))
            try:
                plan(dout, q, k, v, out, lse)
            finally:
                for name in names:
                    setattr(plan, name, real[name])
            for name, args in calls:
                check_ffi(real[name], args, f"{label} plan gqa={heads_k != h} deterministic={deterministic} {name}")


class _PlanArgs(tuple):
    """The argument tuple ``FwdPlan.__call__`` passes its kernel, recorded by calling the plan with a
    recording stand-in for the kernel."""

    def __new__(cls, plan, q):
        recorded = []
        fn = plan.fn
        plan.fn = lambda *args: recorded.extend(args)
        try:
            plan(q, q, q)
        finally:
            plan.fn = fn
        return super().__new__(cls, recorded)


def main(arch: str) -> None:
    os.environ["CUTE_DSL_ARCH"] = arch
    import torch

    from flashattn_hopper.backends import common
    from flashattn_hopper.backends.sm80_bwd import BwdSm80
    from flashattn_hopper.backends.sm80_fwd import FwdSm80
    from flashattn_hopper.backends.sm90_fwd import FwdSm90
    from flashattn_hopper.validate import AttnProblem

    problem = AttnProblem(batch=2, seqlen_q=64, seqlen_k=64, nheads=4, nheads_k=4, head_dim=64, head_dim_v=64,
                          dtype=torch.bfloat16, softmax_scale=0.125, causal=True, window_left=-1, window_right=-1,
                          softcap=0.0, is_varlen=False)
    bshd, rows = torch.zeros(2, 64, 4, 64, dtype=torch.bfloat16), torch.zeros(2, 4, 64)
    tensors = [common.to_cute(t) for t in (bshd, bshd, bshd, bshd, rows)]
    varlen_none = (None, None, None, None)
    if arch == "sm_90a":
        family = FwdSm90()
        counter = common.int_to_cute(torch.zeros(1, dtype=torch.int32))
        compiled = family.compile(family.key(problem, arch, None))
        # softmax_scale, window_left, window_right, softcap, max_ctas, tile counter, gate, FP8 descale,
        # live-block table and sink logits slots, varlen slots
        slots = (None, None, None, None)
        check(compiled, (*tensors, 0.125, 7, 3, 1.0, 132, counter, *slots, *varlen_none), 0x1234, "fwd_sm90")
        check_plans(family, problem, arch, "fwd_sm90")
        from flashattn_hopper.backends.sm90_bwd import BwdSm90

        check_bwd_plans(BwdSm90(), problem, arch, "bwd_sm90")
        return
    family = FwdSm80()
    check(family.compile(family.key(problem, arch)), (*tensors, 0.125, 7, 3, 1.0, *varlen_none), 0x1234, "fwd_sm80")
    check_plans(family, problem, arch, "fwd_sm80")
    bwd = BwdSm80()
    pre_key, main_key, post_dq, _ = bwd.keys(problem, arch)
    acc, sem = torch.zeros(2, 4, 128 * 64), torch.zeros(1, 1, 1, dtype=torch.int32)
    pre_tensors = [common.to_cute(t) for t in (bshd, bshd, rows, rows, rows, acc)]
    check(bwd.compile(pre_key), (*pre_tensors, None, None, None, None, None), 0x1234, "bwd_pre_sm80")
    main_tensors = [common.to_cute(t) for t in (bshd, bshd, bshd, bshd, rows, rows, acc, bshd, bshd, sem, sem)]
    # softmax_scale, window_left, window_right, softcap, deterministic, tail_blocks, tail_segments, varlen
    # slots, the split tail's partial sums (None: not the segments kernel)
    check(bwd.compile(main_key), (*main_tensors, 0.125, 7, 3, 1.0, 1, 5, 2, *varlen_none, None), 0x1234,
          "bwd_sm80")
    post_tensors = [common.to_cute(acc), common.to_cute(bshd)]
    check(bwd.compile(post_dq), (*post_tensors, 0.125, None, None, None), 0x1234, "bwd_post_sm80")
    check_bwd_plans(bwd, problem, arch, "bwd_sm80")


if __name__ == "__main__":
    main(sys.argv[1])
