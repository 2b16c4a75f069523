"""Pieces every kernel family's launcher shares: the family interface, dtype names, fake tensors for
compiling without a GPU, conversion of torch tensors at call time, the current stream, padding."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..jit import KernelKey, compile_cache, target_arch
from ..validate import AttnProblem

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
MAX_GRID_YZ = 65535  # CUDA grid y/z limit
# A window side that is unbounded goes to the kernel as this many tokens (no int32 overflow in the
# kernel's index math as long as sequences are shorter than 2**30).
UNBOUNDED_WINDOW = 1 << 30


@dataclass(frozen=True)
class VarlenArgs:
    """The varlen side inputs, as the user gave them (validated; never read on the host)."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    seqused_q: torch.Tensor | None
    seqused_k: torch.Tensor | None
    max_seqlen_q: int | torch.Tensor | None
    max_seqlen_k: int | torch.Tensor | None


class FwdFamily(Protocol):
    backend: str

    def can_implement(self, p: AttnProblem) -> str | None: ...

    def all_keys(self, arch: str) -> list[KernelKey]: ...

    def compile(self, key: KernelKey, options: str | None = None) -> Any: ...

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnProblem, varlen: VarlenArgs | None,
        out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """out ``(b, s_q, h, dv)`` (varlen ``(total_q, h, dv)``), lse ``(b, h, s_q)`` (varlen ``(h, total_q)``)."""
        ...


