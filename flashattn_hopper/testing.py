"""Reference attention and the flash-attn acceptance rule, shared by the tests and the perf sweep.

``attention_ref`` computes attention with plain PyTorch ops: in fp32 (``upcast=True``, the oracle) or
in the input dtype (``upcast=False``, the "what would PyTorch get" yardstick). The rule, as in
flash-attn's tests: ``max|ours - ref| <= 2 * max|pytorch_same_dtype - ref| + atol`` (factor 3 with
softcap), with ``rounding_atol`` as the gradients' atol (FA3's).

It materializes the (seqlen_q x seqlen_k) scores: use it on test-sized problems or on slices.
"""

from __future__ import annotations

import math

import torch


def _key_mask(
    seqlen_q: int, seqlen_k: int, causal: bool, window: tuple[int, int], device: torch.device, chunk: int = 0,
) -> torch.Tensor | None:
    """Bool (seqlen_q, seqlen_k), True where the key is visible; bottom-right aligned like flash-attn.
    ``chunk`` > 0: also only keys of the query's chunk, ``j // chunk == (i + seqlen_k - seqlen_q) // chunk``
    (flash-attn 3's ``attention_chunk``), built explicitly from that rule."""
    left, right = window
    if causal:
        right = 0
    if left < 0 and right < 0 and chunk <= 0:
        return None
    rows = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    cols = torch.arange(seqlen_k, device=device)[None, :]
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        visible &= cols <= rows + right
    if left >= 0:
        visible &= cols >= rows - left
    if chunk > 0:
        visible &= torch.div(cols, chunk, rounding_mode="floor") == torch.div(rows, chunk, rounding_mode="floor")
    return visible


