"""Tile configurations per kernel family, as frozen tables. One comment per row says why.

A row is chosen by the *kernel* head dims: the user's head dims are padded (in Python, with zeros)
up to the smallest row that holds each (``head_dim`` and ``head_dim_v`` each at its own width).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class FwdTile:
    tile_m: int  # query rows per CTA
    tile_n: int  # key rows per mainloop iteration
    num_threads: int
    # K/V smem stages. 1 is FA2's schedule; 2 give each load a whole block step to land: +0-9 % with
    # 32-row warps on H200, -3 to -13 % at hdim 192/256 whose warps own 16 rows (perf/NOTES_sm80.md).
    num_stages: int = 1


# Ampere FA2 forward (kernels/sm80/fwd.py): warps split along the query rows, 16-bit inputs.
# Smem = (tile_m + 2 * num_stages * tile_n) * hdim * 2 B (Q + K + V).
# What matters on H100/H200 is query rows per warp (tile_m / warps): 32 rows halve the shared-memory
# bytes per mma.sync against 16 rows (each K/V fragment feeds twice the MMAs), and 4-warp CTAs at
# <= 255 regs run 2 per SM, so one CTA's barrier waits hide behind the other's math. Measured on H200,
# bf16, 16k tokens, hidden 2048, vs SDPA flash (FA2), 2026-11-21 (perf/NOTES_sm80.md).
FWD_SM80_TILES: dict[int, FwdTile] = {
    # 128x64, 4 warps (32 rows each): S 64 + O 64 regs/thread, no spills; 1.11-1.37x FA2 at
    # seqlens 512-16k (8 warps 128x128: 0.86-1.04x; 4 warps 128x128 spills, 1.06-1.15x).
    64: FwdTile(tile_m=128, tile_n=64, num_threads=128, num_stages=2),
    # 128x32, 4 warps: S 32 + O 96 regs/thread, no spills with any flag; 0.94-1.01x FA2 at 2k/8k.
    # 128x64 x 4 warps measures 1.06-1.07x but spills 10-30 registers causal or varlen on sm_90a.
    96: FwdTile(tile_m=128, tile_n=32, num_threads=128, num_stages=2),
    # 128x32, 4 warps: S 32 + O 128 regs/thread, no spills dense; 1.03-1.20x FA2 (8 warps 128x64:
    # 0.85-1.05x; FA2's own 4-warp 128x64 spills in our kernel, 1.00-1.14x). Local/softcap/varlen
    # spill here and take 128x64 x 8 warps (backends/sm80_fwd.py, _FEATURE_TILES).
    128: FwdTile(tile_m=128, tile_n=32, num_threads=128, num_stages=2),
    # 128x64, 8 warps (FA2's tile), 1 stage: S 32 + O 96 regs/thread; 1.03-1.06x FA2 at 2k/8k (2 stages
    # 1.00-1.04x; 128x32 x 8 warps 0.87-0.90x; 64x64 x 4 warps 0.87-1.00x).
    192: FwdTile(tile_m=128, tile_n=64, num_threads=256, num_stages=1),
    # 64x64, 4 warps (16 rows each), 1 stage: S 32 + O 128 regs/thread, 96 KB smem, so 2 CTAs per SM;
    # 1.02-1.15x FA2 at 512-16k. FA2's 128x64 x 8 warps (1 CTA/SM) is 0.93-1.18x: ahead at long
    # non-causal, behind at short and causal. 32-row warps would need 256 O regs/thread.
    256: FwdTile(tile_m=64, tile_n=64, num_threads=128, num_stages=1),
}


# Tiles for the sm80 forward's local / softcap / varlen variants where the table's tile spills: those
# features keep a few more values in registers through the key loop (window bounds, softcap scale,
# varlen offsets and lengths, which dense kernels read from the parameter bank). At hdim 128 the
# 4-warp 128x32 tile then spills 5-42 registers on sm_90a (causal varlen on sm_80 too; ptxas of DSL
# 4.8.1, 2026-11-21); 8 warps at 128x64 with 2 stages are spill-free, ~8 % slower dense on H200.
FWD_SM80_FEATURE_TILES: dict[int, FwdTile] = {
    128: FwdTile(tile_m=128, tile_n=64, num_threads=256, num_stages=2),
}

@dataclass(frozen=True)
class FwdTileSm90:
    tile_m: int  # query rows per CTA: 64 per MMA warpgroup
    tile_n: int  # key rows per mainloop iteration
    intra_wg_overlap: bool  # issue S_{j} = Q K_j^T before the softmax of the previous block ends
    pingpong: bool  # named-barrier ping-pong between the MMA warpgroups
    persistent: bool = False  # one CTA per SM walking the tiles (kernels/common/tile_scheduler.py)
    num_stages: int = 2  # K/V shared-memory stages (the TMA ring's depth)
    # CTAs per cluster along M sharing each K/V block by TMA multicast (dense, no causal/local mask,
    # no pack_gqa; other calls run the row with 1)
    cluster_m: int = 1
    # Spanning tiles (dense, unmasked, unpacked calls whose heads have >= tile_m / 64 - 1 blocks of 64
    # rows; others run the row without): the warpgroups of a tile take consecutive 64-row blocks that may
    # run on into the next (batch, head), whose K/V come through a second ring of num_stages stages
    span_heads: bool = False
    # Q buffers in smem for seqlen_q <= FWD_SM90_Q_RING_MAX_SEQLEN (persistent rows with room for their
    # own sO and 2 Q: hdim <= 128, not hdim 96's spanning tiles).
    q_stages: int = 1


# Hopper FA3 forward (kernels/sm90/fwd.py): producer warp + tile_m / 64 MMA warpgroups, 2 K/V stages.
# Smem = (tile_m + 2 * 2 * tile_n) * hdim * 2 B (+ tile_m * hdim * 2 B for a persistent kernel's own sO
# when that fits, hdim <= 128; spanning tiles double the K/V stages: hdim 64, 177 KB with its own sO);
# MMA-thread registers ~ S + O + P/2 <= 216 (2 WGs).
# Every row is persistent (one CTA per SM; static schedule non-causal, atomic-counter dynamic schedule
# causal/local): vs one CTA per tile, H200 bf16 16k tokens 2026-11-21, +19-24 % at s = 512, +9-14 % at
# 1k, +2-9 % at 2k-4k, -1..+7 % at 16k over hdim 64/128/256 (perf/NOTES.md, "Persistent tile schedulers").
FWD_SM90_TILES: dict[int, FwdTileSm90] = {
    # 192x128, 3 MMA WGs at 160 regs (FA4's tile): S 64 + O 32 + P 32 = 128 regs/thread, smem 88 KB.
    # Measured vs 128x128 with 2 WGs (H200, bf16, 16k tokens, 2026-11-21): +7..23% at every seqlen
    # 512-16k non-causal (519 vs 423 TFLOP/s at 16k); causal -1..+8% at >= 2k but -9% at 512-1k
    # (more diagonal waste per 192-row tile). Numbers in perf/NOTES.md.
    # Spanning tiles where 192-row tiles would compute >= 2 % of rows past the sequence (SPAN_MIN_PADDING).
    64: FwdTileSm90(
        tile_m=192, tile_n=128, intra_wg_overlap=True, pingpong=True, persistent=True, span_heads=True, q_stages=2
    ),
    # 128x128, 2 MMA WGs (FA4's tile): smem 160 KB, regs S 64 + O 64 + P 32 = 160 of the 240 each MMA
    # thread gets after setmaxnreg. FA3 C++'s non-causal 128x176 measured no better here (H200,
    # 2026-11-21: 400-624 vs 431-635 TFLOP/s).
    128: FwdTileSm90(tile_m=128, tile_n=128, intra_wg_overlap=True, pingpong=True, persistent=True, q_stages=2),
    # 192x128 with 3 WGs would need S 64 + O 32 + P 32 + ... > the 128 accumulator registers of a
    # 160-register thread, and FA3/FA4's 192x144 is an SS P.V (P through smem), which this kernel
    # lacks; so 128x128 on 2 WGs as for 128: S 64 + O 48 + P 32 = 144 regs, smem 24 + 48 + 48 KB.
    # Native instead of zero-padded to 128: 363-531 TFLOP/s non-causal at 512-8k vs ~325-482 padded;
    # 192x96 on 3 WGs is +4 % at >= 2k but -7 % at 512 (H200, bf16, 2026-11-21, perf/NOTES.md).
    96: FwdTileSm90(tile_m=128, tile_n=128, intra_wg_overlap=True, pingpong=True, persistent=True, q_stages=2),
    # 128x112 (FA3/FA4 for d = dv = 192): S 56 + O 96 + P 28 = 180 regs; smem 48 + 84 + 84 = 216 KB
    # (128x128 would need 240 KB). No ping-pong above 128 (FA3/FA4). Native instead of padded to 256:
    # 448-680 TFLOP/s non-causal at 512-8k vs ~357-540 padded; 128x96 within -3..+7 % (H200, 2026-11-21).
    192: FwdTileSm90(tile_m=128, tile_n=112, intra_wg_overlap=True, pingpong=False, persistent=True),
    # 128x80 (FA3/FA4): O takes 128 regs/thread, so S 40 + P 20 keep it under 240; smem 64 + 80 + 80
    # = 224 KB is the most 2 stages allow (227 KB). No ping-pong above hdim 128 (FA3/FA4 rule).
    # Clusters of 2 where they pay (cluster_pays; see FWD_SM90_CLUSTER_MIN_SEQLEN for the figures).
    256: FwdTileSm90(tile_m=128, tile_n=80, intra_wg_overlap=True, pingpong=False, persistent=True, cluster_m=2),
}

# Two Q buffers (a row's q_stages) only up to this seqlen_q (dense calls; varlen keeps one). With 2 the
# producer loads the next tile's Q while this tile still reads its own; with 1 a short tile waits for
# its Q after the previous tile's last QK^T. H100, bf16, 16k tokens, 2026-11-21, 2 vs 1, 3 repeats, two
# runs (perf/NOTES.md session 13): hdim 64 +7-8 % at 512 non-causal, +2-5 % at 1k-2k, causal -1..+5 %;
# hdim 96 +4-5 % at 512, +1-3 % at 1k; hdim 128 +2-5 % at 512-1k, +1-3 % at 2k; at 4k-16k nothing to
# gain (a tile is long next to its Q load) and -2..+2 % (one cell -7 %) measured.
FWD_SM90_Q_RING_MAX_SEQLEN = 2048

# A gated sm90 forward takes the keys' bias as an extra k16 slice of the QK^T GEMM (no add per score)
# from this many keys (varlen: max_seqlen_k given as an int), where the slice fits the key's smem
# (kernels/sm90/fwd_budget.py ``gate_in_gemm``). The slice is built per call, a cost per token at every
# seqlen, while the kernel's saving grows with the keys. Built by one Triton kernel (CUDA with Triton) it
# pays from 1k keys (H100, perf/NOTES.md session 27: gated / plain at hdim 64 1k 0.73 -> 0.80, 2k 0.76 ->
# 0.88); built by six torch ops (``_TORCH``) only from 4k (session 26: +9 % at hdim 64 1k).
FWD_SM90_GATE_SLICE_MIN_SEQLEN_K = 1024
FWD_SM90_GATE_SLICE_MIN_SEQLEN_K_TORCH = 4096
# The gated sm90 forward skips the P.V GEMM of a key block whose P underflowed to 0 in a whole MMA warpgroup (keys
# decayed past 2**-126 of the row's max: exp2 flushes them to 0, so the skipped product is exactly 0); each block
# then costs one bar.red vote per warpgroup. Off: exact (tests), but +10 % at 16k keys and a loss at 1k-4k alone, and
# nothing beside the whole-block skip below (H100 / H200, perf/NOTES.md session 40).
FWD_SM90_GATE_SKIP_ZERO_PV = False
# Dense gated calls from this many keys, with Triton: the launcher bounds, per tile, which key blocks can hold a nonzero
# P (norms of q and k against the decay: backends/gate_blocks.py, two Triton launches per call; its torch build made
# every call host-bound), and the kernel's producer and MMA warpgroups start each tile at the first such block: decayed
# blocks neither loaded nor computed (exact: their P are 0 in fp32). Gated / plain causal forward with bench_gate's
# gates (H200, NOTES session 40): 1.03-1.09x at 4k keys, 1.8x at 8k, 3.1x at 16k; at 1k 0.59x (nothing to skip, the
# norms' pass is the cost), hence the threshold.
FWD_SM90_GATE_SKIP_DECAYED = True
FWD_SM90_GATE_SKIP_DECAYED_MIN_SEQLEN_K = 4096
# Plain varlen calls keep a plan per signature (api: ``PackedFwdPlan``, the backward's plan kept on it), as dense
# calls do: a repeated call skips validation, dispatch and key building (H200, NOTES session 40: a tiny packed call's
# host time fwd 140 -> 46 us, fwd + bwd 545 -> 315 us).
VARLEN_PLANS = True
# The gated sm90 backward's per-key dS sums by one more WGMMA beside dK's (dS^T times a tile of ones,
# kernels/sm90/bwd_gate.py) instead of each thread's adds and a quad shuffle, and its per-query sums beside dQ's
# (dS times a tile of ones, staged whole for the dQ writer). The two together serialize every WGMMA at head_dim 128
# (ptxas C7512), so there the key builder takes the query half only. H100 (perf/NOTES.md session 39, gated causal
# backward / plain, 1k-16k): hdim 64 0.91 / 0.89 / 0.89 / 0.91 -> 0.94 / 0.94 / 0.92 / 0.97 with both, hdim 128
# 0.88 / 0.94 / 0.94 / 0.97 -> 0.95 / 0.97 / 1.01 / 1.01 with the query half; the key half alone within the spread.
BWD_SM90_GATE_KEY_MMA = True
BWD_SM90_GATE_QUERY_MMA = True
# The gated sm90 backward's mirror of FWD_SM90_GATE_SKIP_DECAYED: dense causal calls without a window, from this many
# keys, not deterministic: the launcher bounds, per (query head, key block), the last query block whose P can be nonzero
# (backends/gate_blocks.py ``last_live_rows``, two Triton launches; not without Triton) and every role of the key
# block's CTA stops there (exact: the skipped blocks' P, dS and so every gradient part are 0 in fp32). Gated backward
# with / without it, bench_gate's gates (H200, perf/NOTES.md session 40): 1.25-1.28x at 4k keys, 1.9-2.1x at 8k, 3.8x at
# 16k.
BWD_SM90_GATE_SKIP_DECAYED = True
BWD_SM90_GATE_SKIP_DECAYED_MIN_SEQLEN_K = 4096
# Both skips above on packed self-attention too (one cu_seqlens for queries and keys, no seqused, an int max_seqlen from
# their min length; the tables a row per sequence: kernels/triton/gate_blocks.py ``VARLEN``; the backward's key takes
# the skip whatever the call's lengths, and a call the table does not serve passes one that skips nothing). Packed
# on / off, bench_gate's gates, 16k tokens (H100, perf/NOTES.md session 41): fwd 1.14-1.21x at 4k sequences, 3.2-3.4x
# at 16k; bwd 1.35-1.36x and 3.7-3.8x; the 1k kernels unchanged.
GATE_SKIP_DECAYED_VARLEN = True

# Clusters of 2 (cluster_m = 2: two CTAs on adjacent m_blocks share each K/V block by TMA multicast, FA3's
# ClusterShape for d >= 128 non-causal) on the hdim 256 row, for dense unmasked calls from this seqlen_q
# (cluster_pays). K/V then cross the L2 -> SM fabric once per pair: about the same work per clock for
# less energy, and these kernels run at the 700 W cap, so the clock rises (1560 -> 1620 MHz, H200).
# Measured, bf16, 16k tokens, 2026-11-21 (perf/NOTES.md session 14), cluster / none, interleaved:
# - steady state (each kernel looping 1-2 s, perf/power_probe.py, bench --steady): hdim 256 H200
#   +1.0..+1.4 % at 2k, +2.0..+2.6 % at 4k, +2.1..+3.2 % at 8k, +2.7..+3.8 % at 16k; H100 +1.1 / +1.8 /
#   +2.2..+2.8 / +2.0..+2.4 %; hdim 128 -1.4..+0.2 % (the clock rises less than the work per clock
#   falls), hdim 64 -4.5 % at 8k (43 m_blocks of 192 rows: the odd one's pair computes a tile past the
#   end), 0 at 16k;
# - do_bench (100 ms of calls, each behind an L2 flush, so the power cap binds less): hdim 256 H100
#   -0.5 % at 2k, -2.2 % at 4k, +2.8 % at 8k, +4.3 % at 16k (session 8: -1 % at 2k, -3 % at 4k).
# So from 8k, where both ways of running gain; at 2k-4k the steady gain and the short-run loss cancel.
# From 8k a 128-row tile has >= 64 m_blocks: an odd count's last pair wastes < 1.6 % on its tile past
# the end. Measured with seqlen_k = seqlen_q only, so seqlen_k must reach it too (short tiles, where the
# pair's lockstep weighs more and less K/V crosses the fabric per tile, are unmeasured).
FWD_SM90_CLUSTER_MIN_SEQLEN = 8192


def cluster_pays(seqlen_q: int, seqlen_k: int | None = None) -> bool:
    """Whether the hdim 256 row's clusters of 2 pay for a dense call (``seqlen_k`` None: as long as
    ``seqlen_q``)."""
    return min(seqlen_q, seqlen_q if seqlen_k is None else seqlen_k) >= FWD_SM90_CLUSTER_MIN_SEQLEN


# Short sequences, where the table row's tile wastes more than it gains (rows past the diagonal in a
# tall causal tile; too few key blocks per tile to amortise a wide one): (largest seqlen_q without a
# causal/local mask, largest with one, tile); 0 = never. Measured persistent, H200, bf16, 16k tokens,
# 2026-11-21 (perf/NOTES.md "Short-sequence tiles" and "Self-resetting tile counter, native v head dim"):
FWD_SM90_SHORT_TILES: dict[int, tuple[int, int, FwdTileSm90]] = {
    # hdim 64 causal: 128x128 on 2 WGs vs 192x128 on 3: 245 vs 208 TFLOP/s at 512, 324 vs 279 at 1k,
    # 381 vs 385 at 2k (non-causal: equal at <= 1k, -10 % at 2k, so causal only). 128x64, 128x96 and
    # 192x96 lost 9-15 % at 512-2k causal, 128x192 and 192x96 7-13 % at 512-1k non-causal.
    # 3 K/V stages since the Q ring (session 13): with the next tile's Q prefetched, its first K/V
    # blocks are what a short tile waits for; +2.0 / +0.9 / +0.3-1.3 % at 512 / 1k / 1.5k causal (H100,
    # 5 and 7 repeats; 4 stages the same as 3), where before the Q ring 3 stages read -1 %.
    64: (0, 1536, FwdTileSm90(
        tile_m=128, tile_n=128, intra_wg_overlap=True, pingpong=True, persistent=True, num_stages=3, q_stages=2
    )),
    # hdim 256, 128x64 vs 128x80: 511 vs 494 non-causal and 326 vs 307 causal at 512 (fewer padded keys
    # in the last block of 512); at 1k -7 % non-causal but +3 % causal (449 vs 437, fewer masked keys
    # on the diagonal); at 2k causal -1 %.
    256: (768, 1536, FwdTileSm90(tile_m=128, tile_n=64, intra_wg_overlap=True, pingpong=False, persistent=True)),
    # hdim 192, 128x64 vs 128x112 (H100, 5 repeats, 2026-11-21): 500 vs 458 non-causal and 305 vs 266 causal at
    # 512, 591 vs 547 and 452 vs 406 at 1k (a 112-key block leaves 12.5 % / 8.6 % of the last block padded at
    # 512 / 1k; 64 divides both; its smem also has room for an own sO), -2 % / +4 % at 2k, -7 % / -2 % at 4k.
    192: (1024, 2048, FwdTileSm90(tile_m=128, tile_n=64, intra_wg_overlap=True, pingpong=False, persistent=True)),
}


# v's head dim other than q's (kernel head dims (qk, v)). Below q's, O takes fewer registers and sV
# less smem than the qk row assumes. 192/128 (DeepSeek-style MLA prefill): FA3's 128x128 (S 64 + O 64
# + P 32 = 160 regs; smem Q 48 + K 96 + V 64 = 208 KB, sO in sQ's buffer) instead of the 192 row's 128x112.
# Above q's (v wider than q/k; FA3's 64/256), sO always has its own buffer (it cannot live in sQ's, and
# a warpgroup's O would land on another's Q), so smem = Q + own sO + 2 stages of K and V; registers are
# the v row's (O at v's width). Pairs not listed take sm90_dv_above_tile (the v row's tile, tile_n
# shrunk until own sO fits).
FWD_SM90_DV_TILES: dict[tuple[int, int], FwdTileSm90] = {
    (192, 128): FwdTileSm90(tile_m=128, tile_n=128, intra_wg_overlap=True, pingpong=False, persistent=True),
    # 128/256: 128x64 beat the widest fitting tile (128x80, hdim 256's row settings) by 3-14 % in every
    # cell, 1k-16k causal or not (H100, perf/results/...-s18/bench_head_dim_v.md).
    (128, 256): FwdTileSm90(tile_m=128, tile_n=64, intra_wg_overlap=True, pingpong=False, persistent=True),
}


def sm90_dv_above_tile(hdim: int, hdim_v: int) -> FwdTileSm90:
    """The tile of a v head dim above q/k's that FWD_SM90_DV_TILES does not list: the v row's tile
    (its registers hold O at v's width) without clusters, spanning tiles or a second Q buffer, with
    the widest tile_n (multiple of 16) whose smem holds Q, K and V stages and an own sO."""
    from .kernels.sm90.fwd_budget import SMEM_CAPACITY, smem_bytes

    row = FWD_SM90_TILES[hdim_v]
    tile_n = row.tile_n
    while tile_n > 16 and smem_bytes(2, hdim, hdim_v, row.tile_m, tile_n, row.num_stages, True) > SMEM_CAPACITY:
        tile_n -= 16
    return replace(row, tile_n=tile_n, cluster_m=1, span_heads=False, q_stages=1)


# Spanning tiles (FwdTileSm90.span_heads) pay where whole tiles would compute many rows past each sequence:
# H100, bf16, 16k tokens, hdim 64 non-causal, 2026-11-21 (perf/NOTES.md "Session 10"), span / not, 5
# repeats: 375 / 359 TFLOP/s at 512 and 450 / 406 at 1k (192-row tiles pad 12.5 %), 481 / 460 at 2k
# (3.1 %); 518 / 515 at 8k (0.8 %). A first version (one main loop) cost 0-2 % where nothing is padded
# (514 / 512 at 6k, 507 / 517 at 12k). Shipped from this fraction of padded rows up.
SPAN_MIN_PADDING = 0.02


def span_pays(tile_m: int, seqlen_q: int) -> bool:
    """Whether whole ``tile_m``-row tiles would compute at least ``SPAN_MIN_PADDING`` of a sequence's
    rows past its end (spanning tiles compute none but in a launch's last tile)."""
    padded = -(-seqlen_q // tile_m) * tile_m - seqlen_q
    return padded >= SPAN_MIN_PADDING * seqlen_q


# FP8 (e4m3) forward (kernels/sm90/fwd_fp8.py): tile_n a multiple of 32 (P.V's k), smem = Q + 3 x 2 stages
# of tile_n x hdim bytes (K, V as loaded, V^T) + a bf16 sO (kernels/sm90/fwd_budget.fp8_smem_bytes).
# Rows measured 2026-11-25 (H100, 16k tokens, perf/bench_fp8_tiles.py): 64: 192x128 on 3 WGs (S 64 + O 32 +
# P 16 regs; 128x128 on 2 WGs -20 %); 128: 128x192 (S 96 + O 64 + P 24; 192 KB), +4-6 % over 128x128 at 16k,
# +1-6 % at 4k, 128x160 between them, 128x64 -16 %; 256: 128x64 (S 32 + O 128 + P 8; 192 KB: 128x128 needs
# 288 with its own bf16 sO). Ping-pong on or off within +-3 % everywhere.
FWD_SM90_FP8_TILES: dict[int, FwdTileSm90] = {
    64: FwdTileSm90(tile_m=192, tile_n=128, intra_wg_overlap=True, pingpong=True, persistent=True),
    128: FwdTileSm90(tile_m=128, tile_n=192, intra_wg_overlap=True, pingpong=True, persistent=True),
    256: FwdTileSm90(tile_m=128, tile_n=64, intra_wg_overlap=True, pingpong=False, persistent=True),
}
# The V^T kernel (v's keys contiguous: ``fp8_v_colmajor``, no sVt buffer). Measured 2026-11-27 (H100, 8k and 2k, perf/bench_fp8_tiles.py --v-layout keys): 256: 128x128 (S 64 +
# O 128 + P 16 = 208 regs, 225 KB) +18-20 % non-causal and +13-14 % causal over 128x64 (1,170 TFLOP/s non-causal at
# 8k), 128x96 between them; 128: 128x192 kept (128x128 -3..-6 %, 128x224 -2..-7 %); 3 K/V stages within +-1 %.
FWD_SM90_FP8_VT_TILES: dict[int, FwdTileSm90] = {
    **FWD_SM90_FP8_TILES,
    256: FwdTileSm90(tile_m=128, tile_n=128, intra_wg_overlap=True, pingpong=False, persistent=True),
}
# Per-block descales: the (q rows, k/v keys) one descale covers (``fp8.kernel_tiles``, ``quantize_qkv``), whatever
# v's layout: q's rows are both kernels' tile_m, k/v's keys a multiple of both kernels' tile_n (the 128 x 64
# kernel at hdim 256 reads one k/v descale per two of its key blocks: ``fp8_scale_tile_n``).
FWD_SM90_FP8_SCALE_TILES: dict[int, tuple[int, int]] = {64: (192, 128), 128: (128, 192), 256: (128, 128)}
# The FP8 forward rescales O lazily (kernels/sm90/fwd_fp8.py ``lazy_rescale``: a row keeps its max within 2**1.8,
# P = 2**7 * p, a warp whose rows kept theirs skips the O multiply), as the 16-bit forward does. Per-tensor
# descales, H100 (perf/NOTES.md session 42): hdim 256 +1 to +7 %, hdim 128 rows-major v +0 to +11 %, keys-major -2 to 0 %.
FWD_SM90_FP8_LAZY_RESCALE = True


def sm90_fwd_tile(
    hdim: int, causal: bool, seqlen_q: int | None, hdim_v: int | None = None, seqlen_k: int | None = None
) -> FwdTileSm90:
    """The sm90 forward tile for kernel head dims (``hdim_v`` None: = ``hdim``; ``seqlen_q`` None:
    the table row, the long-sequence tile). A row's clusters only where ``cluster_pays``."""
    if hdim_v is not None and (hdim, hdim_v) in FWD_SM90_DV_TILES:
        return FWD_SM90_DV_TILES[(hdim, hdim_v)]
    if hdim_v is not None and hdim_v > hdim:
        return _dv_above_tile(hdim, hdim_v)
    short = FWD_SM90_SHORT_TILES.get(hdim)
    if short is not None and seqlen_q is not None and seqlen_q <= short[1 if causal else 0]:
        return short[2]
    row = FWD_SM90_TILES[hdim]
    if row.cluster_m > 1 and seqlen_q is not None and not cluster_pays(seqlen_q, seqlen_k):
        return _without_clusters(row)
    return row


@functools.cache
def _dv_above_tile(hdim: int, hdim_v: int) -> FwdTileSm90:
    """``sm90_dv_above_tile`` (cached: the launcher asks on every call)."""
    return sm90_dv_above_tile(hdim, hdim_v)


@functools.cache
def _without_clusters(tile: FwdTileSm90) -> FwdTileSm90:
    """``tile`` with cluster_m = 1 (cached: the launcher asks on every call)."""
    return replace(tile, cluster_m=1)


def kernel_head_dim(table: dict[int, FwdTile], head_dim: int, head_dim_v: int) -> int | None:
    """Smallest compiled head dim that holds both head dims, or None if the table has none."""
    need = max(head_dim, head_dim_v)
    fits = [d for d in sorted(table) if d >= need]
    return fits[0] if fits else None


def kernel_head_dims(table: dict, head_dim: int, head_dim_v: int) -> tuple[int, int] | None:
    """(qk, v) kernel head dims: the smallest row holding q/k's head dim and the smallest holding v's,
    each run at its own width (192/128 and 64/256 natively; 80/40 as 96/64), or None if the table
    has no row for one of them."""
    qk = [d for d in sorted(table) if d >= head_dim]
    v = [d for d in sorted(table) if d >= head_dim_v]
    if not qk or not v:
        return None
    return qk[0], v[0]


@dataclass(frozen=True)
class BwdSm80Tile:
    tile_m: int  # query rows per m_block step
    tile_n: int  # key rows per CTA (dK/dV accumulated in registers)
    num_threads: int
    atom_m_sdp: int  # warps along M of the S/dP GEMMs (the rest along N)
    atom_n_dkv: int  # warps along M (= keys) of the dK/dV GEMMs
    atom_m_dq: int  # warps along M of the dQ GEMM
    # Q / dO smem buffers. 2: the next block's load is issued at the top of a block and lands
    # during all of it; 1: issued behind a barrier after the operand's last GEMM (dO after dV,
    # Q after dK; with 1 + 1, both after dK: measured 1-5 % faster than refilling dO early).
    stages_q: int = 2
    stages_do: int = 2
    dv_first: bool = False  # dV GEMM before dQ (FA2's order) instead of dQ, dV, dK
    # P and dS to smem with stmatrix (sm_90 rows only) instead of 32-bit shared stores: a quarter of
    # the store instructions in the MIO queue the warps wait on (ldmatrix, shared stores and exp2).
    stmatrix_pds: bool = False


# Ampere FA2 backward (kernels/sm80/bwd.py): 8 warps, K/V once per CTA.
# Smem = ((stages_q + stages_do) * tile_m + 2 * tile_n) * hdim * 2 B + 2 * tile_m * tile_n * 2 B
# (Q, dO; K, V; P, dS); sm80 allows 164 KiB per CTA, sm90 227 KiB (BWD_SM80_TILES_SM90).
BWD_SM80_TILES: dict[int, BwdSm80Tile] = {
    # 128x128, warps 4x2 for every GEMM: FA2/FA3's sm80 bwd tile for d=64 (8 warps); 160 KiB smem;
    # accumulators dK+dV 64 + S+dP 128 fp32 registers per thread.
    64: BwdSm80Tile(tile_m=128, tile_n=128, num_threads=256, atom_m_sdp=4, atom_n_dkv=4, atom_m_dq=4),
    # 64x128, warps 2x4: FA2/FA3's sm80 bwd tile for d=128 (8 warps); 160 KiB smem; dK+dV 128 + S+dP 64
    # fp32 registers per thread. (FA2/FA3 use 64x64 for d=256.)
    128: BwdSm80Tile(tile_m=64, tile_n=128, num_threads=256, atom_m_sdp=2, atom_n_dkv=2, atom_m_dq=2),
    # 64x128, warps 2x4 / 4x2 / 4x2: FA2's sm80 bwd tile for d=96; 128 KiB smem; dK+dV 96 + S+dP 64
    # fp32 registers per thread (rows of 12 16-byte chunks: 4 threads per 64-byte row segment).
    96: BwdSm80Tile(tile_m=64, tile_n=128, num_threads=256, atom_m_sdp=2, atom_n_dkv=4, atom_m_dq=4),
    # 64x64, warps 4x2 / 2x4 / 2x4: FA2's sm80 bwd tile for d=192 (FA3 also has 64x80); 160 KiB smem
    # with 2 Q/dO stages; dK+dV 96 + S+dP 32 fp32 registers per thread.
    192: BwdSm80Tile(tile_m=64, tile_n=64, num_threads=256, atom_m_sdp=4, atom_n_dkv=2, atom_m_dq=2),
    # 64x64 (FA2/FA3's d=256 tile), one Q/dO stage (FA2's A100 schedule): two would need 208 KiB of
    # smem (sm80 has 164); 144 KiB; dK+dV 128 + S+dP 32 fp32 registers per thread.
    256: BwdSm80Tile(tile_m=64, tile_n=64, num_threads=256, atom_m_sdp=4, atom_n_dkv=2, atom_m_dq=2,
                     stages_q=1, stages_do=1),
}


# Rows that replace BWD_SM80_TILES when the sm80 backward is compiled for sm_90a (H100/H200): the
# same mma.sync kernel with Hopper's 227 KiB of smem per CTA, or with sm_90-only stores (stmatrix).
BWD_SM80_TILES_SM90: dict[int, BwdSm80Tile] = {
    # BWD_SM80_TILES' 128x128 with P and dS stored by stmatrix: +2-3 % at 1k-16k, causal or not (H100,
    # 2026-11-21, 3 interleaved repeats; ncu at 16k: MIO-queue stalls -12 %, time -2 %). At d128 it
    # spills 1-4 registers and loses 1-6 %, at d256 it loses ~2 % (perf/NOTES_sm80_bwd.md).
    64: BwdSm80Tile(tile_m=128, tile_n=128, num_threads=256, atom_m_sdp=4, atom_n_dkv=4, atom_m_dq=4,
                    stmatrix_pds=True),
    # 128x64, warps 4x2 / 2x4 / 2x4, 2 Q + 1 dO stages (224 KiB), dV GEMM first so the dO refill
    # overlaps the dQ and dK GEMMs (dQ first, dO refill overlapping dK only: within +-1.5 %):
    # 32-row warps in the S/dP GEMMs read fewer smem bytes per MMA than 64x64's 16-row ones.
    # dK+dV 96 + S+dP 64 fp32 registers per thread, no spills. 1.07-1.38x FA2 at 512-16k vs
    # 0.91-1.27x for 64x64 with 2 + 2 stages (H200, 2026-11-21, perf/NOTES_sm80_bwd.md).
    192: BwdSm80Tile(tile_m=128, tile_n=64, num_threads=256, atom_m_sdp=4, atom_n_dkv=2, atom_m_dq=2,
                     stages_q=2, stages_do=1, dv_first=True),
    # 64x64, 2 Q + 2 dO stages (208 KiB), so every Q/dO load overlaps a whole block, dV GEMM first
    # (FA2's order). H200 vs FA2: 1 + 1 stages 0.83-0.89x at 8k-16k; 2 + 2 stages 0.94-0.99x
    # (0.97-1.22x at 512-4k); dV first on top +4 %: 0.98-1.02x at 8k-16k (perf/NOTES_sm80_bwd.md).
    256: BwdSm80Tile(tile_m=64, tile_n=64, num_threads=256, atom_m_sdp=4, atom_n_dkv=2, atom_m_dq=2,
                     dv_first=True),
}


# A dense or packed gated sm90 forward is launched as a programmatic dependent of the gate's scan kernel
# (kernels/common/gate_scan.py ``pdl``), and the scan's second pass of its first: each launch and prologue overlaps its
# predecessor's tail. A 1k-key gated forward spends ~10 us in the scan beside ~150 us in the kernel (H100, perf/NOTES.md
# session 41).
FWD_GATE_PDL = True


def fwd_gate_pdl(arch: str) -> bool:
    """Whether gated forwards and the gate's scan are chained by programmatic dependent launch
    (``FWD_GATE_PDL`` on sm_90 targets: ``griddepcontrol``, as ``bwd_pdl``)."""
    return FWD_GATE_PDL and arch.startswith("sm_90")


def bwd_pdl(arch: str) -> bool:
    """Whether the backward's preprocess, sm90 main kernel and postprocess are chained by programmatic
    dependent launch (sm_90 targets: ``griddepcontrol``): each is launched while its predecessor in the
    stream finishes and waits in the kernel (``griddepcontrol.wait``) before reading what that one
    wrote, so the launch latency and the prologue between them overlap the predecessor's tail."""
    return arch.startswith("sm_90")


def bwd_dq_red_vec(arch: str) -> int:
    """fp32 values per dQ reduce-add of the sm80 backward (kernels/sm80/bwd.py): 4 on sm_90 targets,
    where PTX has ``red.global.add.v4.f32``, 1 on sm_80. Why: on an H100 (ncu, hdim 64, 16k,
    non-causal, 2026-11-21) our kernel issued the same number of ldmatrix, shared stores, global
    reductions and MMAs as FA2's but its warps waited ~48k cycles each for a full load-store queue
    (``lg_throttle``; FA2's: 34) behind the 32 scalar reductions per thread per query block, issued
    back to back; v4 issues 8 (lg_throttle 10k). Time: +1-3 % at hdim 256, within +-1 % at 64/128
    (the wait moved to the MIO queue; 3 interleaved repeats, perf/NOTES_sm80_bwd.md)."""
    return 4 if arch.startswith("sm_90") else 1


@functools.cache
def bwd_sm80_tile(arch: str, hdim: int, hdim_v: int) -> BwdSm80Tile:
    """The sm80 backward tile for kernel head dims (q/k's, v's). Equal: the row. Different (192/128,
    64/256, 96/192): the wider row's tile, whose accumulators (dK + dV, S + dP) and smem hold both
    (they shrink with the narrower dim), with warps 4 along the M of the dK/dV and dQ GEMMs where the
    row's atoms would split the narrower dim into warp tiles that are not whole (96 against the 192
    row's 2 x 4: 64-column warp tiles)."""
    t = bwd_sm80_tiles(arch)[max(hdim, hdim_v)]
    if hdim == hdim_v:
        return t
    warps = t.num_threads // 32

    def whole(atom: int, *cols: int) -> bool:
        return all(c % (16 * (warps // atom)) == 0 for c in cols)

    if not whole(t.atom_n_dkv, hdim, hdim_v):
        t = replace(t, atom_n_dkv=4)
    if not whole(t.atom_m_dq, hdim):
        t = replace(t, atom_m_dq=4)
    return t


def bwd_sm80_tiles(arch: str) -> dict[int, BwdSm80Tile]:
    """BWD_SM80_TILES with the rows of BWD_SM80_TILES_SM90 on sm_90 targets."""
    if arch.startswith("sm_90"):
        return {**BWD_SM80_TILES, **BWD_SM80_TILES_SM90}
    return BWD_SM80_TILES
