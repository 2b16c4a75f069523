"""Input validation for the public API.

Every check raises ``TypeError``/``ValueError`` (or ``NotImplementedError`` for flash-attn features we
do not have yet) whose message names the argument, says what was expected and what was given.
Never ``assert``: asserts vanish under ``python -O`` and read like internal bugs.

Checks never read device memory (no ``.item()``, no sync): ``cu_seqlens`` contents are the caller's
contract, exactly as in flash-attn.
"""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class AttnProblem:
    """Normalized description of one attention call (static facts only, no tensors)."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    head_dim: int
    head_dim_v: int
    dtype: torch.dtype
    softmax_scale: float
    causal: bool
    window_left: int  # -1: unbounded
    window_right: int  # -1: unbounded
    softcap: float
    is_varlen: bool

    @property
    def is_local(self) -> bool:
        return self.window_left >= 0 or self.window_right >= 0

    @property
    def qhead_per_kvhead(self) -> int:
        return self.nheads // self.nheads_k


def _check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _check_dtypes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fp8: bool = False) -> None:
    if fp8 and q.dtype == torch.float8_e4m3fn:  # (flashattn_hopper/fp8.py routes e4m3 inputs here)
        pass
    elif q.dtype in FP8_DTYPES:
        raise TypeError(f"q is {_dtype_name(q.dtype)}: FP8 attention takes float8_e4m3fn q, k, v")
    elif q.dtype not in SUPPORTED_DTYPES:
        name = _dtype_name(q.dtype)
        why = (f"{name} attention is not supported: cast with q.to(torch.bfloat16)" if q.dtype.is_floating_point
               else "attention needs floating-point inputs")
        raise TypeError(f"q must be float16 or bfloat16, got {name} ({why})")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have the same dtype as q ({_dtype_name(q.dtype)}), got {_dtype_name(t.dtype)}")


def _check_devices(q: torch.Tensor, others: dict[str, torch.Tensor | None]) -> None:
    """All tensors on one CUDA device. Checked after shapes so CPU tests can exercise shape errors."""
    if q.device.type != "cuda":
        hint = "" if torch.cuda.is_available() else " (no CUDA device is available on this machine)"
        raise ValueError(
            f"q must be on a CUDA device, got device '{q.device}'{hint}; flashattn_hopper runs on NVIDIA GPUs "
            "of compute capability 8.0 (Ampere) or 9.0 (Hopper)"
        )
    for name, t in others.items():
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} must be on the same device as q ({q.device}), got {t.device}")


def keys_contiguous(v: torch.Tensor) -> bool:
    """Whether ``v`` (``(batch, seqlen_k, nheads_k, d)`` or varlen ``(total_k, nheads_k, d)``) has its keys
    contiguous instead of its head dim: a view of V^T, which the FP8 kernel loads as it is (``fp8.py``)."""
    return v.dim() >= 3 and v.stride(-3) == 1 and v.shape[-1] > 1 and v.stride(-1) != 1


def _check_last_dim_contiguous(tensors: dict[str, torch.Tensor], fp8: bool = False) -> None:
    for name, t in tensors.items():
        if fp8 and name == "v" and keys_contiguous(t):  # (FP8's V^T path: kernels/sm90/fwd_fp8.py)
            continue
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(
                f"{name} must have a contiguous last dimension (stride(-1) == 1)"
                + (" or, FP8's V^T layout, contiguous keys (stride(-3) == 1)" if fp8 and name == "v" else "")
                + f", got strides {tuple(t.stride())}; "
                f"other strides may be anything (call {name}.contiguous() if it came from a transpose)"
            )


def check_softmax_scale(softmax_scale: object, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    value = float(softmax_scale)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"softmax_scale must be a finite positive number, got {softmax_scale!r}")
    return value


def _window_pair(window_size: object) -> tuple[object, ...] | list[object]:
    """``window_size`` as a host-side sequence: a tuple or list as given, a 1-D integer tensor (any
    device) or numpy array copied to the host once with ``.tolist()`` (FA3's tests draw windows with
    ``torch.randint``)."""
    if isinstance(window_size, (tuple, list)):
        return window_size
    if isinstance(window_size, torch.Tensor):
        dtype = window_size.dtype
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise TypeError(f"window_size must hold integers, got a {_dtype_name(dtype)} tensor")
        if window_size.dim() != 1:
            raise ValueError(f"window_size must be a pair (left, right), got a tensor of shape {tuple(window_size.shape)}")
        return window_size.tolist()  # one copy to the host (a sync for a CUDA tensor)
    if hasattr(window_size, "tolist") and hasattr(window_size, "ndim"):  # a numpy array
        if window_size.ndim != 1:
            raise ValueError(f"window_size must be a pair (left, right), got an array of shape {window_size.shape}")
        return window_size.tolist()  # numpy integers become ints, floats stay floats (rejected below)
    raise TypeError(
        f"window_size must be a pair (left, right) of ints or None: a tuple, list, 1-D integer tensor or numpy "
        f"array, e.g. (128, 0); got {type(window_size).__name__} {window_size!r}"
    )


def check_window(window_size: object, causal: bool) -> tuple[int, int]:
    """Returns (left, right) with -1 meaning unbounded; causal sets right to 0 as flash-attn does."""
    if window_size is None:
        window_size = (-1, -1)
    pair = _window_pair(window_size)
    if len(pair) != 2:
        raise ValueError(f"window_size must be a pair (left, right), got {len(pair)} values: {window_size!r}")
    bounds = []
    for side, w in zip(("left", "right"), pair):
        if w is None:
            w = -1
        elif type(w) is not int:  # numpy integers pass; bools and floats do not
            if isinstance(w, bool) or not isinstance(w, numbers.Integral):
                raise TypeError(f"window_size {side} must be an int or None, got {type(w).__name__} {w!r}")
            w = int(w)
        if w < -1:
            raise ValueError(f"window_size {side} must be >= 0, or -1/None for unbounded, got {w}")
        bounds.append(w)
    left, right = bounds
    if causal:
        right = 0
    return left, right


def is_causal(causal: bool, left: int, right: int) -> bool:
    """A window (-1, 0) is causal attention (bottom-right aligned) under another name."""
    return causal or (left < 0 and right == 0)


def check_softcap(softcap: object) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float (0.0 disables it), got {type(softcap).__name__}")
    value = float(softcap)
    if not math.isfinite(value) or value < 0.0:
        raise ValueError(f"softcap must be a finite number >= 0 (0.0 disables it), got {softcap!r}")
    return value


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        kind = type(value)
        where = "" if kind.__module__ == "builtins" else f"{kind.__module__}."  # (numpy's bool_ is named "bool")
        raise TypeError(f"{name} must be a bool, got {where}{kind.__name__}")
    return value


def _check_head_dims(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    if k.shape[-1] != head_dim:
        raise ValueError(f"k must have the same head dim as q ({head_dim}), got {k.shape[-1]}")
    if head_dim < 1 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"q head dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if head_dim_v < 1:
        raise ValueError(f"v head dim must be in [1, {MAX_HEAD_DIM}], got {head_dim_v}")
    if head_dim_v > MAX_HEAD_DIM:
        # flash-attn 3 has a 64/512 kernel (MLA decode); ours keep O in registers, at most 256 wide.
        raise NotImplementedError(
            f"v head dim {head_dim_v} is not implemented: head_dim_v must be <= {MAX_HEAD_DIM} "
            f"(any head_dim_v up to {MAX_HEAD_DIM} with any q/k head dim up to {MAX_HEAD_DIM})"
        )
    return head_dim, head_dim_v


def _check_heads(q_heads: int, k: torch.Tensor, v: torch.Tensor, head_axis: int) -> int:
    nheads_k = k.shape[head_axis]
    if v.shape[head_axis] != nheads_k:
        raise ValueError(f"v must have the same number of heads as k ({nheads_k}), got {v.shape[head_axis]}")
    if nheads_k < 1 or q_heads % nheads_k != 0:
        raise ValueError(
            f"the number of query heads ({q_heads}) must be a multiple of the number of key/value heads "
            f"({nheads_k}) for GQA/MQA"
        )
    return nheads_k


def check_attention_chunk(attention_chunk: object) -> int:
    """``attention_chunk``: 0 (off) or the chunk length in tokens, a Python or numpy integer."""
    if isinstance(attention_chunk, bool) or isinstance(attention_chunk, torch.Tensor):
        raise TypeError(f"attention_chunk must be an int, got {type(attention_chunk).__name__}")
    try:
        chunk = operator.index(attention_chunk)
    except TypeError:
        raise TypeError(f"attention_chunk must be an int, got {type(attention_chunk).__name__}") from None
    if chunk < 0:
        raise ValueError(f"attention_chunk must be >= 0 (0: no chunking), got {chunk}")
    return chunk


def check_learnable_sink(learnable_sink: object, q: torch.Tensor, head_axis: int) -> None:
    """``learnable_sink``: None, or one logit per query head, a floating ``(nheads,)`` tensor on q's device."""
    if learnable_sink is None:
        return
    if not isinstance(learnable_sink, torch.Tensor):
        raise TypeError(f"learnable_sink must be a tensor of shape (nheads,) or None, got {type(learnable_sink).__name__}")
    nheads = q.shape[head_axis] if isinstance(q, torch.Tensor) and q.dim() > head_axis else None
    if learnable_sink.dim() != 1 or (nheads is not None and learnable_sink.shape[0] != nheads):
        raise ValueError(f"learnable_sink must have shape (nheads,) = ({nheads},), got {tuple(learnable_sink.shape)}")
    if learnable_sink.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"learnable_sink must be float32 (or bf16/fp16), got {_dtype_name(learnable_sink.dtype)}")
    if isinstance(q, torch.Tensor) and learnable_sink.device != q.device:
        raise ValueError(f"learnable_sink must be on q's device ({q.device}), got {learnable_sink.device}")


