"""Bad input gets a clear Python error naming the argument (CPU tier: no GPU needed).

Device checks run after shape/dtype checks, so CPU tensors exercise every shape/dtype error here;
the device errors themselves are checked both here (CPU input) and in the GPU tier (mixed devices).
"""

from __future__ import annotations

import pytest
import torch

from flashattn_hopper import flash_attn_func, flash_attn_varlen_func
from flashattn_hopper import validate


def qkv(b=2, s_q=16, s_k=16, h=4, h_k=4, d=64, dv=None, dtype=torch.bfloat16):
    dv = d if dv is None else dv
    return (
        torch.randn(b, s_q, h, d, dtype=dtype),
        torch.randn(b, s_k, h_k, d, dtype=dtype),
        torch.randn(b, s_k, h_k, dv, dtype=dtype),
    )


def varlen_qkv(total_q=20, total_k=24, h=4, h_k=4, d=64, batch=2):
    q, k, v = (torch.randn(n, hh, d, dtype=torch.bfloat16) for n, hh in ((total_q, h), (total_k, h_k), (total_k, h_k)))
    cu_q = torch.tensor([0, 8, total_q], dtype=torch.int32)
    cu_k = torch.tensor([0, 10, total_k], dtype=torch.int32)
    return q, k, v, cu_q, cu_k


def raises(exc, match, fn, *args, **kwargs):
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)


def test_q_not_a_tensor():
    _, k, v = qkv()
    raises(TypeError, "q must be a torch.Tensor", flash_attn_func, [1.0], k, v)


def test_dtype_fp32_rejected():
    q, k, v = qkv(dtype=torch.float32)
    raises(TypeError, "q must be float16 or bfloat16, got float32", flash_attn_func, q, k, v)


@pytest.mark.parametrize("dtype,why", [
    (torch.float32, r"float32 attention is not supported"),
    (torch.float64, r"float64 attention is not supported"),
    (torch.int32, r"attention needs floating-point inputs"),
    (torch.int64, r"attention needs floating-point inputs"),
])
def test_dtype_message_names_the_dtype_and_the_supported_ones(dtype, why):
    """An integer input used to be told "fp32 attention is not supported"."""
    q, k, v = (t.to(dtype) for t in qkv())
    with pytest.raises(TypeError, match=rf"q must be float16 or bfloat16, got {str(dtype)[6:]} \({why}") as info:
        flash_attn_func(q, k, v)
    assert "fp32" not in str(info.value)


def test_dtype_mismatch():
    q, k, v = qkv()
    raises(TypeError, "k must have the same dtype as q", flash_attn_func, q, k.half(), v)
    raises(TypeError, "v must have the same dtype as q", flash_attn_func, q, k, v.half())


def test_rank():
    q, k, v = qkv()
    raises(ValueError, r"q must have shape \(batch, seqlen, nheads, headdim\)", flash_attn_func, q[0], k, v)


def test_batch_mismatch():
    q, k, v = qkv()
    raises(ValueError, "k must have the same batch size as q", flash_attn_func, q, k[:1], v[:1])


def test_kv_seqlen_mismatch():
    q, k, v = qkv()
    raises(ValueError, "v must have the same seqlen as k", flash_attn_func, q, k, v[:, :5])


def test_heads_not_divisible():
    q, k, v = qkv(h=6, h_k=4)
    raises(ValueError, r"number of query heads \(6\) must be a multiple", flash_attn_func, q, k, v)


def test_kv_heads_differ():
    q, k, _ = qkv(h=4, h_k=2)
    v = torch.randn(2, 16, 1, 64, dtype=torch.bfloat16)
    raises(ValueError, "v must have the same number of heads as k", flash_attn_func, q, k, v)


def test_head_dim_qk_mismatch():
    q, _, v = qkv()
    k = torch.randn(2, 16, 4, 32, dtype=torch.bfloat16)
    raises(ValueError, r"k must have the same head dim as q \(64\)", flash_attn_func, q, k, v)


def test_head_dim_too_large_says_supported_range():
    q, k, v = qkv(d=512)
    raises(ValueError, r"head dim must be in \[1, 256\], got 512", flash_attn_func, q, k, v)


def test_head_dim_v_above_the_limit_names_it():
    """flash-attn 3 tries head_dim_v 512 (its MLA decode kernel): not implemented, and said so."""
    q, k, v = qkv(d=64, dv=512)
    raises(NotImplementedError, r"v head dim 512 is not implemented: head_dim_v must be <= 256", flash_attn_func, q, k, v)


