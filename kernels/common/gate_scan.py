"""The gated forward's inputs from the log forget gates in one pass: ``G = cumsum(g)``, the keys' bias rows and
(optionally) K's extra k16 slice (``flashattn_hopper/gate.py``, ``flashattn_hopper/backends/gate_scan.py``).

Purpose: a dense gated call needed a transposing copy and a scan (torch's, ~24-29 us of GPU at 16k tokens x 32
heads), a division into the bias rows and, from 1k keys, a Triton launch for the slice, each with its own host
time (perf/NOTES.md sessions 27-29: a Python-launched Triton scan cost more host time than it saved). This kernel
does all of it in one launch through TVM-FFI:
- ``G[b, h, s] = sum_{t <= s} g[b, t, h]`` in fp32, the running total carried in fp64 across 32-key steps (a
  sequence's ``|G|`` reaches ~1e4: an fp32 carry would lose the low digits of each key's ``g``);
- ``bias[b, h, s] = G / neg_scale`` (``neg_scale = -softmax_scale``: the keys' bias ``-G_j / scale`` in the
  scores' units, ``gate._key_bias``), rows as the forward's TMA reads them;
- with ``slice_dtype``: ``slice[b, s, h, :]`` = the bias as ``parts`` 16-bit values, each the rest of the ones
  before it rounded to nearest, then zeros (``sm90_fwd.gate_k_slice_torch``'s build, bit for bit).

Layouts: g ``(batch, seqlen, nheads)`` fp32, heads innermost (the user's layout); G and bias ``(batch, nheads,
seqlen)`` fp32 rows with 16-byte aligned strides; the slice ``(batch, seqlen, nheads, slice_cols)`` contiguous.

Grid ``(nheads, batch)``, ``warps`` warps per CTA, each a contiguous chunk of the sequence (a multiple of 32 keys),
lanes along keys: pass 1 sums each warp's chunk (fp64 lane partials, then a butterfly), the chunks' totals meet in
shared memory, pass 2 rescans each chunk 32 keys at a time (an in-warp inclusive scan by shuffles on top of the
carry) and writes G and bias rows 128 contiguous bytes per warp store. g is read 4 bytes per key (the other heads'
bytes of each sector are other CTAs': L2 traffic ~8x g's 4 bytes per key and head, a few MB). No tensor cores.
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Float64, Int32, const_expr
from cutlass.memory import SmemAllocator


class GateScan:
    """One CTA per (batch, head), ``warps`` chunks of keys per CTA; two passes over each chunk (sum, then scan)."""

    def __init__(self, slice_dtype: type[cutlass.Numeric] | None = None, slice_cols: int = 16, parts: int = 3,
                 warps: int = 8):
        if slice_dtype not in (None, cutlass.BFloat16, cutlass.Float16):
            raise ValueError(f"slice_dtype must be None, BFloat16 or Float16, got {slice_dtype}")
        if not 1 <= parts <= slice_cols:
            raise ValueError(f"parts must be in [1, slice_cols], got {parts} and {slice_cols}")
        self.slice_dtype = slice_dtype
        self.slice_cols = slice_cols
        self.parts = parts
        self.warps = warps

    @cute.jit
    def __call__(
        self,
        mg: cute.Tensor,  # (batch, seqlen, nheads) fp32, the log forget gates
        mG: cute.Tensor,  # (batch, nheads, seqlen) fp32, output
        mBias: cute.Tensor,  # (batch, nheads, seqlen) fp32, output
        mSlice: cute.Tensor | None,  # (batch, seqlen, nheads, slice_cols) slice_dtype, output (slice_dtype only)
        neg_scale: Float32,  # -softmax_scale
        stream: cuda.CUstream,
    ):
        if const_expr((mSlice is None) != (self.slice_dtype is None)):
            raise TypeError("mSlice must be given exactly when slice_dtype is")
        for t in (mg, mG, mBias):
            if const_expr(t.element_type != Float32):
                raise TypeError("g, G and bias must be Float32")
        self.kernel(mg, mG, mBias, mSlice, neg_scale).launch(
            grid=[mg.shape[2], mg.shape[0], 1], block=[32 * self.warps, 1, 1], smem=8 * self.warps + 128,
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mg: cute.Tensor, mG: cute.Tensor, mBias: cute.Tensor, mSlice: cute.Tensor | None,
               neg_scale: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        head, batch_idx, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = tidx // 32
        seqlen = mg.shape[1]
        chunk = (seqlen + (32 * self.warps - 1)) // (32 * self.warps) * 32  # keys per warp, whole steps of 32
        start = warp * chunk
        end = cutlass.min(start + chunk, seqlen)
        chunk_totals = SmemAllocator().allocate_tensor(Float64, cute.make_layout(self.warps), byte_alignment=16)
        # Pass 1: this warp's chunk total (fp64 lane partials, then a butterfly).
        partial = Float64(0.0)
        for step in cutlass.range(start, end, 32, unroll=4):
            if step + lane < end:
                partial = partial + Float64(mg[batch_idx, step + lane, head])
        for i in cutlass.range_constexpr(5):
            partial = partial + cute.arch.shuffle_sync_bfly(partial, 1 << i)
        if lane == 0:
            chunk_totals[warp] = partial
        cute.arch.barrier()
        carry = Float64(0.0)
        for w in cutlass.range_constexpr(self.warps):
            if w < warp:
                carry = carry + chunk_totals[w]
        # Pass 2: the chunk again, 32 keys per step: G = carry + the in-warp inclusive sum.
        for step in cutlass.range(start, end, 32, unroll=2):
            key = step + lane
            g = Float32(0.0)
            if key < end:
                g = mg[batch_idx, key, head]
            incl = self.warp_inclusive_sum(g, lane)
            G = Float32(carry + Float64(incl))
            carry = carry + Float64(cute.arch.shuffle_sync(incl, 31))
            if key < end:
                mG[batch_idx, head, key] = G
                bias = G / neg_scale
                mBias[batch_idx, head, key] = bias
                if const_expr(self.slice_dtype is not None):
                    self.store_slice(mSlice, bias, batch_idx, key, head)
    @cute.jit
    def warp_inclusive_sum(self, x: Float32, lane: Int32) -> Float32:
        """Lane ``i``'s ``x`` summed over lanes ``0..i`` (Hillis-Steele: 5 shuffles up)."""
        incl = x
        for i in cutlass.range_constexpr(5):
            other = cute.arch.shuffle_sync_up(incl, 1 << i)
            if lane >= (1 << i):
                incl = incl + other
        return incl

    @cute.jit
    def store_slice(self, mSlice: cute.Tensor, bias: Float32, batch_idx: Int32, key: Int32, head: Int32):
        """The key's ``slice_cols`` 16-bit values: ``parts`` round-to-nearest pieces of ``bias``, then zeros."""
        row = cute.make_rmem_tensor((self.slice_cols,), self.slice_dtype)
        row.fill(0.0)
        rest = bias
        for i in cutlass.range_constexpr(self.parts):
            part = rest.to(self.slice_dtype)
            row[i] = part
            rest = rest - part.to(Float32)
        cute.autovec_copy(row, mSlice[batch_idx, key, head, None])