def check_log_decay(log_decay: object, q: torch.Tensor, k: torch.Tensor, varlen: bool, softcap: object) -> None:
    """``log_decay``: None, or the log forget gates, ``(batch, seqlen_k, nheads)`` (varlen ``(total_k,
    nheads)``), floating, on q's device; bf16 q/k/v with head dims up to 252, no softcap."""
    if log_decay is None:
        return
    if not isinstance(log_decay, torch.Tensor):
        raise TypeError(f"log_decay must be a tensor of log forget gates or None, got {type(log_decay).__name__}")
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        return  # the tensor checks that follow name q or k
    shape = (k.shape[0], q.shape[1]) if varlen else (k.shape[0], k.shape[1], q.shape[2])
    what = "(total_k, nheads)" if varlen else "(batch, seqlen_k, nheads)"
    if tuple(log_decay.shape) != shape:
        raise ValueError(f"log_decay must have shape {what} = {shape}, got {tuple(log_decay.shape)}")
    if log_decay.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"log_decay must be float32 (or bf16/fp16), got {_dtype_name(log_decay.dtype)}")
    if log_decay.device != q.device:
        raise ValueError(f"log_decay must be on q's device ({q.device}), got {log_decay.device}")
    if q.dtype != torch.bfloat16:
        raise NotImplementedError(
            f"log_decay needs bfloat16 q, k, v (got {_dtype_name(q.dtype)}): fp16 cannot hold the cumulative gates of long sequences"
        )
    if q.shape[-1] > MAX_HEAD_DIM - 4:  # gate.py: 4 more q/k columns
        raise NotImplementedError(f"log_decay supports head dims up to {MAX_HEAD_DIM - 4}, got {q.shape[-1]}")
    if isinstance(softcap, (int, float)) and softcap > 0:
        raise NotImplementedError("log_decay with softcap is not implemented (the decay must not pass through tanh)")


