"""FlashAttention-2 backward kernel for Ampere (sm80): ``FlashBwdSm80``.

Purpose: given Q, K, V, dO and the preprocess outputs (``LSE_log2``, ``dPsum``, see
``bwd_pre.py``), compute ``dK``, ``dV`` and accumulate ``dQ`` in fp32 (design doc 2.1, 3.2):

    P  = exp2(S * scale_log2 - LSE_log2),  S = Q K^T      dV += P^T dO
    dP = dO V^T,  dS = P * (dP - dPsum)                   dK += dS^T Q   (times softmax_scale)
    dQaccum += dS K                                      (scaled by the postprocess)

Constraints: bf16/fp16; Q/K ``(batch, seqlen, nheads, head_dim)``, V/dO with ``head_dim_v``
(varlen: ``(total, nheads, head_dim)`` with ``cu_seqlens_q/k`` and optional ``seqused_q/k``) with
unit last stride, other strides multiples of 8 elements, 16-byte aligned bases; ``head_dim`` and
``head_dim_v`` multiples of 16, each at its own width (S, dK, dQ over head_dim; dP, dV over
head_dim_v; the launcher zero-pads other head dims); ``nheads % nheads_k == 0``. Scratch
buffers as in ``common/bwd_utils.py``. Bottom-right causal; sliding window (``is_local``,
runtime sides, unbounded = a huge value); softcap: ``s = softcap * tanh(x * scale / softcap)``
is recomputed from ``x = Q K^T`` and ``dS_x = dS_s * (1 - tanh^2)`` (the scale stays outside, as
without softcap), with the LSE in the capped units.

Paper: FlashAttention-2 (Dao, 2023) section 3.2 / Algorithm 2 (backward, parallel over key
blocks); design doc sections 2.1-2.9 and 3.2 (FA3's ``mainloop_bwd_sm80``).
"""

from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warp
from cutlass.memory import SmemAllocator, get_smem_capacity_in_bytes

from ..common.block_info import BlockInfo
from ..common.bwd_utils import (
    SEQ_PAD, copy_threads_per_row, fragment_accum, m_block_min_max, red_add_tile, scratch_offset,
    semaphore_signal, semaphore_wait, tiled_copy_16b, tiled_mma_sm80,
)
from .bwd_epilogue import BwdSm80Epilogue
from ..common.gemm_sm80 import gemm_ss
from ..common.mask import AttentionMask
from ..common.seqlen import SeqlenInfo, num_varlen_tiles_upper_bound, varlen_tile_coord
from ..common.softmax import apply_softcap, softcap_scale_log2
from ..common.utils import (
    LOG2_E,
    acc_rows_cols,
    assume_strides_aligned,
    convert_to_16bit,
    copy_predicate,
    select_head,
    select_modes,
    smem_layout_atom_sm80,
    transpose_view,
)

_SMEM_ALIGN = 1024  # each buffer starts on a full period of the 128-byte swizzle (8 rows)
# fp32 accumulator registers per thread (dK + dV + S + dP; dQ lives after S/dP are converted).
# Beyond this a config is refused: the rest of the 255-register cap holds operand slices,
# addresses and the LSE/dPsum values.
_MAX_ACC_REGS_PER_THREAD = 192


@dataclass(frozen=True)
class Gemm:
    """One warp-level GEMM ``acc += A B^T`` with both operands read from smem by ``ldmatrix``.

    ``tCsA``/``tCsB`` may carry a trailing stage mode (``a_staged``/``b_staged``); the register
    fragments are shaped for one stage.
    """

    thr_mma: cute.ThrMma
    tCrA: cute.Tensor
    tCrB: cute.Tensor
    tCsA: cute.Tensor
    tCsB: cute.Tensor
    copy_A: cute.TiledCopy
    copy_B: cute.TiledCopy
    a_staged: bool
    b_staged: bool

    def __call__(self, acc: cute.Tensor, stage: Int32 | None = None) -> None:
        sA = self.tCsA[None, None, None, stage] if self.a_staged else self.tCsA
        sB = self.tCsB[None, None, None, stage] if self.b_staged else self.tCsB
        gemm_ss(self.thr_mma, acc, self.tCrA, self.tCrB, sA, sB, self.copy_A, self.copy_B)


@dataclass(frozen=True)
class StagedLoad:
    """``cp.async`` partition of a ``(rows, head_dim | head_dim_v)`` operand: gmem ``(CPY, R, C, block)``,
    smem ``(CPY, R, C[, stage])``, and the identity partitions used for row predicates."""

    tiled_copy: cute.TiledCopy
    gX: cute.Tensor
    sX: cute.Tensor
    cX: cute.Tensor
    c0X: cute.Tensor
    rows: int

    def __call__(self, block: Int32, seqlen: Int32, stage: Int32 | None = None) -> None:
        """Rows past ``seqlen`` are zero-filled (``cp.async`` src-size 0, no gmem access)."""
        pred = copy_predicate(self.cX, self.c0X, seqlen - block * self.rows, None)
        gX = self.gX[None, None, None, block]
        sX = self.sX if stage is None else self.sX[None, None, None, stage]
        cute.copy(self.tiled_copy, gX, sX, pred=pred)


@dataclass(frozen=True)
class MBlockStep:
    """Everything one m_block step needs besides its index."""

    gemm_S: Gemm
    gemm_dP: Gemm
    gemm_dV: Gemm
    gemm_dK: Gemm
    gemm_dQ: Gemm
    load_Q: StagedLoad
    load_dO: StagedLoad
    r2s_PdS: cute.TiledCopy
    tPsP: cute.Tensor
    tdSsdS: cute.Tensor
    tScS_mn: cute.Tensor
    mask: AttentionMask
    block_info: BlockInfo  # the m_block -> n_block ranges (deterministic turns)
    # Scratch of this (batch, head); varlen: sequences start at row_offset.
    mLSE_log2: cute.Tensor  # (seqlen_q_padded,)
    mdPsum: cute.Tensor  # (seqlen_q_padded,)
    mdQaccum: cute.Tensor  # (seqlen_q_padded * head_dim,)
    mdQ_sem: cute.Tensor  # (num_m_blocks,)
    acc_dK: cute.Tensor
    acc_dV: cute.Tensor
    n_block: Int32
    m_block_max: Int32
    seqlen_q: Int32
    row_offset: Int32  # this sequence's first scratch row (varlen; 0 dense)
    scale_log2: Float32
    softcap_scale: Float32 | None  # None: no softcap compiled in
    deterministic: Int32


