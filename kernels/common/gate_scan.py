"""The gated forward's inputs from the log forget gates in one pass: ``G = cumsum(g)``, the keys' bias rows and
(optionally) K's extra k16 slice (``flashattn_hopper/gate.py``, ``flashattn_hopper/backends/gate_scan.py``).

Purpose: a dense gated call needed a transposing copy and a scan (torch's, ~18-24 us of GPU at 16k tokens x 32
heads), a division into the bias rows and, from 1k keys, a Triton launch for the slice, each with its own host
time (perf/NOTES.md sessions 27-29: a Python-launched Triton scan cost more host time than it saved). This kernel
does all of it in one TVM-FFI call (``gate.scanned_gate``, with or without g's gradient):
- ``G[b, h, s] = sum_{t <= s} g[b, t, h]`` in fp32, summed in fp64 (a sequence's ``|G|`` reaches ~1e4: an fp32
  running total would lose the low digits of each key's ``g``);
- ``bias[b, h, s] = G * neg_inv_scale`` (``1 / -softmax_scale`` rounded to fp32: the keys' bias ``-G_j / scale``
  in the scores' units as torch's division by a scalar computes it, ``gate._key_bias``), rows as the forward's TMA
  reads them;
- with ``slice_dtype``: ``slice[b, s, h, :]`` = the bias as ``parts`` 16-bit values, each the rest of the ones
  before it rounded to nearest, then zeros (``sm90_fwd.gate_k_slice_torch``'s build, bit for bit).

Layouts: g ``(batch, seqlen, nheads)`` fp32, heads innermost (the user's layout); G and bias ``(batch, nheads,
seqlen)`` fp32 rows with 16-byte aligned strides; the slice ``(batch, seqlen, nheads, slice_cols)`` contiguous;
the chunk sums ``(batch, chunks, nheads)`` fp64 scratch.

Two passes over the same grid ``(ceil(nheads / 32), batch, ceil(seqlen / chunk))``, ``chunk = keys_per_warp *
warps`` keys per CTA, a lane per head (g's rows read 128 contiguous bytes per warp load), two launches in one call:
1. ``chunk_sums``: each chunk's sum per head (fp64) into the scratch;
2. ``scan``: each warp sums a share of the earlier chunks' sums and its own keys; the sums meet in shared memory;
   then each warp scans its keys on the fp64 carry, writes K's slice rows (each lane 32 contiguous bytes: 1 KB per
   warp store) and stages G, which the CTA writes transposed as G and bias rows (128 contiguous bytes per store).
Many small chunks keep every SM busy (512 CTAs at 16k tokens with the backend's 4 keys per warp): the first
version was one pass whose CTAs each summed every key before their 256-key chunk themselves, 64 CTAs,
latency-bound (17-24 us at 16k tokens x 16-32 heads on an H100, perf/NOTES.md session 37), and for that reason
limited to 2k keys; this one takes 7.3 / 13.2 us there. No tensor cores.

Varlen (``mCu``: packed sequences, batch 1; session 38, not yet run on a GPU): the sums restart at each sequence
start. A chunk's record is its sum from its last start on; a CTA's carry sums the records from the chunk holding the
start of its first key's sequence (``mChunkSeq``: that sequence, one host searchsorted per call, the CTA walking on
from it over ``cu_seqlens``), and a warp with a start passes on its sum from there only.
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Float64, Int32, const_expr
from cutlass.memory import SmemAllocator


def check_scan_args(fp32: dict[str, cute.Tensor], mSums: cute.Tensor, mCu: cute.Tensor | None,
                    mChunkSeq: cute.Tensor | None) -> None:
    """Compile-time checks both scans' launches share: the named fp32 tensors, the fp64 chunk sums, and the
    varlen pair given together."""
    for name, t in fp32.items():
        if t.element_type != Float32:
            raise TypeError(f"{name} must be Float32")
    if mSums.element_type != Float64:
        raise TypeError("the chunk sums must be Float64")
    if (mCu is None) != (mChunkSeq is None):
        raise TypeError("mCu and mChunkSeq come together (varlen)")


@cute.jit
def strided_chunk_sum(mSums: cute.Tensor, batch_idx: Int32, head: Int32, begin: Int32, end: Int32, warps: int
                      ) -> Float64:
    """The sum of ``mSums[batch_idx, c, head]`` over the chunks ``c = begin, begin + warps, ...`` below ``end`` (one
    warp's share of a range of chunk sums, ``warps`` sharing it), 8 loads in flight per step, four fp64 partials.
    Shared with the gradient's reverse scan (``gate_scan_grad.py``: the later chunks)."""
    partials = [Float64(0.0), Float64(0.0), Float64(0.0), Float64(0.0)]
    loads = cute.make_rmem_tensor((8,), Float64)
    for c in cutlass.range(begin, end, 8 * warps, unroll=1):
        for i in cutlass.range_constexpr(8):
            loads[i] = Float64(0.0)
            if c + i * warps < end:
                loads[i] = mSums[batch_idx, c + i * warps, head]
        for i in cutlass.range_constexpr(8):
            partials[i % 4] = partials[i % 4] + loads[i]
    return (partials[0] + partials[1]) + (partials[2] + partials[3])


@cute.jit
def next_start(mCu: cute.Tensor, seq: Int32) -> Int32:
    """The first key after sequence ``seq`` of the packed keys (``cu_seqlens[seq + 1]``; past the last sequence a
    key no row reaches)."""
    nxt = Int32(2**31 - 1)
    if seq + 1 < mCu.shape[0]:
        nxt = mCu[seq + 1]
    return nxt


@cute.jit
def sequence_of(mCu: cute.Tensor, seq: Int32, key: Int32) -> Int32:
    """The sequence holding ``key``, walking forward from ``seq`` (one at or before it); zero-length sequences are
    stepped over, keys past the last sequence stay with the last index (``cu_seqlens``' length - 1)."""
    while next_start(mCu, seq) <= key:
        seq = seq + 1
    return seq


@cute.jit
def store_chunk_sum(own_sums: cute.Tensor, mSums: cute.Tensor, batch_idx: Int32, chunk_idx: Int32, head: Int32,
                    nheads: Int32, warps: int):
    """The chunk's sum of its lane's head (the warps' ``own_sums``, after the CTA's barrier) into the scratch, by
    warp 0. Shared with the gradient's scan (``gate_scan_grad.py``)."""
    if cute.arch.thread_idx()[0] // 32 == 0 and head < nheads:
        lane = cute.arch.lane_idx()
        total = Float64(0.0)
        for w in cutlass.range_constexpr(warps):
            total = total + own_sums[lane, w]
        mSums[batch_idx, chunk_idx, head] = total


def chunk_keys(warps: int, keys_per_warp: int) -> int:
    """The keys of one CTA's chunk (``keys_per_warp`` per warp, a lane per head) of both scans, checked: whole warps
    of 32 keys, ``warps`` dividing the 32 lanes (the chunk sums' strided reads)."""
    if (keys_per_warp * warps) % 32 or 32 % warps:
        raise ValueError(f"keys_per_warp * warps must be a multiple of 32 and warps divide 32, got "
                         f"{keys_per_warp} and {warps}")
    return keys_per_warp * warps


class GateScan:
    """A lane per head, ``keys_per_warp`` keys per warp, ``warps`` warps per CTA; the chunk sums, then the scan."""

    def __init__(self, slice_dtype: type[cutlass.Numeric] | None = None, slice_cols: int = 16, parts: int = 3,
                 warps: int = 8, keys_per_warp: int = 8, pdl: bool = False):
        """``pdl`` (sm_90 targets): the scan is launched as a programmatic dependent of the chunk sums and waits for
        them in the kernel (``griddepcontrol.wait``), and both let their dependents launch at their start: the
        scan's launch and gate loads overlap the chunk sums, the gated forward's launch and prologue the scan (a
        1k-key call is ~10 us of scan beside a ~150 us forward, perf/NOTES.md session 41)."""
        if slice_dtype not in (None, cutlass.BFloat16, cutlass.Float16):
            raise ValueError(f"slice_dtype must be None, BFloat16 or Float16, got {slice_dtype}")
        if not 1 <= parts <= slice_cols:
            raise ValueError(f"parts must be in [1, slice_cols], got {parts} and {slice_cols}")
        self.chunk = chunk_keys(warps, keys_per_warp)
        self.slice_dtype = slice_dtype
        self.slice_cols = slice_cols
        self.parts = parts
        self.warps = warps
        self.keys_per_warp = keys_per_warp
        self.pdl = pdl

    @cute.jit
    def __call__(
        self,
        mg: cute.Tensor,  # (batch, seqlen, nheads) fp32, the log forget gates
        mSums: cute.Tensor,  # (batch, ceil(seqlen / chunk), nheads) fp64 scratch: each chunk's sums
        mG: cute.Tensor,  # (batch, nheads, seqlen) fp32, output
        mBias: cute.Tensor,  # (batch, nheads, seqlen) fp32, output
        mSlice: cute.Tensor | None,  # (batch, seqlen, nheads, slice_cols) slice_dtype, output (slice_dtype only)
        neg_inv_scale: Float32,  # 1 / -softmax_scale (fp32, as torch divides by a scalar)
        mCu: cute.Tensor | None,  # varlen: (sequences + 1,) int32 cu_seqlens of the packed keys (batch 1), else None
        mChunkSeq: cute.Tensor | None,  # varlen: (chunks,) int32, 1 + the sequence of each chunk's first key
        stream: cuda.CUstream,
    ):
        if const_expr((mSlice is None) != (self.slice_dtype is None)):
            raise TypeError("mSlice must be given exactly when slice_dtype is")
        check_scan_args({"g": mg, "G": mG, "bias": mBias}, mSums, mCu, mChunkSeq)
        grid = [(mg.shape[2] + 31) // 32, mg.shape[0], (mg.shape[1] + (self.chunk - 1)) // self.chunk]
        block = [32 * self.warps, 1, 1]
        sums_smem = 8 * 32 * self.warps + 128
        self.chunk_sums(mg, mSums, mCu, mChunkSeq).launch(grid=grid, block=block, smem=sums_smem, stream=stream)
        # prefix and own sums, staged G (chunk x 32 heads, rows padded to 33 words), varlen's restart flags,
        # alignment
        scan_smem = 2 * 8 * 32 * self.warps + 4 * self.chunk * 33 + 4 * self.warps + 256
        self.scan(mg, mSums, mG, mBias, mSlice, neg_inv_scale, mCu, mChunkSeq).launch(
            grid=grid, block=block, smem=scan_smem, stream=stream, use_pdl=self.pdl,
        )

    @cute.jit
    def load_keys(self, mg: cute.Tensor, gates: cute.Tensor, batch_idx: Int32, start: Int32, head: Int32) -> Float64:
        """This warp's ``keys_per_warp`` gates of its lane's head from key ``start`` (0 past the ends) into
        ``gates``; their sum in fp64."""
        own = Float64(0.0)
        for i in cutlass.range_constexpr(self.keys_per_warp):
            gates[i] = Float32(0.0)
            if start + i < mg.shape[1] and head < mg.shape[2]:
                gates[i] = mg[batch_idx, start + i, head]
            own = own + Float64(gates[i])
        return own

    @cute.kernel
    def chunk_sums(self, mg: cute.Tensor, mSums: cute.Tensor, mCu: cute.Tensor | None, mChunkSeq: cute.Tensor | None):
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()  # (the scan waits for this grid before reading mSums)
        tidx, _, _ = cute.arch.thread_idx()
        head_block, batch_idx, chunk_idx = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = tidx // 32
        head = head_block * 32 + lane
        allocator = SmemAllocator()
        own_sums = allocator.allocate_tensor(Float64, cute.make_layout((32, self.warps)), byte_alignment=16)
        gates = cute.make_rmem_tensor((self.keys_per_warp,), Float32)
        start = chunk_idx * self.chunk + warp * self.keys_per_warp
        own = self.load_keys(mg, gates, batch_idx, start, head)
        if const_expr(mCu is not None):
            # Varlen: the chunk's sum from its last sequence start on (the start of its last key's sequence),
            # what the chunks after it add up to that sequence's keys.
            last_key = cutlass.min(chunk_idx * self.chunk + self.chunk, mg.shape[1]) - 1
            last_start = mCu[sequence_of(mCu, cutlass.max(mChunkSeq[chunk_idx] - 1, 0), last_key)]
            own = Float64(0.0)
            for i in cutlass.range_constexpr(self.keys_per_warp):
                if start + i >= last_start:
                    own = own + Float64(gates[i])
        own_sums[lane, warp] = own
        cute.arch.barrier()
        store_chunk_sum(own_sums, mSums, batch_idx, chunk_idx, head, mg.shape[2], self.warps)

    @cute.kernel
    def scan(self, mg: cute.Tensor, mSums: cute.Tensor, mG: cute.Tensor, mBias: cute.Tensor,
             mSlice: cute.Tensor | None, neg_inv_scale: Float32, mCu: cute.Tensor | None,
             mChunkSeq: cute.Tensor | None):
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()  # (the gated forward waits for this grid in its prologue)
        tidx, _, _ = cute.arch.thread_idx()
        head_block, batch_idx, chunk_idx = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = tidx // 32
        head = head_block * 32 + lane
        nheads = mg.shape[2]
        seqlen = mg.shape[1]
        chunk_start = chunk_idx * self.chunk
        start = chunk_start + warp * self.keys_per_warp
        allocator = SmemAllocator()
        prefix_sums = allocator.allocate_tensor(Float64, cute.make_layout((32, self.warps)), byte_alignment=16)
        own_sums = allocator.allocate_tensor(Float64, cute.make_layout((32, self.warps)), byte_alignment=16)
        # (chunk keys x 32 heads, rows padded to 33 words: the transposed reads are conflict-free)
        staged = allocator.allocate_tensor(Float32, cute.make_layout((self.chunk, 32), stride=(33, 1)),
                                           byte_alignment=16)
        gates = cute.make_rmem_tensor((self.keys_per_warp,), Float32)
        own = self.load_keys(mg, gates, batch_idx, start, head)
        # The earlier chunks' sums: this warp's are chunks warp, warp + warps, ... (varlen: from the chunk holding
        # the start of this chunk's first key's sequence, whose sum is from that start on, chunk_sums)
        first_chunk = Int32(0)
        starts = cute.make_rmem_tensor((self.keys_per_warp,), Int32)  # (varlen: 1 where a sequence starts)
        restart_flags = None
        if const_expr(mCu is not None):
            restart_flags = allocator.allocate_tensor(Int32, cute.make_layout((self.warps,)), byte_alignment=16)
            first_seq = cutlass.max(mChunkSeq[chunk_idx] - 1, 0)
            first_chunk = mCu[first_seq] // self.chunk
            # This warp's keys: which start a sequence; its sum from its last start (and whether it has one).
            seq = sequence_of(mCu, first_seq, start)
            own = Float64(0.0)
            restarted = Int32(0)
            for i in cutlass.range_constexpr(self.keys_per_warp):
                seq = sequence_of(mCu, seq, start + i)
                starts[i] = Int32(0)
                if mCu[seq] == start + i:
                    starts[i] = Int32(1)
                    own = Float64(0.0)
                    restarted = Int32(1)
                own = own + Float64(gates[i])
            if lane == 0:
                restart_flags[warp] = restarted
        own_sums[lane, warp] = own
        if const_expr(self.pdl):
            # (g, cu_seqlens and chunk_seq predate the chunk sums' launch; mSums is theirs; every store below)
            cute.arch.griddepcontrol_wait()
        earlier = Float64(0.0)
        if head < nheads:
            earlier = strided_chunk_sum(mSums, batch_idx, head, first_chunk + warp, chunk_idx, self.warps)
        prefix_sums[lane, warp] = earlier
        cute.arch.barrier()
        carry = Float64(0.0)
        for w in cutlass.range_constexpr(self.warps):
            carry = carry + prefix_sums[lane, w]
        for w in cutlass.range_constexpr(self.warps):
            if w < warp:
                if const_expr(mCu is not None):  # (a warp with a start passes on its sum from there only)
                    if restart_flags[w] != 0:
                        carry = own_sums[lane, w]
                    else:
                        carry = carry + own_sums[lane, w]
                else:
                    carry = carry + own_sums[lane, w]
        # This warp's keys: G on the carry, the slice rows, G staged; then G and bias rows, transposed.
        for i in cutlass.range_constexpr(self.keys_per_warp):
            if const_expr(mCu is not None):
                if starts[i] != 0:
                    carry = Float64(0.0)
            carry = carry + Float64(gates[i])
            G = Float32(carry)
            staged[warp * self.keys_per_warp + i, lane] = G
            if const_expr(self.slice_dtype is not None):
                if start + i < seqlen and head < nheads:
                    self.store_slice(mSlice, G * neg_inv_scale, batch_idx, start + i, head)
        cute.arch.barrier()
        # warp w writes the rows of heads w, w + warps, ...: 32 keys (lanes) per store
        for jj in cutlass.range_constexpr(32 // self.warps):
            j = warp + jj * self.warps
            for kk in cutlass.range_constexpr(self.chunk // 32):
                key = chunk_start + kk * 32 + lane
                if key < seqlen and head_block * 32 + j < nheads:
                    G = staged[kk * 32 + lane, j]
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
