"""The gated backward's last step in one call: the log forget gates' gradient ``dg``, the reverse cumsum along each
sequence of G's gradient (``flashattn_hopper/gate.py`` ``_scan_gradient``, ``flashattn_hopper/backends/gate_scan.py``).

Purpose: after the sm90 backward kernel the gradient of ``G`` is the dS sums it wrote per key (``key_sums``,
``d(-G_j)``) and per query (``query_sums``, ``dG_i``); g's gradient is ``dg_j = sum_{t >= j} (query_sums[t - shift] -
key_sums[t])`` (``shift = seqlen_k - seqlen_q``: query ``i`` sits at key ``i + shift``; queries before the first
key add nothing). Torch did it in five launches (a negation, an add, two flips and its scan: ~30-35 us of GPU per
call at 16k tokens x 16-32 heads on an H100, ~5 % of a gated backward at 1k, perf/NOTES.md session 38); this kernel
reads the two row sets once and writes dg in g's own layout and dtype.

Layouts: ``key_sums`` ``(batch, nheads, seqlen_k)`` and ``query_sums`` ``(batch, nheads, seqlen_q)`` fp32 rows (last
stride 1); ``dg`` ``(batch, seqlen_k, nheads)``, heads innermost, fp32 / bf16 / fp16; the chunk sums ``(batch, chunks,
nheads)`` fp64 scratch.

The forward scan's plan mirrored (``gate_scan.py``): two passes over the grid ``(ceil(nheads / 32), batch,
ceil(seqlen_k / chunk))``, ``chunk = keys_per_warp * warps`` keys per CTA, a lane per head:
1. ``chunk_sums``: the CTA stages its chunk of G's gradient (32 heads x chunk keys, read along the rows: 128
   contiguous bytes per warp load) in shared memory, then each chunk's sum per head (fp64) into the scratch;
2. ``scan``: the same staging; each warp sums a share of the *later* chunks' sums, the sums meet in shared memory,
   then each warp scans its keys from the last one down on the fp64 carry and writes dg (a lane per head: 32
   contiguous values per store). fp64 carries: dg sums up to ``seqlen_k`` terms of mixed signs.
No tensor cores. Varlen (``mCu``, packed self-attention, batch 1; session 38, not yet run on a GPU): the forward's
segments mirrored, the sums restarting at each sequence's end (a chunk's record is its sum up to its first
sequence's end; a CTA's carry sums the records up to the chunk holding its last key's sequence's end).
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Float64, Int32, const_expr
from cutlass.memory import SmemAllocator

from .gate_scan import check_scan_args, chunk_keys, next_start, sequence_of, store_chunk_sum, strided_chunk_sum


class GateScanGrad:
    """A lane per head, ``keys_per_warp`` keys per warp, ``warps`` warps per CTA; the chunk sums, then the reverse
    scan."""

    def __init__(self, warps: int = 8, keys_per_warp: int = 4):
        self.chunk = chunk_keys(warps, keys_per_warp)
        self.warps = warps
        self.keys_per_warp = keys_per_warp

    @cute.jit
    def __call__(
        self,
        mKey: cute.Tensor,  # (batch, nheads, seqlen_k) fp32: dS's sums per key, d(-G)
        mQuery: cute.Tensor,  # (batch, nheads, seqlen_q) fp32: dS's sums per query, dG at the queries
        mSums: cute.Tensor,  # (batch, ceil(seqlen_k / chunk), nheads) fp64 scratch
        mdg: cute.Tensor,  # (batch, seqlen_k, nheads) fp32 / bf16 / fp16, output
        shift: Int32,  # seqlen_k - seqlen_q
        mCu: cute.Tensor | None,  # varlen: (sequences + 1,) int32 cu_seqlens of the packed keys (batch 1), else None
        mChunkSeq: cute.Tensor | None,  # varlen: (chunks,) int32, 1 + the sequence of each chunk's first key
        stream: cuda.CUstream,
    ):
        check_scan_args({"the key sums": mKey, "the query sums": mQuery}, mSums, mCu, mChunkSeq)
        grid = [(mKey.shape[1] + 31) // 32, mKey.shape[0], (mKey.shape[2] + (self.chunk - 1)) // self.chunk]
        block = [32 * self.warps, 1, 1]
        # staged chunk (chunk keys x 32 heads, rows padded to 33 words), own and later sums, varlen's end flags,
        # alignment
        smem = 4 * self.chunk * 33 + 2 * 8 * 32 * self.warps + 4 * self.warps + 256
        self.chunk_sums(mKey, mQuery, mSums, shift, mCu, mChunkSeq).launch(grid=grid, block=block, smem=smem,
                                                                           stream=stream)
        self.scan(mKey, mQuery, mSums, mdg, shift, mCu, mChunkSeq).launch(grid=grid, block=block, smem=smem,
                                                                          stream=stream)

    @cute.jit
    def stage(self, mKey: cute.Tensor, mQuery: cute.Tensor, staged: cute.Tensor, batch_idx: Int32, head_block: Int32,
              chunk_start: Int32, shift: Int32):
        """The chunk's G gradient ``query_sums[t - shift] - key_sums[t]`` (0 past the ends) into ``staged`` (key,
        head): warp w reads the rows of heads w, w + warps, ..., 32 keys (lanes) per load."""
        lane = cute.arch.lane_idx()
        warp = cute.arch.thread_idx()[0] // 32
        for jj in cutlass.range_constexpr(32 // self.warps):
            j = warp + jj * self.warps
            head = head_block * 32 + j
            for kk in cutlass.range_constexpr(self.chunk // 32):
                key = chunk_start + kk * 32 + lane
                value = Float32(0.0)
                if key < mKey.shape[2] and head < mKey.shape[1]:
                    query = key - shift
                    if query >= 0 and query < mQuery.shape[2]:
                        value = mQuery[batch_idx, head, query]
                    value = value - mKey[batch_idx, head, key]
                staged[kk * 32 + lane, j] = value
        cute.arch.barrier()

    @cute.jit
    def own_keys(self, staged: cute.Tensor, grads: cute.Tensor) -> Float64:
        """This warp's keys of its lane's head from ``staged`` into ``grads``; their sum in fp64."""
        lane = cute.arch.lane_idx()
        warp = cute.arch.thread_idx()[0] // 32
        own = Float64(0.0)
        for i in cutlass.range_constexpr(self.keys_per_warp):
            grads[i] = staged[warp * self.keys_per_warp + i, lane]
            own = own + Float64(grads[i])
        return own

    @cute.kernel
    def chunk_sums(self, mKey: cute.Tensor, mQuery: cute.Tensor, mSums: cute.Tensor, shift: Int32,
                   mCu: cute.Tensor | None, mChunkSeq: cute.Tensor | None):
        tidx, _, _ = cute.arch.thread_idx()
        head_block, batch_idx, chunk_idx = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = tidx // 32
        head = head_block * 32 + lane
        allocator = SmemAllocator()
        staged = allocator.allocate_tensor(Float32, cute.make_layout((self.chunk, 32), stride=(33, 1)),
                                           byte_alignment=16)
        own_sums = allocator.allocate_tensor(Float64, cute.make_layout((32, self.warps)), byte_alignment=16)
        self.stage(mKey, mQuery, staged, batch_idx, head_block, chunk_idx * self.chunk, shift)
        grads = cute.make_rmem_tensor((self.keys_per_warp,), Float32)
        own = self.own_keys(staged, grads)
        if const_expr(mCu is not None):
            # Varlen: the chunk's sum up to the end of its first key's sequence, what that sequence's keys in the
            # chunks before it add.
            first_end = next_start(mCu, cutlass.max(mChunkSeq[chunk_idx] - 1, 0))
            start = chunk_idx * self.chunk + warp * self.keys_per_warp
            own = Float64(0.0)
            for i in cutlass.range_constexpr(self.keys_per_warp):
                if start + i < first_end:
                    own = own + Float64(grads[i])
        own_sums[lane, warp] = own
        cute.arch.barrier()
        store_chunk_sum(own_sums, mSums, batch_idx, chunk_idx, head, mKey.shape[1], self.warps)

    @cute.kernel
    def scan(self, mKey: cute.Tensor, mQuery: cute.Tensor, mSums: cute.Tensor, mdg: cute.Tensor, shift: Int32,
             mCu: cute.Tensor | None, mChunkSeq: cute.Tensor | None):
        tidx, _, _ = cute.arch.thread_idx()
        head_block, batch_idx, chunk_idx = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = tidx // 32
        head = head_block * 32 + lane
        nheads = mKey.shape[1]
        seqlen = mKey.shape[2]
        start = chunk_idx * self.chunk + warp * self.keys_per_warp
        allocator = SmemAllocator()
        staged = allocator.allocate_tensor(Float32, cute.make_layout((self.chunk, 32), stride=(33, 1)),
                                           byte_alignment=16)
        later_sums = allocator.allocate_tensor(Float64, cute.make_layout((32, self.warps)), byte_alignment=16)
        own_sums = allocator.allocate_tensor(Float64, cute.make_layout((32, self.warps)), byte_alignment=16)
        self.stage(mKey, mQuery, staged, batch_idx, head_block, chunk_idx * self.chunk, shift)
        grads = cute.make_rmem_tensor((self.keys_per_warp,), Float32)
        own = Float64(0.0)
        if const_expr(mCu is None):
            own = self.own_keys(staged, grads)
        # The later chunks' sums: this warp's are chunks chunk_idx + 1 + warp, + warps, ... (varlen: up to the chunk
        # holding the end of this chunk's last key's sequence, whose sum is up to that end, chunk_sums)
        end_chunk = mSums.shape[1]
        ends = cute.make_rmem_tensor((self.keys_per_warp,), Int32)  # (varlen: 1 where a sequence ends)
        end_flags = None
        if const_expr(mCu is not None):
            end_flags = allocator.allocate_tensor(Int32, cute.make_layout((self.warps,)), byte_alignment=16)
            first_seq = cutlass.max(mChunkSeq[chunk_idx] - 1, 0)
            last_key = cutlass.min(chunk_idx * self.chunk + self.chunk, seqlen) - 1
            last_end = next_start(mCu, sequence_of(mCu, first_seq, last_key))
            end_chunk = cutlass.min((cutlass.min(last_end, seqlen) - 1) // self.chunk + 1, end_chunk)
            # This warp's keys: which end a sequence; its sum up to its first end (and whether it has one).
            seq = sequence_of(mCu, first_seq, start)
            for i in cutlass.range_constexpr(self.keys_per_warp):
                seq = sequence_of(mCu, seq, start + i)
                ends[i] = Int32(0)
                if next_start(mCu, seq) == start + i + 1:
                    ends[i] = Int32(1)
            self.own_keys(staged, grads)
            own = Float64(0.0)
            ended = Int32(0)
            for ii in cutlass.range_constexpr(self.keys_per_warp):
                i = self.keys_per_warp - 1 - ii
                if ends[i] != 0:
                    own = Float64(0.0)
                    ended = Int32(1)
                own = own + Float64(grads[i])
            if lane == 0:
                end_flags[warp] = ended
        own_sums[lane, warp] = own
        later = Float64(0.0)
        if head < nheads:
            later = strided_chunk_sum(mSums, batch_idx, head, chunk_idx + 1 + warp, end_chunk, self.warps)
        later_sums[lane, warp] = later
        cute.arch.barrier()
        carry = Float64(0.0)
        for w in cutlass.range_constexpr(self.warps):
            carry = carry + later_sums[lane, w]
        for ww in cutlass.range_constexpr(self.warps):
            # (varlen: from the farthest warp in, so that the nearest end decides)
            w = self.warps - 1 - ww if const_expr(mCu is not None) else ww
            if w > warp:
                if const_expr(mCu is not None):  # (a warp with an end passes on its sum up to there only)
                    if end_flags[w] != 0:
                        carry = own_sums[lane, w]
                    else:
                        carry = carry + own_sums[lane, w]
                else:
                    carry = carry + own_sums[lane, w]
        if const_expr(mCu is not None):  # (read again: held across the later chunks' loop, one was spilled)
            self.own_keys(staged, grads)
        # This warp's keys from the last one down: dg on the carry, a lane per head.
        for ii in cutlass.range_constexpr(self.keys_per_warp):
            i = self.keys_per_warp - 1 - ii
            if const_expr(mCu is not None):
                if ends[i] != 0:
                    carry = Float64(0.0)
            carry = carry + Float64(grads[i])
            if start + i < seqlen and head < nheads:
                mdg[batch_idx, start + i, head] = Float32(carry).to(mdg.element_type)