class BwdFamily(Protocol):
    backend: str

    def can_implement(self, p: AttnProblem, deterministic: bool) -> str | None: ...

    def all_keys(self, arch: str) -> list[KernelKey]: ...

    def compile(self, key: KernelKey, options: str | None = None) -> Any: ...

    def backward(
        self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, p: AttnProblem, varlen: VarlenArgs | None, deterministic: bool,
        dq: torch.Tensor | None = None, dk: torch.Tensor | None = None, dv: torch.Tensor | None = None,
        dk_fp32: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dq, dk, dv shaped like q, k, v; written into ``dq``/``dk``/``dv`` where given (internal:
        tests pass NaN-poisoned buffers, contiguous, with the kernel's padded head dim). ``dk_fp32``
        (internal): dk in fp32, unrounded."""
        ...


def cutlass_dtype(name: str) -> Any:
    import cutlass

    return {"fp16": cutlass.Float16, "bf16": cutlass.BFloat16, "e4m3": cutlass.Float8E4M3FN}[name]


def fake_bshd(dtype: Any, batch: Any, seqlen: Any, heads: Any, dim: Any) -> Any:
    """A fake (batch, seqlen, heads, dim) tensor with the ABI of ``to_cute`` at call time: every shape
    dynamic, every stride but the last dynamic and declared a multiple of 8 elements (``kernel_ready``
    guarantees it), data 16-byte aligned."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    strides = tuple(cute.sym_int64(divisibility=8) for _ in range(3))
    return make_fake_tensor(dtype, (batch, seqlen, heads, dim), stride=(*strides, 1), assumed_align=16)


def fake_f32(shape: tuple[Any, ...], stride_divisibility: int = 1) -> Any:
    """A fake fp32 tensor (LSE-like): dynamic shapes and strides, last stride 1; the other strides
    multiples of ``stride_divisibility`` (4: rows a TMA can read, ``aligned_rows``)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    strides = tuple(cute.sym_int64(divisibility=stride_divisibility) for _ in range(len(shape) - 1))
    return make_fake_tensor(cutlass.Float32, shape, stride=(*strides, 1), assumed_align=16)


class _TensorArg:
    """A tensor argument for a compiled kernel, built without DLPack.

    A kernel compiled with every shape dynamic and every stride but the unit last one dynamic takes a
    pointer to ``{void *data; int32 shape[rank]; int64 stride[rank - 1]}`` (the struct an exported
    kernel's C header declares, and what ``from_dlpack(t).mark_layout_dynamic(leading_dim=rank-1)``
    builds). Filling it with ctypes costs ~1 us against ~6 us for the DLPack route per tensor, which
    matters for small problems (H200, 2026-11-21: 31 us of a 156 us call went to five conversions).
    """

    __slots__ = ("_desc", "_pointers", "_tensor")

    def __init__(self, t: torch.Tensor) -> None:
        desc = _descriptor_type(t.dim())()
        desc.data = t.data_ptr()
        desc.shape[:] = t.shape
        desc.stride[:] = t.stride()[:-1]
        self._desc, self._tensor = desc, t  # both must outlive the call
        self._pointers = [ctypes.addressof(desc)]

    def __c_pointers__(self) -> list[int]:
        return self._pointers


@functools.cache
def _descriptor_type(rank: int) -> type[ctypes.Structure]:
    fields = [("data", ctypes.c_void_p), ("shape", ctypes.c_int32 * rank), ("stride", ctypes.c_int64 * (rank - 1))]
    return type(f"TensorDesc{rank}", (ctypes.Structure,), {"_fields_": fields})


def to_cute(t: torch.Tensor) -> Any:
    """A call-time tensor argument matching the fake tensors of ``fake_bshd``/``fake_f32``."""
    return _TensorArg(t)


class _ValueArg:
    """A scalar or stream argument of a compiled kernel as the pointer its C entry reads: a ctypes
    ``c_int32`` (Int32), ``c_float`` (Float32) or ``c_void_p`` (the CUstream handle, as the DSL's
    stream adapter passes it). Built without the DSL's per-call cast and adapter lookup, which took
    most of the compiled call's 71 us of a ~200 us ``flash_attn_func`` on an H100 node's host
    (2026-11-21, perf/NOTES.md)."""

    __slots__ = ("_value", "_pointers")

    def __init__(self, value: ctypes._SimpleCData) -> None:
        self._value = value  # must outlive the call
        self._pointers = [ctypes.addressof(value)]

    def __c_pointers__(self) -> list[int]:
        return self._pointers


class _AbsentArg:
    """An argument compiled as None (a compile-time constant): it passes no pointer."""

    __slots__ = ()

    def __c_pointers__(self) -> list[int]:
        return []


@functools.cache
def _absent_arg() -> Any:
    """What a slot compiled as None gets: ``_AbsentArg``, or None itself in the DSL's debug mode
    (``CUTE_DSL_DEBUG``), whose argument check accepts nothing else there."""
    return None if _dsl_debug() else _AbsentArg()


def kernel_arg(value: Any) -> Any:
    """A call-time argument for a slot compiled as ``Int32`` (Python int), ``Float32`` (Python float)
    or None; anything else (tensor and stream arguments) passes through."""
    if value is None:
        return _absent_arg()
    if type(value) is int:
        return _ValueArg(ctypes.c_int32(value))
    if type(value) is float:
        return _ValueArg(ctypes.c_float(value))
    return value


def launch(compiled: Any, *args: Any) -> None:
    """``compiled(*args)`` for arguments that all carry ``__c_pointers__`` (``to_cute``, ``kernel_arg``,
    ``current_stream``): their pointers go straight to the compiled function's executor (one serves
    every device: the DSL loads the kernels as CUDA libraries for all devices, and callers launch
    under ``torch.cuda.device`` of the tensors; tests/test_multi_gpu.py), skipping the DSL's
    per-call signature walk (``generate_execution_args``), which only re-derives them (H200 host,
    2026-11-21: ~7 of a ~70 us call). The first call of a compiled function (it
    creates that executor), a function with a sealed trace spec, and the DSL's debug mode (full
    argument checks) take the DSL's own path."""
    executor = getattr(compiled, "_default_executor", None)
    if executor is None or getattr(compiled, "_pyir_spec", None) is not None or _dsl_debug():
        compiled(*args)
        return
    pointers: list[int] = []
    for arg in args:
        pointers += arg.__c_pointers__()
    executor.run_compiled_program(pointers)


@functools.cache
def _dsl_debug() -> bool:
    from cutlass.base_dsl.dsl import BaseDSL

    return bool(BaseDSL._get_dsl().envar.debug)


def current_stream(device: torch.device) -> Any:
    """The device's current stream as a kernel argument."""
    return current_stream_arg(torch.cuda.current_stream(device).cuda_stream)


def current_stream_arg(handle: int) -> Any:
    """A CUstream handle (``torch.cuda.Stream.cuda_stream``) as a kernel argument."""
    return _ValueArg(ctypes.c_void_p(handle))


# Per-problem memos of the gated and sinked routes (``FwdLauncher.variant_key``, ``BwdSm80.cached_plan``),
# bounded like api's plans: what a call's signature fixes, worked out once.
_VARIANT_KEYS: dict[tuple[Any, ...], tuple[Any, Any]] = {}
_SINK_PLANS: dict[tuple[Any, ...], Any] = {}  # (sink key, problem, device) -> FwdPlan | None (forward_with_sink)
_MAX_MEMO = 1024


def varlen_flags(varlen: VarlenArgs | None) -> tuple[bool, bool, bool]:
    """What a key reads of the varlen inputs: given at all, ``seqused_q`` given, ``seqused_k`` given."""
    if varlen is None:
        return (False, False, False)
    return (True, varlen.seqused_q is not None, varlen.seqused_k is not None)