def check_common_options(
    softmax_scale: object,
    causal: object,
    window_size: object,
    softcap: object,
    deterministic: object,
    return_lse: object,
    return_attn_probs: object,
    backend: object,
) -> None:
    _check_bool("causal", causal)
    _check_bool("deterministic", deterministic)
    _check_bool("return_lse", return_lse)
    _check_bool("return_attn_probs", return_attn_probs)
    # (The scalars here too, not only in validate_dense / validate_varlen: the sink, gate and chunk routes
    # take float(softmax_scale) before those run, and the gate's route never passes softcap on.)
    if softmax_scale is not None:
        check_softmax_scale(softmax_scale, 1)
    check_softcap(softcap)
    if backend is not None and (not isinstance(backend, str) or backend not in ("sm90", "sm80")):
        raise ValueError(f"backend must be None, 'sm90' or 'sm80', got {backend!r}")


def validate_dense(
    q: object,
    k: object,
    v: object,
    softmax_scale: object,
    causal: bool,
    window_size: object,
    softcap: object,
    fp8: bool = False,
) -> AttnProblem:
    q, k, v = _check_tensor("q", q), _check_tensor("k", k), _check_tensor("v", v)
    _check_dtypes(q, k, v, fp8)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (batch, seqlen, nheads, headdim), got {tuple(t.shape)}")
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k = k.shape[1]
    for name, t in (("k", k), ("v", v)):
        if t.shape[0] != batch:
            raise ValueError(f"{name} must have the same batch size as q ({batch}), got {t.shape[0]}")
    if v.shape[1] != seqlen_k:
        raise ValueError(f"v must have the same seqlen as k ({seqlen_k}), got {v.shape[1]}")
    nheads_k = _check_heads(nheads, k, v, head_axis=2)
    head_dim, head_dim_v = _check_head_dims(q, k, v)
    _check_last_dim_contiguous({"q": q, "k": k, "v": v}, fp8)
    scale = check_softmax_scale(softmax_scale, head_dim)
    left, right = check_window(window_size, causal)
    cap = check_softcap(softcap)
    _check_devices(q, {"k": k, "v": v})
    return AttnProblem(
        batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=nheads, nheads_k=nheads_k,
        head_dim=head_dim, head_dim_v=head_dim_v, dtype=q.dtype, softmax_scale=scale,
        causal=is_causal(causal, left, right), window_left=left, window_right=right, softcap=cap, is_varlen=False,
    )


