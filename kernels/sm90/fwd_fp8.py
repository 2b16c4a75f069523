"""FP8 (e4m3) forward of the Hopper kernel: ``FlashFwdSm90Fp8``.

Purpose: the FA3 forward (``fwd.py``) on ``float8_e4m3fn`` Q, K, V with fp32 accumulation, bf16 O
and the fp32 LSE, at e4m3 WGMMA's rate (twice bf16's). Per (batch, kv head) descales
(``mDescale[0|1|2, b, h_k]``, FA3's ``q_descale``/``k_descale``/``v_descale``): q's and k's fold into
the tile's softmax scale (the scores' true scale, so the LSE needs nothing more), v's into the
final row scale of O. Per-block descales (``block_scales``, ``mDescale[0, b, h, m_block]`` and
``mDescale[1|2, b, h_k, n_block // kv_scale_ratio]``, the FA3 paper's block quantization, blocks = this kernel's
tiles, or for k/v ``scale_tile_n`` keys, a multiple of tile_n):
q's in the tile's scale, each key block's k descale in that block's softmax scale (the running max
kept in scaled units, ``OnlineSoftmax(block_scales=True)``), v's as a bias log2(vd[n]) on that block's
scores: P carries vd, so O sums true values, the max is taken over the biased scores (P stays in e4m3's
range) and the row sum takes P / vd (``OnlineSoftmax.update``'s ``block_value_log2``). Note: e4m3
WGMMA adds with ~14 mantissa bits, so S is less exact than bf16's.

What differs from the 16-bit kernel (``../shared/design/fp8.md``):
- e4m3 WGMMA takes both smem operands K-major only (no transpose bit below 16 bits), so P.V needs
  V^T with the keys contiguous. V still arrives by TMA as stored (keys x head dim); three warps
  of the producer warpgroup, idle in the 16-bit kernel, transpose each V stage into a K-major sVt
  stage (4 x 4-byte shared loads, 8 byte permutes, 4 x 4-byte stores per 16 bytes) while the MMA
  warpgroups work on earlier blocks.
- P's key order: the e4m3 A fragment (k32) holds per thread keys ``{4t..4t+3}`` of each 16, the S
  accumulator ``{2t, 2t+1, 2t+8, 2t+9}``. Instead of moving P across lanes, the transpose writes
  V^T in that order: column ``16h + 4t + q`` of sVt holds key ``16h + 8 (q >> 1) + 2t + (q & 1)``,
  so P goes from S's registers to the A fragment with a conversion only (``acc_to_frag_a_fp8``).
- P is ``2**8 * p`` (``p_max_offset``): probabilities down to 2**-17 stay above e4m3's smallest
  subnormal, and 256 stays below its 448 maximum because the row max is renewed before every exp2.
  O / row_sum cancels the factor; the LSE subtracts it. ``lazy_rescale``: a row keeps its max while a
  block's exceeds it by at most ``FP8_RESCALE_THRESHOLD`` (1.8) powers of two, with P ``2**7 * p``, so P
  stays <= 2**8.8 < 448, and a warp whose rows all kept theirs skips the O rescale
  (``common/softmax.py``; block descales too, their V descale being in the scores' bias).
- O has its own bf16 buffer (it cannot alias the e4m3 sQ, half its size).

V^T from the caller (``v_colmajor``, FA3's ``V_colmajor``): where v's keys are contiguous in global
memory (a ``(batch, seqlen_k, nheads_k, d)`` view with seqlen stride 1, as ``fp8.quantize_qkv(v_layout=
"keys")`` writes it), the TMA loads each V^T tile straight into the K-major operand layout (sV is then sVt's
layout, keys in their natural order): no transposing warps, no second V buffer, one smem write per V byte
instead of three passes. P's key order is then fixed in registers (``_keys_in_order``): after the cvt, each
quad trades half-registers (2 shuffles + 4 byte permutes per two registers) so that A column ``16h + 4t + q``
holds key ``16h + 4t + q``. Dense only: a varlen sequence's first key would be the box's innermost coordinate,
which the TMA needs on 16 bytes (the launcher copies varlen V^T to rows).

Roles (``128 * (1 + tile_m / 64)`` threads):

    | warpgroup | warps | registers | role                                                   |
    | WG0       | 0     | 56 (40)   | producer: TMA loads of Q, K[n], V[n] (as in fwd.py)    |
    | WG0       | 1-3   | 56 (40)   | transpose V[n] (sV, keys x d) -> sVt[n] (d x keys, K-major) |
    | WG1..     | 4     | 224 (152) | MMA: as fwd.py, P.V reading sVt                        |

(``v_colmajor``: warps 1-3 idle as in fwd.py, the 16-bit kernel's register split, V's pipeline feeding the
MMA warps; no vt pipeline.)

Pipelines (besides fwd.py's Q and K):

    | pipeline   | stages | producer -> consumer                     | arrive counts           |
    | pipeline_v | 2      | TMA V[n] -> the 3 transposing warps      | tx bytes / lane 0 per warp |
    | vt         | 2      | transposing threads -> every MMA thread  | 96 / num_mma_threads    |

Timeline of one V stage: TMA lands V[n] -> each transposing warp takes a (16 keys x 32 columns)
piece at a time, round robin -> ``__syncwarp``, release V[n] (the TMA may refill it) -> async-proxy
fence (the WGMMA reads what generic stores wrote) -> arrive on vt[n] -> the MMA warpgroups' P.V of
block n reads sVt[n] and releases it. With intra-WG overlap the P.V of a block is issued one step
after its QK^T, so the transpose of V[n] has a whole block's GEMMs of slack.

Constraints: head_dim a multiple of 32 in [64, 256] and head_dim_v equal to it; tile_n a multiple
of 32 (P.V's k is 32); no softcap, sink, gate, clusters or spanning tiles; varlen, causal, local,
GQA and persistent/dynamic schedules as in fwd.py.

Paper: FlashAttention-3 (Shah et al., 2024) section 3.3 (FP8: layout conformance of P and V^T).
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as hopper_helpers
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from ..common.sm90_utils import acc_to_frag_a_fp8, make_smem_layout_sm90
from .fwd import _MAX_ACC_REGS, _REGISTERS, FlashFwdSm90
from .fwd_budget import SMEM_CAPACITY, acc_registers, fp8_smem_bytes
from .fwd_parts import MmaParts, Pipelines, TileWalk

# (producer warpgroup, MMA warpgroup) registers per thread: the transposing warps hold 16 bytes of
# V in flight and their addresses; producer + sum of MMA <= the launch's registers per thread (a multiple
# of 8 of 64K / threads: 168 at 3 warpgroups, 128 at 4) x the warpgroups: a setmaxnreg increase beyond what
# the decreases freed waits forever ((32, 240) hung at 3 warpgroups; the assert in __init__ checks it).
# 3 MMA warpgroups: at 32 the transposing warps spilled (6 LDL/STL, hdim 64 causal); 152 holds S 64 + O 32 +
# P 16 without spills or serialized WGMMAs (SASS), not yet timed against 160.
_REGISTERS_FP8 = {1: (56, 256), 2: (56, 224), 3: (40, 152)}
# Lazy rescale of e4m3 P: P = 2**offset * p with p <= 2**threshold against a kept max, so offset + threshold
# <= log2(448) = 8.807 (the satfinite cvt would clamp above). Offset 7 keeps p down to 2**-16 above e4m3's
# smallest subnormal. The share of (warp of 16 rows, block) pairs that still rescale on N(0, 1) scores (a numpy
# count, 8k keys in 192-key blocks): 59 % at threshold 0, 30 % at 0.8 (offset 8), 13 % at 1.8 (19 % at 2k keys).
FP8_RESCALE_THRESHOLD = 1.8
FP8_LAZY_MAX_OFFSET = 7.0
# Byte selectors of prmt.b32 (bytes 0-3 from the first operand, 4-7 from the second).
_INTERLEAVE_LO = 0x5140  # a0 b0 a1 b1
_INTERLEAVE_HI = 0x7362  # a2 b2 a3 b3
_HALVES_LO = 0x5410  # a0 a1 b0 b1
_HALVES_HI = 0x7632  # a2 a3 b2 b3
_SWAPPED_LO = 0x1054  # b0 b1 a0 a1
_SWAPPED_HI = 0x3276  # b2 b3 a2 a3


class FlashFwdSm90Fp8(FlashFwdSm90):
    """FA3 forward on e4m3 inputs; see the module docstring for roles, pipelines and timeline."""

    transposes_v = True
    num_transpose_warps = 3
    p_max_offset = 8.0

    def __init__(
        self,
        head_dim: int,
        head_dim_v: int,
        tile_m: int,
        tile_n: int,
        is_causal: bool,
        is_local: bool = False,
        intra_wg_overlap: bool = True,
        pingpong: bool = True,
        num_stages: int = 2,
        persistent: bool = False,
        pack_gqa: int = 1,
        wg_local_epilogue: bool = True,
        section_l2_mb: int = 16,
        block_scales: bool = False,
        v_colmajor: bool = False,
        scale_tile_n: int = 0,
        lazy_rescale: bool = False,
    ):
        if scale_tile_n and (not block_scales or scale_tile_n % tile_n):
            raise ValueError(f"FlashFwdSm90Fp8: scale_tile_n ({scale_tile_n}) needs block scales and a multiple of tile_n")
        # Per-block k/v descales over scale_tile_n keys: key block n reads descale n // kv_scale_ratio.
        self.kv_scale_ratio = scale_tile_n // tile_n if scale_tile_n else 1
        if block_scales and (pack_gqa > 1 or not intra_wg_overlap):
            raise ValueError("FlashFwdSm90Fp8: block scales need pack_gqa 1 (a tile's rows of one head) and intra-WG overlap")
        # Per-block descales (mDescale (3, batch, nheads, blocks)): q's per tile of rows, k's and v's per
        # scale_tile_n keys (0: per key block), instead of one per (batch, kv head).
        self.block_scales = block_scales
        # V^T loaded by TMA from a keys-contiguous v (module docstring): no in-kernel transpose.
        self.v_colmajor = v_colmajor
        self.transposes_v = not v_colmajor
        super().__init__(
            cutlass.Float8E4M3FN, head_dim, head_dim_v, tile_m, tile_n, is_causal, is_local=is_local,
            intra_wg_overlap=intra_wg_overlap, pingpong=pingpong, num_stages=num_stages, persistent=persistent,
            pack_gqa=pack_gqa, wg_local_epilogue=wg_local_epilogue, section_l2_mb=section_l2_mb,
            lazy_rescale=False,
        )
        if lazy_rescale:
            self.rescale_threshold = FP8_RESCALE_THRESHOLD
            self.p_max_offset = FP8_LAZY_MAX_OFFSET
        self.producer_regs, self.mma_regs = (_REGISTERS if v_colmajor else _REGISTERS_FP8)[self.num_mma_wg]
        # The launch gives every thread the same registers (a multiple of 8 of 64K / threads); the
        # warpgroups' setmaxnreg split must not ask for more in all (an increase would wait forever).
        warpgroups = 1 + self.num_mma_wg
        assert self.producer_regs + self.num_mma_wg * self.mma_regs <= 65536 // (128 * warpgroups) // 8 * 8 * warpgroups
        # (bf16 O cannot share the e4m3 sQ, half its size: can_implement checks the own sO fits)
        assert not self.o_aliases_q, "FlashFwdSm90Fp8 needs its own sO"

    @staticmethod
    def _out_dtype(dtype: type[cutlass.Numeric]) -> type[cutlass.Numeric]:
        return cutlass.BFloat16

    @staticmethod
    def can_implement(
        dtype, head_dim, head_dim_v, tile_m, tile_n, num_stages=2, is_causal=False, is_local=False,
        pack_gqa=1, cluster_m=1, span_heads=False, has_sink=False, has_gate=False, has_softcap=False,
        gate_slice=False, v_colmajor=False,
    ) -> str | None:
        if dtype is not cutlass.Float8E4M3FN:
            return f"dtype must be Float8E4M3FN, got {dtype}"
        if head_dim % 32 != 0 or not 64 <= head_dim <= 256 or head_dim_v != head_dim:
            return f"head_dim must be a multiple of 32 in [64, 256] and head_dim_v equal to it, got {head_dim}/{head_dim_v}"
        if tile_n % 32 != 0:
            return f"tile_n must be a multiple of 32 (P.V's k), got {tile_n}"
        if cluster_m > 1 or span_heads or has_sink or has_gate or has_softcap:
            return "no clusters, spanning tiles, sink, gate or softcap with FP8 inputs"
        reason = FlashFwdSm90.can_implement(
            cutlass.BFloat16, head_dim, head_dim_v, tile_m, tile_n, num_stages, is_causal, is_local, pack_gqa,
        )
        # (the 16-bit rules but shared memory and registers, counted here: e4m3 P takes half bf16's)
        if reason is not None and "shared memory" not in reason and "registers per MMA thread" not in reason:
            return reason
        acc_regs = acc_registers(tile_m, tile_n, head_dim_v, p_bytes=1)
        if acc_regs > _MAX_ACC_REGS[tile_m // 64]:
            return f"S + O + P take {acc_regs} registers per MMA thread (> {_MAX_ACC_REGS[tile_m // 64]}); use a smaller tile_n"
        smem = fp8_smem_bytes(head_dim, head_dim_v, tile_m, tile_n, num_stages, v_colmajor)
        if smem > SMEM_CAPACITY:
            return f"needs {smem} bytes of shared memory, sm90 allows {SMEM_CAPACITY}"
        return None

    def _smem_bytes(self, dtype, head_dim, head_dim_v, tile_m, tile_n, num_stages, own_sO: bool, q_stages: int = 1,
                    gate: bool = False, gate_slice: bool = False) -> int:
        return fp8_smem_bytes(head_dim, head_dim_v, tile_m, tile_n, num_stages, self.v_colmajor)

    def _implement_options(self) -> dict:
        return {"v_colmajor": self.v_colmajor}

    # ------------------------------------------------------------------ smem, MMAs, pipelines

    def _vt_layout(self):
        """sVt: ``num_stages`` K-major ``(head_dim_v, tile_n)`` tiles (keys contiguous, in P's order)."""
        return make_smem_layout_sm90(self.dtype, self.head_dim_v, self.tile_n, self.num_stages)

    def _vt_view(self, storage) -> cute.Tensor:
        layout = self._vt_layout()
        buffer = storage.sV if const_expr(self.v_colmajor) else storage.sVt
        return buffer.get_tensor(layout.outer, swizzle=layout.inner)

    def _smem_layouts(self):
        """fwd.py's, but with ``v_colmajor`` sV is sVt's K-major layout seen as ``(tile_n, head_dim_v, stages)``:
        the TMA box of a keys-contiguous V lands there as the P.V WGMMA reads it."""
        sQ_layout, sK_layout, sV_layout, sO_layout = super()._smem_layouts()
        if const_expr(self.v_colmajor):
            sV_layout = cute.select(self._vt_layout(), mode=[1, 0, 2])
        return sQ_layout, sK_layout, sV_layout, sO_layout

    def _pv_operand(self, storage, sV: cute.Tensor) -> cute.Tensor:
        """The P.V WGMMA's B operand: the V^T stages (K-major), the transposing warps' or the TMA's."""
        return self._vt_view(storage)

    def _vt_pipeline(self, storage) -> pipeline.PipelineAsync:
        return pipeline.PipelineAsync.create(
            num_stages=self.num_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_transpose_warps * 32),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads),
            barrier_storage=storage.mbar_vt.data_ptr(), defer_sync=True,
        )

    def _tiled_mmas(self):
        """S = Q K^T and O += P V^T, e4m3 x e4m3 -> fp32, every smem operand K-major."""
        K = cute.nvgpu.OperandMajorMode.K
        tiled_mma_qk = hopper_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, K, Float32, atom_layout_mnk=(self.num_mma_wg, 1, 1), tiler_mn=(64, self.tile_n),
        )
        tiled_mma_pv = hopper_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, K, Float32, atom_layout_mnk=(self.num_mma_wg, 1, 1),
            tiler_mn=(64, self.head_dim_v), a_source=warpgroup.OperandSource.RMEM,
        )
        return tiled_mma_qk, tiled_mma_pv

    def _pv_fragment_b(self, wg_mma_pv: cute.ThrMma, sVt: cute.Tensor) -> cute.Tensor:
        return wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sVt))

    def _pv_fragment_a(self, wg_mma_pv: cute.ThrMma) -> cute.Tensor:
        # A compact e4m3 fragment: the register-A WGMMA reads it in order (a strided view of S's
        # registers would be packed as stored, mixing rows).
        return cute.make_rmem_tensor(wg_mma_pv.partition_shape_A((self.tile_m, self.tile_n)), self.dtype)

    def _store_p(self, mma: MmaParts, acc_S: cute.Tensor) -> None:
        """P (fp32 S registers) -> e4m3 A fragment, keys in sVt's order (satfinite cvt, packed pairs);
        ``v_colmajor``: then put in the keys' natural order (``_keys_in_order``)."""
        acc_as_a = cute.make_tensor(acc_S.iterator, acc_to_frag_a_fp8(acc_S.layout))
        mma.tOrP.store(acc_as_a.load().to(self.dtype))
        if const_expr(self.v_colmajor):
            self._keys_in_order(mma.tOrP)

    def _keys_in_order(self, tOrP: cute.Tensor) -> None:
        """Reorder the e4m3 A fragment's keys in place, from S's order to the natural one.

        The fragment's 32-bit registers come in pairs, rows ``r`` and ``r + 8`` of one group of 16 keys
        (PTX's ``a0, a1`` / ``a2, a3``). After the cvt, byte ``q`` of thread ``t``'s register (``t`` = lane
        % 4) holds key ``8 (q >> 1) + 2t + (q & 1)`` of the group (the accumulator's columns); the
        WGMMA wants key ``4t + q`` there, which threads ``2t, 2t + 1`` (mod 4) hold: in their low halves
        for ``t < 2``, high halves for ``t >= 2``. So each thread packs its pair's low halves (X) and high
        halves (Y), two shuffles deliver to thread ``t`` X (``t < 2``) or Y (``t >= 2``) of both source
        threads (every source sends one packed word per shuffle: lanes that must send X and Y in the same
        shuffle are never the same source), and two byte permutes unpack rows ``r`` and ``r + 8``."""
        words = cute.recast_tensor(tOrP, Int32)
        lane = cute.arch.lane_idx()
        t = lane % 4
        odd, high = t % 2, t // 2
        quad = lane - t
        # Shuffle a: thread t reads lane 2 odd + high (t = 0, 1, 2, 3 <- 0, 2, 1, 3); shuffle b: lane
        # 2 odd + 1 - high (<- 1, 3, 0, 2). Even lanes send X in a and Y in b, odd lanes the reverse.
        src_a = quad + 2 * odd + high
        src_b = quad + 2 * odd + 1 - high
        send_a = _HALVES_LO + odd * (_HALVES_HI - _HALVES_LO)
        send_b = _HALVES_HI - odd * (_HALVES_HI - _HALVES_LO)
        # Thread t < 2 got keys 4t, 4t + 1 in a and 4t + 2, 4t + 3 in b; t >= 2 the other way round.
        row_r = _HALVES_LO + high * (_SWAPPED_LO - _HALVES_LO)
        row_r8 = _HALVES_HI + high * (_SWAPPED_HI - _HALVES_HI)
        for i in range(cute.size(words) // 2):  # (traced inline: a plain Python loop unrolls)
            lo, hi = words[2 * i], words[2 * i + 1]
            got_a = cute.arch.shuffle_sync(Int32(cute.arch.prmt(lo, hi, send_a)), src_a)
            got_b = cute.arch.shuffle_sync(Int32(cute.arch.prmt(lo, hi, send_b)), src_b)
            words[2 * i] = Int32(cute.arch.prmt(got_a, got_b, row_r))
            words[2 * i + 1] = Int32(cute.arch.prmt(got_a, got_b, row_r8))

    # ------------------------------------------------------------------ the transposing warps

    @cute.jit
    def transpose_v(
        self,
        storage,  # the kernel's shared storage: sV (as TMA wrote it) and sVt, read and written as 4-byte words
        pipes: Pipelines,
        walk: TileWalk,
        warp_in_group: Int32,  # 0 .. num_transpose_warps - 1
    ):
        """For each V stage the producer loads (this CTA's tiles, the producer's order), write its
        transpose into the next sVt stage. Warp w takes the groups of 16 keys ``kg = w, w + 3, ...``
        and every 32-column block ``cb`` of them; lane ``(t, c)`` (c = lane % 8, t = lane // 8) reads
        keys ``16 kg + 2t + {0, 1, 8, 9}`` at columns ``32 cb + 4c .. + 3`` and writes rows
        ``32 cb + 4c .. + 3`` of sVt at keys ``16 kg + 4t .. + 3``. Store j of a lane writes row
        ``4c + (j ^ m)``, ``m = (c >> 1) % 4``: the 8 lanes c of one store then hit 8 distinct rows mod 8,
        whose swizzled 16-byte chunks are 8 distinct bank groups (row ``4c + j`` for every lane put 8
        rows on 2 chunk positions: 4-way conflicts, ncu's 6.6-7.9-way on the H100). Picking word j ^ m costs
        no instruction (the byte permutes take lane-constant selectors instead of immediates); the per-store
        row offsets hold one register each (SASS: about one more instruction per store).

        Addresses by hand from the tiles' structure (``_tile_offset``): the swizzle's row bits are a
        lane's constants and the rest is additive, so each access costs a few integer ops (the
        generic ``crd2idx`` path cost ~17 per access, the transposing warps then held back P.V;
        ``recast_tensor`` of the swizzled fp8 views to 32-bit words moved rows, measured)."""
        lane = cute.arch.lane_idx()
        c, t = lane % 8, lane // 8
        n, dv = self.tile_n, self.head_dim_v
        v_atom, vt_atom = _atom_bytes(dv), _atom_bytes(n)
        v_words = cute.make_tensor(cute.recast_ptr(storage.sV.data_ptr(), dtype=Int32),
                                   cute.make_layout(n * dv * self.num_stages // 4))
        vt_words = cute.make_tensor(cute.recast_ptr(storage.sVt.data_ptr(), dtype=Int32),
                                    cute.make_layout(n * dv * self.num_stages // 4))
        # Lane constants: the swizzle's xor of each row the lane touches (sV rows 2t, 2t + 1 mod 8;
        # sVt rows 4c + (j ^ m) mod 8), and the lane's part of each address.
        # sVt's row offset and the swizzle's chunk xor occupy disjoint bits (chunk bits 4 .. 3 +
        # log2(A / 16), row bits from log2(A)), so one register per store holds both: the address is
        # ``vt_col + (vt_lane[j] ^ (chunk << 4))``.
        m = (c >> 1) % 4
        v_xor = [_row_xor(2 * t + e, v_atom) for e in (0, 1)]
        v_lane = (2 * t) * v_atom + 4 * (c % 4)  # + chunk * 16
        vt_rows = [4 * c + (m ^ j) for j in range(4)]
        vt_lane = [(row * vt_atom + 4 * t) | (_row_xor(row, vt_atom) << 4) for row in vt_rows]
        # Permute selectors: store j takes word j ^ m of the four (m's bit 1 swaps the interleaves'
        # halves, bit 0 the final halves).
        swap_il, swap_h = m >> 1, m % 2
        il_first = _INTERLEAVE_LO + swap_il * (_INTERLEAVE_HI - _INTERLEAVE_LO)
        il_second = _INTERLEAVE_HI - swap_il * (_INTERLEAVE_HI - _INTERLEAVE_LO)
        h_first = _HALVES_LO + swap_h * (_HALVES_HI - _HALVES_LO)
        h_second = _HALVES_HI - swap_h * (_HALVES_HI - _HALVES_LO)
        key_groups = n // 16
        nw = self.num_transpose_warps
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        vt_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        handoff_state = walk.handoff.consumer_state() if const_expr(self.dynamic_schedule) else None
        tile_idx = walk.scheduler.first_tile()
        while tile_idx < walk.scheduler.num_tiles:
            has_tile, batch_idx, head_idx, seqlen, tile = self.tile_work(walk, tile_idx)
            if has_tile:
                for _ in cutlass.range(tile.n_block_max - tile.n_block_min, unroll=1):
                    pipes.v.consumer_wait(v_state, pipes.v.consumer_try_wait(v_state))
                    pipes.vt.producer_acquire(vt_state)
                    stage_bytes = v_state.index * (n * dv)
                    for i in cutlass.range_constexpr((key_groups + nw - 1) // nw):
                        kg = warp_in_group + nw * i
                        if kg < key_groups:
                            v_rows = stage_bytes + kg * (16 * v_atom) + v_lane
                            # sVt: key group kg is 16-byte chunk kg % (A / 16) of atom column kg // (A / 16)
                            chunks = vt_atom // 16
                            vt_col = stage_bytes + (kg // chunks) * (dv * vt_atom)
                            vt_chunk = kg % chunks
                            for cb in cutlass.range_constexpr(dv // 32):
                                atom_col, in_atom = (32 * cb) // v_atom, (32 * cb) % v_atom
                                v_col = atom_col * (n * v_atom) + v_rows
                                r = [
                                    v_words[(v_col + dk * v_atom + ((((in_atom >> 4) + c // 4) ^ v_xor[dk % 2]) << 4)) >> 2]
                                    for dk in (0, 1, 8, 9)
                                ]
                                first01 = Int32(cute.arch.prmt(r[0], r[1], il_first))
                                second01 = Int32(cute.arch.prmt(r[0], r[1], il_second))
                                first23 = Int32(cute.arch.prmt(r[2], r[3], il_first))
                                second23 = Int32(cute.arch.prmt(r[2], r[3], il_second))
                                for j, (a, b, sel) in enumerate(((first01, first23, h_first), (first01, first23, h_second),
                                                                 (second01, second23, h_first), (second01, second23, h_second))):
                                    row_bytes = (32 * cb) * vt_atom
                                    vt_words[(vt_col + row_bytes + (vt_lane[j] ^ (vt_chunk << 4))) >> 2] = (
                                        Int32(cute.arch.prmt(a, b, sel))
                                    )
                    cute.arch.sync_warp()  # every lane's reads of V[n] are done before lane 0 releases it
                    pipes.v.consumer_release(v_state)
                    # Generic-proxy stores must be visible to the WGMMA (async proxy) that reads sVt.
                    cute.arch.fence_proxy("async.shared", space="cta")
                    pipes.vt.producer_commit(vt_state)
                    v_state.advance()
                    vt_state.advance()
            tile_idx, handoff_state = walk.scheduler.next_tile_consumer(tile_idx, walk.handoff, handoff_state)


def _atom_bytes(row_bytes: int) -> int:
    """The swizzle atom's row width (bytes) of a K-major e4m3 tile with rows this wide
    (``make_smem_layout_sm90``: the widest of 128/64/32 that divides the row). The tile's byte
    offset of (row r, byte b) of stage s, R rows of W bytes: ``s R W + (b // A) R A + r A + b % A``
    with ``Swizzle<log2(A/16), 4, 3>`` on it: 16-byte chunk bits ^= bits 7.. of ``r A``."""
    for width in (128, 64, 32):
        if row_bytes % width == 0:
            return width
    raise ValueError(f"rows of {row_bytes} bytes have no WGMMA swizzle atom")


def _row_xor(row, atom_bytes: int):
    """The value the swizzle xors into the 16-byte chunk index of a row (depends on row mod 8 only)."""
    return ((row * atom_bytes) >> 7) & (atom_bytes // 16 - 1)