@pytest.mark.parametrize("d,dv", [(64, 128), (64, 256), (128, 256), (96, 192), (8, 256)])
def test_head_dim_v_larger_than_qk_passes_the_head_dim_checks(d, dv):
    q, k, v = qkv(d=d, dv=dv)  # CPU tensors: the device check, after the shapes', is what stops them
    raises(ValueError, "q must be on a CUDA device", flash_attn_func, q, k, v)


def test_last_dim_not_contiguous():
    q, k, v = qkv()
    q_t = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # same shape, stride(-1) != 1
    raises(ValueError, "q must have a contiguous last dimension", flash_attn_func, q_t, k, v)


def test_other_strides_are_fine_until_device_check():
    qkv_packed = torch.randn(2, 16, 3, 4, 64, dtype=torch.bfloat16)
    q, k, v = qkv_packed.unbind(dim=2)  # non-contiguous views: must pass validation
    raises(ValueError, "q must be on a CUDA device", flash_attn_func, q, k, v)


@pytest.mark.parametrize("scale,exc", [("0.1", TypeError), (-1.0, ValueError), (float("nan"), ValueError), (True, TypeError)])
def test_softmax_scale(scale, exc):
    q, k, v = qkv()
    raises(exc, "softmax_scale", flash_attn_func, q, k, v, softmax_scale=scale)


@pytest.mark.parametrize("window,exc", [
    ((1, 2, 3), ValueError), ((-2, 0), ValueError), ((1.5, 0), TypeError), ((True, 0), TypeError),
    (5, TypeError), ("ab", TypeError), (3.0, TypeError),
    (torch.tensor([1.0, 2.0]), TypeError), (torch.tensor([True, False]), TypeError),
    (torch.tensor([1, 2, 3]), ValueError), (torch.tensor([[1, 2]]), ValueError), (torch.tensor([-2, 0]), ValueError),
])
def test_window_size(window, exc):
    q, k, v = qkv()
    raises(exc, "window_size", flash_attn_func, q, k, v, window_size=window)


def _window_forms(left, right):
    """The same window as every form flash-attn users pass: FA3's varlen tests use a torch.randint tensor."""
    np = pytest.importorskip("numpy", reason="the numpy forms need numpy (a dependency of the CuTe DSL)")
    return {
        "tuple": (left, right), "list": [left, right],
        "tensor_int64": torch.tensor([left, right]), "tensor_int32": torch.tensor([left, right], dtype=torch.int32),
        "numpy_array": np.array([left, right]), "numpy_scalars": (np.int64(left), np.int32(right)),
    }


@pytest.mark.parametrize("left,right", [(128, 0), (-1, 7), (0, 0)])
def test_window_size_forms_normalize_alike(left, right):
    for name, form in _window_forms(left, right).items():
        for causal in (False, True):
            assert validate.check_window(form, causal) == validate.check_window((left, right), causal), name
    assert validate.check_window([None, 5], False) == validate.check_window((None, 5), False) == (-1, 5)


def test_window_size_forms_accepted_by_both_entry_points():
    """Every form passes validation: the next error is the device check (CPU tensors here)."""
    q, k, v = qkv()
    vq, vk, vv, cu_q, cu_k = varlen_qkv()
    for name, form in _window_forms(64, 0).items():
        raises(ValueError, "CUDA device", flash_attn_func, q, k, v, window_size=form)
        raises(ValueError, "CUDA device", flash_attn_varlen_func, vq, vk, vv, cu_q, cu_k, 8, 10, window_size=form)


def test_window_size_numpy_errors():
    np = pytest.importorskip("numpy", reason="the numpy forms need numpy (a dependency of the CuTe DSL)")
    q, k, v = qkv()
    raises(TypeError, "window_size left must be an int", flash_attn_func, q, k, v, window_size=np.array([1.5, 0.0]))
    raises(ValueError, "window_size left must be >= 0", flash_attn_func, q, k, v, window_size=np.array([-3, 0]))
    raises(ValueError, r"window_size must be a pair .* shape \(1, 2\)", flash_attn_func, q, k, v, window_size=np.array([[1, 2]]))


@pytest.mark.parametrize("softcap,exc", [(-1.0, ValueError), (float("inf"), ValueError), ("1", TypeError)])
def test_softcap(softcap, exc):
    q, k, v = qkv()
    raises(exc, "softcap", flash_attn_func, q, k, v, softcap=softcap)


@pytest.mark.parametrize("name", ["causal", "deterministic", "return_lse", "return_attn_probs"])
def test_bool_flags(name):
    q, k, v = qkv()
    raises(TypeError, f"{name} must be a bool", flash_attn_func, q, k, v, **{name: 1})


def test_backend_value():
    q, k, v = qkv()
    raises(ValueError, "backend must be None, 'sm90' or 'sm80'", flash_attn_func, q, k, v, backend="sm70")