def _check_int_or_tensor(name: str, value: object) -> None:
    """max_seqlen: a Python int or a 0-d integer tensor; never read (no sync, no recompile)."""
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise TypeError(f"{name} must be an int or a 0-d integer tensor, got a {value.dtype} tensor of shape {tuple(value.shape)}")
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or a 0-d integer tensor, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def _check_index_tensor(name: str, t: object, length: int | None, what: str) -> torch.Tensor:
    t = _check_tensor(name, t)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be an int32 tensor, got {_dtype_name(t.dtype)}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D ({what}), got shape {tuple(t.shape)}")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name} must have length {length} ({what}), got {t.shape[0]}")
    return t


def validate_varlen(
    q: object,
    k: object,
    v: object,
    cu_seqlens_q: object,
    cu_seqlens_k: object,
    max_seqlen_q: object,
    max_seqlen_k: object,
    seqused_q: object,
    seqused_k: object,
    softmax_scale: object,
    causal: bool,
    window_size: object,
    softcap: object,
    fp8: bool = False,
) -> AttnProblem:
    q, k, v = _check_tensor("q", q), _check_tensor("k", k), _check_tensor("v", v)
    _check_dtypes(q, k, v, fp8)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must have shape (total_tokens, nheads, headdim) for varlen, got {tuple(t.shape)}")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"v must have the same number of tokens as k ({k.shape[0]}), got {v.shape[0]}")
    nheads = q.shape[1]
    nheads_k = _check_heads(nheads, k, v, head_axis=1)
    head_dim, head_dim_v = _check_head_dims(q, k, v)
    _check_last_dim_contiguous({"q": q, "k": k, "v": v}, fp8)
    cu_q = _check_index_tensor("cu_seqlens_q", cu_seqlens_q, None, "batch + 1 offsets")
    if cu_q.shape[0] < 1:
        raise ValueError("cu_seqlens_q must have length batch + 1 >= 1, got an empty tensor")
    batch = cu_q.shape[0] - 1
    _check_index_tensor("cu_seqlens_k", cu_seqlens_k, batch + 1, "batch + 1, same as cu_seqlens_q")
    if seqused_q is not None:
        _check_index_tensor("seqused_q", seqused_q, batch, "one length per sequence")
    if seqused_k is not None:
        _check_index_tensor("seqused_k", seqused_k, batch, "one length per sequence")
    _check_int_or_tensor("max_seqlen_q", max_seqlen_q)
    _check_int_or_tensor("max_seqlen_k", max_seqlen_k)
    scale = check_softmax_scale(softmax_scale, head_dim)
    left, right = check_window(window_size, causal)
    cap = check_softcap(softcap)
    _check_devices(q, {
        "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_seqlens_k,  # type: ignore[dict-item]
        "seqused_q": seqused_q, "seqused_k": seqused_k,  # type: ignore[dict-item]
    })
    return AttnProblem(
        batch=batch, seqlen_q=q.shape[0], seqlen_k=k.shape[0], nheads=nheads, nheads_k=nheads_k,
        head_dim=head_dim, head_dim_v=head_dim_v, dtype=q.dtype, softmax_scale=scale,
        causal=is_causal(causal, left, right), window_left=left, window_right=right, softcap=cap, is_varlen=True,
    )


