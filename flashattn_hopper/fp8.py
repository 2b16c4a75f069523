"""FP8 (e4m3) quantization of q, k, v for an FP8 attention forward: per-tensor or per-block scales,
optionally after a random-sign Hadamard transform of q and k (FlashAttention-3 paper section 3.3,
"incoherent processing"; ``../shared/design/fp8.md`` sections 3-4).

- **Scales.** ``x8 = satfinite_e4m3(x / scale)`` with ``scale = amax / 448`` and the descale
  ``scale`` returned for the kernel to multiply back. Per tensor: one amax per (batch, kv head), the
  shape of FA3's ``q_descale``/``k_descale``/``v_descale`` ``(batch, nheads_k)`` (q's over the query
  heads of each kv head). Per block: one per (batch, head, tile of rows), ``(batch, nheads,
  ceil(seqlen_q / tile_m))`` for q and ``(batch, nheads_k, ceil(seqlen_k / tile_n))`` for k and v, the
  tiles being the kernel's, so a block scale is one scalar per tile there.
- **Incoherent processing.** ``M = diag(signs) * H / sqrt(d)`` (H the Sylvester Walsh-Hadamard
  matrix, signs a seeded random +-1 vector) is orthogonal, so ``(q M)(k M)^T = q k^T``: the scores are
  unchanged up to rounding while an outlier channel spreads over all d coordinates, lowering amax
  toward the RMS. The same M goes on q and k, never on v. After rotary embedding, if any.

Computed with torch ops (fp32 intermediates) on the inputs' device, dense ``(batch, seqlen, nheads,
head_dim)`` inputs, head dims a power of two for the Hadamard transform (a Triton kernel per tensor on
CUDA 16-bit inputs, ``quantize_triton``). ``attention`` (below) is the API's route for e4m3 inputs to the
sm90 FP8 kernel (kernels/sm90/fwd_fp8.py), which takes either kind of descale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import validate

E4M3_MAX = 448.0
# amax floor: an all-zero block gets a finite scale (its values quantize to 0 either way).
_AMAX_FLOOR = 1e-12


@dataclass(frozen=True)
class Fp8Qkv:
    """Quantized q, k, v (``torch.float8_e4m3fn``, the inputs' shapes) and their fp32 descales."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_descale: torch.Tensor
    k_descale: torch.Tensor
    v_descale: torch.Tensor
    signs: torch.Tensor | None  # the Hadamard transform's random signs (None: no transform)


def hadamard(head_dim: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The normalized Sylvester Walsh-Hadamard matrix ``H / sqrt(d)`` (fp32, orthogonal, symmetric)."""
    if head_dim < 1 or head_dim & (head_dim - 1):
        raise ValueError(f"the Hadamard transform needs a power-of-two head dim, got {head_dim}")
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(head_dim)


def random_signs(head_dim: int, seed: int = 0, device: torch.device | str | None = None) -> torch.Tensor:
    """A reproducible random +-1 vector (fp32) of length ``head_dim``."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (head_dim,), generator=gen) * 2 - 1).to(device=device, dtype=torch.float32)


def incoherent(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``x M`` over the last dim with ``M = diag(signs) H / sqrt(d)`` (fp32 result)."""
    return (x.float() * signs) @ hadamard(x.shape[-1], x.device)


def _to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``satfinite(x / scale)`` in e4m3 (the cast itself does not saturate: clamp first)."""
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _per_head_group(x: torch.Tensor, nheads_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (batch, kv head): ``(x8, descale (b, h_k))``; x ``(b, s, h, d)`` fp32, h a multiple of h_k."""
    b, s, h, d = x.shape
    groups = x.view(b, s, nheads_k, h // nheads_k, d)
    amax = groups.abs().amax(dim=(1, 3, 4)).clamp_min(_AMAX_FLOOR)  # (b, h_k)
    scale = amax / E4M3_MAX
    x8 = _to_e4m3(groups, scale[:, None, :, None, None]).view(b, s, h, d)
    return x8, scale


def _per_block(x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (batch, head, block of ``rows`` rows): ``(x8, descale (b, h, ceil(s / rows)))``."""
    b, s, h, d = x.shape
    blocks = -(-s // rows)
    padded = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, blocks * rows - s)).view(b, blocks, rows, h, d)
    amax = padded.abs().amax(dim=(2, 4)).clamp_min(_AMAX_FLOOR)  # (b, blocks, h)
    scale = amax / E4M3_MAX
    x8 = _to_e4m3(padded, scale[:, :, None, :, None]).view(b, blocks * rows, h, d)[:, :s]
    return x8, scale.transpose(1, 2).contiguous()


def quantize_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block: bool = True, hadamard_qk: bool = True,
    seed: int = 0, tile_m: int | None = None, tile_n: int | None = None, impl: str = "auto", v_layout: str = "rows",
) -> Fp8Qkv:
    """Quantize dense floating ``(batch, seqlen, nheads, head_dim)`` q, k, v to e4m3.

    ``block``: per-block scales (tiles of ``tile_m`` query rows / ``tile_n`` key rows; None: the FP8
    kernel's tiles at this head dim, ``kernel_tiles``, which the kernel requires), else per (batch, kv head). ``hadamard_qk``: rotate q and k by the same random-sign
    Hadamard matrix first (``seed`` picks the signs; head dim a power of two). v is never rotated.
    ``impl``: ``"triton"`` (one kernel per tensor, ``quantize_triton``: CUDA 16-bit inputs, head dims a
    power of two in [16, 256]), ``"torch"`` (fp32 torch ops, any device and dtype), or ``"auto"``: Triton
    where it applies and is installed. ``v_layout``: ``"rows"`` (v8 row-major like v) or ``"keys"``: v8 has v's
    shape with its keys contiguous (``keys_major_empty``), which the FP8 kernel loads as V^T straight into the
    layout its P.V MMA reads (no transpose in the kernel; on an H100 +3 to +8 % at head dim 128 and +30 to +50 % at
    256, where it also takes a larger tile with per-tensor scales; not at 64, -4 to -13 % with block scales there).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a (batch, seqlen, nheads, headdim) tensor")
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise TypeError(f"{name} must be a floating tensor (fp16, bf16, fp32, fp64) to quantize, got {t.dtype}")
    nheads, nheads_k = q.shape[2], k.shape[2]
    if nheads % nheads_k != 0 or v.shape[2] != nheads_k:
        raise ValueError(f"nheads ({nheads}) must be a multiple of k's and v's nheads ({nheads_k}, {v.shape[2]})")
    if block:
        default_m, default_n = kernel_tiles(max(q.shape[-1], v.shape[-1]))  # (the kernel's key: both head dims)
        tile_m = default_m if tile_m is None else tile_m
        tile_n = default_n if tile_n is None else tile_n
        if tile_m < 1 or tile_n < 1:
            raise ValueError(f"tile_m and tile_n must be positive, got {tile_m}, {tile_n}")
    if v_layout not in ("rows", "keys"):
        raise ValueError(f"v_layout must be 'rows' or 'keys', got {v_layout!r}")
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    signs = random_signs(q.shape[-1], seed, q.device) if hadamard_qk else None
    fits = _triton_fits(q, k, v, (tile_m, tile_n) if block else None)
    if impl == "triton" and fits is not None:
        raise ValueError(f"impl='triton' cannot quantize these inputs: {fits}")
    if impl == "triton" or (impl == "auto" and fits is None):
        v_out = keys_major_empty(v.shape, v.device) if v_layout == "keys" else None
        (q8, qd), (k8, kd), (v8, vd) = (
            quantize_triton(t, nheads_k, rows if block else None, s, out) for t, rows, s, out in
            ((q, tile_m, signs, None), (k, tile_n, signs, None), (v, tile_n, None, v_out))
        )
        return Fp8Qkv(q8, k8, v8, qd, kd, vd, signs)
    qf, kf, vf = (t.float() for t in (q, k, v))
    if signs is not None:
        qf, kf = incoherent(qf, signs), incoherent(kf, signs)
    if block:
        (q8, qd), (k8, kd), (v8, vd) = _per_block(qf, tile_m), _per_block(kf, tile_n), _per_block(vf, tile_n)
    else:
        (q8, qd), (k8, kd), (v8, vd) = (_per_head_group(t, nheads_k) for t in (qf, kf, vf))
    if v_layout == "keys":
        v8 = keys_major_empty(v8.shape, v8.device).copy_(v8)
    return Fp8Qkv(q8, k8, v8, qd, kd, vd, signs)


def keys_major_empty(shape: tuple[int, ...] | torch.Size, device: torch.device | str | None = None) -> torch.Tensor:
    """An uninitialized e4m3 ``(batch, seqlen, nheads, head_dim)`` tensor whose keys are contiguous (a view of a
    ``(batch, nheads, head_dim, seqlen rounded up to 16)`` buffer): the V layout the FP8 kernel loads as V^T with
    no in-kernel transpose (its other strides multiples of 16 bytes, as its TMA needs)."""
    b, s, h, d = shape
    buffer = torch.empty(b, h, d, -(-s // 16) * 16, dtype=torch.float8_e4m3fn, device=device)
    return buffer[..., :s].permute(0, 3, 1, 2)


def _pm1_hadamard(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The Sylvester matrix of +-1 (unnormalized), ``size`` a power of two."""
    return (hadamard(size, device) * math.sqrt(size)).round().to(dtype)


def _triton_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: tuple[int, int] | None) -> str | None:
    """None if ``quantize_triton`` takes these inputs, else why not."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    if any(t.device.type != "cuda" for t in (q, k, v)):
        return "the inputs are not CUDA tensors"
    if any(t.dtype not in (torch.float16, torch.bfloat16) or t.dtype != q.dtype for t in (q, k, v)):
        return "q, k, v must all be float16 or all bfloat16"
    for name, t in (("q", q), ("k", k), ("v", v)):
        d = t.shape[-1]
        if d < 16 or d > 256 or d & (d - 1):
            return f"{name}'s head dim must be a power of two in [16, 256], got {d}"
    if tiles is not None and any(rows % (32 if t.shape[-1] > 128 else 64)
                                 for rows, t in ((tiles[0], q), (tiles[1], k), (tiles[1], v))):
        return f"block rows {tiles} must be multiples of 64 (32 above head dim 128)"
    return None


def quantize_triton(
    x: torch.Tensor, nheads_k: int, block_rows: int | None, signs: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One tensor through the Triton kernel (``kernels/triton/fp8_quantize.py``): ``(x8, descale)``, per
    block of ``block_rows`` rows ``(b, h, blocks)`` or, with None, per (batch, kv head) ``(b, nheads_k)``.
    16-bit x ``(b, s, h, d)``, d a power of two in [16, 256]; ``signs``: the Hadamard signs or None; ``out``:
    x8's e4m3 buffer of x's shape, any strides (None: a new row-major one)."""
    from .kernels.triton.fp8_quantize import quantize_kernel

    b, s, h, d = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device) if out is None else out
    half = min(d, 128)
    had = _pm1_hadamard(half, x.dtype, x.device) if signs is not None else x.new_zeros(1)
    sgn = signs.to(device=x.device, dtype=x.dtype) if signs is not None else x.new_zeros(1)
    chunk = 32 if d > 128 else 64
    common = dict(D=d, CHUNK=chunk, HADAMARD=signs is not None, num_warps=8)
    args = (x, out)
    tail = (sgn, had, s, h, x.stride(0), x.stride(1), x.stride(2), 1.0 / math.sqrt(d), *out.stride())
    if block_rows is not None:
        rows = max(chunk, -(-block_rows // chunk) * chunk)
        if rows != block_rows:
            raise ValueError(f"block rows ({block_rows}) must be a multiple of {chunk} here")
        scale = torch.empty(b, h, -(-s // rows), dtype=torch.float32, device=x.device)
        quantize_kernel[(-(-s // rows), h, b)](*args, scale, *tail, ROWS=rows, PER_BLOCK=True, GROUP=1, PASS=0,
                                               **common)
        return out, scale
    amax = torch.zeros(b, nheads_k, dtype=torch.float32, device=x.device)
    grid = (-(-s // 128), h, b)
    for step in (1, 2):
        quantize_kernel[grid](*args, amax, *tail, ROWS=128, PER_BLOCK=False, GROUP=h // nheads_k, PASS=step,
                              **common)
    return out, amax.clamp_min(_AMAX_FLOOR) / E4M3_MAX


def dequantize(x8: torch.Tensor, descale: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """fp32 values of a quantized ``(b, s, h, d)`` tensor: ``descale`` ``(b, h_k)`` per (batch, kv
    head), or ``(b, h, blocks)`` per block of ``rows`` rows."""
    b, s, h, d = x8.shape
    x = x8.float()
    if rows is None:
        return (x.view(b, s, descale.shape[1], -1, d) * descale[:, None, :, None, None]).view(b, s, h, d)
    per_row = descale.repeat_interleave(rows, dim=2)[:, :, :s]  # (b, h, s)
    return x * per_row.transpose(1, 2)[..., None]


# ---------------------------------------------------------------------------------------- attention

DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")


def split_descales(extras: dict[str, object], varlen: bool) -> dict[str, object]:
    """The call's ``q/k/v_descale`` taken out of its other flash-attn keywords, which are checked as
    for 16-bit inputs (``validate.check_flash_attn_extras``)."""
    scales = {name: extras.pop(name, None) for name in DESCALE_NAMES}
    validate.check_flash_attn_extras("flash_attn_varlen_func" if varlen else "flash_attn_func", extras)
    return scales


def is_fp8(t: object) -> bool:
    """Whether ``t`` is a tensor of an 8-bit float dtype (the API routes those here)."""
    return isinstance(t, torch.Tensor) and t.dtype in validate.FP8_DTYPES


def kernel_tiles(head_dim: int) -> tuple[int, int]:
    """``(tile_m, tile_n)``: the rows of q and of k/v that one per-block descale covers at this head dim
    (``configs.FWD_SM90_FP8_SCALE_TILES``: the FP8 kernels' tile_m, and a multiple of their tile_n)."""
    from . import configs

    hdim = configs.kernel_head_dim(configs.FWD_SM90_FP8_TILES, head_dim, head_dim)
    if hdim is None:
        raise ValueError(f"FP8 attention supports head dims up to 256, got {head_dim}")
    return configs.FWD_SM90_FP8_SCALE_TILES[hdim]


def descales(
    extras: dict[str, object], p: validate.AttnProblem, device: torch.device,
    max_seqlens: tuple[object, object] | None = None,
) -> torch.Tensor:
    """The kernel's fp32 descales from the call's ``q_descale``, ``k_descale``, ``v_descale`` (None: 1).

    Per tensor (FA3's): each ``(batch, nheads_k)`` (q's indexed by kv head too) -> ``(3, batch, nheads_k)``.
    Per block (the FA3 paper's block quantization): q's ``(batch, nheads, ceil(seqlen_q / tile_m))``, k's
    and v's ``(batch, nheads_k, ceil(seqlen_k / tile_n))`` with the kernel's tiles (``kernel_tiles``, what
    ``quantize_qkv(block=True)`` uses) -> ``(3, batch, nheads, blocks)``; varlen (``max_seqlens``: the call's
    ``max_seqlen_q``/``max_seqlen_k``, ints here): blocks per sequence, ``ceil(max_seqlen / tile)`` of them
    (a sequence's rows from its start, as the kernel tiles it; ``max_seqlen_k`` must bound every sequence's
    key count, or the kernel reads past a sequence's scales). A wrong shape, dtype or device
    raises, naming the argument: a silently dropped descale gives wrong output. Values must be positive
    and finite (not checked: that would cost a device sync; ``quantize_qkv``'s are by construction); a per-block
    v descale of 0 gives its block's values as 0, its probabilities still in the rows' sums while the other
    blocks' descales stay below 2**26 (the kernel takes each block's v descale as a log2 bias on its scores,
    floored at 2**-100; NaN or negative ones read as that floor too)."""
    given = {name: extras.get(name) for name in DESCALE_NAMES}
    for name, value in given.items():
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a float32 tensor of shape (batch, nheads_k) or None, got {type(value).__name__}")
        if value.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {str(value.dtype).replace('torch.', '')}")
        if value.device != device:
            raise ValueError(f"{name} must be on {device} like q, got {value.device}")
    per_block = any(value is not None and value.dim() == 3 for value in given.values())
    if not per_block:
        out = torch.ones(3, p.batch, p.nheads_k, dtype=torch.float32, device=device)
        for i, (name, value) in enumerate(given.items()):
            if value is not None:
                if tuple(value.shape) != (p.batch, p.nheads_k):
                    raise ValueError(
                        f"{name} must have shape (batch, nheads_k) = {(p.batch, p.nheads_k)} (or per block, see "
                        f"flashattn_hopper.fp8.descales), got {tuple(value.shape)}"
                    )
                out[i] = value
        return out
    seqlen_q, seqlen_k = p.seqlen_q, p.seqlen_k
    if p.is_varlen:
        if max_seqlens is None or any(type(n) is not int for n in max_seqlens):
            raise TypeError("per-block descales with varlen inputs need max_seqlen_q and max_seqlen_k as Python ints")
        seqlen_q, seqlen_k = max_seqlens
    tile_m, tile_n = kernel_tiles(max(p.head_dim, p.head_dim_v))
    q_blocks, k_blocks = -(-seqlen_q // tile_m), -(-seqlen_k // tile_n)
    shapes = {"q_descale": (p.batch, p.nheads, q_blocks), "k_descale": (p.batch, p.nheads_k, k_blocks),
              "v_descale": (p.batch, p.nheads_k, k_blocks)}
    for name, value in given.items():
        if value is not None and tuple(value.shape) != shapes[name]:
            raise ValueError(
                f"{name} must have shape {shapes[name]} for per-block descales (tiles of {tile_m} query rows and "
                f"{tile_n} key rows at this head dim: flashattn_hopper.fp8.kernel_tiles), got {tuple(value.shape)}"
            )
    return block_descales(tuple(given.values()), (3, p.batch, p.nheads, max(q_blocks, k_blocks)), device)


def block_descales(values: tuple[torch.Tensor | None, ...], shape: tuple[int, ...],
                   device: torch.device) -> torch.Tensor:
    """The kernel's per-block descales ``shape`` = ``(3, batch, nheads, blocks)`` of q's, k's and v's (checked
    shapes; None: 1), each into its first heads and blocks (``descales``, and the cached plans' calls)."""
    out = torch.ones(shape, dtype=torch.float32, device=device)
    for i, value in enumerate(values):
        if value is not None:
            out[i, :, : value.shape[1], : value.shape[2]] = value
    return out


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: dict[str, object], softmax_scale: object,
    causal: bool, window_size: object, softcap: object, backend: str | None,
    varlen: tuple[object, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of e4m3 ``q, k, v``: out bf16, lse fp32 (the API's checks of the other options
    came first). ``varlen``: ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
    seqused_k)`` for the packed layout. Hopper only (sm90's e4m3 WGMMA); no softcap, sink, gate or
    backward (FP8 is an inference forward)."""
    from . import dispatch
    from .backends.common import VarlenArgs, empty_result

    scales = split_descales(extras, varlen is not None)
    if validate.check_softcap(softcap) > 0.0:
        raise NotImplementedError("softcap is not implemented for FP8 inputs")
    if varlen is None:
        p = validate.validate_dense(q, k, v, softmax_scale, causal, window_size, softcap, fp8=True)
        varlen_args = None
    else:
        cu_q, cu_k, max_q, max_k, used_q, used_k = varlen
        p = validate.validate_varlen(q, k, v, cu_q, cu_k, max_q, max_k, used_q, used_k, softmax_scale, causal,
                                     window_size, softcap, fp8=True)
        varlen_args = VarlenArgs(cu_q, cu_k, used_q, used_k, max_q, max_k)
    chosen, _ = dispatch.select_backend(q.device, backend)
    if chosen != "sm90":
        raise NotImplementedError(
            "FP8 (float8_e4m3fn) attention needs a Hopper GPU (compute capability 9.0, backend 'sm90'): "
            "its e4m3 tensor-core MMA has no sm80 form; cast q, k, v to bfloat16 there"
        )
    descale = descales(scales, p, q.device, None if varlen is None else (varlen[2], varlen[3]))
    if p.batch == 0 or p.seqlen_q == 0 or p.seqlen_k == 0 or p.nheads == 0:
        out, lse = empty_result(q, p)
        return out.to(torch.bfloat16), lse
    return dispatch.FWD_KERNELS["sm90"].forward_fp8(q, k, v, p, varlen_args, descale)