def test_flash_attn2_positional_dropout_fails_loudly():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="positional"):
        flash_attn_func(q, k, v, 0.0, None, True)  # FA2 order: dropout_p, softmax_scale, causal


def test_positional_option_names_dropout_p_and_keyword_only():
    q, k, v = qkv()
    with pytest.raises(TypeError) as info:
        flash_attn_func(q, k, v, 0.1)
    message = str(info.value)
    assert "dropout_p" in message and "keyword-only" in message and "(q, k, v) but 4 were given" in message, message
    assert "dropout_p=0.1" in message


def test_varlen_positional_option_after_max_seqlen_k():
    q, k, v, cu_q, cu_k = varlen_qkv()
    with pytest.raises(TypeError) as info:
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 8, 10, 0.0)  # FA2: dropout_p; FA3: seqused_q
    message = str(info.value)
    assert "after max_seqlen_k are keyword-only" in message and "dropout_p" in message and "seqused_q" in message


@pytest.mark.parametrize("name,value", [("dropout_p", 0.1), ("alibi_slopes", torch.ones(4)), ("qv", torch.ones(1))])
def test_unimplemented_flash_attn_features(name, value):
    q, k, v = qkv()
    raises(NotImplementedError, name, flash_attn_func, q, k, v, **{name: value})


def test_descales_need_fp8_inputs():
    """FA3's descales go with float8_e4m3fn q, k, v (tests/test_fp8_fwd.py); with 16-bit inputs they are an error."""
    q, k, v = qkv()
    raises(TypeError, "q_descale", flash_attn_func, q, k, v, q_descale=torch.ones(1, 4))


def test_implemented_flash_attn_extras_pass_to_the_device_check():
    """attention_chunk and learnable_sink are ours now (tests/test_chunk.py, tests/test_sinks.py)."""
    q, k, v = qkv()
    raises(ValueError, "CUDA device", flash_attn_func, q, k, v, attention_chunk=4, learnable_sink=torch.ones(q.shape[2]))


def test_flash_attn_neutral_values_accepted_until_device_check():
    q, k, v = qkv()
    raises(ValueError, "CUDA device", flash_attn_func, q, k, v, dropout_p=0.0, alibi_slopes=None, num_splits=1, pack_gqa=None)


def test_unknown_keyword():
    q, k, v = qkv()
    raises(TypeError, "unexpected keyword argument 'bogus'", flash_attn_func, q, k, v, bogus=1)


def test_cpu_tensors_explain_gpu_requirement():
    q, k, v = qkv()
    with pytest.raises(ValueError) as info:
        flash_attn_func(q, k, v)
    message = str(info.value)
    assert "q must be on a CUDA device" in message and "compute capability 8.0" in message
    if not torch.cuda.is_available():
        assert "no CUDA device is available" in message


def test_mixed_devices_named():
    q, k, v = qkv()
    raises(ValueError, "k must be on the same device as q", validate._check_devices, _fake_cuda(q), {"k": k})


def _fake_cuda(t):
    """A stand-in whose device reports cuda, to check the same-device rule without a GPU."""

    class _T:
        device = torch.device("cuda", 0)

    return _T()


# --- varlen ---------------------------------------------------------------------------------


def test_varlen_cu_seqlens_dtype():
    q, k, v, cu_q, cu_k = varlen_qkv()
    raises(TypeError, "cu_seqlens_q must be an int32 tensor, got int64", flash_attn_varlen_func, q, k, v, cu_q.long(), cu_k, 8, 10)


def test_varlen_cu_seqlens_length():
    q, k, v, cu_q, cu_k = varlen_qkv()
    raises(ValueError, "cu_seqlens_k must have length 3", flash_attn_varlen_func, q, k, v, cu_q, cu_k[:2], 8, 10)


def test_varlen_cu_seqlens_rank():
    q, k, v, cu_q, cu_k = varlen_qkv()
    raises(ValueError, "cu_seqlens_q must be 1-D", flash_attn_varlen_func, q, k, v, cu_q[None], cu_k, 8, 10)


def test_varlen_cu_seqlens_not_tensor():
    q, k, v, _, cu_k = varlen_qkv()
    raises(TypeError, "cu_seqlens_q must be a torch.Tensor", flash_attn_varlen_func, q, k, v, [0, 8, 20], cu_k, 8, 10)


def test_varlen_seqused_length():
    q, k, v, cu_q, cu_k = varlen_qkv()
    raises(ValueError, "seqused_k must have length 2", flash_attn_varlen_func, q, k, v, cu_q, cu_k, 8, 10,
           seqused_k=torch.zeros(3, dtype=torch.int32))


def test_varlen_rank():
    q, k, v, cu_q, cu_k = varlen_qkv()
    raises(ValueError, r"q must have shape \(total_tokens, nheads, headdim\)", flash_attn_varlen_func, q[None], k, v, cu_q, cu_k)


