"""e4m3 quantization of one q, k or v tensor in Triton, for the FP8 forward (``flashattn_hopper/fp8.py``).

Purpose: ``quantize_qkv``'s work per tensor in one pass over HBM per scale group instead of ~10 torch
ops: optional random-sign Hadamard transform over the head dim (``x diag(signs) H / sqrt(d)``, H the
Sylvester matrix of +-1, as tensor-core dots: the products of 16-bit x and +-1 are exact and add in
fp32; at d = 256, ``H256 = [[H128, H128], [H128, -H128]]``, two dots with H128 per row block), the amax
of each scale group, ``scale = max(amax, 1e-12) / 448`` and ``satfinite(x / scale)`` in e4m3.
Scale groups: per block (``ROWS`` rows of one (batch, head): one program does both passes over its
block, reading it twice) or per (batch, kv head) (all rows of the ``GROUP`` query heads of a kv head:
a first launch takes each program's amax into the group's slot with an atomic max, a second
quantizes).

Constraints: 16-bit inputs ``(batch, seqlen, nheads, head_dim)`` with unit last stride; head_dim a
power of two in [16, 256]; outputs e4m3 of the same shape at strides ``out_stride_*`` (row-major, or the
keys contiguous: the FP8 kernel's V^T layout, ``fp8.quantize_qkv(v_layout="keys")``); fp32 ``scale_ptr``:
``(batch, nheads, blocks)`` per block, or ``(batch, nheads_k)`` amax slots zero-filled before the
first launch per group.

Triton, not the CuTe DSL: an elementwise pass with small dots, where generated code is enough and no
compile-key plumbing is needed (timed against the torch path by ``perf/bench_fp8.py``).
"""

import triton
import triton.language as tl

E4M3_MAX = tl.constexpr(448.0)  # compiled Triton reads only constexpr globals (its CPU interpreter reads any)


@triton.jit
def _load_half(x_ptr, base, rows, seqlen, stride_s, col0, signs_ptr, HD: tl.constexpr, HADAMARD: tl.constexpr):
    """(CHUNK, HD) 16-bit rows at columns col0.., times the signs when HADAMARD; rows past seqlen are 0."""
    cols = col0 + tl.arange(0, HD)
    x = tl.load(x_ptr + base + rows[:, None] * stride_s + cols[None, :], mask=(rows < seqlen)[:, None], other=0.0)
    if HADAMARD:
        x = x * tl.load(signs_ptr + cols)[None, :].to(x.dtype)  # (+-1: exact)
    return x


@triton.jit
def _rows(x_ptr, base, rows, seqlen, stride_s, signs_ptr, hadamard, inv_sqrt_d,
          D: tl.constexpr, HADAMARD: tl.constexpr):
    """fp32 (lo, hi) halves of (CHUNK, D) rows (hi: the second 128 columns at D = 256, else lo again)."""
    HD: tl.constexpr = D if D <= 128 else 128
    lo = _load_half(x_ptr, base, rows, seqlen, stride_s, 0, signs_ptr, HD, HADAMARD)
    if D > 128:
        hi = _load_half(x_ptr, base, rows, seqlen, stride_s, HD, signs_ptr, HD, HADAMARD)
        if HADAMARD:
            a = tl.dot(lo, hadamard, out_dtype=tl.float32)
            c = tl.dot(hi, hadamard, out_dtype=tl.float32)
            return (a + c) * inv_sqrt_d, (a - c) * inv_sqrt_d
        return lo.to(tl.float32), hi.to(tl.float32)
    if HADAMARD:
        y = tl.dot(lo, hadamard, out_dtype=tl.float32) * inv_sqrt_d
        return y, y
    return lo.to(tl.float32), lo.to(tl.float32)