class FlashBwdSm80(BwdSm80Epilogue):
    """FA2 backward on sm80: one CTA owns one key block ``(n_block, head, batch)``.

    Grid ``(ceil(seqlen_k / tile_n), nheads, batch)``; ``num_threads / 32`` warps, no warp
    specialisation. K and V of the block are loaded once; the CTA walks the query blocks
    ``m_block_min .. m_block_max - 1`` (causal: from the first one that sees the block), keeping
    ``acc_dK``/``acc_dV`` in fp32 registers. Three tiled MMAs (warps ``atom_m x (W / atom_m)``):
    ``S/dP`` over ``(tile_m, tile_n)``, ``dK/dV`` over ``(tile_n, head_dim)``, ``dQ`` over
    ``(tile_m, head_dim)``. The transposed operands (P^T, dS^T, dO^T, Q^T, K^T) are read from the
    same row-major swizzled smem tiles with ``ldmatrix.trans``.

    Shared memory: sQ ``stages_q`` and sdO ``stages_do`` buffers (1 or 2 each), sK, sV, sP,
    sdS single.

    Copy groups (``cp.async.commit_group`` -> ``wait_group(0)`` + CTA barrier): K, V, Q[m0],
    dO[m0] in the prologue; a double-buffered operand's next block is issued at the top of
    m_block m into the other stage (it lands during the whole block); a single-buffered one
    after its last reader, behind a CTA barrier: dO after the dV GEMM, Q after the dK GEMM.
    Everything is waited at the top of m_block m + 1.

    Timeline of one m_block (stage ``s``)::

        wait, barrier (Q/dO[s] landed; every warp done with the previous block's sP, sdS and
        stage s ^ 1) | issue the double-buffered Q/dO[m+1] -> stage s ^ 1 | LSE_log2, dPsum ->
        regs | S = Q K^T, dP = dO V^T | mask, P = exp2(..), dS = P (dP - dPsum) | P, dS -> sP,
        sdS | barrier | dQ = dS K -> red.add into dQaccum (fragment order) | dV += P^T dO |
        dK += dS^T Q

    ``dv_first`` runs the dV GEMM before dQ (FA2's order). With one dO buffer and two Q
    buffers, dO[m+1] is issued right after the dV GEMM behind a barrier (so it overlaps the dK
    GEMM, and the dQ GEMM with ``dv_first``); with one buffer each, Q[m+1] and dO[m+1] are
    issued together after the dK GEMM behind one barrier.

    The dQ reduce-adds are fire-and-forget, so they drain while the dV/dK GEMMs run. With
    ``deterministic`` the CTA waits for its turn on the m_block's semaphore before adding, so
    additions into dQaccum happen in a fixed n_block order (see ``bwd_utils``): ascending, or
    for causal descending with the block index reversed (FA3/FA4's shortest-first order: in
    ascending order each causal key block starts only after its left neighbour has passed the
    diagonal, a chain that measured 0.55x of FA2 on an H200; see perf/NOTES_sm80_bwd.md).

    Epilogue (``bwd_epilogue.py``): MHA converts ``dK * softmax_scale`` and ``dV`` to 16-bit
    through smem (reusing sK/sV) with 128-bit predicated stores. GQA (``is_gqa``) reduce-adds the
    fp32 accumulators into ``dKaccum``/``dVaccum`` (the postprocess scales and converts);
    deterministic: in ascending query-head order per KV head.

    Split tail (dense, no causal/local mask, not deterministic): with one CTA per SM and equal
    key blocks, a launch of ``N`` key blocks on ``S`` SMs runs ``ceil(N / S)`` waves and its last
    one holds ``N mod S`` CTAs while the other SMs idle (16k tokens at hidden 2048: 4096 or 2048
    blocks on 132 SMs, 31.03 / 15.52 waves run as 32 / 16: 2-3 % measured, H100,
    perf/NOTES_sm80_bwd.md). So the last ``tail_blocks`` key blocks of the grid's linear order
    (n_block fastest) are skipped by this kernel and run by a second launch of the same class
    with ``tail_split`` (the segments kernel): ``tail_segments`` CTAs per skipped block, over
    consecutive ranges of its query blocks, a 1-D grid one wave wide. A segment's partial dK/dV
    go to fp32 scratch (``epilogue_tail``; GQA: into the KV head's sums, as whole blocks do); its
    dQ adds are those of a whole block. Two launches, not one grid with both: whole-block CTAs
    then keep their coordinates in blockIdx (rematerialisable), where decoding them from a flat
    index spilled 2-4 registers into the m_block loop at hdim 64/128 (SASS, sm_90a).
    """

    def __init__(
        self,
        dtype: type[cutlass.Numeric],
        head_dim: int,
        head_dim_v: int,
        tile_m: int,
        tile_n: int,
        num_threads: int,
        atom_m_sdp: int,
        atom_n_dkv: int,
        atom_m_dq: int,
        is_causal: bool,
        is_gqa: bool,
        is_local: bool = False,
        has_softcap: bool = False,
        stages_q: int = 2,
        stages_do: int = 2,
        dv_first: bool = False,
        dq_red_vec: int = 1,
        stmatrix_pds: bool = False,
        tail_split: bool = False,
        arch: str = "sm_80",
    ):
        reason = self.can_implement(
            dtype, head_dim, tile_m, tile_n, num_threads, atom_m_sdp, atom_n_dkv, atom_m_dq,
            stages_q, stages_do, arch, dq_red_vec, stmatrix_pds, head_dim_v,
        )
        if is_causal and is_local:
            reason = "is_causal and is_local are exclusive (causal with a window is local, right = 0)"
        if tail_split and (is_causal or is_local):
            reason = "tail_split needs key blocks of equal length (no causal or local mask)"
        if reason is not None:
            raise ValueError(f"FlashBwdSm80 cannot implement this config: {reason}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.num_threads = num_threads
        self.num_warps = num_threads // 32
        self.atom_m_sdp = atom_m_sdp
        self.atom_n_dkv = atom_n_dkv
        self.atom_m_dq = atom_m_dq
        self.is_causal = is_causal
        self.is_gqa = is_gqa
        self.is_local = is_local
        self.has_softcap = has_softcap
        self.stages_q = stages_q
        self.stages_do = stages_do
        self.dv_first = dv_first
        # fp32 values per dQ reduce-add (``red.global.add.v4.f32`` on sm_90: a quarter of the
        # load-store queue entries); it sets the dQaccum layout the dQ postprocess must read.
        self.dq_red_vec = dq_red_vec
        # P and dS to smem with stmatrix (sm_90): a quarter of the shared-store instructions of
        # 32-bit stores, in a kernel whose warps wait on the MIO queue (ldmatrix, shared stores
        # and exp2 share it).
        self.stmatrix_pds = stmatrix_pds
        # The last key blocks of a dense launch split into segments over their query blocks, so the
        # launch's last wave is short (class docstring).
        self.tail_split = tail_split

    @staticmethod
    def can_implement(
        dtype, head_dim, tile_m, tile_n, num_threads, atom_m_sdp, atom_n_dkv, atom_m_dq,
        stages_q=2, stages_do=2, arch="sm_80", dq_red_vec=1, stmatrix_pds=False, head_dim_v=None,
    ) -> str | None:
        """None if this static config compiles into a correct kernel for ``arch`` (its shared
        memory capacity: sm_80 164 KiB, sm_90 227 KiB), else the reason why not. ``head_dim_v``
        None: ``head_dim``."""
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        if dtype not in (cutlass.BFloat16, cutlass.Float16):
            return f"dtype must be BFloat16 or Float16, got {dtype}"
        for name, dim in (("head_dim", head_dim), ("head_dim_v", head_dim_v)):
            if dim % 16 != 0 or not 16 <= dim <= 256:
                return f"{name} must be a multiple of 16 in [16, 256], got {dim}"
        if num_threads <= 0 or num_threads % 32 != 0:
            return f"num_threads must be a positive multiple of 32, got {num_threads}"
        if dq_red_vec not in (1, 4) or (dq_red_vec == 4 and not arch.startswith("sm_90")):
            return f"dq_red_vec must be 1, or 4 on sm_90 (red.global.add.v4.f32), got {dq_red_vec} on {arch}"
        if stmatrix_pds and not arch.startswith("sm_90"):
            return f"stmatrix_pds needs sm_90 (stmatrix), got {arch}"
        if stages_q not in (1, 2) or stages_do not in (1, 2):
            return f"stages_q/stages_do (Q/dO buffers) must be 1 or 2, got {stages_q}/{stages_do}"
        for name, tile in (("tile_m", tile_m), ("tile_n", tile_n)):
            if tile <= 0 or SEQ_PAD % tile != 0 or tile % 16 != 0:
                return f"{name} must be a multiple of 16 dividing {SEQ_PAD}, got {tile}"
        num_warps = num_threads // 32
        for name, atom, (m, n) in (
            ("atom_m_sdp", atom_m_sdp, (tile_m, tile_n)),
            ("atom_n_dkv", atom_n_dkv, (tile_n, head_dim)),
            ("atom_n_dkv", atom_n_dkv, (tile_n, head_dim_v)),
            ("atom_m_dq", atom_m_dq, (tile_m, head_dim)),
        ):
            if atom <= 0 or num_warps % atom != 0:
                return f"{name} ({atom}) must divide the number of warps ({num_warps})"
            if m % (16 * atom) != 0 or n % (16 * (num_warps // atom)) != 0:
                return f"{name} ({atom}): the {m} x {n} tile is not a whole number of warp tiles"
        for name, rows, cols in (
            ("Q", tile_m, head_dim), ("K", tile_n, head_dim), ("dO", tile_m, head_dim_v), ("V", tile_n, head_dim_v)
        ):
            threads_per_row = copy_threads_per_row(cols, 128 // dtype.width, num_threads)
            if num_threads % threads_per_row or rows % (num_threads // threads_per_row):
                return f"the {name} tile ({rows} x {cols}) is not covered by whole copy passes"
        acc_regs = (tile_n * (head_dim + head_dim_v) + 2 * tile_m * tile_n) // num_threads
        if acc_regs > _MAX_ACC_REGS_PER_THREAD:
            return f"accumulators need {acc_regs} fp32 registers per thread (> {_MAX_ACC_REGS_PER_THREAD})"
        elem = dtype.width // 8
        smem = (
            (stages_q * head_dim + stages_do * head_dim_v) * tile_m * elem  # sQ, sdO
            + tile_n * (head_dim + head_dim_v) * elem  # sK, sV
            + 2 * tile_m * tile_n * elem  # sP, sdS
        )
        base_arch = arch.rstrip("abf")  # sm_90a -> sm_90: the capacity table knows base archs
        capacity = get_smem_capacity_in_bytes(base_arch)
        if smem > capacity:
            return f"needs {smem} bytes of shared memory, {base_arch} allows {capacity}"
        return None

    # ------------------------------------------------------------------ static building blocks

    def _smem_layouts(self):
        def tile(rows: int, cols: int, stages: int | None = None):
            atom = smem_layout_atom_sm80(self.dtype, cols)
            if stages is None:
                return cute.tile_to_shape(atom, (rows, cols), (0, 1))
            return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))

        d, dv = self.head_dim, self.head_dim_v
        return {
            "sQ": tile(self.tile_m, d, self.stages_q),
            "sdO": tile(self.tile_m, dv, self.stages_do),
            "sK": tile(self.tile_n, d),
            "sV": tile(self.tile_n, dv),
            "sP": tile(self.tile_m, self.tile_n),
            "sdS": tile(self.tile_m, self.tile_n),
        }

    def _shared_storage(self, layouts):
        def buffer(layout):
            return cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layout)], _SMEM_ALIGN]

        @cute.struct
        class SharedStorage:
            sQ: buffer(layouts["sQ"])
            sdO: buffer(layouts["sdO"])
            sK: buffer(layouts["sK"])
            sV: buffer(layouts["sV"])
            sP: buffer(layouts["sP"])
            sdS: buffer(layouts["sdS"])
            # segments kernel: the arrival count, read by every thread (epilogue_tail)
            sArrived: cute.struct.MemRange[Int32, 1 if self.tail_split else 0]

        return SharedStorage

    def _tiled_mma(self, atom_m: int) -> cute.TiledMma:
        return tiled_mma_sm80(self.dtype, self.num_warps, atom_m)

    # ------------------------------------------------------------------ host entry point

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, nheads, head_dim) | varlen (total_q, nheads, head_dim)
        mK: cute.Tensor,  # (batch, seqlen_k, nheads_k, head_dim) | varlen (total_k, ...)
        mV: cute.Tensor,  # (batch, seqlen_k, nheads_k, head_dim_v) | varlen (total_k, ...)
        mdO: cute.Tensor,  # like mQ with head_dim_v
        mLSE_log2: cute.Tensor,  # (batch | 1, nheads, seqlen_q_padded) fp32
        mdPsum: cute.Tensor,  # (batch | 1, nheads, seqlen_q_padded) fp32
        mdQaccum: cute.Tensor,  # (batch | 1, nheads, seqlen_q_padded * head_dim) fp32, zeroed
        mdK: cute.Tensor,  # MHA: like mK (mdV: like mV), 16-bit output;
        mdV: cute.Tensor,  # GQA: (batch | 1, nheads_k, seqlen_k_padded * head_dim[_v]) fp32, zeroed
        mdQ_sem: cute.Tensor,  # (batch | 1, nheads, seqlen_q_padded / tile_m) int32, zeroed
        mdKV_sem: cute.Tensor,  # (batch | 1, nheads_k, seqlen_k_padded / tile_n) int32, zeroed
        softmax_scale: Float32,
        window_left: Int32,  # is_local only (else ignored); unbounded: a huge value
        window_right: Int32,  # is_local only (else ignored); unbounded: a huge value
        softcap: Float32,  # has_softcap only (else ignored)
        deterministic: Int32,  # 0 or 1; the semaphores are only touched when 1
        tail_blocks: Int32,  # dense: the grid's last key blocks, left to the segments kernel (or 0)
        tail_segments: Int32,  # segments kernel: CTAs per split key block, >= 1 (else ignored)
        mCuSeqlensQ: cute.Tensor | None,  # (batch + 1,) int32; given iff mCuSeqlensK is
        mCuSeqlensK: cute.Tensor | None,  # (batch + 1,) int32
        mSeqUsedQ: cute.Tensor | None,  # (batch,) int32
        mSeqUsedK: cute.Tensor | None,  # (batch,) int32
        # segments kernel, MHA: (tail_blocks, 2, tile_n * max(head_dim, head_dim_v)) fp32 partial
        # dK/dV sums, zeroed,
        # with mdKV_sem (1, 1, tail_blocks) int32 zeroed arrival counts; else None
        mdKV_tail: cute.Tensor | None,
        stream: cuda.CUstream,
    ):
        if const_expr(
            not (mQ.element_type == mK.element_type == mV.element_type == mdO.element_type)
            or mQ.element_type != self.dtype
        ):
            raise TypeError(f"Q/K/V/dO must all be {self.dtype}")
        acc_dtype = Float32 if const_expr(self.is_gqa) else self.dtype
        if const_expr(mdK.element_type != acc_dtype or mdV.element_type != acc_dtype):
            raise TypeError(f"dK/dV must be {acc_dtype}")
        if const_expr((mCuSeqlensQ is None) != (mCuSeqlensK is None)):
            raise TypeError("cu_seqlens_q and cu_seqlens_k must be given together")
        varlen = const_expr(mCuSeqlensQ is not None)
        if const_expr(self.tail_split and (varlen or (mdKV_tail is None) != self.is_gqa)):
            raise TypeError("tail_split needs dense inputs, and mdKV_tail exactly when not GQA")
        modes = [0, 2, 1] if varlen else [1, 3, 2, 0]  # -> (s, d, h[, b])
        mQ, mK, mV, mdO = [select_modes(assume_strides_aligned(t), modes) for t in (mQ, mK, mV, mdO)]
        if const_expr(not self.is_gqa):
            mdK, mdV = [select_modes(assume_strides_aligned(t), modes) for t in (mdK, mdV)]
        layouts = self._smem_layouts()
        SharedStorage = self._shared_storage(layouts)
        qhead_per_kvhead = mQ.shape[2] // mK.shape[2]
        if const_expr(self.has_softcap):
            softcap_scale, scale_log2 = softcap_scale_log2(softmax_scale, softcap)
        else:
            softcap_scale, scale_log2 = Float32(1.0), softmax_scale * LOG2_E
        if const_expr(varlen):
            num_batch = mCuSeqlensK.shape[0] - 1
            grid = [num_varlen_tiles_upper_bound(mK.shape[0], num_batch, self.tile_n), mQ.shape[2], 1]
        elif const_expr(self.tail_split):
            num_batch = mQ.shape[3]
            grid = [tail_blocks * tail_segments, 1, 1]
        else:
            num_batch = mQ.shape[3]
            grid = [(mK.shape[0] + (self.tile_n - 1)) // self.tile_n, mQ.shape[2], num_batch]
        self.kernel(
            mQ, mK, mV, mdO, mLSE_log2, mdPsum, mdQaccum, mdK, mdV, mdQ_sem, mdKV_sem,
            softmax_scale, scale_log2, softcap_scale, window_left, window_right,
            qhead_per_kvhead, deterministic, tail_blocks, tail_segments, num_batch, mCuSeqlensQ,
            mCuSeqlensK, mSeqUsedQ, mSeqUsedK, mdKV_tail, SharedStorage,
        ).launch(
            grid=grid,
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
        mdO: cute.Tensor,  # (seqlen_q, head_dim_v, nheads[, batch])
        mLSE_log2: cute.Tensor,  # (batch | 1, nheads, seqlen_q_padded)
        mdPsum: cute.Tensor,  # (batch | 1, nheads, seqlen_q_padded)
        mdQaccum: cute.Tensor,  # (batch | 1, nheads, seqlen_q_padded * head_dim)
        mdK: cute.Tensor,  # MHA (seqlen_k, head_dim, nheads_k[, batch]); GQA flat fp32
        mdV: cute.Tensor,
        mdQ_sem: cute.Tensor,  # (batch | 1, nheads, num_m_blocks_padded)
        mdKV_sem: cute.Tensor,  # (batch | 1, nheads_k, num_n_blocks_padded)
        softmax_scale: Float32,
        scale_log2: Float32,
        softcap_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        qhead_per_kvhead: Int32,
        deterministic: Int32,
        tail_blocks: Int32,
        tail_segments: Int32,
        num_batch: Int32,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        mSeqUsedQ: cute.Tensor | None,
        mSeqUsedK: cute.Tensor | None,
        mdKV_tail: cute.Tensor | None,
        SharedStorage: cutlass.Constexpr,
    ):
        """This CTA's (sequence, key block[, segment]): a varlen CTA past the last tile, and a dense
        one among the last ``tail_blocks`` (the segments kernel's), exit."""
        block_x, head_idx, block_z = cute.arch.block_idx()
        args = (
            mQ, mK, mV, mdO, mLSE_log2, mdPsum, mdQaccum, mdK, mdV, mdQ_sem, mdKV_sem,
            softmax_scale, scale_log2, softcap_scale, window_left, window_right, qhead_per_kvhead,
            deterministic, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, mdKV_tail,
            tail_segments, SharedStorage,
        )
        if const_expr(mCuSeqlensK is not None):
            batch_idx, n_block = varlen_tile_coord(
                block_x, num_batch, self.tile_n, mCuSeqlensK, mSeqUsedK
            )
            if batch_idx >= 0:
                self.key_block(*args, n_block, head_idx, batch_idx, Int32(-1), Int32(0))
        elif const_expr(self.tail_split):
            # Segment block_x % tail_segments of the whole kernel's skipped block block_x //
            # tail_segments (in its linear order: n_block fastest, then head, then batch).
            num_n_blocks = (mK.shape[0] + (self.tile_n - 1)) // self.tile_n
            tail_index = block_x // tail_segments
            block = num_n_blocks * mQ.shape[2] * num_batch - tail_blocks + tail_index
            head_batch = block // num_n_blocks
            self.key_block(
                *args, block % num_n_blocks, head_batch % mQ.shape[2], head_batch // mQ.shape[2],
                block_x % tail_segments, tail_index,
            )
        else:
            grid_x, grid_y, grid_z = cute.arch.grid_dim()
            if block_x + grid_x * (head_idx + grid_y * block_z) < grid_x * grid_y * grid_z - tail_blocks:
                self.key_block(*args, block_x, head_idx, block_z, Int32(-1), Int32(0))

    @cute.jit
    def key_block(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSE_log2: cute.Tensor,
        mdPsum: cute.Tensor,
        mdQaccum: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mdQ_sem: cute.Tensor,
        mdKV_sem: cute.Tensor,
        softmax_scale: Float32,
        scale_log2: Float32,
        softcap_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        qhead_per_kvhead: Int32,
        deterministic: Int32,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        mSeqUsedQ: cute.Tensor | None,
        mSeqUsedK: cute.Tensor | None,
        mdKV_tail: cute.Tensor | None,
        tail_segments: Int32,
        SharedStorage: cutlass.Constexpr,
        n_block: Int32,
        head_idx: Int32,
        batch_idx: Int32,
        segment: Int32,  # segments kernel: this CTA's segment of its key block (else unused)
        tail_index: Int32,  # segments kernel: the key block's index among the split ones
    ):
        """Prologue (partitions, K/V and first Q/dO loads), loop over m_blocks, epilogue.

        Arguments as ``kernel``'s (one method: the prologue's partitions feed every later step).
        """
        tidx, _, _ = cute.arch.thread_idx()
        varlen = const_expr(mCuSeqlensQ is not None)
        seqlen = SeqlenInfo.create(
            batch_idx, mQ.shape[0], mK.shape[0], mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK
        )
        seqlen_q, seqlen_k = seqlen.seqlen_q, seqlen.seqlen_k
        # Scratch: (batch, head) rows in the dense layout, padded per-sequence offsets in varlen.
        scratch_b = Int32(0) if const_expr(varlen) else batch_idx
        row_offset_q = scratch_offset(seqlen.offset_q, batch_idx) if const_expr(varlen) else Int32(0)
        head_idx_kv = head_idx // qhead_per_kvhead
        num_n_blocks = (seqlen_k + (self.tile_n - 1)) // self.tile_n
        ordered_desc = const_expr(self.is_causal or self.is_local)
        if const_expr(ordered_desc):
            if deterministic != 0:
                # Shortest-first: the last key block (fewest query blocks) takes the lowest block
                # index and the first turn on every m_block it visits (see compute_one_m_block).
                n_block = num_n_blocks - 1 - n_block

        window_l = window_left if const_expr(self.is_local) else None
        window_r = window_right if const_expr(self.is_local) else None
        m_block_min, m_block_max = m_block_min_max(
            self.tile_m, self.tile_n, n_block, seqlen_q, seqlen_k, self.is_causal, self.is_local,
            window_left, window_right,
        )
        if const_expr(self.tail_split):  # consecutive, near-equal ranges of the query blocks
            num_m_blocks = m_block_max - m_block_min
            m_block_max = m_block_min + (segment + 1) * num_m_blocks // tail_segments
            m_block_min = m_block_min + segment * num_m_blocks // tail_segments

        layouts = self._smem_layouts()
        storage = SmemAllocator().allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(layouts["sQ"])
        sdO = storage.sdO.get_tensor(layouts["sdO"])
        sK = storage.sK.get_tensor(layouts["sK"])
        sV = storage.sV.get_tensor(layouts["sV"])
        sP = storage.sP.get_tensor(layouts["sP"])
        sdS = storage.sdS.get_tensor(layouts["sdS"])

        d, dv = self.head_dim, self.head_dim_v
        mQ_cur = seqlen.q_view(select_head(mQ, head_idx, 2), batch_idx)
        mdO_cur = seqlen.q_view(select_head(mdO, head_idx, 2), batch_idx)
        mK_cur = seqlen.k_view(select_head(mK, head_idx_kv, 2), batch_idx)
        mV_cur = seqlen.k_view(select_head(mV, head_idx_kv, 2), batch_idx)
        gQ = cute.local_tile(mQ_cur, (self.tile_m, d), (None, 0))
        gdO = cute.local_tile(mdO_cur, (self.tile_m, dv), (None, 0))
        gK = cute.local_tile(mK_cur, (self.tile_n, d), (None, 0))
        gV = cute.local_tile(mV_cur, (self.tile_n, dv), (None, 0))
        load_Q = self._staged_load(gQ, sQ, self.tile_m, d, tidx)
        load_dO = self._staged_load(gdO, sdO, self.tile_m, dv, tidx)
        load_K = self._staged_load(gK, sK, self.tile_n, d, tidx)
        load_V = self._staged_load(gV, sV, self.tile_n, dv, tidx)

        tiled_mma_sdp = self._tiled_mma(self.atom_m_sdp)
        tiled_mma_dkv = self._tiled_mma(self.atom_n_dkv)
        tiled_mma_dq = self._tiled_mma(self.atom_m_dq)
        thr_mma_sdp = tiled_mma_sdp.get_slice(tidx)
        thr_mma_dkv = tiled_mma_dkv.get_slice(tidx)
        acc_dK = cute.make_rmem_tensor(thr_mma_dkv.partition_shape_C((self.tile_n, d)), Float32)
        acc_dV = cute.make_rmem_tensor(thr_mma_dkv.partition_shape_C((self.tile_n, dv)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)

        if const_expr(self.stmatrix_pds):
            store_atom = cute.make_copy_atom(
                warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype
            )
        else:
            store_atom = cute.make_copy_atom(
                cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32
            )
        r2s_PdS = cute.make_tiled_copy_C(store_atom, tiled_mma_sdp).get_slice(tidx)
        cS = cute.make_identity_tensor((self.tile_m, self.tile_n))
        step = MBlockStep(
            gemm_S=self._gemm(tiled_mma_sdp, sQ, sK, tidx, a_staged=True),
            gemm_dP=self._gemm(tiled_mma_sdp, sdO, sV, tidx, a_staged=True),
            gemm_dV=self._gemm(
                tiled_mma_dkv, transpose_view(sP), transpose_view(sdO), tidx,
                a_trans=True, b_trans=True, b_staged=True,
            ),
            gemm_dK=self._gemm(
                tiled_mma_dkv, transpose_view(sdS), transpose_view(sQ), tidx,
                a_trans=True, b_trans=True, b_staged=True,
            ),
            gemm_dQ=self._gemm(tiled_mma_dq, sdS, transpose_view(sK), tidx, b_trans=True),
            load_Q=load_Q,
            load_dO=load_dO,
            r2s_PdS=r2s_PdS,
            tPsP=r2s_PdS.partition_D(sP),
            tdSsdS=r2s_PdS.partition_D(sdS),
            tScS_mn=acc_rows_cols(thr_mma_sdp.partition_C(cS)),
            mask=AttentionMask(self.tile_m, self.tile_n, seqlen_q, seqlen_k, window_l, window_r),
            block_info=BlockInfo(
                self.tile_m, self.tile_n, self.is_causal, self.is_local, window_l, window_r
            ),
            mLSE_log2=mLSE_log2[scratch_b, head_idx, None],
            mdPsum=mdPsum[scratch_b, head_idx, None],
            mdQaccum=mdQaccum[scratch_b, head_idx, None],
            mdQ_sem=mdQ_sem[scratch_b, head_idx, None],
            acc_dK=acc_dK,
            acc_dV=acc_dV,
            n_block=n_block,
            m_block_max=m_block_max,
            seqlen_q=seqlen_q,
            row_offset=row_offset_q,
            scale_log2=scale_log2,
            softcap_scale=softcap_scale if const_expr(self.has_softcap) else None,
            deterministic=deterministic,
        )

        if m_block_min < m_block_max:
            load_K(n_block, seqlen_k)
            load_V(n_block, seqlen_k)
            load_Q(m_block_min, seqlen_q, Int32(0))
            load_dO(m_block_min, seqlen_q, Int32(0))
        cute.arch.cp_async_commit_group()
        for m_block in cutlass.range(m_block_min, m_block_max, unroll=1):
            stage = (m_block - m_block_min) % 2
            stage_q = stage if const_expr(self.stages_q == 2) else Int32(0)
            stage_do = stage if const_expr(self.stages_do == 2) else Int32(0)
            self.compute_one_m_block(m_block, stage_q, stage_do, step)

        row_offset_k = scratch_offset(seqlen.offset_k, batch_idx) if const_expr(varlen) else Int32(0)
        if const_expr(self.is_gqa):
            self.epilogue_gqa(
                acc_dK, acc_dV, mdK[scratch_b, head_idx_kv, None],
                mdV[scratch_b, head_idx_kv, None], mdKV_sem[scratch_b, head_idx_kv, None],
                thr_mma_dkv, tidx,
                (row_offset_k // self.tile_n if const_expr(varlen) else Int32(0)) + n_block,
                head_idx, head_idx_kv,
                qhead_per_kvhead, deterministic,
            )
        else:
            mdK_cur = seqlen.k_view(select_head(mdK, head_idx_kv, 2), batch_idx)
            mdV_cur = seqlen.k_view(select_head(mdV, head_idx_kv, 2), batch_idx)

            if const_expr(self.tail_split):
                self.epilogue_tail(
                    acc_dK, acc_dV, mdKV_tail[tail_index, None, None], mdKV_sem[0, 0, None],
                    storage.sArrived.get_tensor(cute.make_layout(1)), tail_index, tail_segments,
                    softmax_scale, mdK_cur, mdV_cur, sK, sV, tiled_mma_dkv, tidx, n_block,
                    seqlen.seqlen_k,
                )
            else:
                self.epilogue_mha(
                    acc_dK, acc_dV, softmax_scale, mdK_cur, mdV_cur, sK, sV, tiled_mma_dkv, tidx,
                    n_block, seqlen.seqlen_k,
                )

    def _staged_load(self, gX, sX, rows: int, cols: int, tidx) -> StagedLoad:
        tiled_copy = tiled_copy_16b(self.dtype, self.num_threads, cols, is_async=True)
        thr_copy = tiled_copy.get_slice(tidx)
        cX = cute.make_identity_tensor((rows, cols))
        return StagedLoad(
            tiled_copy=tiled_copy,
            gX=thr_copy.partition_S(gX),
            sX=thr_copy.partition_D(sX),
            cX=thr_copy.partition_S(cX),
            c0X=tiled_copy.get_slice(0).partition_S(cX),
            rows=rows,
        )

    def _gemm(self, tiled_mma, sA, sB, tidx, a_trans=False, b_trans=False, a_staged=False,
              b_staged=False) -> Gemm:
        """Fragments and ldmatrix partitions of ``acc += A B^T``; ``*_trans``: the smem view is
        the transpose of a row-major tile, so it is read with ``ldmatrix.trans``."""
        thr_mma = tiled_mma.get_slice(tidx)

        def ldsm(transpose: bool):
            return cute.make_copy_atom(
                warp.LdMatrix8x8x16bOp(transpose=transpose, num_matrices=4), self.dtype
            )

        copy_A = cute.make_tiled_copy_A(ldsm(a_trans), tiled_mma).get_slice(tidx)
        copy_B = cute.make_tiled_copy_B(ldsm(b_trans), tiled_mma).get_slice(tidx)
        sA0 = sA[None, None, 0] if a_staged else sA
        sB0 = sB[None, None, 0] if b_staged else sB
        return Gemm(
            thr_mma=thr_mma,
            tCrA=thr_mma.make_fragment_A(thr_mma.partition_A(sA0)),
            tCrB=thr_mma.make_fragment_B(thr_mma.partition_B(sB0)),
            tCsA=copy_A.partition_S(sA),
            tCsB=copy_B.partition_S(sB),
            copy_A=copy_A,
            copy_B=copy_B,
            a_staged=a_staged,
            b_staged=b_staged,
        )

    @cute.jit
    def compute_one_m_block(self, m_block: Int32, stage_q: Int32, stage_do: Int32,
                            step: MBlockStep):
        """One query block: recompute P, form dS, accumulate dV, dK and (atomically) dQ."""
        q_double = const_expr(self.stages_q == 2)
        do_double = const_expr(self.stages_do == 2)
        # Q/dO of this block (and K/V on the first block) have landed for every thread; every
        # warp is done with the previous block, so the other stages, sP and sdS may be written.
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        if const_expr(q_double or do_double):
            if m_block + 1 < step.m_block_max:
                if const_expr(q_double):
                    step.load_Q(m_block + 1, step.seqlen_q, 1 - stage_q)
                if const_expr(do_double):
                    step.load_dO(m_block + 1, step.seqlen_q, 1 - stage_do)
            cute.arch.cp_async_commit_group()

        num_rows = cute.size(step.tScS_mn.shape[0])
        lse = cute.make_rmem_tensor((num_rows,), Float32)
        dpsum = cute.make_rmem_tensor((num_rows,), Float32)
        for r in cutlass.range_constexpr(num_rows):
            row = step.row_offset + m_block * self.tile_m + step.tScS_mn[r, 0][0]
            lse[r] = step.mLSE_log2[row]
            dpsum[r] = step.mdPsum[row]

        thr_mma_sdp = step.gemm_S.thr_mma
        acc_S = cute.make_rmem_tensor(
            thr_mma_sdp.partition_shape_C((self.tile_m, self.tile_n)), Float32
        )
        acc_dP = cute.make_rmem_tensor(
            thr_mma_sdp.partition_shape_C((self.tile_m, self.tile_n)), Float32
        )
        acc_S.fill(0.0)
        acc_dP.fill(0.0)
        step.gemm_S(acc_S, stage_q)
        step.gemm_dP(acc_dP, stage_do)
        if const_expr(step.softcap_scale is not None):
            apply_softcap(acc_S, step.softcap_scale)  # S = tanh(x * scale / softcap)
        self._mask_block(acc_S, m_block, step)
        acc_S_mn = acc_rows_cols(acc_S)
        acc_dP_mn = acc_rows_cols(acc_dP)
        for r in cutlass.range_constexpr(num_rows):
            for c in cutlass.range_constexpr(cute.size(acc_S_mn.shape[1])):
                s = acc_S_mn[r, c]
                p = cute.math.exp2(s * step.scale_log2 - lse[r], fastmath=True)
                acc_S_mn[r, c] = p
                ds = p * (acc_dP_mn[r, c] - dpsum[r])
                if const_expr(step.softcap_scale is not None):
                    # d tanh = 1 - tanh^2; a masked score is -inf (P = 0): clamp it to -1 so the
                    # factor is 0, not -inf (0 * -inf = NaN).
                    t = cute.arch.fmax(s, Float32(-1.0))
                    ds = ds * (Float32(1.0) - t * t)
                acc_dP_mn[r, c] = ds
        rP = convert_to_16bit(acc_S, self.dtype)
        rdS = convert_to_16bit(acc_dP, self.dtype)
        cute.copy(step.r2s_PdS, step.r2s_PdS.retile(rP), step.tPsP)
        cute.copy(step.r2s_PdS, step.r2s_PdS.retile(rdS), step.tdSsdS)
        cute.arch.barrier()  # sP, sdS complete

        if const_expr(not q_double and not do_double):
            # One buffer each: refill both after the last GEMM behind one barrier (on an H200
            # 1-5 % faster than refilling dO right after the dV GEMM behind a second barrier).
            self._dq_step(m_block, step)
            step.gemm_dV(step.acc_dV, stage_do)
            step.gemm_dK(step.acc_dK, stage_q)
            cute.arch.barrier()
            if m_block + 1 < step.m_block_max:
                step.load_Q(m_block + 1, step.seqlen_q, Int32(0))
                step.load_dO(m_block + 1, step.seqlen_q, Int32(0))
            cute.arch.cp_async_commit_group()
        else:
            if const_expr(self.dv_first):
                self._dv_step(m_block, stage_do, step)
            self._dq_step(m_block, step)
            if const_expr(not self.dv_first):
                self._dv_step(m_block, stage_do, step)
            step.gemm_dK(step.acc_dK, stage_q)
            if const_expr(not q_double):
                # One Q buffer: the next block's Q waits until every warp has read this one.
                cute.arch.barrier()
                if m_block + 1 < step.m_block_max:
                    step.load_Q(m_block + 1, step.seqlen_q, Int32(0))
                cute.arch.cp_async_commit_group()

    @cute.jit
    def _dv_step(self, m_block: Int32, stage_do: Int32, step: MBlockStep):
        """dV += P^T dO; with one dO buffer, then refill it (dV is dO's last reader)."""
        step.gemm_dV(step.acc_dV, stage_do)
        if const_expr(self.stages_do == 1):
            cute.arch.barrier()
            if m_block + 1 < step.m_block_max:
                step.load_dO(m_block + 1, step.seqlen_q, Int32(0))
            cute.arch.cp_async_commit_group()

    @cute.jit
    def _dq_step(self, m_block: Int32, step: MBlockStep):
        """dQ = dS K for this m_block, reduce-added into dQaccum (in the deterministic mode in
        this key block's turn)."""
        thr_mma_dq = step.gemm_dQ.thr_mma
        acc_dQ = cute.make_rmem_tensor(
            thr_mma_dq.partition_shape_C((self.tile_m, self.head_dim)), Float32
        )
        acc_dQ.fill(0.0)
        step.gemm_dQ(acc_dQ)
        tidx = cute.arch.thread_idx()[0]
        q_block = step.row_offset // self.tile_m + m_block  # m_block's tile in the scratch
        gdQaccum = fragment_accum(
            step.mdQaccum, self.tile_m * self.head_dim, self.num_threads, q_block, tidx,
            self.dq_red_vec,
        )
        if step.deterministic != 0:
            turn = step.n_block
            if const_expr(self.is_causal or self.is_local):
                # The key blocks visiting m_block are a range ending at n_block_max - 1; they
                # add in descending order, each waiting only for a lower block index.
                _, n_block_max = step.block_info.n_block_min_max(
                    step.seqlen_q, step.mask.seqlen_k, m_block
                )
                turn = n_block_max - 1 - step.n_block
            semaphore_wait(step.mdQ_sem, q_block, turn, tidx)
        red_add_tile(acc_dQ, gdQaccum, self.dq_red_vec)
        if step.deterministic != 0:
            semaphore_signal(step.mdQ_sem, q_block, tidx)

    @cute.jit
    def _mask_block(self, acc_S: cute.Tensor, m_block: Int32, step: MBlockStep):
        """Mask S where needed: keys past seqlen_k (only the last key block), and with causal /
        local the blocks that cross the right (diagonal) or left window edge. A uniform branch:
        the mask code is traced once, most blocks skip it."""
        mask = step.mask
        block_start = step.n_block * self.tile_n
        block_end = block_start + self.tile_n
        need_mask = block_end > mask.seqlen_k
        offset = mask.seqlen_k - step.seqlen_q
        if const_expr(self.is_causal or self.is_local):
            # The tile's first row sees keys up to first_row_limit: every later row sees more.
            first_row_limit = m_block * self.tile_m + offset
            if const_expr(self.is_local):
                first_row_limit = first_row_limit + mask.window_right
            need_mask = need_mask | (first_row_limit < block_end - 1)
        if const_expr(self.is_local):
            # The tile's last row sees keys from last_row_first: every earlier row sees more.
            last_row_first = (m_block + 1) * self.tile_m - 1 + offset - mask.window_left
            need_mask = need_mask | (last_row_first > block_start)
        if need_mask:
            mask.apply(
                acc_S, step.gemm_S.thr_mma, m_block, step.n_block, mask_seqlen=True,
                mask_causal=self.is_causal, mask_local=self.is_local,
            )