@pytest.mark.parametrize("value,exc", [(8.0, TypeError), (-1, ValueError), (torch.tensor([8]), TypeError), (torch.tensor(8.0), TypeError)])
def test_varlen_max_seqlen(value, exc):
    q, k, v, cu_q, cu_k = varlen_qkv()
    raises(exc, "max_seqlen_q", flash_attn_varlen_func, q, k, v, cu_q, cu_k, value, 10)


def test_varlen_max_seqlen_tensor_accepted_without_reading_it():
    q, k, v, cu_q, cu_k = varlen_qkv()
    # A 0-d tensor passes validation (the next error is the device check, so it was not rejected).
    raises(ValueError, "CUDA device", flash_attn_varlen_func, q, k, v, cu_q, cu_k, torch.tensor(12), torch.tensor(14))


def test_varlen_cu_seqlens_on_other_device_than_q():
    q, k, v, cu_q, cu_k = varlen_qkv()
    raises(ValueError, "cu_seqlens_q must be on the same device as q", validate._check_devices, _fake_cuda(q), {"cu_seqlens_q": cu_q})


def test_scalar_options_are_checked_on_the_sink_and_gate_routes():
    """softmax_scale and softcap of the wrong type or value are named errors on every route: the sink and gate
    routes took float(softmax_scale) before validate_dense ran, and the gate's route dropped a softcap that
    was not a Python number (np.float32(5) gave the no-softcap output)."""
    import numpy as np

    q, k, v = qkv(b=1, s_q=8, s_k=8, h=2, h_k=2)
    extras = ({"learnable_sink": torch.zeros(2)}, {"log_decay": torch.zeros(1, 8, 2)})
    for extra in extras:
        for scale in (np.float32(0.1), torch.tensor(0.1), "0.1", True):
            raises(TypeError, "softmax_scale must be a float", flash_attn_func, q, k, v, softmax_scale=scale, **extra)
        raises(ValueError, "softmax_scale must be a finite positive", flash_attn_func, q, k, v, softmax_scale=-1.0,
               **extra)
        for cap in (np.float32(5.0), torch.tensor(5.0), "5"):
            raises(TypeError, "softcap must be a float", flash_attn_func, q, k, v, softcap=cap, **extra)
        raises(ValueError, "softcap must be a finite number", flash_attn_func, q, k, v, softcap=float("nan"), **extra)


def test_backend_and_extras_of_odd_types_are_named_errors():
    """An unhashable backend reached the plan cache's lookup (TypeError: unhashable type); an array-valued
    flash-attn keyword raised numpy's / torch's ambiguous truth value."""
    import numpy as np

    q, k, v = qkv(b=1, s_q=8, s_k=8, h=2, h_k=2)
    raises(ValueError, "backend must be None", flash_attn_func, q, k, v, backend=["sm90"])
    raises(ValueError, "backend must be None", flash_attn_func, q, k, v, backend={})
    raises(NotImplementedError, "alibi_slopes is not supported", flash_attn_func, q, k, v, alibi_slopes=np.ones(2))
    raises(NotImplementedError, "dropout_p is not supported", flash_attn_func, q, k, v, dropout_p=torch.tensor([0.1, 0.2]))
    raises(TypeError, "causal must be a bool, got numpy.bool", flash_attn_func, q, k, v, causal=np.bool_(True))


def test_varlen_routes_that_index_first_validate_first():
    """attention_chunk, log_decay and learnable_sink index with cu_seqlens / seqused before the kernels' checks:
    the varlen errors come first (a chunked call used to accept a batch mismatch and float or int64 offsets; a
    gated one raised IndexError, on CUDA a device-side assert). (max_seqlen_k is not read by the chunk route
    either since its segment table is sized from the shapes: ``chunk.varlen_num_segments``.)"""
    q, k, v, cu_q, cu_k = varlen_qkv(h=2, h_k=2)
    routes = ({"attention_chunk": 8}, {"log_decay": torch.zeros(24, 2)}, {"learnable_sink": torch.zeros(2)})
    for extra in routes:
        raises(ValueError, "cu_seqlens_k must have length 3", flash_attn_varlen_func, q, k, v, cu_q, cu_k[:2], 12, 14,
               **extra)
        raises(TypeError, "cu_seqlens_q must be an int32 tensor", flash_attn_varlen_func, q, k, v, cu_q.long(), cu_k,
               12, 14, **extra)
        raises(ValueError, "seqused_k must have length 2", flash_attn_varlen_func, q, k, v, cu_q, cu_k, 12, 14,
               seqused_k=torch.tensor([3], dtype=torch.int32), **extra)