@triton.jit
def _store_half(out_ptr, y, out_base, rows, seqlen, out_stride_s, out_stride_d, col0, scale, HD: tl.constexpr):
    cols = col0 + tl.arange(0, HD)
    # (a NaN stays NaN, as in the torch path; the enum is spelled inline: compiled Triton cannot bind it to a name)
    q = tl.minimum(tl.maximum(y / scale, -E4M3_MAX, propagate_nan=tl.PropagateNan.ALL), E4M3_MAX,
                   propagate_nan=tl.PropagateNan.ALL)
    q = q.to(tl.float8e4nv)
    offsets = out_base + rows[:, None] * out_stride_s + cols[None, :].to(tl.int64) * out_stride_d
    tl.store(out_ptr + offsets, q, mask=(rows < seqlen)[:, None])


@triton.jit
def quantize_kernel(
    x_ptr, out_ptr, scale_ptr, signs_ptr, hadamard_ptr,
    seqlen, nheads, stride_b, stride_s, stride_h, inv_sqrt_d,
    out_stride_b, out_stride_s, out_stride_h, out_stride_d,
    D: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr, HADAMARD: tl.constexpr,
    PER_BLOCK: tl.constexpr, GROUP: tl.constexpr, PASS: tl.constexpr,
):
    """Grid ``(ceil(seqlen / ROWS), nheads, batch)``. PER_BLOCK: amax and quantize one block of rows.
    Else PASS 1: atomic max of this program's rows into its (batch, kv head) slot; PASS 2: quantize
    with that slot's scale. ``hadamard_ptr``: the (HD, HD) +-1 matrix in x's dtype, HD = min(D, 128)."""
    HD: tl.constexpr = D if D <= 128 else 128
    blk, head, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hd = tl.arange(0, HD)
    hadamard = tl.load(hadamard_ptr + hd[:, None] * HD + hd[None, :]) if HADAMARD else hd
    base = b.to(tl.int64) * stride_b + head.to(tl.int64) * stride_h
    out_base = b.to(tl.int64) * out_stride_b + head.to(tl.int64) * out_stride_h
    row0 = blk * ROWS
    amax = tl.zeros((), dtype=tl.float32)
    if PER_BLOCK or PASS == 1:
        for c in tl.static_range(0, ROWS, CHUNK):
            rows = (row0 + c + tl.arange(0, CHUNK)).to(tl.int64)  # (64-bit offsets past 2**31 elements)
            lo, hi = _rows(x_ptr, base, rows, seqlen, stride_s, signs_ptr, hadamard, inv_sqrt_d, D, HADAMARD)
            amax = tl.maximum(amax, tl.maximum(tl.max(tl.abs(lo)), tl.max(tl.abs(hi))), propagate_nan=tl.PropagateNan.ALL)
            # a NaN input makes the group's amax (so its scale and values) NaN, as in the torch path
            nans = tl.sum((lo != lo).to(tl.int32)) + tl.sum((hi != hi).to(tl.int32))
            amax = tl.where(nans > 0, float("nan"), amax)
    if PER_BLOCK:
        scale = tl.maximum(amax, 1e-12, propagate_nan=tl.PropagateNan.ALL) / E4M3_MAX
        tl.store(scale_ptr + (b * nheads + head) * tl.cdiv(seqlen, ROWS) + blk, scale)
    elif PASS == 1:
        tl.atomic_max(scale_ptr + b * (nheads // GROUP) + head // GROUP, amax)
    if PER_BLOCK or PASS == 2:
        if not PER_BLOCK:
            group_amax = tl.load(scale_ptr + b * (nheads // GROUP) + head // GROUP)
            scale = tl.maximum(group_amax, 1e-12, propagate_nan=tl.PropagateNan.ALL) / E4M3_MAX
        for c in tl.static_range(0, ROWS, CHUNK):
            rows = (row0 + c + tl.arange(0, CHUNK)).to(tl.int64)
            lo, hi = _rows(x_ptr, base, rows, seqlen, stride_s, signs_ptr, hadamard, inv_sqrt_d, D, HADAMARD)
            _store_half(out_ptr, lo, out_base, rows, seqlen, out_stride_s, out_stride_d, 0, scale, HD)
            if D > 128:
                _store_half(out_ptr, hi, out_base, rows, seqlen, out_stride_s, out_stride_d, HD, scale, HD)