def aligned_rows(t: torch.Tensor) -> torch.Tensor:
    """fp32 ``t`` (its last axis contiguous) as a TMA reads rows: every other stride a multiple of 4
    elements (16 bytes) and a 16-byte aligned start; ``t`` itself if it is, else a copy into rows
    padded to a multiple of 4 (a view of its first columns)."""
    t = t.to(torch.float32)
    if t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s % 4 == 0 for s in t.stride()[:-1]):
        return t
    n = t.shape[-1]
    rows = t.new_empty(*t.shape[:-1], -(-n // 4) * 4)
    rows[..., :n] = t
    return rows[..., :n]


def pad_head_dim(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    if t.shape[-1] == head_dim:
        return t
    return torch.nn.functional.pad(t, (0, head_dim - t.shape[-1]))


def keys_contiguous_ready(v: torch.Tensor) -> bool:
    """Whether a keys-contiguous ``v`` (``validate.keys_contiguous``) is one the FP8 V^T kernel takes as it is:
    16-byte-aligned data, every other stride a multiple of 16 elements (its TMA's rule for 1-byte elements)."""
    return v.data_ptr() % 16 == 0 and all(s % 16 == 0 for i, s in enumerate(v.stride()) if i != v.dim() - 3)


def kernel_ready(t: torch.Tensor) -> torch.Tensor:
    """The kernels assume 16-byte-aligned data and strides that are multiples of 8 elements, and of 16
    bytes (FP8's byte views: 16 elements) (a fresh copy, not ``contiguous()``, which returns a contiguous
    but misaligned view as it is)."""
    unit = max(8, 16 // t.element_size())
    if t.data_ptr() % 16 == 0 and all(s % unit == 0 for s in t.stride()[:-1]):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def empty_result(q: torch.Tensor, p: AttnProblem) -> tuple[torch.Tensor, torch.Tensor]:
    """Results with no kernel launch: empty batches or queries, or no keys at all (O = 0, LSE = -inf)."""
    if p.is_varlen:  # seqlen_q is total_q
        out_shape, lse_shape = (p.seqlen_q, p.nheads, p.head_dim_v), (p.nheads, p.seqlen_q)
    else:
        out_shape, lse_shape = (p.batch, p.seqlen_q, p.nheads, p.head_dim_v), (p.batch, p.nheads, p.seqlen_q)
    out = torch.zeros(out_shape, dtype=q.dtype, device=q.device)
    lse = torch.full(lse_shape, float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse


def mask_flags(p: AttnProblem) -> tuple[bool, bool]:
    """``(causal, local)`` as the kernel sees them: causal with a left window is local with
    right = 0; a window ``(-1, 0)`` is causal; ``(-1, -1)`` is neither."""
    left, right = p.window_left, p.window_right
    if left < 0 and right < 0:
        return p.causal, False
    if left < 0 and right == 0:  # validate sets right = 0 for causal
        return True, False
    return False, True


def window_args(p: AttnProblem) -> tuple[int, int]:
    """(left, right) for the kernels' Int32 slots: unbounded sides, and sides as wide as the longest
    sequence can be (>= 2**30), as ``UNBOUNDED_WINDOW``."""
    return tuple(w if 0 <= w < UNBOUNDED_WINDOW else UNBOUNDED_WINDOW for w in (p.window_left, p.window_right))


def int_ready(t: torch.Tensor) -> torch.Tensor:
    """int32, contiguous: what the kernels read cu_seqlens / seqused as."""
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def int_to_cute(t: torch.Tensor) -> Any:
    """A 1-D int32 tensor (cu_seqlens, seqused) as a kernel argument (dynamic length, unit stride)."""
    return _TensorArg(t)


def ffi_compile(kernel: Any, *args: Any, options: str | None = None) -> Any:
    """``cute.compile(kernel, *args, stream)`` for the TVM-FFI calling path: ``args`` are fake tensors
    (``fake_bshd``, ``fake_f32``, ...), DSL scalars and None (slots compiled as absent); the stream
    parameter (last) is the environment stream, i.e. PyTorch's current stream of the first CUDA
    tensor argument's device, which TVM-FFI also makes the current device for the launch. The
    result (the DSL's function; ``jit.callable_of`` gives the plain ``tvm_ffi.Function``) takes torch
    tensors, Python ints/floats and None positionally, without the stream, and checks dtypes, ranks,
    shared extents, stride divisibility and alignment itself (ValueError/TypeError on a mismatch,
    before any launch). A call costs a few us of host time against ~40-80 us for the DSL's own
    argument conversion (H100 node, perf/NOTES.md)."""
    import cutlass.cute as cute

    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(kernel, *args, stream, options="--enable-tvm-ffi" + (f" {options}" if options else ""))


def compile_forward(
    kernel: Any, dtype: Any, varlen: bool, seqused_q: bool, seqused_k: bool, options: str | None,
    extra_args: tuple[Any, ...] = (), out_dtype: Any = None, v_keys_contiguous: bool = False,
) -> Any:
    """``ffi_compile`` of a forward kernel with the shared signature ``(Q, K, V, O, LSE, softmax_scale,
    window_left, window_right, softcap, *extra_args, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
    stream)``; absent varlen inputs are compiled as None (constants). ``extra_args`` are a family's own
    arguments as compile-time stand-ins (the sm90 kernel's CTA count, tile counter, gate, FP8 descales); the family's
    ``extra_args`` gives their call-time values to ``launch_forward``. ``out_dtype``: O's element type
    where it is not the inputs' (FP8: inputs as bytes, ``Uint8``, and bf16 O). ``v_keys_contiguous``: V with
    stride 1 along its keys instead of its head dim (FP8's V^T layout, ``validate.keys_contiguous``), the
    other strides multiples of 16 elements."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    out_dtype = dtype if out_dtype is None else out_dtype
    h, h_k, d, d_v = (cute.sym_int() for _ in range(4))
    if varlen:
        total_q, total_k, b1, b = (cute.sym_int() for _ in range(4))

        def packed(total: Any, heads: Any, dim: Any, elem: Any = dtype) -> Any:
            strides = tuple(cute.sym_int64(divisibility=8) for _ in range(2))
            return make_fake_tensor(elem, (total, heads, dim), stride=(*strides, 1), assumed_align=16)

        def ints(n: Any) -> Any:
            return make_fake_tensor(cutlass.Int32, (n,), stride=(1,), assumed_align=4)

        if v_keys_contiguous:
            strides = tuple(cute.sym_int64(divisibility=16) for _ in range(2))
            v_fake = make_fake_tensor(dtype, (total_k, h_k, d_v), stride=(1, *strides), assumed_align=16)
        else:
            v_fake = packed(total_k, h_k, d_v)
        tensors = (packed(total_q, h, d), packed(total_k, h_k, d), v_fake,
                   packed(total_q, h, d_v, out_dtype), fake_f32((h, total_q)))
        varlen_tensors = (ints(b1), ints(b1), ints(b) if seqused_q else None, ints(b) if seqused_k else None)
    else:
        b, s_q, s_k = (cute.sym_int() for _ in range(3))
        if v_keys_contiguous:
            b_stride, h_stride, d_stride = (cute.sym_int64(divisibility=16) for _ in range(3))
            v_fake = make_fake_tensor(dtype, (b, s_k, h_k, d_v), stride=(b_stride, 1, h_stride, d_stride),
                                      assumed_align=16)
        else:
            v_fake = fake_bshd(dtype, b, s_k, h_k, d_v)
        tensors = (fake_bshd(dtype, b, s_q, h, d), fake_bshd(dtype, b, s_k, h_k, d), v_fake,
                   fake_bshd(out_dtype, b, s_q, h, d_v), fake_f32((b, h, s_q)))
        varlen_tensors = (None, None, None, None)
    scalars = (cutlass.Float32(1.0), cutlass.Int32(0), cutlass.Int32(0), cutlass.Float32(1.0))
    scalars += tuple(extra_args)
    return ffi_compile(kernel, *tensors, *scalars, *varlen_tensors, options=options)


def launch_forward(
    compiled: Any, key: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnProblem,
    varlen: VarlenArgs | None, out: torch.Tensor | None, lse: torch.Tensor | None, extra_args: tuple[Any, ...] = (),
    stream_handle: int | None = None, out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pads and aligns the inputs, allocates out/lse (``out``/``lse`` given: tests pass NaN-poisoned
    contiguous buffers of v's head dim; where the kernel runs v padded, out is written through a
    padded buffer) and launches a ``compile_forward`` kernel
    (``compiled``: its ``jit.callable_of``) on the inputs' device and current stream (TVM-FFI's
    environment stream; ``stream_handle``, that stream's handle, only chose ``extra_args``). ``key``
    carries head_dim(_v) and the feature flags. ``out_dtype``: O's dtype where it is not q's (FP8: q, k, v
    come as their bytes, ``uint8`` views, and O is bf16)."""
    q_k, k_k = (kernel_ready(pad_head_dim(t, key.head_dim)) for t in (q, k))
    # (a key whose V keys are contiguous gets v as it is: forward_fp8 checked that the kernel takes it)
    v_k = v if getattr(key, "fp8_v_colmajor", False) else kernel_ready(pad_head_dim(v, key.head_dim_v))
    given_out = None
    if out is not None and out.shape[-1] != key.head_dim_v:  # v padded (e.g. 96/64): write through a padded buffer
        given_out, out = out, None
    if key.varlen:
        out_shape, lse_shape = (p.seqlen_q, p.nheads, key.head_dim_v), (p.nheads, p.seqlen_q)
    else:
        out_shape, lse_shape = (p.batch, p.seqlen_q, p.nheads, key.head_dim_v), (p.batch, p.nheads, p.seqlen_q)
    if out is None:
        out = torch.empty(out_shape, dtype=out_dtype or q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    if key.seqused_q:  # the kernels write only rows < seqused_q of each sequence
        out.zero_()
        if not key.sink:  # (a sink key's LSE holds the sink: a row with no key's LSE)
            lse.fill_(float("-inf"))
    window_left, window_right = window_args(p) if key.local else (0, 0)
    softcap = p.softcap if key.softcap else 1.0
    if varlen is not None:
        ints = (varlen.cu_seqlens_q, varlen.cu_seqlens_k, varlen.seqused_q, varlen.seqused_k)
        int_args = tuple(None if t is None else int_ready(t) for t in ints)
    else:
        int_args = (None, None, None, None)
    compiled(q_k, k_k, v_k, out, lse, float(p.softmax_scale), window_left, window_right, float(softcap),
             *extra_args, *int_args)
    if key.head_dim_v != p.head_dim_v:
        out = out[..., : p.head_dim_v]
        if given_out is not None:
            out = given_out.copy_(out)
    return out, lse


class FwdPlan:
    """A dense forward call with everything its signature fixes (shapes, dtypes, device, options)
    worked out once: the compiled function and its scalar arguments, the output shapes. A call then
    allocates out/lse and makes one TVM-FFI call (``api`` keeps plans per signature). Only for
    inputs the kernel takes as they are (native head dims, no padding or slicing); TVM-FFI rejects,
    before launching, inputs whose strides or alignment the kernel cannot take (ValueError): the
    caller then goes the general way (``FwdLauncher.forward``), which copies them."""

    __slots__ = ("fn", "key", "problem", "family", "out_shape", "lse_shape", "dtype", "head", "counter_device",
                 "tail", "backend", "bwd")

    def __init__(self, fn: Any, key: Any, problem: AttnProblem, family: Any, head: tuple[Any, ...],
                 counter_device: int | None, tail: tuple[Any, ...] = ()) -> None:
        self.fn, self.key, self.problem, self.family, self.head = fn, key, problem, family, head
        self.counter_device = counter_device  # the device index of a dynamic schedule's tile counter
        self.tail = tail  # arguments after the counter (sm90: the gate's and the FP8 descales' slots, None)
        p = problem
        self.out_shape = (p.batch, p.seqlen_q, p.nheads, p.head_dim_v)
        self.lse_shape = (p.batch, p.nheads, p.seqlen_q)
        self.dtype = p.dtype
        self.backend: str | None = None  # the backend the caller asked for (the backward's dispatch)
        self.bwd: dict[bool, Any] = {}  # deterministic -> the backward's plan (callers fill it)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``lse``: the LSE buffer, given where the kernel reads it first (a sink key's logits)."""
        out = q.new_empty(self.out_shape)  # (q's dtype and device: fewer arguments to parse than torch.empty)
        if lse is None:
            lse = q.new_empty(self.lse_shape, dtype=torch.float32)
        if self.counter_device is None:
            self.fn(q, k, v, out, lse, *self.head, None, None, None, None)
        else:
            self.fn(q, k, v, out, lse, *self.head, tile_counter(self.counter_device), *self.tail, None, None, None, None)
        return out, lse


def varlen_out_shapes(p: AttnProblem) -> tuple[tuple[int, int, int], tuple[int, int]]:
    """The out and LSE shapes of a varlen problem: ``(total_q, nheads, head_dim_v)``, ``(nheads, total_q)``."""
    return (p.seqlen_q, p.nheads, p.head_dim_v), (p.nheads, p.seqlen_q)


class PackedFwdPlan(FwdPlan):
    """``FwdPlan`` of a varlen problem (``FwdLauncher.plan`` with its ``varlen``): out ``(total_q, nheads,
    head_dim_v)``, the LSE ``(nheads, total_q)``; a call passes its own ``VarlenArgs`` (int32 and contiguous:
    the caller checked), and with ``seqused_q`` zeroes out and fills the LSE with -inf first (the kernels write only
    the used rows), as ``launch_forward``."""

    __slots__ = ()

    def __init__(self, *parts: Any) -> None:
        super().__init__(*parts)
        self.out_shape, self.lse_shape = varlen_out_shapes(self.problem)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                 varlen: VarlenArgs | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        ints = (varlen.cu_seqlens_q, varlen.cu_seqlens_k, varlen.seqused_q, varlen.seqused_k)
        out = q.new_empty(self.out_shape)
        lse = q.new_empty(self.lse_shape, dtype=torch.float32)
        if self.key.seqused_q:
            out.zero_()
            lse.fill_(float("-inf"))
        if self.counter_device is None:
            self.fn(q, k, v, out, lse, *self.head, *ints)
        else:
            self.fn(q, k, v, out, lse, *self.head, tile_counter(self.counter_device), *self.tail, *ints)
        return out, lse


class FwdLauncher:
    """The ``forward`` both forward families share: empty problems need no launch; otherwise key,
    compile-or-cache, launch. Subclasses provide ``key(problem, arch, varlen)`` and ``compile``."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnProblem, varlen: VarlenArgs | None,
        out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``out``/``lse`` (internal: tests pass NaN-poisoned buffers) must be contiguous, out with v's
        head dim."""
        if p.batch == 0 or p.seqlen_q == 0 or p.seqlen_k == 0 or p.nheads == 0:
            return empty_result(q, p)
        key = self.key(p, target_arch(), varlen)  # type: ignore[attr-defined]
        compiled = compile_cache.get(key, self.compile)  # type: ignore[attr-defined]
        index = device_index(q.device)
        extra = self.extra_args(key, q.device, current_stream_handle(index))
        return launch_forward(compiled, key, q, k, v, p, varlen, out, lse, extra)

    sink_key_overrides: dict[str, Any] = {}  # key fields a sink key must have (a family's restrictions)

    def variant_key(self, p: AttnProblem, varlen: VarlenArgs | None, **fields: Any) -> tuple[Any, Any]:
        """``(the plain key, it with ``fields`` replaced)`` of problem ``p``, worked out once per (family,
        problem, arch, varlen flags, fields): a gated or sinked call built and ``dataclasses.replace``d
        its key per call (~60 of a ~190 us gated forward on an H200)."""
        arch = target_arch()
        memo = (self.kind, p, arch, varlen_flags(varlen), tuple(sorted(fields.items())))  # type: ignore[attr-defined]
        keys = _VARIANT_KEYS.get(memo)
        if keys is None:
            plain = self.key(p, arch, varlen)  # type: ignore[attr-defined]
            if len(_VARIANT_KEYS) >= _MAX_MEMO:
                _VARIANT_KEYS.clear()
            keys = _VARIANT_KEYS[memo] = (plain, dataclasses.replace(plain, **fields))
        return keys

    def forward_with_sink(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnProblem, varlen: VarlenArgs | None,
        sink: torch.Tensor, even_unpacked: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(out, lse')`` with one learnable sink logit per query head (``sink``: ``(nheads,)``) in
        the kernel's finalize (``sinks.py`` has the math), launched by ``launch_sinked``. A non-empty problem
        (the caller handles the others). None where the sink key would give up what the plain call's key does
        (``sink_key_overrides``: sm90's packed GQA heads, 3-6x faster at decode, and spanning tiles),
        unless ``even_unpacked`` (tests): the caller then joins the sink after the plain kernel."""
        overrides = self.sink_key_overrides
        plain, key = self.variant_key(p, varlen, sink=True, **overrides)
        if not even_unpacked and any(getattr(plain, name) != value for name, value in overrides.items()):
            return None
        logits = sink.detach().to(device=q.device, dtype=torch.float32)
        return self.launch_sinked(q, k, v, p, varlen, key, logits)

    def launch_sinked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnProblem, varlen: VarlenArgs | None,
        key: Any, logits: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward_with_sink``'s launch of the sink ``key``, ``logits`` fp32 on q's device: the LSE buffer
        starts as each head's logit in every row, where the kernel reads it and overwrites it (sm80; sm90
        overrides this with its kernel's sink slot)."""
        # A fresh buffer always (expand().contiguous() of a (1, h, 1) view would be the sink itself).
        if varlen is not None:
            lse = torch.empty((p.nheads, p.seqlen_q), dtype=torch.float32, device=q.device)
            lse.copy_(logits[:, None].expand(p.nheads, p.seqlen_q))
        else:
            lse = torch.empty((p.batch, p.nheads, p.seqlen_q), dtype=torch.float32, device=q.device)
            lse.copy_(logits[None, :, None].expand(p.batch, p.nheads, p.seqlen_q))
            # Dense: the sink key's plan, kept like a plain call's (``plan``): launch_forward's per-call
            # padding checks, argument building and stream lookup took ~half a sinked call's host time.
            result = run_kept_plan(_SINK_PLANS, (key, p, q.device), lambda: self.plan(q, p, key), q, k, v, lse)
            if result is not None:
                return result
        compiled = compile_cache.get(key, self.compile)  # type: ignore[attr-defined]
        extra = self.extra_args(key, q.device, current_stream_handle(device_index(q.device)))
        out, lse = launch_forward(compiled, key, q, k, v, p, varlen, None, lse, extra)
        return out.contiguous(), lse  # (out is a view where v ran padded)

    def plan(self, q: torch.Tensor, p: AttnProblem, key: Any = None, varlen: VarlenArgs | None = None
             ) -> FwdPlan | None:
        """A ``FwdPlan`` for a problem the kernel takes without padding, else None; ``key``: a variant of the
        problem's key (``variant_key``) instead of its own; a varlen problem with its ``varlen`` (which of its
        tensors are given: the key's flags) gets a ``PackedFwdPlan``."""
        if p.is_varlen != (varlen is not None) or p.batch == 0 or p.seqlen_q == 0 or p.seqlen_k == 0 or p.nheads == 0:
            return None
        if key is None:
            key = self.key(p, target_arch(), varlen)  # type: ignore[attr-defined]
        if key.head_dim != p.head_dim or key.head_dim_v != p.head_dim_v:
            return None
        fn = compile_cache.get(key, self.compile)  # type: ignore[attr-defined]
        index = device_index(q.device)
        extra = self.extra_args(key, q.device, current_stream_handle(index))
        window_left, window_right = window_args(p) if key.local else (0, 0)
        softcap = float(p.softcap) if key.softcap else 1.0
        head = (float(p.softmax_scale), window_left, window_right, softcap)
        plan_type = FwdPlan if varlen is None else PackedFwdPlan
        if extra:  # (max_ctas, tile counter or None, ...): the counter is per stream, fetched per call
            rest = extra[2:]  # (sm90: the gate's and FP8 descales' slots, None for every planned key)
            if extra[1] is None:  # (no dynamic schedule: the counter argument stays None)
                return plan_type(fn, key, p, self, (*head, extra[0], None, *rest), None)
            return plan_type(fn, key, p, self, (*head, extra[0]), index, rest)
        return plan_type(fn, key, p, self, head, None)

    def extra_args(self, key: Any, device: torch.device, stream_handle: int | None = None) -> tuple[Any, ...]:
        """A family's own call-time kernel arguments (see ``compile_forward``) for a launch on the
        stream ``stream_handle`` (None: the device's current stream); none by default."""
        return ()


def kept_plan(plans: dict[tuple[Any, ...], Any], memo: tuple[Any, ...], build: Callable[[], Any]) -> Any:
    """``plans[memo]``, built by ``build()`` (a plan or None: kept either way) on the first call; the dict
    is emptied when it reaches ``_MAX_MEMO`` entries."""
    plan = plans.get(memo, False)
    if plan is False:
        if len(plans) >= _MAX_MEMO:
            plans.clear()
        plan = plans[memo] = build()
    return plan


def run_kept_plan(plans: dict[tuple[Any, ...], Any], memo: tuple[Any, ...], build: Callable[[], Any],
                  *args: Any) -> Any:
    """``kept_plan``'s plan called with ``args``; None where there is no plan or TVM-FFI turned the inputs down
    (strides or alignment the kernel cannot take: the caller's general way copies them)."""
    plan = kept_plan(plans, memo, build)
    if plan is None:
        return None
    try:
        return plan(*args)
    except (ValueError, TypeError):
        return None


def device_index(device: torch.device) -> int:
    """A CUDA device's index (the current device for a bare ``cuda``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def current_stream_handle(device_index: int) -> int:
    """The CUstream handle of a device's current stream: ``torch.cuda.current_stream(i).cuda_stream``
    without building a Stream object (this runs on every call of a causal sm90 forward)."""
    return torch._C._cuda_getCurrentRawStream(device_index)


def is_capturing(device_index: int) -> bool:
    """Whether the current stream of a device is being captured into a CUDA graph (without a device
    switch when it is the current device: this runs on every launch that asks; torch's private
    getters, as ``torch.cuda.current_device``/``is_current_stream_capturing`` call them, skip the
    public wrappers' lazy-init checks, ~1 us per call on an H100 node's host)."""
    if device_index == torch._C._cuda_getDevice():
        return torch._C._cuda_isCurrentStreamCapturing()
    with torch.cuda.device(device_index):
        return torch.cuda.is_current_stream_capturing()


def tile_counter(device_index: int, stream_handle: int | None = None) -> torch.Tensor:
    """The dynamic schedule's tile counter for the current stream of a device. The kernel leaves it
    at zero (its last fetch resets it, kernels/common/tile_scheduler.py), so each stream's counter
    is zeroed once, when first used, instead of by a memset before every launch (2-4 us of a
    100-200 us causal call at 512-2k tokens); ``stream_handle`` is the launch's stream (None: the
    device's current one). One per stream: launches on a stream run in order,
    launches on two streams may overlap. Under CUDA graph capture every call gets its own zeroed
    counter (a captured memset): a replay may run beside eager calls on the capture stream.
    Assumes launches on one stream do not overlap (no programmatic dependent launch) and that a
    destroyed stream's handle is not reused while its causal kernels still run."""
    if is_capturing(device_index):
        return torch.zeros(1, dtype=torch.int32, device=torch.device("cuda", device_index))
    if stream_handle is None:
        stream_handle = current_stream_handle(device_index)
    return _stream_tile_counter(device_index, stream_handle)


@functools.cache
def _stream_tile_counter(device_index: int, stream_handle: int) -> torch.Tensor:
    """A zeroed int32 counter kept for one (device, stream): a cache, like the compile cache (one
    4-byte buffer per stream the process launches causal kernels on)."""
    return torch.zeros(1, dtype=torch.int32, device=torch.device("cuda", device_index))




@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a GPU (cached: a device property query costs microseconds)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# An empty kernel for the cluster occupancy query (the driver JIT-compiles it in milliseconds).
_PROBE_PTX = b""".version 8.0
.target sm_90
.address_size 64
.visible .entry cluster_probe()
{
    ret;
}
\0"""


def cluster_ctas(device_index: int, cluster_size: int) -> int:
    """CTAs that clusters of ``cluster_size`` keep resident on a GPU at once with one CTA per SM: a
    persistent launch of more would leave clusters waiting for others to finish, and their tiles
    running after the rest. Below ``num_sms`` where a GPC's SMs do not pair up (H100 and H200: 132 of
    132 for pairs, 120 for clusters of 4). Cached: one driver occupancy query per (device, cluster
    size) on an empty kernel that, like ours, fits one CTA per SM (all of its shared memory); the CuTe
    DSL's HardwareInfo asks the same, but compiles its kernel first. During CUDA graph capture an
    unqueried size gets ``num_sms`` rounded down, uncached: the query synchronizes the device and
    unloads a module, which would invalidate the capture. Where the driver reports no resident
    cluster (MPS/MIG limits), the same."""
    fallback = num_sms(device_index) // cluster_size * cluster_size
    if is_capturing(device_index):
        return fallback
    return _resident_cluster_ctas(device_index, cluster_size, fallback)


@functools.cache
def _resident_cluster_ctas(device_index: int, cluster_size: int, fallback: int) -> int:
    """``cluster_ctas`` outside a capture (cached)."""
    from cuda.bindings import driver

    def check(result):
        if result[0] != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cluster occupancy query failed: {result[0]!r}")
        return result[1] if len(result) > 1 else None

    with torch.cuda.device(device_index):
        torch.cuda.synchronize()  # (makes the device's primary context current: the query runs in it)
        module = check(driver.cuModuleLoadData(_PROBE_PTX))
        try:
            func = check(driver.cuModuleGetFunction(module, b"cluster_probe"))
            smem = torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin
            attr = driver.CUfunction_attribute
            check(driver.cuFuncSetAttribute(func, attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem))
            check(driver.cuFuncSetAttribute(func, attr.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1))
            cluster_dim = driver.CUlaunchAttribute()
            cluster_dim.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            cluster_dim.value.clusterDim.x, cluster_dim.value.clusterDim.y, cluster_dim.value.clusterDim.z = (
                cluster_size, 1, 1
            )
            config = driver.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = cluster_size, 1, 1
            config.blockDimX, config.blockDimY, config.blockDimZ = 128, 1, 1
            config.sharedMemBytes = smem
            config.numAttrs, config.attrs = 1, [cluster_dim]
            clusters = check(driver.cuOccupancyMaxActiveClusters(func, config))
        finally:
            driver.cuModuleUnload(module)
    return min(clusters * cluster_size, fallback) if clusters > 0 else fallback
