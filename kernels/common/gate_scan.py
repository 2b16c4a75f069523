"""The gated forward's inputs from the log forget gates in one pass: ``G = cumsum(g)``, the keys' bias rows and
(optionally) K's extra k16 slice (``flashattn_hopper/gate.py``, ``flashattn_hopper/backends/gate_scan.py``).

Purpose: a dense gated call needed a transposing copy and a scan (torch's, ~24-29 us of GPU at 16k tokens x 32
heads), a division into the bias rows and, from 1k keys, a Triton launch for the slice, each with its own host
time (perf/NOTES.md sessions 27-29: a Python-launched Triton scan cost more host time than it saved). This kernel
does all of it in one launch through TVM-FFI (for forward-only calls up to 2k keys, ``gate.scanned_gate``; 23 us
at 16 x 1k keys x 32 heads on an H200 against the torch route's 34 us of kernels: latency-bound, 64 CTAs, see
perf/NOTES.md session 30):
- ``G[b, h, s] = sum_{t <= s} g[b, t, h]`` in fp32, summed in fp64 (a sequence's ``|G|`` reaches ~1e4: an fp32
  running total would lose the low digits of each key's ``g``);
- ``bias[b, h, s] = G * neg_inv_scale`` (``1 / -softmax_scale`` rounded to fp32: the keys' bias ``-G_j / scale``
  in the scores' units as torch's division by a scalar computes it, ``gate._key_bias``), rows as the forward's TMA
  reads them;
- with ``slice_dtype``: ``slice[b, s, h, :]`` = the bias as ``parts`` 16-bit values, each the rest of the ones
  before it rounded to nearest, then zeros (``sm90_fwd.gate_k_slice_torch``'s build, bit for bit).

Layouts: g ``(batch, seqlen, nheads)`` fp32, heads innermost (the user's layout); G and bias ``(batch, nheads,
seqlen)`` fp32 rows with 16-byte aligned strides; the slice ``(batch, seqlen, nheads, slice_cols)`` contiguous.

Grid ``(ceil(nheads / 32), batch, ceil(seqlen / (32 * warps)))``: a CTA per 32 heads (one per lane: g's rows
read 128 contiguous bytes per warp load) and chunk of ``32 * warps`` keys, 32 per warp. Each CTA first sums g
over every key before its chunk (its warps striding those rows, fp64 partials; redundant across chunks, which
is why the route takes this kernel for short sequences only: ``gate.SCAN_KERNEL_MAX_SEQLEN``), and each warp
its own 32 keys (held in registers); the sums meet in shared memory; then each warp scans its keys on the fp64
carry, writes K's slice rows (each lane 32 contiguous bytes: 1 KB per warp store) and stages G in a padded smem
tile, which it writes transposed as G and bias rows (128 contiguous bytes per store). No tensor cores.
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Float64, Int32, const_expr
from cutlass.memory import SmemAllocator


class GateScan:
    """32 heads per CTA (one per lane), a chunk of ``32 * warps`` keys (32 per warp); prefix sums, then the scan."""

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
        neg_inv_scale: Float32,  # 1 / -softmax_scale (fp32, as torch divides by a scalar)
        stream: cuda.CUstream,
    ):
        if const_expr((mSlice is None) != (self.slice_dtype is None)):
            raise TypeError("mSlice must be given exactly when slice_dtype is")
        for t in (mg, mG, mBias):
            if const_expr(t.element_type != Float32):
                raise TypeError("g, G and bias must be Float32")
        smem = 2 * 8 * 32 * self.warps + 4 * self.warps * 32 * 33 + 256  # prefix and own sums, staged G, alignment
        chunk = 32 * self.warps
        grid = [(mg.shape[2] + 31) // 32, mg.shape[0], (mg.shape[1] + (chunk - 1)) // chunk]
        self.kernel(mg, mG, mBias, mSlice, neg_inv_scale).launch(
            grid=grid, block=[32 * self.warps, 1, 1], smem=smem, stream=stream,
        )

    @cute.kernel
    def kernel(self, mg: cute.Tensor, mG: cute.Tensor, mBias: cute.Tensor, mSlice: cute.Tensor | None,
               neg_inv_scale: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        head_block, batch_idx, chunk_idx = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = tidx // 32
        head = head_block * 32 + lane
        nheads = mg.shape[2]
        seqlen = mg.shape[1]
        chunk_start = chunk_idx * (32 * self.warps)
        start = chunk_start + 32 * warp
        allocator = SmemAllocator()
        prefix_sums = allocator.allocate_tensor(Float64, cute.make_layout((32, self.warps)), byte_alignment=16)
        own_sums = allocator.allocate_tensor(Float64, cute.make_layout((32, self.warps)), byte_alignment=16)
        # (32 keys x 32 heads per warp, rows padded to 33 words: the transposed reads are conflict-free)
        staged = allocator.allocate_tensor(Float32, cute.make_layout((32, 32, self.warps), stride=(33, 1, 33 * 32)),
                                           byte_alignment=16)
        # The keys before the chunk: this warp's rows warp, warp + warps, ..., 16 loads in flight per step (the
        # loop is latency-bound: four per step took ~23 us at 1k keys), four fp64 partials.
        partials = [Float64(0.0), Float64(0.0), Float64(0.0), Float64(0.0)]
        gates = cute.make_rmem_tensor((32,), Float32)
        if head < nheads:
            for row in cutlass.range(warp, chunk_start, 16 * self.warps, unroll=1):
                for i in cutlass.range_constexpr(16):
                    gates[i] = Float32(0.0)
                    if row + i * self.warps < chunk_start:
                        gates[i] = mg[batch_idx, row + i * self.warps, head]
                for i in cutlass.range_constexpr(16):
                    partials[i % 4] = partials[i % 4] + Float64(gates[i])
        own = Float64(0.0)
        for i in cutlass.range_constexpr(32):
            gates[i] = Float32(0.0)
            if start + i < seqlen and head < nheads:
                gates[i] = mg[batch_idx, start + i, head]
            own = own + Float64(gates[i])
        prefix_sums[lane, warp] = (partials[0] + partials[1]) + (partials[2] + partials[3])
        own_sums[lane, warp] = own
        cute.arch.barrier()
        carry = Float64(0.0)
        for w in cutlass.range_constexpr(self.warps):
            carry = carry + prefix_sums[lane, w]
        for w in cutlass.range_constexpr(self.warps):
            if w < warp:
                carry = carry + own_sums[lane, w]
        # This warp's 32 keys: G on the carry, the slice rows, G staged; then G and bias rows, transposed.
        for i in cutlass.range_constexpr(32):
            carry = carry + Float64(gates[i])
            G = Float32(carry)
            staged[i, lane, warp] = G
            if const_expr(self.slice_dtype is not None):
                if start + i < seqlen and head < nheads:
                    self.store_slice(mSlice, G * neg_inv_scale, batch_idx, start + i, head)
        cute.arch.sync_warp()
        key = start + lane
        for j in cutlass.range_constexpr(32):
            if key < seqlen and head_block * 32 + j < nheads:
                G = staged[lane, j, warp]
                mG[batch_idx, head_block * 32 + j, key] = G
                mBias[batch_idx, head_block * 32 + j, key] = G * neg_inv_scale

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
