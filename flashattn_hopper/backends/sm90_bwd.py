"""Launcher of the Hopper FA3 backward: preprocess (kernels/common/bwd_pre.py), main
(kernels/sm90/bwd.py: TMA + WGMMA, warp-specialised) and postprocess (kernels/common/bwd_post.py).

The pre and post kernels, the scratch buffers, the deterministic semaphores and the launch sequence
are the Ampere family's (``BwdSm80.backward``); the main kernel, its key and the postprocess's modes
differ: dQaccum is in the fragment order of the dQ WGMMA, one block per warpgroup, and the GQA dK/dV
sums of the tile_n 128 kernel in that of the dK/dV WGMMA per warpgroup (the wide kernel's are row-major).
Head dims up to 256 with q and v the same after padding, and q/k 192-256 with v from 128 up to q/k's
(256 and 256/192 on ``kernels/sm90/bwd_wide.py``, 192, 192/128 and 256/128 on ``bwd_wide96.py``); other
problems run on the Ampere backward (dispatch falls back when this family cannot implement them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import configs
from ..jit import KernelKey
from ..validate import AttnProblem
from .common import MAX_GRID_YZ, VarlenArgs, cutlass_dtype, fake_bshd, fake_f32, ffi_compile
from .gate_scan import scan_keys
from .sm80_bwd import (
    _POST_THREADS, _POST_TILE_M, BwdPostKey, BwdPreKey, BwdSm80, _fake, _fake_ints, _fake_packed,
)


# gqa_loop under causal / local masks (kernels/sm90/bwd.py ``loop_chunks``): the dense grid in chunks of this many key
# blocks, and (tiles' "balanced") only where it has at least this many CTAs per SM: a CTA is then group x its key
# block's query blocks long, and with fewer the longest ones set the kernel's time (MQA 16:1 at 1k-16k: 128 CTAs
# for 132 SMs, -32 to -44 %, perf/NOTES.md session 36).
LOOP_CHUNK_N = 8
LOOP_MIN_CTAS_PER_SM = 3
# Under masks a KV head's CTAs drift apart over its query heads in ascending order (each walks its own query range
# per head), so from 4k the group's Q / dO and dQ sums share L2 at once (GQA 4:1 causal, hdim 128: +6.7 % at 1k,
# -1.9 % at 4k, -6.6 % at 16k against the fp32 sums). Descending with the heads innermost (``loop_desc``) keeps them on
# one query block: hdim 128 +5 / +9 / +5 / +2 / -3 % at 1k / 2k / 4k / 8k / 16k, hdim 64 (1k: -5 % against
# ascending) +9 / +4 / -2 % at 2k / 4k / 8k (H100, perf/NOTES.md session 37). The rows' ``loop_masked_max_seqlen``
# and ``loop_desc_above`` hold those bounds.


@dataclass(frozen=True)
class BwdSm90Tile:
    tile_m: int  # query rows per m_block step
    tile_n: int  # key rows per CTA (64 per MMA warpgroup)
    num_stages: int = 2  # Q / dO ring stages
    dq_split_rows: bool = False  # the two warpgroups split dQ by rows (tile_m 128) instead of columns
    dq_transposed: bool = False  # tile_m 80: dQ^T = K^T dS^T (kernels/sm90/bwd.py), hdim 128 only
    trace: bool = False  # debug: clock() stamps of two blocks stored by two CTAs (bwd_loop.py store_stamps)
    pingpong: bool = False  # the MMA warpgroups do not meet per block; dQ lags one block (kernels/sm90/bwd_loop.py)
    ds_packed: bool = False  # dS^T by packed 16-bit products of P^T (kernels/sm90/bwd_loop.py ds16_from_probs16)
    # dQaccum zeroed tile by tile by its first claimant, not by the preprocess (kernels/sm90/bwd_store.py
    # ``claim_dq_tile``): "all" problems, "masked" (causal or local) ones only, or "" never
    dq_claim: str = ""
    # GQA by one CTA per (key block, KV head) walking its query heads, dK/dV stored once in 16 bits (kernels/sm90/bwd.py
    # ``gqa_loop``) instead of fp32 sums reduce-added per query head and a postprocess (tile_n 128, not gated, not
    # deterministic): "all" problems, "unmasked" (neither causal nor local) ones only, "balanced" (unmasked, and dense
    # masked ones whose grid has LOOP_MIN_CTAS_PER_SM CTAs per SM: ``_gqa_flags``), or "" never
    gqa_loop: str = ""
    # "balanced": masked problems take the loop up to this many queries and keys
    loop_masked_max_seqlen: int = 1024
    # masked gqa_loop problems with more queries or keys than this walk the heads innermost and the query blocks
    # descending (kernels/sm90/bwd.py ``loop_desc``; 0: all of them, -1: none), without dq_claim (its claims a block
    # ahead assume ascending blocks)
    loop_desc_above: int = -1


# Tiles by (padded) head dim, 64 keys per MMA warpgroup. d=128: 64x128, FA3's sm90 tile; d=96 the same natively
# (it ran padded to 128 before session 35: +25 % at 16k, 2.3x at 1k on an H100; the dQ GEMM's 48-column halves of
# K take 32-byte swizzle atoms, ``FlashBwdSm90._smem_layouts``). d=64: 128x128 with dQ split by rows, measured
# +2-7 % over 64x128 on an H100 (perf/NOTES.md, session 18); softcap keeps 64x128 there (``_main_key``). d=256:
# 64x64, the warpgroups splitting head_dim (kernels/sm90/bwd_wide.py, picked by tile_n 64); one Q/dO stage (two do
# not fit beside sdQ). d=192: 64x96 (bwd_wide96.py, picked by tile_n 96; below). GQA without causal or local masks:
# one CTA per (key block, KV head) (``gqa_loop``): +1 to +36 % over the fp32-sum route at 1k-16k, GQA 4:1 and MQA
# (H100, perf/NOTES.md session 36; -2 % at 16k with 2:1 and 16:1, within the runs' spread). Causal / local calls take
# it with >= 3 CTAs per SM up to the row's ``loop_masked_max_seqlen`` (d128 and d96: 8k, descending; d64: 4k,
# descending above 1k; ``LOOP_*`` above); longer ones keep the fp32 sums. d96 causal GQA 4:1, descending loop against
# the fp32 sums (and the 1k ascending loop): +3 / +7 / +4 / +2 % at 1k / 2k / 4k / 8k (H100, perf/NOTES.md session 41).
BWD_SM90_TILES: dict[int, BwdSm90Tile] = {
    64: BwdSm90Tile(tile_m=128, tile_n=128, dq_split_rows=True, pingpong=True, ds_packed=True, dq_claim="all",
                    gqa_loop="balanced", loop_masked_max_seqlen=4096, loop_desc_above=1024),
    96: BwdSm90Tile(tile_m=64, tile_n=128, dq_claim="masked", gqa_loop="balanced", loop_masked_max_seqlen=8192,
                    loop_desc_above=0),
    128: BwdSm90Tile(tile_m=64, tile_n=128, dq_claim="masked", gqa_loop="balanced", loop_masked_max_seqlen=8192,
                     loop_desc_above=0),
    192: BwdSm90Tile(tile_m=64, tile_n=96, num_stages=2, dq_claim="all"),
    256: BwdSm90Tile(tile_m=64, tile_n=64, num_stages=1, dq_claim="all"),
}
# d=192: 64 x 96 (kernels/sm90/bwd_wide96.py: scores by query rows, 48 keys per warpgroup, dK^T / dV^T), two
# Q stages, and one dO stage where v is 192 wide (the kernel's rule: two do not fit beside sdQ).
# Pairs whose v is narrower than q/k's row and that take another tile than the row's. 256/128: 64 x 96 (the d192
# kernel; one Q/dO stage for smem: K 48 + V 24 + Q 32 + dO 16 + sdSt 24 + sdQ 64 KB), +13 to +34 % over the 64-key
# row at 1k-16k on an H100 (perf/NOTES.md, session 36). 256/256 does not fit 96 keys (dK^T + dV^T: 192 registers).
BWD_SM90_PAIR_TILES: dict[tuple[int, int], BwdSm90Tile] = {
    (256, 128): BwdSm90Tile(tile_m=64, tile_n=96, num_stages=1, dq_claim="all"),
}
# d=64 runs its MMA warpgroups in ping-pong (kernels/sm90/bwd_loop.py ``pingpong_tail``: dQ one block behind, no
# per-block meeting; deterministic, softcap and gated calls keep the lockstep loop): +2-5.6 % from 4k, within +-2 %
# at 1k-2k on an H100 (perf/NOTES.md, session 29); the default since the backward GPU tier passed with it (session
# 30, H200). The lockstep tile stays for benchmarks: ``perf/bench_bwd.py --tiles 64:128x128:2:rows``. d=64 also
# forms dS^T by packed 16-bit products (``ds_packed``: bf16 keys but softcap's and the gated GQA one): +1.3 to +5.2 %
# on an H200 (NOTES session 31); at d=128, which keeps fp32 P^T, it removes 16 of 437 instructions and measured
# even, so it stays off there.
# 80 x 128 at hdim 128 (FA4's dense non-causal tile; the dQ GEMM runs transposed; the scratch pads query
# rows to multiples of 640, dense only): built and correct, not in the table. Measured on an H200
# (perf/NOTES.md, session 23) against 64 x 128: main kernel -1.8 % time at 16k, +7 % at 512, even at
# 1k-4k; within +-2 % again in session 24, after which 64 x 128 gained 3-7 % (dV after dS^T).
# Opt-in for benchmarks: ``perf/bench_bwd.py --tiles 128:80x128:2:transposed``.
# dq_claim (the preprocess no longer zeroes dQaccum; each tile is zeroed in L2 by the first CTA to claim it, a block
# ahead of its adds): on an H100 +10 / +17 % at hdim 64 / 128 512 causal, +4-6 % at 1k causal, +0-5 % at hdim 64
# non-causal; hdim 128 non-causal lost 2.5-2.8 % at 2k-4k (repeat 5), so it claims under causal / local masks only
# (perf/NOTES.md session 33).
BWD_SM90_TILE_80 = BwdSm90Tile(tile_m=80, tile_n=128, dq_transposed=True)


@dataclass(frozen=True)
class BwdSm90Key(KernelKey):
    dtype: str
    head_dim: int
    head_dim_v: int  # == head_dim, or 128..head_dim where head_dim >= 192 (bwd_wide.py)
    tile_m: int
    tile_n: int
    causal: bool
    gqa: bool  # nheads != nheads_k: dK/dV summed over query heads in fp32 scratch
    num_stages: int = 2
    # (implied by tile_m 128, so left out of display names: they stay within a progress line's 120 columns)
    dq_split_rows: bool = field(default=False, metadata={"display": False})
    local: bool = False
    softcap: bool = False
    varlen: bool = False
    dq_transposed: bool = False  # tile_m 80 (BWD_SM90_TILE_80)
    trace: bool = False  # BwdSm90Tile's
    pingpong: bool = False  # BwdSm90Tile's
    ds_packed: bool = False  # BwdSm90Tile's (bf16 only; not with softcap or the gated GQA key)
    dq_claim: bool = False  # BwdSm90Tile's (not deterministic, not trace; then the preprocess does not zero dQaccum)
    seqused_q: bool = False
    seqused_k: bool = False
    deterministic: bool = False  # semaphore-ordered adds compiled in (the sm80 kernel's is a runtime flag)
    tail_split: bool = False  # never (the launcher shared with sm80 reads it)
    gate: bool = False  # gated log-decay: a bias per (query head, key), dG's sums (``backward_with_gate``)
    # BwdSm90Tile's (with gqa: no fp32 sums, the MHA epilogue per KV head); "loop" in display names (120 columns)
    gqa_loop: bool = field(default=False, metadata={"display": "loop"})
    loop_desc: bool = field(default=False, metadata={"display": "desc"})  # (BwdSm90Tile.loop_desc_above)
    # the gate's per-key / per-query sums by WGMMA (configs.BWD_SM90_GATE_KEY_MMA / _QUERY_MMA; short
    # display names: progress lines stay within 120 columns)
    gate_key_mma: bool = field(default=False, metadata={"display": "ksum"})
    gate_query_mma: bool = field(default=False, metadata={"display": "qsum"})
    # dense causal gated calls from configs.BWD_SM90_GATE_SKIP_DECAYED_MIN_SEQLEN_K keys, not deterministic: each key
    # block's query blocks end at the launcher's bound of the decayed ones (``gate_blocks.last_live_rows``)
    gate_skip_decayed: bool = field(default=False, metadata={"display": "zblk"})


_DQ_POST_THREADS = 256  # the dQ postprocess rebuilds the main kernel's two-warpgroup dQ WGMMA


class BwdSm90(BwdSm80):
    """FA3 backward on sm90: parallel over key blocks, dQ by fp32 reduce-adds, dK/dV in registers."""

    backend = "sm90"
    kind = "bwd_sm90"
    tiles = BWD_SM90_TILES
    pair_tiles = BWD_SM90_PAIR_TILES

    def kernel_dims(self, p: AttnProblem) -> tuple[int, int] | None:
        """The table's rows for q/k and v, except that a 96 / 128 pair runs both at 128 (v or q/k padded), as before
        the table had a 96 row (the narrow kernel takes q and v at one width)."""
        dims = super().kernel_dims(p)
        return (128, 128) if dims in ((96, 128), (128, 96)) else dims

    def can_implement(self, p: AttnProblem, deterministic: bool) -> str | None:
        dims = self.kernel_dims(p)
        if dims is None or not (dims[0] == dims[1] or dims[0] >= 192 and 128 <= dims[1] <= dims[0]):
            return (
                f"head dims ({p.head_dim}, {p.head_dim_v}) are not implemented by the sm90 backward yet; "
                f"supported: q and v head dims equal up to {max(self.tiles)}, or q/k over 128 with v from "
                "over 64 up to q/k's"
            )
        return super().can_implement(p, deterministic)

    splits_tail = False  # (its key's tail_split stays False: the launcher shared with sm80 reads it)
    gate_slots = 4  # the main kernel's mGate, mdGq, mdGk, mLiveRows (None without a gate / the skip)

    def can_gate(self, p: AttnProblem) -> bool:
        """Whether ``backward_with_gate`` serves ``p`` (the gate is in ``kernels/sm90/bwd.py``, the
        tiles of 64 keys per warpgroup: head dims up to 128, q's and v's equal; no softcap)."""
        dims = self.kernel_dims(p)
        return (dims is not None and dims[0] == dims[1] and self.tiles[dims[0]].tile_n == 128 and p.softcap == 0.0
                and self.can_implement(p, False) is None)

    def backward_with_gate(
        self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, p: AttnProblem, varlen: VarlenArgs | None, deterministic: bool, bias: torch.Tensor,
        rows_dpsum: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        """``(dq, dk, dv, dS's sums per key, dS's sums per query)`` of attention whose scores carry
        ``bias`` per (query head, key) (``flashattn_hopper/gate.py``: ``-G_j / softmax_scale``, the
        forward's ``forward_with_gate``; fp32, dense ``(batch, nheads, seqlen_k)``, varlen ``(nheads,
        total_k)``), ``lse`` that forward's. The sums are of the gradient of the scaled scores, in the
        bias's layout (per key) and the LSE's (per query), fp32. A non-empty problem ``can_gate`` accepts.
        ``rows_dpsum`` (dense): then also ``rowsum(dout * out)`` (``BwdPlan``'s, for a sink's gradient)."""
        f32, dev = torch.float32, q.device
        plan = self.cached_plan(p, varlen, deterministic, dev, gate=True)
        bias = bias.to(device=dev, dtype=f32)  # (rows as given: the kernel reads them by index)
        # Per query: reduce-added by the kernel. Per key: stored once by the CTA owning it, except varlen
        # rows between seqused_k and the next sequence, which no CTA owns.
        q_rows = (p.nheads, p.seqlen_q) if p.is_varlen else (p.batch, p.nheads, p.seqlen_q)
        query_sums = torch.zeros(q_rows, dtype=f32, device=dev)
        key_sums = (torch.zeros_like if p.is_varlen else torch.empty_like)(bias)
        live_rows = self.live_rows(plan.main_key, p, varlen, q, k, bias) if plan.main_key.gate_skip_decayed else None
        grads = plan(dout.contiguous(), q, k, v, out, lse, varlen, gate=(bias, query_sums, key_sums, live_rows),
                     rows_dpsum=rows_dpsum)
        return (*grads[:3], key_sums, query_sums, *grads[3:])

    @staticmethod
    def live_rows(key: BwdSm90Key, p: AttnProblem, varlen: VarlenArgs | None, q: torch.Tensor, k: torch.Tensor,
                  bias: torch.Tensor) -> torch.Tensor:
        """A ``gate_skip_decayed`` key's table (``gate_blocks.last_live_rows``): dense; packed self-attention from
        the min length (``sm90_fwd.skippable_packed``); else (a packed call it does not serve) one that skips
        nothing, each key block's end past every query block."""
        from .gate_blocks import last_live_rows
        from .sm90_fwd import skippable_packed

        if varlen is None:
            return last_live_rows(q, k, bias, p.softmax_scale, key.tile_m, key.tile_n)
        max_seqlen = skippable_packed(varlen)
        if max_seqlen >= configs.BWD_SM90_GATE_SKIP_DECAYED_MIN_SEQLEN_K:
            return last_live_rows(q, k, bias, p.softmax_scale, key.tile_m, key.tile_n,
                                  (varlen.cu_seqlens_k, max_seqlen))
        # (p's lengths are the totals, bounds on any sequence's; one row read through zero strides: no memory per
        # sequence and head)
        ends = torch.full((1, 1, -(-p.seqlen_k // key.tile_n)), -(-p.seqlen_q // key.tile_m), dtype=torch.int32,
                          device=q.device)
        return ends.expand(max(varlen.cu_seqlens_k.shape[0] - 1, 1), p.nheads, ends.shape[-1])

    def _mode_flags(self, deterministic: bool) -> dict[str, bool]:
        """The semaphore-ordered adds are compiled in (the turn bookkeeping costs registers)."""
        return {"deterministic": deterministic}

    def _gate_flags(self, p: AttnProblem, gate: bool, deterministic: bool,
                    varlen: VarlenArgs | None) -> dict[str, bool]:
        """The gate's key fields: the skip of decayed query blocks (``configs.BWD_SM90_GATE_SKIP_DECAYED``) for causal
        calls without a window, not deterministic (its turns count every key block): dense from ``_MIN_SEQLEN_K``
        keys; packed (``configs.GATE_SKIP_DECAYED_VARLEN``) without seqused whatever the lengths (the plan is kept
        per varlen flags: ``live_rows`` gives a call the table does not serve one that skips nothing). (GQA too:
        the gated GQA key's CTAs are per query head, as the table's rows.)"""
        from . import sm90_fwd

        flags = super()._gate_flags(p, gate, deterministic, varlen)
        # (dense: the table by Triton, as the forward's; packed: per call, ``live_rows``)
        long_keys = (p.seqlen_k >= configs.BWD_SM90_GATE_SKIP_DECAYED_MIN_SEQLEN_K and sm90_fwd._has_triton()
                     if varlen is None else
                     configs.GATE_SKIP_DECAYED_VARLEN and varlen.seqused_q is None and varlen.seqused_k is None)
        if (gate and configs.BWD_SM90_GATE_SKIP_DECAYED and not deterministic and p.causal and p.window_left < 0
                and long_keys):
            flags["gate_skip_decayed"] = True
        return flags

    def _gqa_flags(self, p: AttnProblem, dk_fp32: bool, varlen: bool, sms: int | None) -> dict[str, bool]:
        """A real GQA problem whose dK is not asked in fp32 may take the tile's ``gqa_loop``; with a causal or local
        mask (``gqa_loop_masked``) where its chunked grid's z fits (dense) and, for "balanced" tiles, up to the tile's
        ``loop_masked_max_seqlen`` queries and keys where the grid has at least ``LOOP_MIN_CTAS_PER_SM`` CTAs per SM
        (``sms`` None: not checked); in descending order past its ``loop_desc_above`` (``gqa_loop_desc``)."""
        if p.nheads == p.nheads_k or dk_fp32:
            return {}
        t = self._tile(*self.kernel_dims(p))
        n_blocks = -(-p.seqlen_k // 128)  # (tile_n 128: the only gqa_loop kernel's)
        chunks_fit = varlen or p.batch * -(-n_blocks // LOOP_CHUNK_N) <= MAX_GRID_YZ
        ctas = None if varlen else p.batch * p.nheads_k * n_blocks
        seqlen = max(p.seqlen_q, p.seqlen_k)
        balanced = not varlen and seqlen <= t.loop_masked_max_seqlen and (
            sms is None or ctas >= LOOP_MIN_CTAS_PER_SM * sms)
        return {"gqa_loop": True, "gqa_loop_masked": chunks_fit, "gqa_loop_balanced": chunks_fit and balanced,
                "gqa_loop_desc": 0 <= t.loop_desc_above < seqlen}

    def _tile(self, hdim: int, hdim_v: int) -> BwdSm90Tile:
        """The table's tile of a (padded) head-dim pair."""
        return self.pair_tiles.get((hdim, hdim_v)) or self.tiles[hdim]

    def _main_key(self, arch: str, dtype: str, hdim: int, hdim_v: int, causal: bool, gqa: bool,
                  **flags: bool) -> BwdSm90Key:
        t = self._tile(hdim, hdim_v)
        # (``keys``: real GQA, not dk_fp32's scratch route)
        masked = causal or flags.get("local")
        loop_masked, loop_balanced = flags.pop("gqa_loop_masked", False), flags.pop("gqa_loop_balanced", False)
        loop_desc = flags.pop("gqa_loop_desc", False)
        gqa_loop = flags.pop("gqa_loop", False) and t.tile_n == 128 and not t.trace and (
            not masked and t.gqa_loop in ("unmasked", "balanced", "all")
            or masked and (t.gqa_loop == "all" and loop_masked or t.gqa_loop == "balanced" and loop_balanced))
        gqa_loop = gqa_loop and not flags.get("gate") and not flags.get("deterministic")
        loop_desc = gqa_loop and masked and loop_desc
        if flags.get("softcap") and t.tile_m == 128:  # (fp32 S^T kept for tanh' beside dP^T: too many registers)
            t = BwdSm90Tile(tile_m=64, tile_n=t.tile_n, num_stages=t.num_stages)
        return BwdSm90Key(
            kernel=self.kind, arch=arch, dtype=dtype, head_dim=hdim, head_dim_v=hdim_v, tile_m=t.tile_m, tile_n=t.tile_n,
            causal=causal, gqa=gqa, num_stages=t.num_stages, dq_split_rows=t.dq_split_rows,
            **({"dq_transposed": True} if t.dq_transposed else {}),
            **({"trace": True} if t.trace else {}),
            **({"pingpong": True} if t.pingpong and not flags.get("gate") and not flags.get("softcap")
               and not flags.get("deterministic") else {}),
            # Not fp16 (its range: the 16-bit difference can overflow where the fp32 product would not, and a
            # masked 0 * inf is NaN), not the gated GQA key (it spills 12 bytes with it), not tile_m 80 (not built).
            **({"ds_packed": True} if t.ds_packed and dtype == "bf16" and not flags.get("softcap")
               and not (flags.get("gate") and gqa) and t.tile_m != 80 else {}),
            # (its tile states take the semaphores' slot: not with deterministic's turns or trace's clocks)
            **({"dq_claim": True} if (t.dq_claim == "all" or t.dq_claim == "masked" and (causal or flags.get("local")))
               and not t.trace and not flags.get("deterministic") and not loop_desc else {}),
            **({"gqa_loop": True} if gqa_loop else {}), **({"loop_desc": True} if loop_desc else {}),
            # (both at head_dim 128 serialize every WGMMA, ptxas C7512: the query half alone there)
            **({"gate_key_mma": True} if flags.get("gate") and configs.BWD_SM90_GATE_KEY_MMA
               and not (configs.BWD_SM90_GATE_QUERY_MMA and hdim == 128) else {}),
            **({"gate_query_mma": True} if flags.get("gate") and configs.BWD_SM90_GATE_QUERY_MMA else {}), **flags,
        )

    def tile_80_key(self, arch: str) -> BwdSm90Key:
        """The opt-in 80 x 128 tile's key (``BWD_SM90_TILE_80``: d128 bf16 dense non-causal MHA)."""
        t = BWD_SM90_TILE_80
        return BwdSm90Key(kernel=self.kind, arch=arch, dtype="bf16", head_dim=128, head_dim_v=128, tile_m=t.tile_m,
                          tile_n=t.tile_n, causal=False, gqa=False, num_stages=t.num_stages, dq_transposed=True)

    def _post_keys(self, arch: str, dtype: str, hdim: int, hdim_v: int, varlen: bool = False,
                   seqused_q: bool = False, seqused_k: bool = False,
                   main: KernelKey | None = None) -> tuple[BwdPostKey, BwdPostKey]:
        """(dQ postprocess: dQaccum in the fragment order of the main kernel's dQ WGMMA per warpgroup
        (``wg_blocks``), whose tile ``main`` gives (None: the table's); GQA dK/dV postprocess: tile_n 128
        (``sm90/bwd.py``) sums in the dK/dV WGMMA's fragment order per warpgroup (``wg_blocks``), the wide
        kernel's row-major)."""
        t = self.tiles[hdim] if main is None else main
        dq = BwdPostKey(kernel="bwd_post_sm80", arch=arch, dtype=dtype, head_dim=hdim, tile_m=t.tile_m,
                        num_threads=_DQ_POST_THREADS, atom_m=0, varlen=varlen, seqused=seqused_q, dq_red_vec=4,
                        dq_wgmma="transposed" if t.dq_transposed else "rows" if t.dq_split_rows else "cols",
                        wg_blocks=True, **({"dq_claimed": True} if getattr(main, "dq_claim", False) else {}))
        if t.tile_n == 128:
            kv = BwdPostKey(kernel="bwd_post_sm80", arch=arch, dtype=dtype, head_dim=hdim, tile_m=128,
                            num_threads=_DQ_POST_THREADS, atom_m=0, varlen=varlen, seqused=seqused_k, dq_red_vec=4,
                            dq_wgmma="rows", wg_blocks=True)
        else:
            kv = BwdPostKey(kernel="bwd_post_sm80", arch=arch, dtype=dtype, head_dim=hdim, tile_m=_POST_TILE_M,
                            num_threads=_POST_THREADS, atom_m=0, varlen=varlen, seqused=seqused_k)
        return dq, kv

    def all_keys(self, arch: str) -> list[KernelKey]:
        """One representative per code path: the preprocess without dQaccum's zeroing and the dQ postprocess of a
        ``dq_claim`` key (its unclaimed tiles read as zeros) and of one without; d128 bf16 dense (MHA non-causal, GQA
        causal, GQA non-causal: ``gqa_loop``; d64 causal GQA: its chunked grid; d128 causal GQA: ``loop_desc``), the
        opt-in 80 x 128 tile (dQ^T) and its postprocess, d64 causal (ping-pong), d64 deterministic (the lockstep loop
        with ds_packed), d96 causal (K in 32-byte swizzle atoms), d128 varlen causal, window and causal softcap; the
        wide kernel: d256 causal, d256 causal GQA; the 96-key kernel (``bwd_wide96.py``): d256/128 causal GQA (its
        predicated sums, one Q/dO stage), d192/128 deterministic causal GQA (its turns), d192 MHA non-causal (the
        transposing epilogue, and at v's 192 its dO ring one stage behind Q's two); the gate (d128 causal GQA: its query
        dG sums by WGMMA; d64 causal GQA: both halves, dV issued after the dG sums there, ``dv_after_sums``; and d64
        with the sums by the threads, ``BWD_SM90_GATE_KEY_MMA`` / ``_QUERY_MMA`` off); the dQ postprocess of both dQ
        WGMMA splits (d128: by columns, d64: by rows) and of d192 (its unswizzled staging tile); the GQA dK/dV
        postprocess of the tile_n 128 kernel (d128, ``wg_blocks``); the gated forward's G scan (``gate_scan.py``: rows
        only, and with K's bf16 slice) and its backward's dg scan (fp32), each in its varlen mode too. (The preprocess
        and the row-major postprocess are the sm80 family's keys.)"""
        if not arch.startswith("sm_90"):
            return []
        main = self._main_key
        tile_80 = self.tile_80_key(arch)
        claimed = main(arch, "bf16", 128, 128, True, False)  # (dq_claim: its pre and dQ post differ)
        return [
            BwdPreKey(kernel="bwd_pre_sm80", arch=arch, dtype="bf16", head_dim=128, head_dim_v=128,
                      dq_state_tile_m=64),
            self._post_keys(arch, "bf16", 128, 128, main=claimed)[0],
            self._post_keys(arch, "bf16", 128, 128, main=dataclasses.replace(claimed, dq_claim=False))[0],
            self._post_keys(arch, "bf16", 64, 64)[0],
            self._post_keys(arch, "bf16", 192, 128)[0],
            self._post_keys(arch, "bf16", 128, 128)[1],
            main(arch, "bf16", 128, 128, False, False),
            tile_80,
            self._post_keys(arch, "bf16", 128, 128, main=tile_80)[0],
            main(arch, "bf16", 128, 128, True, True),
            main(arch, "bf16", 128, 128, False, True, gqa_loop=True),
            main(arch, "bf16", 64, 64, True, True, gqa_loop=True, gqa_loop_balanced=True),
            main(arch, "bf16", 128, 128, True, True, gqa_loop=True, gqa_loop_balanced=True, gqa_loop_desc=True),
            main(arch, "bf16", 128, 128, True, True, deterministic=True),
            main(arch, "bf16", 64, 64, True, False),
            main(arch, "bf16", 64, 64, False, True, deterministic=True),
            main(arch, "bf16", 96, 96, True, False),
            main(arch, "bf16", 128, 128, True, False, varlen=True),
            main(arch, "bf16", 128, 128, False, False, local=True),
            main(arch, "bf16", 128, 128, True, False, softcap=True),
            main(arch, "bf16", 256, 256, True, False),
            main(arch, "bf16", 256, 256, True, True),
            main(arch, "bf16", 256, 128, True, True),
            main(arch, "bf16", 192, 128, True, True, deterministic=True),
            main(arch, "bf16", 192, 192, False, False),
            main(arch, "bf16", 128, 128, True, True, gate=True),
            # (with the skip of decayed query blocks: configs.BWD_SM90_GATE_SKIP_DECAYED)
            main(arch, "bf16", 64, 64, True, True, gate=True, gate_skip_decayed=True),
            # (the dG sums by the threads: configs.BWD_SM90_GATE_KEY_MMA / _QUERY_MMA off)
            dataclasses.replace(main(arch, "bf16", 64, 64, True, True, gate=True), gate_key_mma=False,
                                gate_query_mma=False),
            *scan_keys(arch),
        ]

    def compile(self, key: KernelKey, options: str | None = None) -> Any:
        if key.kernel == "gate_scan":  # (the gated forward's G scan: listed here with the gate's other keys)
            from .gate_scan import compile_scan

            return compile_scan(key, options)  # type: ignore[arg-type]
        if key.kernel == "gate_scan_grad":  # (its backward's dg scan)
            from .gate_scan import compile_scan_grad

            return compile_scan_grad(key, options)  # type: ignore[arg-type]
        if key.kernel != self.kind:
            return super().compile(key, options)
        import cutlass
        import cutlass.cute as cute

        from ..kernels.sm90.bwd import FlashBwdSm90
        from ..kernels.sm90.bwd_wide import FlashBwdSm90Wide
        from ..kernels.sm90.bwd_wide96 import FlashBwdSm90Wide96

        k: BwdSm90Key = key  # type: ignore[assignment]
        dtype = cutlass_dtype(k.dtype)
        f32, i32 = cutlass.Float32, cutlass.Int32
        b, s_q, s_k, h, h_k, d, dv, s_pad, acc_len, acc_k, acc_v, b1, nb = (cute.sym_int() for _ in range(13))
        sem_q = tuple(cute.sym_int() for _ in range(3))
        sem_kv = tuple(cute.sym_int() for _ in range(3))

        def qkv(seqlen: Any, heads: Any, width: Any = d) -> Any:
            return _fake_packed(dtype, seqlen, heads, width) if k.varlen else fake_bshd(dtype, b, seqlen, heads, width)

        kernel_class = {64: FlashBwdSm90Wide, 96: FlashBwdSm90Wide96}.get(k.tile_n, FlashBwdSm90)
        kernel = kernel_class(
            dtype, k.head_dim, k.tile_m, k.tile_n, k.causal, k.gqa and not k.gqa_loop, is_local=k.local,
            has_softcap=k.softcap,
            num_stages=k.num_stages, dq_split_rows=k.dq_split_rows, deterministic=k.deterministic,
            head_dim_v=k.head_dim_v, **({"has_gate": True} if k.gate else {}),
            **({"dq_transposed": True} if k.dq_transposed else {}),
            **({"trace": True} if k.trace else {}),
            **({"pingpong": True} if k.pingpong else {}),
            **({"ds_packed": True} if k.ds_packed else {}),
            **({"dq_claim": True} if k.dq_claim else {}),
            **({"gqa_loop": True, "loop_chunk_n": LOOP_CHUNK_N} if k.gqa_loop else {}),
            **({"loop_desc": True} if k.loop_desc else {}),
            **({"gate_key_mma": True} if k.gate_key_mma else {}),
            **({"gate_query_mma": True} if k.gate_query_mma else {}),
            **({"skip_decayed": True} if k.gate_skip_decayed else {}),
        )
        if k.gqa and not k.gqa_loop:
            dkv = (_fake(f32, (b, h_k, acc_k), 4), _fake(f32, (b, h_k, acc_v), 4))
        else:
            dkv = (qkv(s_k, h_k), qkv(s_k, h_k, dv))
        fakes = (
            qkv(s_q, h), qkv(s_k, h_k), qkv(s_k, h_k, dv), qkv(s_q, h, dv), _fake(f32, (b, h, s_pad), 4),
            _fake(f32, (b, h, s_pad), 4), _fake(f32, (b, h, acc_len), 4), *dkv, _fake(i32, sem_q),
            _fake(i32, sem_kv),
        )
        ints = (
            _fake_ints(b1) if k.varlen else None, _fake_ints(b1) if k.varlen else None,
            _fake_ints(nb) if k.seqused_q else None, _fake_ints(nb) if k.seqused_k else None,
        )
        scalars = (f32(1.0), i32(0), i32(0), f32(1.0), i32(0), i32(0), i32(0))
        gate = (None,) * 4
        if k.gate:  # bias, per-query sums, per-key sums: (b, h, s) | varlen (h, total), fp32, contiguous
            gate = (*(fake_f32(tuple(cute.sym_int() for _ in range(2 if k.varlen else 3))) for _ in range(3)),
                    _fake(i32, tuple(cute.sym_int() for _ in range(3))) if k.gate_skip_decayed else None)
        return ffi_compile(kernel, *fakes, *scalars, *ints, None, *gate, options=options)