# flash-attn 2/3/4 keyword arguments we do not implement, with the value that means "feature off".
# Passing the neutral value is accepted (code written for flash-attn keeps working); anything else
# raises NotImplementedError naming the argument. Performance hints we pick ourselves are ignored.
_UNSUPPORTED_NEUTRAL = {
    "dropout_p": 0.0,
    "alibi_slopes": None,
    "qv": None,
    # (FP8 inputs take them: flashattn_hopper/fp8.py; with 16-bit inputs only None)
    "q_descale": None,
    "k_descale": None,
    "v_descale": None,
    "score_mod": None,
    "mask_mod": None,
    "block_table": None,
    "page_table": None,
}
_IGNORED_HINTS = {"num_splits", "pack_gqa", "sm_margin"}


def too_many_positional(
    func_name: str, positional: str, extra: tuple[object, ...], fa2_next: str, fa3_next: str,
) -> TypeError:
    """The error for options passed by position: flash-attn 2 and 3 take them positionally, in different
    orders, so a positional value cannot be mapped safely; say which name each library would give it."""
    n = len(positional.split(", "))
    return TypeError(
        f"{func_name}() takes {n} positional arguments ({positional}) but {n + len(extra)} were given: the options "
        f"after {positional.rsplit(', ', 1)[-1]} are keyword-only. flash-attn 2 reads argument {n + 1} as {fa2_next}, "
        f"flash-attn 3 as {fa3_next}; pass options by name, e.g. {fa2_next}={_short(extra[0])}"
    )


def check_flash_attn_extras(func_name: str, extras: dict[str, object]) -> None:
    for name, value in extras.items():
        if name in _IGNORED_HINTS:
            continue
        if name not in _UNSUPPORTED_NEUTRAL:
            raise TypeError(f"{func_name}() got an unexpected keyword argument {name!r}")
        if isinstance(value, torch.Tensor) or not _is_neutral(value, _UNSUPPORTED_NEUTRAL[name]):
            if name.endswith("_descale"):
                raise TypeError(f"{name} goes with float8_e4m3fn q, k, v (FP8 attention); these inputs are not FP8")
            raise NotImplementedError(f"{name} is not supported by flashattn_hopper (got {_short(value)})")


def _is_neutral(value: object, neutral: object) -> bool:
    """Whether a flash-attn keyword's value is its "off" value (an array compares elementwise: never)."""
    try:
        return bool(value == neutral)
    except Exception:  # noqa: BLE001 - e.g. numpy's ambiguous truth value
        return False


def _short(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return repr(value)