def _dense_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    window: tuple[int, int],
    softcap: float,
    chunk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (b, s_q, h, d), k/v (b, s_k, h_k, d); computed in q's dtype."""
    nheads, nheads_k = q.shape[2], k.shape[2]
    if nheads != nheads_k:
        k = k.repeat_interleave(nheads // nheads_k, dim=2)
        v = v.repeat_interleave(nheads // nheads_k, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q * softmax_scale, k)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    visible = _key_mask(q.shape[1], k.shape[1], causal, window, q.device, chunk)
    if visible is None:
        lse = torch.logsumexp(scores.float(), dim=-1)  # (b, h, s_q)
        probs = torch.softmax(scores, dim=-1)
    else:
        # Rows that see no key: softmax over finite zeros, then zeroed, so that neither the output
        # nor any gradient flowing back through the reference is NaN; their LSE is -inf.
        has_key = visible.any(dim=-1, keepdim=True)
        scores = scores.masked_fill(~visible, float("-inf")).masked_fill(~has_key, 0.0)
        lse = torch.logsumexp(scores.float(), dim=-1).masked_fill(~has_key[..., 0], float("-inf"))
        probs = torch.softmax(scores, dim=-1) * has_key
    out = torch.einsum("bhts,bshd->bthd", probs, v)
    return out, lse


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (-1, -1),
    softcap: float = 0.0,
    attention_chunk: int = 0,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference (out, lse) in the API's layouts; varlen when ``cu_seqlens_q`` is given.

    Varlen runs each sequence on its own (a padding mask in effect), honouring ``seqused``; rows past
    ``seqused_q`` come back as out = 0, lse = -inf. ``attention_chunk``: the chunk mask, built from its
    definition (per sequence). out is returned in the input dtype.
    """
    dtype = q.dtype
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    window = tuple(-1 if w is None else w for w in window_size)
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    if cu_seqlens_q is None:
        out, lse = _dense_ref(q, k, v, scale, causal, window, softcap, attention_chunk)  # type: ignore[arg-type]
        return out.to(dtype), lse
    assert cu_seqlens_k is not None, "attention_ref: varlen needs cu_seqlens_k too"
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    used_q = seqused_q.tolist() if seqused_q is not None else None
    used_k = seqused_k.tolist() if seqused_k is not None else None
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    for i in range(len(cu_q) - 1):
        len_q = used_q[i] if used_q is not None else cu_q[i + 1] - cu_q[i]
        len_k = used_k[i] if used_k is not None else cu_k[i + 1] - cu_k[i]
        if len_q == 0:
            continue
        q_i = q[cu_q[i] : cu_q[i] + len_q][None]
        k_i, v_i = (t[cu_k[i] : cu_k[i] + len_k][None] for t in (k, v))
        if len_k == 0:
            continue  # no keys: out stays 0, lse stays -inf
        o_i, lse_i = _dense_ref(q_i, k_i, v_i, scale, causal, window, softcap, attention_chunk)  # type: ignore[arg-type]
        out[cu_q[i] : cu_q[i] + len_q] = o_i[0]
        lse[:, cu_q[i] : cu_q[i] + len_q] = lse_i[0]
    return out.to(dtype), lse


def max_err_check(
    out: torch.Tensor, out_ref: torch.Tensor, out_pt: torch.Tensor, atol: float = 1e-5, factor: float = 2.0
) -> tuple[bool, float, float]:
    """The flash-attn rule. Returns (ok, our max error, allowed bound).

    Entries where the reference is infinite (the -inf LSE of rows with no keys) must match exactly, in
    ours and in PyTorch's result. Fails, with bound = NaN, where the rule has no yardstick: a NaN in
    ours or in the reference, or a PyTorch error that is not finite (NaN, or inf where the reference
    is finite). Mapping that error to a large finite number would let any error of ours pass.
    """
    out, out_ref, out_pt = out.float(), out_ref.float(), out_pt.float()
    same_inf = torch.isinf(out_ref) & (out == out_ref)
    diff = torch.where(same_inf, torch.zeros_like(out), (out - out_ref).abs())
    diff_pt = torch.where(torch.isinf(out_ref) & (out_pt == out_ref), torch.zeros_like(out_pt), (out_pt - out_ref).abs())
    if torch.isnan(diff).any():
        return False, float("nan"), float("nan")
    err = diff.max().item() if diff.numel() else 0.0
    err_pt = diff_pt.max().item() if diff_pt.numel() else 0.0  # NaN if any entry is NaN
    if not math.isfinite(err_pt):
        return False, err, float("nan")
    bound = factor * err_pt + atol
    return err <= bound, err, bound


def assert_close_to_ref(
    name: str, out: torch.Tensor, out_ref: torch.Tensor, out_pt: torch.Tensor, atol: float = 1e-5,
    factor: float = 2.0,
) -> None:
    """``max_err_check`` as an assertion whose message says which part failed."""
    ok, err, bound = max_err_check(out, out_ref, out_pt, atol=atol, factor=factor)
    if ok:
        return
    if math.isnan(err):
        raise AssertionError(f"{name}: NaN in ours or in the fp32 reference")
    if math.isnan(bound):
        raise AssertionError(
            f"{name}: PyTorch's same-dtype error is not finite (NaN, or inf where the fp32 reference is finite): "
            f"the rule has no yardstick (ours: max |ours - fp32 ref| = {err:.3e})"
        )
    raise AssertionError(
        f"{name}: max |ours - fp32 ref| = {err:.3e} > allowed {bound:.3e} ({factor:g}x PyTorch's error + atol {atol:.3e})"
    )


def rounding_atol(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """The gradients' atol, FA3's (hopper/test_flash_attn.py): twice the error of one rounding to
    ``dtype`` at magnitude ``|ref| + 0.3`` (``2 * max|(r + 0.3 - 0.3) - r|`` with ``r = ref`` in
    ``dtype``), up to one ulp of ``dtype`` at the largest entries (at least at 0.3); 0 for an
    all-zero reference.

    A floor under twice PyTorch's error for what the kernels do differently from PyTorch's roundings
    (exp2 with the scale folded into an FMA, the order of fp32 reduce-adds, tanh.approx) where
    PyTorch's error happens to be small. Measured on the CPU (tests/test_reference.py, 113x203, d 64,
    15 seeds): an emulation of the sm80 backward's roundings (P and dS rounded before their MMAs, fp32
    accumulation) uses at most a third of the bound; a gradient scaled by 1.05 (bf16) or 1.01 (fp16)
    exceeds it by 1.4x or more. Its cost: a relative error of ~3 % or less of the largest entries
    passes in bf16 (~0.5 % in fp16), so the fp16 tests are the finer net.
    """
    r = ref.detach().to(dtype)
    return 2.0 * ((r + 0.3 - 0.3) - r).abs().max().item() if r.numel() else 0.0


def capture_cuda_graph(step, warmups: int = 1):
    """``(graph, outputs)``: ``step()`` run ``warmups`` times on a side stream first (its kernels compiled and its
    plans kept before the capture, which can do neither), then captured once in a CUDA graph; ``outputs`` are that
    call's static tensors, which every ``graph.replay()`` rewrites."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs
