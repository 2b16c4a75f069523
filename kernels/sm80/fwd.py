"""FlashAttention-2 forward kernel for Ampere (sm80): ``FlashFwdSm80``.

Purpose: ``O = softmax(Q K^T * softmax_scale) V`` and the natural-log LSE per query row, for
bf16/fp16 inputs with fp32 accumulation; optional bottom-right-aligned causal or sliding-window
(local) masking, softcap, GQA/MQA (query head ``h`` reads KV head ``h // (nheads // nheads_k)``,
no K/V repeat) and variable-length (packed) batches.

Constraints:
- Dense: Q/K/V/O ``(batch, seqlen, nheads, head_dim)``, LSE fp32 ``(batch, nheads, seqlen_q)``.
  Varlen (``cu_seqlens_q/k`` given): Q/K/V/O ``(total, nheads, head_dim)``, LSE
  ``(nheads, total_q)``, ``cu_seqlens`` int32 ``(batch + 1,)``, optional ``seqused`` int32
  ``(batch,)``. Unit last stride, every other stride a multiple of 8 elements, 16-byte aligned
  base pointers. All extents dynamic; the runtime head dims must equal the compiled ones.
- ``head_dim``/``head_dim_v`` multiples of 8 up to 256; tiles padded to 16 in registers and
  smem, with zero-filled loads and predicated stores on the padding (compile-time flag).
- ``softmax_scale > 0``, ``softcap > 0`` when enabled (see ``common/softmax.py``); window sides
  are runtime ``Int32`` (an unbounded side is passed as a huge value, e.g. ``2**30``).
- Rows past ``seqused_q`` are not written (the launcher zero-fills them).

Paper: FlashAttention-2 (Dao, 2023) section 3.1 (Algorithm 1, forward) with the block skipping
of 3.1.1; design doc ``fa3_cute_design.md`` sections 1.9 (masks), 1.14 (varlen), 3.1 (sm80).
"""

from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.memory import SmemAllocator, get_smem_capacity_in_bytes

from ..common.block_info import BlockInfo
from ..common.gemm_sm80 import gemm_rs, gemm_ss
from ..common.mask import AttentionMask
from ..common.seqlen import SeqlenInfo, num_varlen_tiles_upper_bound, varlen_tile_coord
from ..common.softmax import OnlineSoftmax, apply_softcap, read_sink_log2, softcap_scale_log2
from ..common.utils import (
    LOG2_E,
    acc_rows_cols,
    acc_to_frag_a_sm80,
    attention_kernel_views,
    convert_to_16bit,
    copy_predicate,
    select_head,
    smem_layout_atom_sm80,
    transpose_view,
)

# fp32 registers per thread the S and O accumulators may take; beyond this a config is refused.
# The rest of the 255-register cap holds operand slices, P, addresses and softmax state.
# Measured (CPU compile, DSL 4.8.1 + its ptxas, sm_80, 4 warps): 128 + 32 (d128, 128x32) and
# 64 + 64 (d64, 128x64) are spill-free; FA2's A100 tiles at 192 (d64 128x128, d128 128x64)
# compile correctly but spill 100-450 bytes (FA2's C++ 128x64 d128 kernel spills 172 bytes too).
_MAX_ACC_REGS_PER_THREAD = 192
_SMEM_ALIGN = 1024  # each buffer starts on a full period of the 128-byte swizzle (8 rows)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _copy_threads_per_row(dtype_width: int, cols: int) -> int:
    """Threads sharing one smem-atom row in a 16-byte-per-thread tiled copy (see utils)."""
    row_bytes = cols * dtype_width // 8
    atom_bytes = next((b for b in (128, 64, 32) if row_bytes % b == 0), 16)
    return atom_bytes // 16


@dataclass(frozen=True)
class TileLoad:
    """One operand's ``cp.async`` partition for this thread.

    ``gX``/``sX`` are ``(CPY, CPY_ROWS, CPY_COLS[, n_block | stage])`` gmem/smem views; ``cX``/
    ``c0X`` the identity coordinates of this thread and of thread 0 (for predicates). When the
    head dim is padded, ``col_limit`` is the real head dim and ``col_pred`` its precomputed
    predicate; both are None otherwise.
    """

    tiled_copy: cute.TiledCopy
    gX: cute.Tensor
    sX: cute.Tensor
    cX: cute.Tensor
    c0X: cute.Tensor
    col_limit: int | None
    col_pred: cute.Tensor | None


@dataclass(frozen=True)
class MmaParts:
    """Register fragments, their smem sources (K/V with a stage mode) and the O accumulator."""

    thr_mma_qk: cute.ThrMma
    thr_mma_pv: cute.ThrMma
    tSrQ: cute.Tensor
    tSrK: cute.Tensor
    tOrVt: cute.Tensor
    tSsQ: cute.Tensor
    tSsK: cute.Tensor
    tOsVt: cute.Tensor
    smem_thr_copy_Q: cute.TiledCopy
    smem_thr_copy_K: cute.TiledCopy
    smem_thr_copy_V: cute.TiledCopy
    acc_O: cute.Tensor


@dataclass(frozen=True)
class BlockStep:
    """What one key-block step needs besides the block index and its compile-time flags.

    ``softcap_scale`` is None unless softcap is compiled in.
    """

    mma: MmaParts
    load_K: TileLoad
    load_V: TileLoad
    softmax: OnlineSoftmax
    mask: AttentionMask
    seqlen_k: Int32
    m_block: Int32
    n_block_min: Int32
    softcap_scale: Float32 | None


class FlashFwdSm80:
    """FA2 forward on sm80: one CTA computes one ``(tile_m, head_dim_v)`` tile of O.

    Grid: dense ``(ceil(seqlen_q / tile_m), nheads, batch)`` (causal/local: m_blocks in reverse
    so the longest rows start first); varlen-Q ``(upper bound of tiles over all sequences,
    nheads, 1)``, each CTA finding its ``(batch, m_block)`` with a warp scan of ``cu_seqlens_q``
    (``common/seqlen.py``) and exiting if it has none. ``num_threads / 32`` warps, no warp
    specialisation: every warp loads, computes and stores. Warps split the tile along M
    (``tile_m / num_warps`` rows each), so softmax row reductions stay inside a quad.

    Data path per CTA (``num_stages`` K and V buffers; O reuses sQ)::

        gmem --cp.async 16B, swizzled--> sQ, sK, sV --ldmatrix--> regs --mma.sync--> S (fp32)
        S --softcap, mask, online softmax, cvt--> P (16-bit regs, reused as the A operand)
        P, sV --ldmatrix.trans--> mma.sync --> O (fp32 regs) --cvt--> sO --16B st.global--> O

    One stage (``cp.async`` group waited with ``wait_group(0)`` + CTA barrier)::

        | group          | issued                    | waited                           |
        | Q + K[first]   | prologue                  | top of the first block           |
        | V[n]           | top of block n            | after the softmax of block n     |
        | K[n-1]         | after the softmax of n    | top of block n-1                 |

    Two stages: each load gets a whole block step to land (waits are ``wait_group(2)``)::

        | group          | issued                    | waited                   | buffer      |
        | Q + K[first]   | prologue                  | top of the first block   | K[first%2]  |
        | V[first]       | prologue                  | after its softmax        | V[first%2]  |
        | K[first-1]     | prologue                  | top of block first-1     | K[(f-1)%2]  |
        | V[n-1]         | top of block n            | after softmax of n-1     | V[(n-1)%2]  |
        | K[n-2]         | after the softmax of n    | top of block n-2         | K[n%2]      |

    Timeline of block n (right to left over key blocks, ``n_block_max - 1`` down to
    ``n_block_min``)::

        wait K[n], barrier (sV slot free) | issue V | S = Q K[n]^T | softcap, mask, softmax,
        O *= scale, P = cvt(S) | wait V[n], barrier (sK slot free) | issue K | O += P V[n]

    The first block is the only one masked by ``seqlen_k``; with causal/local the blocks that
    straddle the right (then, local, the left) window edge carry that mask and the rest none
    (``BlockInfo``). A CTA with no visible key block skips the loop and writes O = 0,
    LSE = -inf.
    """

    def __init__(
        self,
        dtype: type[cutlass.Numeric],
        head_dim: int,
        head_dim_v: int,
        tile_m: int,
        tile_n: int,
        num_threads: int,
        is_causal: bool,
        is_local: bool = False,
        has_softcap: bool = False,
        num_stages: int = 1,
        has_sink: bool = False,
    ):
        reason = self.can_implement(
            dtype, head_dim, head_dim_v, tile_m, tile_n, num_threads, is_causal,
            is_local=is_local, num_stages=num_stages,
        )
        if reason is not None:
            raise ValueError(f"FlashFwdSm80 cannot implement this config: {reason}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        # A learnable sink per query head joins each row's denominator at finalize (common/softmax.py);
        # its logit is read from mLSE, which the launcher fills with it and the epilogue overwrites.
        self.has_sink = has_sink
        # mma.sync k16 / ldmatrix x4 work on 16-wide slices; pad the head dims to that.
        self.tile_hdim = _round_up(head_dim, 16)
        self.tile_hdimv = _round_up(head_dim_v, 16)
        self.check_hdim = head_dim != self.tile_hdim
        self.check_hdim_v = head_dim_v != self.tile_hdimv
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.num_threads = num_threads
        self.num_warps = num_threads // 32
        self.is_causal = is_causal
        self.is_local = is_local
        self.has_softcap = has_softcap
        self.num_stages = num_stages

    @staticmethod
    def can_implement(
        dtype, head_dim, head_dim_v, tile_m, tile_n, num_threads, is_causal,
        is_local=False, num_stages=1,
    ) -> str | None:
        """None if this static config compiles into a correct kernel, else the reason why not."""
        if dtype not in (cutlass.BFloat16, cutlass.Float16):
            return f"dtype must be BFloat16 or Float16, got {dtype}"
        for name, d in (("head_dim", head_dim), ("head_dim_v", head_dim_v)):
            if d % 8 != 0 or not 8 <= d <= 256:
                return f"{name} must be a multiple of 8 in [8, 256] (16-byte rows), got {d}"
        if is_causal and is_local:
            return "is_causal and is_local are exclusive (causal with a window is local, right = 0)"
        if num_stages not in (1, 2):
            return f"num_stages must be 1 or 2, got {num_stages}"
        if num_threads <= 0 or num_threads % 32 != 0:
            return f"num_threads must be a positive multiple of 32, got {num_threads}"
        num_warps = num_threads // 32
        if tile_m % (16 * num_warps) != 0:
            return f"tile_m ({tile_m}) must be a multiple of 16 * num_warps ({16 * num_warps})"
        if tile_n <= 0 or tile_n % 16 != 0:
            return f"tile_n must be a positive multiple of 16, got {tile_n}"
        tile_hdim, tile_hdimv = _round_up(head_dim, 16), _round_up(head_dim_v, 16)
        for name, rows, cols in (
            ("Q", tile_m, tile_hdim),
            ("K", tile_n, tile_hdim),
            ("V", tile_n, tile_hdimv),
            ("O", tile_m, tile_hdimv),
        ):
            threads_per_row = _copy_threads_per_row(dtype.width, cols)
            if num_threads % threads_per_row != 0 or rows % (num_threads // threads_per_row):
                return (
                    f"the {name} tile ({rows} x {cols}) is not covered by whole passes of "
                    f"{num_threads} threads copying 16 bytes each"
                )
        acc_regs = (tile_m * tile_hdimv + tile_m * tile_n) // num_threads
        if acc_regs > _MAX_ACC_REGS_PER_THREAD:
            return (
                f"S and O accumulators need {acc_regs} fp32 registers per thread "
                f"(> {_MAX_ACC_REGS_PER_THREAD}); use more threads or smaller tiles"
            )
        elem_bytes = dtype.width // 8
        smem_bytes = (
            _round_up(max(tile_m * tile_hdim, tile_m * tile_hdimv) * elem_bytes, _SMEM_ALIGN)
            + num_stages * _round_up(tile_n * tile_hdim * elem_bytes, _SMEM_ALIGN)
            + num_stages * _round_up(tile_n * tile_hdimv * elem_bytes, _SMEM_ALIGN)
        )
        smem_capacity = get_smem_capacity_in_bytes("sm_80")
        if smem_bytes > smem_capacity:
            return f"needs {smem_bytes} bytes of shared memory, sm80 allows {smem_capacity}"
        return None

    # ------------------------------------------------------------------ static building blocks

    def _smem_layouts(self):
        """Swizzled smem layouts: Q/O ``(rows, hdim)``, K/V ``(tile_n, hdim, num_stages)``."""

        def tile(rows: int, cols: int, stages: int | None = None):
            atom = smem_layout_atom_sm80(self.dtype, cols)
            if stages is None:
                return cute.tile_to_shape(atom, (rows, cols), (0, 1))
            return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))

        return (
            tile(self.tile_m, self.tile_hdim),
            tile(self.tile_n, self.tile_hdim, self.num_stages),
            tile(self.tile_n, self.tile_hdimv, self.num_stages),
            tile(self.tile_m, self.tile_hdimv),
        )

    def _shared_storage(self, sQ_layout, sK_layout, sV_layout, sO_layout):
        # sO is written after the last read of sQ, so it takes sQ's bytes (sized for both).
        cosize_QO = max(cute.cosize(sQ_layout), cute.cosize(sO_layout))

        def buffer(num_elems: int):
            return cute.struct.Align[cute.struct.MemRange[self.dtype, num_elems], _SMEM_ALIGN]

        @cute.struct
        class SharedStorage:
            sQ: buffer(cosize_QO)
            sK: buffer(cute.cosize(sK_layout))
            sV: buffer(cute.cosize(sV_layout))

        return SharedStorage

    def _gmem_tiled_copy(self, cols: int, is_async: bool) -> cute.TiledCopy:
        """16 bytes per thread per copy, threads row-major over the 16-byte chunks of a row.

        A warp then covers whole 128-byte rows (coalesced gmem) and, through the swizzle, 8
        distinct bank groups in smem. ``is_async``: ``cp.async`` (gmem -> smem, L2 only, which
        suits tiles read once per CTA); else plain 128-bit loads/stores.
        """
        copy_bits = 128
        op = (
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL)
            if is_async
            else cute.nvgpu.CopyUniversalOp()
        )
        atom = cute.make_copy_atom(op, self.dtype, num_bits_per_copy=copy_bits)
        threads_per_row = _copy_threads_per_row(self.dtype.width, cols)
        thr_layout = cute.make_ordered_layout(
            (self.num_threads // threads_per_row, threads_per_row), order=(1, 0)
        )
        val_layout = cute.make_layout((1, copy_bits // self.dtype.width))
        return cute.make_tiled_copy_tv(atom, thr_layout, val_layout)

    def _tiled_mma(self) -> cute.TiledMma:
        """Warps stacked along M; N and K permuted to 16 so B loads are ``ldmatrix.x4``."""
        return cute.make_tiled_mma(
            warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16)),
            (self.num_warps, 1, 1),
            permutation_mnk=(self.num_warps * 16, 16, 16),
        )

    # ------------------------------------------------------------------ host entry point

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, nheads, head_dim) | varlen (total_q, nheads, head_dim)
        mK: cute.Tensor,  # (batch, seqlen_k, nheads_k, head_dim) | varlen (total_k, ...)
        mV: cute.Tensor,  # (batch, seqlen_k, nheads_k, head_dim_v) | varlen (total_k, ...)
        mO: cute.Tensor,  # like mQ with head_dim_v, output
        mLSE: cute.Tensor,  # (batch, nheads, seqlen_q) | varlen (nheads, total_q), fp32 output
        softmax_scale: Float32,
        window_left: Int32,  # local only (else ignored); unbounded: a huge value
        window_right: Int32,  # local only (else ignored); unbounded: a huge value
        softcap: Float32,  # has_softcap only (else ignored)
        mCuSeqlensQ: cute.Tensor | None,  # (batch + 1,) int32
        mCuSeqlensK: cute.Tensor | None,  # (batch + 1,) int32
        mSeqUsedQ: cute.Tensor | None,  # (batch,) int32
        mSeqUsedK: cute.Tensor | None,  # (batch,) int32
        stream: cuda.CUstream,
    ):
        varlen_q = const_expr(mCuSeqlensQ is not None)
        varlen_k = const_expr(mCuSeqlensK is not None)
        mQ, mK, mV, mO, mLSE = attention_kernel_views(mQ, mK, mV, mO, mLSE, self.dtype, varlen_q, varlen_k)
        qhead_per_kvhead = mQ.shape[2] // mK.shape[2]
        SharedStorage = self._shared_storage(*self._smem_layouts())
        if const_expr(self.has_softcap):
            softcap_scale, scale_log2 = softcap_scale_log2(softmax_scale, softcap)
        else:
            softcap_scale, scale_log2 = Float32(1.0), softmax_scale * LOG2_E
        if const_expr(varlen_q):
            num_batch = mCuSeqlensQ.shape[0] - 1
            grid_x = num_varlen_tiles_upper_bound(mQ.shape[0], num_batch, self.tile_m)
            grid_z = 1
        else:
            num_batch = mQ.shape[3]
            grid_x = (mQ.shape[0] + (self.tile_m - 1)) // self.tile_m
            grid_z = num_batch
        self.kernel(
            mQ, mK, mV, mO, mLSE, scale_log2, softcap_scale, window_left, window_right,
            qhead_per_kvhead, num_batch, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK,
            SharedStorage,
        ).launch(
            grid=[grid_x, mQ.shape[2], grid_z],
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )

    # ------------------------------------------------------------------ device code

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,  # (seqlen_q, head_dim, nheads[, batch])
        mK: cute.Tensor,  # (seqlen_k, head_dim, nheads_k[, batch])
        mV: cute.Tensor,  # (seqlen_k, head_dim_v, nheads_k[, batch])
        mO: cute.Tensor,  # (seqlen_q, head_dim_v, nheads[, batch])
        mLSE: cute.Tensor,  # (seqlen_q, nheads[, batch])
        scale_log2: Float32,
        softcap_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        qhead_per_kvhead: Int32,
        num_batch: Int32,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        mSeqUsedQ: cute.Tensor | None,
        mSeqUsedK: cute.Tensor | None,
        SharedStorage: cutlass.Constexpr,
    ):
        """Tile coordinates, then (if this CTA has a tile) prologue, main loop, epilogue."""
        tidx, _, _ = cute.arch.thread_idx()
        block_x, head_idx, block_z = cute.arch.block_idx()
        storage = SmemAllocator().allocate(SharedStorage)
        if const_expr(mCuSeqlensQ is not None):
            batch_idx, m_block = varlen_tile_coord(
                block_x, num_batch, self.tile_m, mCuSeqlensQ, mSeqUsedQ
            )
            if batch_idx >= 0:
                self.attention_tile(
                    mQ, mK, mV, mO, mLSE, scale_log2, softcap_scale, window_left, window_right,
                    qhead_per_kvhead, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, storage,
                    tidx, m_block, head_idx, batch_idx,
                )
        else:
            m_block = block_x
            if const_expr(self.is_causal or self.is_local):
                # Bottom tiles see the most keys: start them first (longest-processing-time).
                m_block = cute.arch.grid_dim()[0] - 1 - block_x
            self.attention_tile(
                mQ, mK, mV, mO, mLSE, scale_log2, softcap_scale, window_left, window_right,
                qhead_per_kvhead, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, storage,
                tidx, m_block, head_idx, block_z,
            )

    @cute.jit
    def attention_tile(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        scale_log2: Float32,
        softcap_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        qhead_per_kvhead: Int32,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        mSeqUsedQ: cute.Tensor | None,
        mSeqUsedK: cute.Tensor | None,
        storage,
        tidx: Int32,
        m_block: Int32,
        head_idx: Int32,
        batch_idx: Int32,
    ):
        """One ``(m_block, head, batch)`` tile of O and LSE."""
        seqlen = SeqlenInfo.create(
            batch_idx, mQ.shape[0], mK.shape[0], mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK
        )
        seqlen_q, seqlen_k = seqlen.seqlen_q, seqlen.seqlen_k
        head_idx_kv = head_idx // qhead_per_kvhead

        sQ_layout, sK_layout, sV_layout, sO_layout = self._smem_layouts()
        sQ = storage.sQ.get_tensor(sQ_layout)
        sK = storage.sK.get_tensor(sK_layout)
        sV = storage.sV.get_tensor(sV_layout)
        sO = cute.make_tensor(sQ.iterator, sO_layout)

        # This (batch, head)'s (seqlen, head_dim) views, then (tile, head_dim[, n_block]) tiles.
        mQ_cur = seqlen.q_view(select_head(mQ, head_idx, 2), batch_idx)
        mK_cur = seqlen.k_view(select_head(mK, head_idx_kv, 2), batch_idx)
        mV_cur = seqlen.k_view(select_head(mV, head_idx_kv, 2), batch_idx)
        mO_cur = seqlen.q_view(select_head(mO, head_idx, 2), batch_idx)
        mLSE_cur = seqlen.q_view(select_head(mLSE, head_idx, 1), batch_idx)
        gQ = cute.local_tile(mQ_cur, (self.tile_m, self.tile_hdim), (m_block, 0))
        gK = cute.local_tile(mK_cur, (self.tile_n, self.tile_hdim), (None, 0))
        gV = cute.local_tile(mV_cur, (self.tile_n, self.tile_hdimv), (None, 0))
        load_Q = self._make_tile_load(gQ, sQ, self.tile_m, self.tile_hdim, self.head_dim, tidx)
        load_K = self._make_tile_load(gK, sK, self.tile_n, self.tile_hdim, self.head_dim, tidx)
        load_V = self._make_tile_load(gV, sV, self.tile_n, self.tile_hdimv, self.head_dim_v, tidx)
        mma = self._make_mma_parts(sQ, sK, sV, tidx)

        window_l = window_left if const_expr(self.is_local) else None
        window_r = window_right if const_expr(self.is_local) else None
        block_info = BlockInfo(
            self.tile_m, self.tile_n, self.is_causal, self.is_local, window_l, window_r
        )
        n_block_min, n_block_max = block_info.n_block_min_max(seqlen_q, seqlen_k, m_block)
        mask = AttentionMask(self.tile_m, self.tile_n, seqlen_q, seqlen_k, window_l, window_r)
        softmax = OnlineSoftmax(scale_log2, num_rows=cute.size(acc_rows_cols(mma.acc_O).shape[0]))

        # Q rows past seqlen_q are zero-filled; their results are never stored.
        self.load_tile(load_Q, None, 0, seqlen_q - m_block * self.tile_m, check_rows=True)
        # An m_block that sees no key (causal/local, or seqlen_k = 0) loads nothing else.
        n_first = n_block_max - 1
        has_blocks = n_block_max > n_block_min
        if has_blocks:
            self.load_tile(
                load_K, n_first, n_first % self.num_stages, seqlen_k - n_first * self.tile_n,
                check_rows=True,
            )
        cute.arch.cp_async_commit_group()
        if const_expr(self.num_stages == 2):
            if has_blocks:
                self.load_tile(
                    load_V, n_first, n_first % 2, seqlen_k - n_first * self.tile_n, check_rows=True
                )
            cute.arch.cp_async_commit_group()
            if n_first - 1 >= n_block_min:
                self.load_tile(load_K, n_first - 1, (n_first - 1) % 2, Int32(0), check_rows=False)
            cute.arch.cp_async_commit_group()

        if has_blocks:
            step = BlockStep(
                mma, load_K, load_V, softmax, mask, seqlen_k, m_block, n_block_min,
                softcap_scale if const_expr(self.has_softcap) else None,
            )
            self.mainloop(step, block_info, seqlen_q, n_block_max)

        sink_log2 = None
        if const_expr(self.has_sink):  # (read here, not before the key loop: live across it, it spilled)
            cO_acc = cute.make_identity_tensor((self.tile_m, self.tile_hdimv))
            tOcO_mn = acc_rows_cols(mma.thr_mma_pv.partition_C(cO_acc))
            sink_log2 = read_sink_log2(mLSE_cur, tOcO_mn, m_block * self.tile_m, seqlen_q)
        o_scale, lse = softmax.finalize(sink_log2)
        softmax.rescale_O(mma.acc_O, o_scale)
        self.epilogue(
            mma.acc_O, lse, mO_cur, mLSE_cur, sO, mma.thr_mma_pv, tidx, m_block, seqlen_q,
        )

    def _make_tile_load(self, gX, sX, rows: int, cols: int, head_dim: int, tidx) -> TileLoad:
        tiled_copy = self._gmem_tiled_copy(cols, is_async=True)
        thr_copy = tiled_copy.get_slice(tidx)
        cX = cute.make_identity_tensor((rows, cols))
        tXcX = thr_copy.partition_S(cX)
        t0XcX = tiled_copy.get_slice(0).partition_S(cX)
        col_limit = head_dim if head_dim != cols else None
        col_pred = copy_predicate(tXcX, t0XcX, None, col_limit) if col_limit is not None else None
        return TileLoad(
            tiled_copy,
            thr_copy.partition_S(gX),
            thr_copy.partition_D(sX),
            tXcX,
            t0XcX,
            col_limit,
            col_pred,
        )

    def _make_mma_parts(self, sQ, sK, sV, tidx) -> MmaParts:
        tiled_mma = self._tiled_mma()
        thr_mma_qk = tiled_mma.get_slice(tidx)
        thr_mma_pv = tiled_mma.get_slice(tidx)
        sVt = transpose_view(sV)  # (head_dim_v, tile_n, stage): V as the B operand of P V
        ldsm = cute.make_copy_atom(
            warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype
        )
        # V is stored (tile_n, head_dim_v) row-major; the B operand wants it K-major: transpose.
        ldsm_t = cute.make_copy_atom(
            warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype
        )
        smem_thr_copy_Q = cute.make_tiled_copy_A(ldsm, tiled_mma).get_slice(tidx)
        smem_thr_copy_K = cute.make_tiled_copy_B(ldsm, tiled_mma).get_slice(tidx)
        smem_thr_copy_V = cute.make_tiled_copy_B(ldsm_t, tiled_mma).get_slice(tidx)
        acc_O = cute.make_rmem_tensor(
            thr_mma_pv.partition_shape_C((self.tile_m, self.tile_hdimv)), Float32
        )
        acc_O.fill(0.0)
        return MmaParts(
            thr_mma_qk=thr_mma_qk,
            thr_mma_pv=thr_mma_pv,
            tSrQ=thr_mma_qk.make_fragment_A(thr_mma_qk.partition_A(sQ)),
            tSrK=thr_mma_qk.make_fragment_B(thr_mma_qk.partition_B(sK[None, None, 0])),
            tOrVt=thr_mma_pv.make_fragment_B(thr_mma_pv.partition_B(sVt[None, None, 0])),
            tSsQ=smem_thr_copy_Q.partition_S(sQ),
            tSsK=smem_thr_copy_K.partition_S(sK),
            tOsVt=smem_thr_copy_V.partition_S(sVt),
            smem_thr_copy_Q=smem_thr_copy_Q,
            smem_thr_copy_K=smem_thr_copy_K,
            smem_thr_copy_V=smem_thr_copy_V,
            acc_O=acc_O,
        )

    @cute.jit
    def load_tile(
        self,
        ld: TileLoad,
        n_block: Int32 | None,
        stage: Int32,
        row_limit: Int32,
        check_rows: cutlass.Constexpr[bool],
    ):
        """Issue the ``cp.async`` copies of one tile into smem ``stage`` (``n_block`` None: the
        tile has neither a block nor a stage mode, i.e. Q).

        ``check_rows``: rows ``>= row_limit`` (counted from the tile's first row) are zero-filled
        (``cp.async`` with src-size 0, no gmem access). Needed for Q and for the first, possibly
        partial, key block: zero V rows keep ``P = 0`` times padding at exactly 0, never NaN.
        Padded head-dim columns are zero-filled too, so they add nothing to ``Q K^T``.
        """
        gX = ld.gX if const_expr(n_block is None) else ld.gX[None, None, None, n_block]
        sX = ld.sX if const_expr(n_block is None) else ld.sX[None, None, None, stage]
        if const_expr(check_rows):
            pred = copy_predicate(ld.cX, ld.c0X, row_limit, ld.col_limit)
            cute.copy(ld.tiled_copy, gX, sX, pred=pred)
        elif const_expr(ld.col_pred is not None):
            cute.copy(ld.tiled_copy, gX, sX, pred=ld.col_pred)
        else:
            cute.copy(ld.tiled_copy, gX, sX)

    @cute.jit
    def mainloop(self, step: BlockStep, block_info: BlockInfo, seqlen_q: Int32, n_block_max: Int32):
        """Key blocks right to left in up to four segments, each with its masking compiled in.

        Segments (descending ``n``): the first block (seqlen + causal/local mask), blocks that
        may cross the right window edge, unmasked blocks, blocks that may cross the left window
        edge (local only). Called only when ``n_block_max > n_block_min``; the first block's
        loads are already in flight. (The mainloop is one method because the segment bounds
        and their loops only make sense together.)
        """
        masked = self.is_causal or self.is_local
        # 1. The rightmost block: the only one that can be cut by seqlen_k.
        self.compute_one_n_block(
            n_block_max - 1, step, is_first=True, mask_seqlen=True, mask_causal=self.is_causal,
            mask_local=self.is_local,
        )
        # 2. Blocks that may still cross the diagonal / right window edge.
        n_block_unmasked_end = n_block_max - 1
        if const_expr(masked):
            n_block_mask_min = block_info.n_block_min_right_mask(
                seqlen_q, step.seqlen_k, step.m_block, step.n_block_min
            )
            n_block_unmasked_end = cutlass.min(n_block_unmasked_end, n_block_mask_min)
            for i in cutlass.range(n_block_max - 1 - n_block_unmasked_end, unroll=1):
                self.compute_one_n_block(
                    n_block_max - 2 - i, step, is_first=False, mask_seqlen=False,
                    mask_causal=self.is_causal, mask_local=self.is_local,
                )
        # 3. Blocks fully inside the window: no masking code at all.
        n_block_unmasked_begin = step.n_block_min
        if const_expr(self.is_local):
            n_block_unmasked_begin = cutlass.min(
                block_info.n_block_max_left_mask(
                    seqlen_q, step.seqlen_k, step.m_block, step.n_block_min
                ),
                n_block_unmasked_end,
            )
        for i in cutlass.range(n_block_unmasked_end - n_block_unmasked_begin, unroll=1):
            self.compute_one_n_block(
                n_block_unmasked_end - 1 - i, step, is_first=False, mask_seqlen=False,
                mask_causal=False, mask_local=False,
            )
        # 4. Local: blocks that may cross the left window edge.
        if const_expr(self.is_local):
            for i in cutlass.range(n_block_unmasked_begin - step.n_block_min, unroll=1):
                self.compute_one_n_block(
                    n_block_unmasked_begin - 1 - i, step, is_first=False, mask_seqlen=False,
                    mask_causal=False, mask_local=True,
                )

    @cute.jit
    def compute_one_n_block(
        self,
        n_block: Int32,
        step: BlockStep,
        is_first: cutlass.Constexpr[bool],
        mask_seqlen: cutlass.Constexpr[bool],
        mask_causal: cutlass.Constexpr[bool],
        mask_local: cutlass.Constexpr[bool],
    ):
        """S = Q K[n]^T, mask, online softmax, O = O * scale + P V[n]; overlaps the next loads."""
        mma = step.mma
        two_stage = const_expr(self.num_stages == 2)
        stage = n_block % self.num_stages if const_expr(two_stage) else 0
        # K[n] (and Q, on the first block) has landed for every thread; every warp is also done
        # with the previous block's P V, so that block's sV slot may be overwritten.
        cute.arch.cp_async_wait_group(2 if const_expr(two_stage) else 0)
        cute.arch.barrier()
        if const_expr(two_stage):
            if n_block - 1 >= step.n_block_min:
                self.load_tile(step.load_V, n_block - 1, 1 - stage, Int32(0), check_rows=False)
        else:
            self.load_tile(
                step.load_V, n_block, 0, step.seqlen_k - n_block * self.tile_n,
                check_rows=is_first,
            )
        cute.arch.cp_async_commit_group()

        acc_S = cute.make_rmem_tensor(
            mma.thr_mma_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32
        )
        acc_S.fill(0.0)
        gemm_ss(
            mma.thr_mma_qk, acc_S, mma.tSrQ, mma.tSrK, mma.tSsQ, mma.tSsK[None, None, None, stage],
            mma.smem_thr_copy_Q, mma.smem_thr_copy_K,
        )
        if const_expr(step.softcap_scale is not None):
            apply_softcap(acc_S, step.softcap_scale)
        if const_expr(mask_seqlen or mask_causal or mask_local):
            step.mask.apply(
                acc_S, mma.thr_mma_qk, step.m_block, n_block,
                mask_seqlen=mask_seqlen, mask_causal=mask_causal, mask_local=mask_local,
            )
        row_scale = step.softmax.update(acc_S, is_first=is_first)
        if const_expr(not is_first):
            step.softmax.rescale_O(mma.acc_O, row_scale)
        # Convert before the barrier so the fp32 S is dead before the next K's address math
        # (a lower register peak: fewer spills at the 192-register tiles).
        tOrP = acc_to_frag_a_sm80(convert_to_16bit(acc_S, self.dtype))

        # V[n] has landed; every warp has finished reading this sK slot, so it may be refilled.
        cute.arch.cp_async_wait_group(2 if const_expr(two_stage) else 0)
        cute.arch.barrier()
        # Only the first block visited can be partial, so no row predicate here.
        if const_expr(two_stage):
            if n_block - 2 >= step.n_block_min:
                self.load_tile(step.load_K, n_block - 2, stage, Int32(0), check_rows=False)
        else:
            if n_block > step.n_block_min:
                self.load_tile(step.load_K, n_block - 1, 0, Int32(0), check_rows=False)
        cute.arch.cp_async_commit_group()

        gemm_rs(
            mma.thr_mma_pv, mma.acc_O, tOrP, mma.tOrVt, mma.tOsVt[None, None, None, stage],
            mma.smem_thr_copy_V,
        )

    @cute.jit
    def epilogue(
        self,
        acc_O: cute.Tensor,
        lse: cute.Tensor,
        mO_cur: cute.Tensor,  # (seqlen_q, head_dim_v) of this (batch, head)
        mLSE_cur: cute.Tensor,  # (seqlen_q,) of this (batch, head)
        sO: cute.Tensor,
        thr_mma_pv: cute.ThrMma,
        tidx: Int32,
        m_block: Int32,
        seqlen_q: Int32,
    ):
        """O (already normalised) -> 16-bit -> sO -> 128-bit predicated stores; LSE per row.

        Staging through smem turns the MMA layout (2 columns per thread) into whole 16-byte row
        chunks per thread, so the gmem stores are 128-bit and coalesced.
        """
        rO = convert_to_16bit(acc_O, self.dtype)
        # sO is sQ: wait until no cp.async can still land in it (a CTA that skipped the key
        # loop never waited for Q) and every warp has issued its last ldmatrix from sQ.
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        smem_copy_O = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32),
            self._tiled_mma(),
        )
        smem_thr_copy_O = smem_copy_O.get_slice(tidx)
        cute.copy(smem_copy_O, smem_thr_copy_O.retile(rO), smem_thr_copy_O.partition_D(sO))

        # LSE: the thread holding column 0 of a row (lane % 4 == 0) writes it, rows < seqlen_q.
        cO_acc = cute.make_identity_tensor((self.tile_m, self.tile_hdimv))
        tOcO_mn = acc_rows_cols(thr_mma_pv.partition_C(cO_acc))
        if tOcO_mn[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = m_block * self.tile_m + tOcO_mn[r, 0][0]
                if row < seqlen_q:
                    mLSE_cur[row] = lse[r]

        cute.arch.barrier()  # sO is complete
        gmem_tiled_copy_O = self._gmem_tiled_copy(self.tile_hdimv, is_async=False)
        gmem_thr_copy_O = gmem_tiled_copy_O.get_slice(tidx)
        tOsO = gmem_thr_copy_O.partition_S(sO)
        tOrO = cute.make_fragment_like(tOsO, self.dtype)
        cute.autovec_copy(tOsO, tOrO)
        gO = cute.local_tile(mO_cur, (self.tile_m, self.tile_hdimv), (m_block, 0))
        tOgO = gmem_thr_copy_O.partition_D(gO)
        cO = cute.make_identity_tensor((self.tile_m, self.tile_hdimv))
        tOcO = gmem_thr_copy_O.partition_S(cO)
        t0OcO = gmem_tiled_copy_O.get_slice(0).partition_S(cO)
        col_pred = None
        if const_expr(self.check_hdim_v):
            col_pred = copy_predicate(tOcO, t0OcO, None, self.head_dim_v)
        row_bound = seqlen_q - m_block * self.tile_m - tOcO[0][0]
        for m in cutlass.range_constexpr(cute.size(tOrO.shape[1])):
            if t0OcO[0, m, 0][0] < row_bound:
                cute.copy(
                    gmem_tiled_copy_O,
                    tOrO[None, m, None],
                    tOgO[None, m, None],
                    pred=col_pred[None, m, None] if const_expr(self.check_hdim_v) else None,
                )
