"""Launcher of the Hopper FA3 forward (kernels/sm90/fwd.py): key, compile, launch.

Dense and varlen (packed ``(total, h, d)``) layouts, causal / sliding-window / softcap, GQA/MQA. Head
dims are served by the smallest row of ``configs.FWD_SM90_TILES`` that holds each, q/k's and v's at
their own widths (192/128 and 64/256 natively; inputs zero-padded in Python, the output sliced back).
Nothing here reads device memory: ``cu_seqlens``, ``seqused`` and a tensor ``max_seqlen`` stay on
the GPU (the varlen grid is an upper bound).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

import torch

from .. import configs
from ..fp8 import block_descales
from ..jit import KernelKey
from ..validate import AttnProblem, keys_contiguous
from .common import (
    DTYPE_NAMES, UNBOUNDED_WINDOW, FwdLauncher, FwdPlan, VarlenArgs, aligned_rows, compile_cache, compile_forward,
    current_stream_handle, cutlass_dtype, cluster_ctas, device_index, fake_bshd, fake_f32, keys_contiguous_ready,
    _SINK_PLANS, kept_plan, launch_forward, mask_flags, num_sms, run_kept_plan, target_arch, tile_counter,
    varlen_out_shapes, window_args,
)


@dataclass(frozen=True)
class FwdSm90Key(KernelKey):
    dtype: str
    head_dim: int
    head_dim_v: int
    tile_m: int
    tile_n: int
    causal: bool = False
    # defaults as the table's usual rows, so display names show only what differs (jit.KernelKey)
    intra_wg_overlap: bool = True  # softmax of one block overlaps the next block's QK^T in each warpgroup
    pingpong: bool = True  # two MMA warpgroups alternate GEMMs and softmax (named barriers)
    local: bool = False
    softcap: bool = False
    varlen: bool = False  # cu_seqlens_q and cu_seqlens_k given
    seqused_q: bool = False
    seqused_k: bool = False
    persistent: bool = False  # one CTA per SM walking tiles (else one CTA per tile)
    pack_gqa: int = 1  # query heads per KV head packed into one tile's rows (1: not packed)
    wg_local_epilogue: bool = True  # each MMA warpgroup stores its own rows (no CTA-wide barrier)
    num_stages: int = 2  # K/V shared-memory stages
    cluster_m: int = 1  # CTAs per cluster along M, K/V multicast to all (dense, unmasked, unpacked)
    # causal/local tile order: longest first across sections of heads whose K/V fit in this many
    # MiB of L2 (0: head by head)
    section_l2_mb: int = 16
    # dense, unmasked, unpacked: a tile's warpgroups take consecutive 64-row blocks that may run on
    # into the next (batch, head) (no rows past seqlen_q computed but in the launch's last tile)
    span_heads: bool = False
    # the softmax keeps a row's max until a block's exceeds it by 2**8; warps skip the O rescale
    lazy_rescale: bool = True
    # Q buffers in shared memory (2: the next tile's Q loads under this tile; persistent, own sO)
    q_stages: int = 1
    # a learnable sink logit per query head joins each row's softmax at finalize, one load per tile
    # from the kernel's sink slot (``launch_sinked``); no pack_gqa, no spanning tiles
    sink: bool = False
    # gated log-decay: a bias per (query head, key) added to every score (``forward_with_gate``);
    # no pack_gqa, no spanning tiles, no softcap
    gate: bool = False
    # gated: launched as a programmatic dependent of the gate's scan (``configs.fwd_gate_pdl``): every role waits
    # in the prologue (``griddepcontrol.wait``) before its first global access
    gate_pdl: bool = False
    # the gate's bias as the QK^T GEMM's extra k16 slice where it fits (``gate_slice``), else fp32 rows
    # added per score; long keys only (configs.FWD_SM90_GATE_SLICE_MIN_SEQLEN_K)
    gate_slice: bool = False
    # the gated kernel skips the P.V of a key block whose P underflowed to 0 in a whole warpgroup (an exact skip:
    # configs.FWD_SM90_GATE_SKIP_ZERO_PV); short display name (progress lines within 120 columns)
    gate_skip_pv: bool = field(default=False, metadata={"display": "zskip"})
    # the gated kernel starts each tile at its first key block that may hold a nonzero P (the launcher's table,
    # backends/gate_blocks.py: configs.FWD_SM90_GATE_SKIP_DECAYED; dense, no local window)
    gate_skip_decayed: bool = field(default=False, metadata={"display": "zblk"})
    # FP8 (dtype e4m3) with per-block descales (q per tile of rows, k/v per key block; pack_gqa 1)
    fp8_block_scales: bool = False
    # FP8 with v's keys contiguous (``validate.keys_contiguous``): V^T loaded by TMA as the P.V WGMMA reads it,
    # P's keys reordered in registers, no transposing warps (kernels/sm90/fwd_fp8.py)
    fp8_v_colmajor: bool = False
    # FP8 per-block descales over more keys than tile_n (``configs.FWD_SM90_FP8_SCALE_TILES``; 0: tile_n's)
    fp8_scale_tile_n: int = 0


def q_ring_fits(tile_m: int, tile_n: int, hdim: int, hdim_v: int, kv_stages: int) -> bool:
    """Whether two Q buffers, the own sO and ``kv_stages`` K/V stages fit one CTA's shared memory
    (16-bit elements; the kernel's own count, which imports no DSL)."""
    from ..kernels.sm90.fwd_budget import SMEM_CAPACITY, smem_bytes

    return smem_bytes(2, hdim, hdim_v, tile_m, tile_n, kv_stages, True, 2) <= SMEM_CAPACITY


class FwdSm90(FwdLauncher):
    """FA3 forward: TMA + WGMMA, producer warp + MMA warpgroups, intra-WG overlap, ping-pong."""

    backend = "sm90"
    kind = "fwd_sm90"
    tiles = configs.FWD_SM90_TILES
    # a sink key's tile holds rows of one head (the kernel reads one head's logit per row)
    sink_key_overrides = {"pack_gqa": 1, "span_heads": False}

    def can_implement(self, p: AttnProblem) -> str | None:
        if configs.kernel_head_dim(self.tiles, p.head_dim, p.head_dim_v) is None:
            return (
                f"head dims ({p.head_dim}, {p.head_dim_v}) are not implemented on the sm90 backend; "
                f"supported: head dims up to {max(self.tiles)}"
            )
        if p.softcap < 0.0:
            return f"softcap must be >= 0 (0 disables it), got {p.softcap}"
        # The grid is 1-D over every query tile (kernels/common/tile_scheduler.py).
        tile_m = self.tiles[configs.kernel_head_dim(self.tiles, p.head_dim, p.head_dim_v)].tile_m
        seqlen_tiles = (p.seqlen_q + p.batch * (tile_m - 1)) // tile_m + 1 if p.is_varlen else -(-p.seqlen_q // tile_m)
        if seqlen_tiles * p.nheads * (1 if p.is_varlen else p.batch) >= 2**31:
            return f"batch * seqlen_q * nheads / {tile_m} query tiles must be < 2**31 on the sm90 backend"
        if max(p.seqlen_q, p.seqlen_k) >= UNBOUNDED_WINDOW:
            return f"seqlen_q/seqlen_k ({p.seqlen_q}, {p.seqlen_k}) must be < 2**30 on the sm90 backend"
        return None

    def _key(
        self, arch: str, dtype: str, hdim: int, seqlen_q: int | None = None, hdim_v: int | None = None,
        tile: configs.FwdTileSm90 | None = None, **flags: Any,
    ) -> FwdSm90Key:
        """``tile``: the caller's ``configs.sm90_fwd_tile`` for these arguments, if it has it."""
        hdim_v = hdim if hdim_v is None else hdim_v
        if tile is None:
            masked = flags.get("causal", False) or flags.get("local", False)
            tile = configs.sm90_fwd_tile(hdim, masked, seqlen_q, hdim_v)
        # Clusters need every CTA of one to visit the same key blocks: dense, no mask, no packing;
        # so do the warpgroups of a spanning tile, which also needs every head to have at least
        # tile_m / 64 - 1 blocks of 64 rows (a tile then spans at most two heads), and pays only
        # where whole tiles would pad many rows (configs.span_pays; seqlen_q None: the row's key).
        # A row with both runs clusters (a cluster's CTAs take m_blocks of one head).
        dense_unmasked = not (
            flags.get("causal") or flags.get("local") or flags.get("varlen") or flags.get("pack_gqa", 1) > 1
        )
        cluster_m = tile.cluster_m if dense_unmasked else 1
        span_ok = (
            dense_unmasked and cluster_m == 1 and seqlen_q is not None
            and -(-seqlen_q // 64) >= tile.tile_m // 64 - 1 and configs.span_pays(tile.tile_m, seqlen_q)
        )
        span_heads = tile.span_heads and span_ok
        kv_stages = tile.num_stages * (2 if span_heads else 1)
        q_ring = (
            tile.q_stages > 1 and tile.persistent and seqlen_q is not None
            and seqlen_q <= configs.FWD_SM90_Q_RING_MAX_SEQLEN
            and q_ring_fits(tile.tile_m, tile.tile_n, hdim, hdim_v, kv_stages)
        )
        q_stages = tile.q_stages if q_ring else 1
        return FwdSm90Key(
            kernel=self.kind, arch=arch, dtype=dtype, head_dim=hdim, head_dim_v=hdim_v, tile_m=tile.tile_m,
            tile_n=tile.tile_n, intra_wg_overlap=tile.intra_wg_overlap, pingpong=tile.pingpong,
            persistent=tile.persistent, num_stages=tile.num_stages, q_stages=q_stages,
            cluster_m=cluster_m, span_heads=span_heads, **flags,
        )

    def key(self, p: AttnProblem, arch: str, varlen: VarlenArgs | None = None) -> FwdSm90Key:
        dims = configs.kernel_head_dims(self.tiles, p.head_dim, p.head_dim_v)
        assert dims is not None, "can_implement() must accept the problem first"
        hdim, hdim_v = dims
        if hdim_v < hdim and (hdim % 64 == 0) != (hdim_v % 64 == 0):
            # 96 tiles shared memory with a 64-byte swizzle atom, the other rows with 128 bytes; sO
            # may share sQ's buffer only with the same atom (kernels/sm90/fwd.py), so such pairs
            # (96/64, 128/96, ...) run v zero-padded to q's width. (A v above q's, 96/192 or 64/96,
            # always has its own sO.)
            hdim_v = hdim
        causal, local = mask_flags(p)
        # Varlen: seqlen_q is the total of all sequences, which says nothing about each one's length.
        seqlen_q = None if varlen is not None else p.seqlen_q
        tile = configs.sm90_fwd_tile(hdim, causal or local, seqlen_q, hdim_v, None if varlen else p.seqlen_k)
        return self._key(
            arch, DTYPE_NAMES[p.dtype], hdim, seqlen_q, hdim_v, tile, causal=causal, local=local,
            softcap=p.softcap > 0.0,
            pack_gqa=pack_gqa_factor(p, tile.tile_m, varlen is not None),
            varlen=varlen is not None,
            seqused_q=varlen is not None and varlen.seqused_q is not None,
            seqused_k=varlen is not None and varlen.seqused_k is not None,
        )

    def all_keys(self, arch: str) -> list[FwdSm90Key]:
        """The variants users hit, for precompile and the compile-only tests (sm_90a only: WGMMA/TMA):
        bf16/fp16 x head dims x causal x {dense, varlen (64/128/256 only)}, plus bf16 local and
        softcap at 128, decode-style GQA (pack_gqa 4 and 8, bf16, hdim 128, causal), bf16 192/128 and causal 64/256, the
        spanning tiles, the two-Q-buffer tiles, the cluster rows without clusters, the short-sequence
        tiles and two FP8 keys (per tensor and per block).
        Rarer combinations (local/softcap at other head dims or with varlen, seqused, varlen at 96/192,
        other pack factors) compile on first use."""
        if not arch.startswith("sm_90"):
            return []
        keys = [
            self._key(arch, dtype, hdim, causal=causal, varlen=varlen)
            for hdim in self.tiles for dtype in ("bf16", "fp16") for varlen in (False, True)
            for causal in (False, True) if hdim in (64, 128, 256) or not varlen
        ]
        keys.append(self._key(arch, "bf16", 128, causal=False, local=True))
        keys += [self._key(arch, "bf16", 128, causal=causal, softcap=True) for causal in (False, True)]
        keys += [self._key(arch, "bf16", 128, causal=True, pack_gqa=g) for g in (4, 8)]
        # v's head dim below q's: 192/128 (MLA-style prefill) with its own tile; above it (own sO
        # always): 64/256, flash-attn 3's own pair, one representative.
        keys += [self._key(arch, "bf16", 192, None, 128, causal=causal) for causal in (False, True)]
        keys.append(self._key(arch, "bf16", 64, None, 256, causal=True))
        # Spanning tiles (hdim 64 at 512 rows: 192-row tiles would pad 12.5 %), bf16/fp16.
        keys += [
            self._key(arch, dtype, hdim, 512, causal=False)
            for hdim, tile in self.tiles.items() if tile.span_heads for dtype in ("bf16", "fp16")
        ]
        # Two Q buffers (seqlen_q <= configs.FWD_SM90_Q_RING_MAX_SEQLEN) on the rows that have them.
        keys += [
            self._key(arch, dtype, hdim, 1024, causal=causal)
            for hdim, tile in self.tiles.items() if tile.q_stages > 1 and not tile.span_heads
            for dtype in ("bf16", "fp16") for causal in (False, True)
        ]
        # Rows with clusters (configs.cluster_pays) without them: shorter dense non-causal calls.
        keys += [
            self._key(arch, dtype, hdim, configs.FWD_SM90_CLUSTER_MIN_SEQLEN // 2, causal=False)
            for hdim, tile in self.tiles.items() if tile.cluster_m > 1 for dtype in ("bf16", "fp16")
        ]
        # FP8 (e4m3): per tensor at hdim 128 causal (the transposing warps join the dynamic schedule's
        # handoff), per block at hdim 64 causal (3 MMA warpgroups: the tightest registers).
        keys += [self.fp8_key(_fp8_problem(hdim), arch, block_scales=block) for hdim, block in ((128, False), (64, True))]
        # ... and with v's keys contiguous (V^T by TMA, P's keys reordered in registers).
        keys += [self.fp8_key(_fp8_problem(128), arch, v_colmajor=True)]
        # Short-sequence tiles (configs.FWD_SM90_SHORT_TILES), bf16/fp16, dense.
        keys += [
            self._key(arch, dtype, hdim, bounds[causal], causal=causal)
            for hdim, bounds in configs.FWD_SM90_SHORT_TILES.items()
            for dtype in ("bf16", "fp16") for causal in (False, True) if bounds[causal] > 0
        ]
        return keys

    def fp8_key(
        self, p: AttnProblem, arch: str, varlen: VarlenArgs | None = None, block_scales: bool = False,
        v_colmajor: bool = False,
    ) -> FwdSm90Key:
        """The key of an e4m3 problem (``configs.FWD_SM90_FP8_TILES``, ``FWD_SM90_FP8_VT_TILES`` for the V^T kernel;
        v at q's padded width);
        ``block_scales``: descales per tile of rows (no packed GQA tiles); ``v_colmajor``: v's keys contiguous
        (``fp8_v_colmajor``)."""
        hdim = configs.kernel_head_dim(configs.FWD_SM90_FP8_TILES, p.head_dim, p.head_dim_v)
        assert hdim is not None, "fp8.attention checks the head dims first"
        tile = (configs.FWD_SM90_FP8_VT_TILES if v_colmajor else configs.FWD_SM90_FP8_TILES)[hdim]
        scale_m, scale_n = configs.FWD_SM90_FP8_SCALE_TILES[hdim]
        assert scale_m == tile.tile_m and scale_n % tile.tile_n == 0, "FWD_SM90_FP8_SCALE_TILES fits both kernels"
        causal, local = mask_flags(p)
        return FwdSm90Key(
            kernel=self.kind, arch=arch, dtype="e4m3", head_dim=hdim, head_dim_v=hdim, tile_m=tile.tile_m,
            tile_n=tile.tile_n, causal=causal, local=local, intra_wg_overlap=tile.intra_wg_overlap,
            pingpong=tile.pingpong, persistent=tile.persistent, num_stages=tile.num_stages,
            pack_gqa=1 if block_scales else pack_gqa_factor(p, tile.tile_m, varlen is not None),
            varlen=varlen is not None, seqused_q=varlen is not None and varlen.seqused_q is not None,
            seqused_k=varlen is not None and varlen.seqused_k is not None,
            fp8_block_scales=block_scales, lazy_rescale=configs.FWD_SM90_FP8_LAZY_RESCALE,
            fp8_v_colmajor=v_colmajor, fp8_scale_tile_n=scale_n if block_scales and scale_n != tile.tile_n else 0,
        )

    def forward_fp8(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnProblem, varlen: VarlenArgs | None,
        descale: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` of e4m3 ``q, k, v`` (``flashattn_hopper/fp8.py`` validated them), out bf16;
        ``descale`` fp32 contiguous: ``(3, batch, nheads_k)``, q's, k's and v's descales, or per block
        ``(3, batch, nheads, blocks)`` (q's per tile of rows, k's and v's per key block of the kernel's
        tiles in the first nheads_k heads)."""
        colmajor = keys_contiguous(v)
        if colmajor and (varlen is not None or not keys_contiguous_ready(v)
                         or configs.kernel_head_dim(configs.FWD_SM90_FP8_TILES, p.head_dim, p.head_dim_v) != p.head_dim_v):
            # A row-major copy for the transposing kernel: varlen (a sequence's first key is the TMA box's innermost
            # coordinate, which must fall on 16 bytes: cu_seqlens_k would have to be multiples of 16, unknown on the
            # host without a sync; an unaligned one raised an illegal instruction on an H100), strides the TMA
            # cannot take, or a padded head dim.
            colmajor, v = False, v.contiguous()
        key = self.fp8_key(p, target_arch(), varlen, block_scales=descale.dim() == 4, v_colmajor=colmajor)
        compiled = compile_cache.get(key, self.compile)
        extra = self.extra_args(key, q.device, current_stream_handle(device_index(q.device)))
        q8, k8, v8 = (t.view(torch.uint8) for t in (q, k, v))
        return launch_forward(
            compiled, key, q8, k8, v8, p, varlen, None, None, (*extra[:3], descale, *extra[4:]),
            out_dtype=torch.bfloat16,
        )

    def plan_fp8(self, q: torch.Tensor, p: AttnProblem, block_scales: bool = False,
                 v_colmajor: bool = False) -> Fp8Plan | None:
        """An ``Fp8Plan`` for a dense e4m3 problem with per-tensor descales (``block_scales``: per block,
        ``fp8.descales``) that the kernel takes without padding, else None (the call's checks,
        ``fp8.attention``, passed first); ``v_colmajor``: for v's keys contiguous (``fp8_v_colmajor``)."""
        if p.is_varlen or p.batch == 0 or p.seqlen_q == 0 or p.seqlen_k == 0 or p.nheads == 0:
            return None
        key = self.fp8_key(p, target_arch(), block_scales=block_scales, v_colmajor=v_colmajor)
        if key.head_dim != p.head_dim or key.head_dim_v != p.head_dim_v:
            return None
        if block_scales:  # the kernel's (3, batch, nheads, blocks) (``fp8.descales``)
            q_blocks, k_blocks = -(-p.seqlen_q // key.tile_m), -(-p.seqlen_k // (key.fp8_scale_tile_n or key.tile_n))
            fill_shape: tuple[int, ...] = (3, p.batch, p.nheads, max(q_blocks, k_blocks))
        else:
            fill_shape = (p.batch, p.nheads_k)
        return Fp8Plan(*self._plan_parts(q, p, key), fill_shape)

    def kernel(self, key: FwdSm90Key) -> Any:
        """The kernel object for ``key`` (its static configuration; not yet compiled)."""
        from ..kernels.sm90.fwd import FlashFwdSm90

        if key.dtype == "e4m3":
            from ..kernels.sm90.fwd_fp8 import FlashFwdSm90Fp8

            return FlashFwdSm90Fp8(
                key.head_dim, key.head_dim_v, key.tile_m, key.tile_n, key.causal, is_local=key.local,
                intra_wg_overlap=key.intra_wg_overlap, pingpong=key.pingpong, num_stages=key.num_stages,
                persistent=key.persistent, pack_gqa=key.pack_gqa, wg_local_epilogue=key.wg_local_epilogue,
                section_l2_mb=key.section_l2_mb, block_scales=key.fp8_block_scales, v_colmajor=key.fp8_v_colmajor,
                scale_tile_n=key.fp8_scale_tile_n, lazy_rescale=key.lazy_rescale,
            )

        return FlashFwdSm90(
            cutlass_dtype(key.dtype), key.head_dim, key.head_dim_v, key.tile_m, key.tile_n, key.causal, is_local=key.local,
            has_softcap=key.softcap, intra_wg_overlap=key.intra_wg_overlap, pingpong=key.pingpong,
            persistent=key.persistent, pack_gqa=key.pack_gqa, wg_local_epilogue=key.wg_local_epilogue,
            num_stages=key.num_stages, cluster_m=key.cluster_m, section_l2_mb=key.section_l2_mb,
            span_heads=key.span_heads, lazy_rescale=key.lazy_rescale, q_stages=key.q_stages, has_sink=key.sink,
            has_gate=key.gate, gate_slice=key.gate_slice, skip_zero_pv=key.gate_skip_pv,
            skip_decayed_blocks=key.gate_skip_decayed, pdl=key.gate_pdl,
        )

    def compile(self, key: FwdSm90Key, options: str | None = None) -> Any:
        kernel = self.kernel(key)
        dtype = cutlass_dtype(key.dtype)
        import cutlass
        from cutlass.cute.runtime import make_fake_tensor

        counter = make_fake_tensor(cutlass.Int32, (1,), stride=(1,), assumed_align=4) if _dynamic(key) else None
        if key.dtype == "e4m3":  # inputs as bytes, bf16 O, the (3, batch, nheads_k) descales
            import cutlass.cute as cute

            descale = fake_f32(tuple(cute.sym_int() for _ in range(4 if key.fp8_block_scales else 3)))
            return compile_forward(
                kernel, cutlass.Uint8, key.varlen, key.seqused_q, key.seqused_k, options,
                extra_args=(cutlass.Int32(1), counter, None, descale, None, None), out_dtype=cutlass.BFloat16,
                v_keys_contiguous=key.fp8_v_colmajor,
            )
        gate = None
        from ..kernels.sm90.fwd_budget import GATE_COLS

        if key.gate and not gate_slice(key):  # (batch, nheads, seqlen_k) | varlen (nheads, total_k)
            import cutlass.cute as cute

            gate = fake_f32(tuple(cute.sym_int() for _ in range(2 if key.varlen else 3)), stride_divisibility=4)
        elif key.gate:  # K's slice: (batch, seqlen_k, nheads, GATE_COLS) | varlen (total_k, nheads, GATE_COLS)
            import cutlass.cute as cute
            from cutlass.cute.runtime import make_fake_tensor

            if key.varlen:
                shape = (cute.sym_int(), cute.sym_int(), GATE_COLS)
                strides = (cute.sym_int64(divisibility=8), GATE_COLS, 1)
                gate = make_fake_tensor(dtype, shape, stride=strides, assumed_align=16)
            else:
                gate = fake_bshd(dtype, cute.sym_int(), cute.sym_int(), cute.sym_int(), GATE_COLS)
        return compile_forward(
            kernel, dtype, key.varlen, key.seqused_q, key.seqused_k, options,
            extra_args=(cutlass.Int32(1), counter, gate, None, fake_live_blocks() if key.gate_skip_decayed else None,
                        fake_sink_logits() if key.sink else None),
        )

    def extra_args(self, key: FwdSm90Key, device: torch.device, stream_handle: int | None = None) -> tuple[Any, ...]:
        """``max_ctas`` (one CTA per SM: the kernel runs one CTA per SM at a time; with clusters, as
        many as stay resident together), for the dynamic schedule a tile counter that is zero at
        launch on that stream (``tile_counter``), else None, and the gate's slot: None
        (``forward_with_gate`` puts its bias there), the FP8 descales' slot: None
        (``forward_fp8`` puts them there), the gated key's live-block table's slot: None
        (``forward_with_gate`` puts it there with ``gate_skip_decayed``), and the sink logits' slot: None
        (``launch_sinked`` puts them there)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        ctas = num_sms(index) if key.cluster_m == 1 else cluster_ctas(index, key.cluster_m)
        return ctas, tile_counter(index, stream_handle) if _dynamic(key) else None, None, None, None, None

    def forward_with_gate(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnProblem, varlen: VarlenArgs | None,
        bias: torch.Tensor, k_slice: torch.Tensor | None = None, key: FwdSm90Key | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` with ``bias`` added to every score of its (query head, key) before the
        softmax (``flashattn_hopper/gate.py``: ``-G_j``); ``bias`` fp32 in the scores' units, dense
        ``(batch, nheads, seqlen_k)``, varlen ``(nheads, total_k)``; the kernel takes it as K's extra
        k16 slice (``gate_k_slice``) where the key's kernel takes it (``gate_slice``), else as fp32 rows a
        TMA reads (``aligned_rows``). No softcap; a non-empty problem; the key: ``gate_key`` (``key``: that key,
        kept by the caller). ``k_slice``: the slice already built from ``bias`` (``backends/gate_scan.py``), where the
        key takes one."""
        if key is None:
            key = self.gate_key(p, varlen)
        bias = bias.to(device=q.device)
        if gate_slice(key):
            gate = k_slice if k_slice is not None else gate_k_slice(bias, q.dtype, varlen is not None)
        else:
            gate = aligned_rows(bias)
        if varlen is None:
            # Dense: the gated key's plan, kept like a plain call's: launch_forward's per-call checks and
            # argument building were ~40 us of a gated call's host time (H100: 183 -> 141 us, NOTES s28).
            result = run_kept_plan(_GATE_PLANS, (key, p, q.device), lambda: self.gate_plan(q, p, key), q, k, v, gate,
                                   bias)
            if result is not None:
                return result
        compiled = compile_cache.get(key, self.compile)
        ctas, counter, *_ = self.extra_args(key, q.device, current_stream_handle(device_index(q.device)))
        packed = None if varlen is None else (varlen.cu_seqlens_k, varlen.max_seqlen_k)
        out, lse = launch_forward(compiled, key, q, k, v, p, varlen, None, None,
                                  (ctas, counter, gate, None, live_blocks(key, p, q, k, bias, packed), None))
        return out.contiguous(), lse  # (out is a view where v ran padded)

    def gate_scan_args(self, p: AttnProblem) -> tuple[torch.dtype | None, str]:
        """``(slice_dtype, arch)`` of a dense gated call's scan (``backends/gate_scan.py``): q's dtype where the
        gated key takes K's k16 slice (None: the fp32 rows only) and the key's arch (kept per problem)."""
        args = _GATE_SCAN_ARGS.get(p)
        if args is None:
            key = self.gate_key(p, None)
            args = gate_slice_dtype(key), key.arch
            if len(_GATE_SCAN_ARGS) >= 1024:
                _GATE_SCAN_ARGS.clear()
            _GATE_SCAN_ARGS[p] = args
        return args

    def kept_gate_plan(self, q: torch.Tensor, p: AttnProblem, key: FwdSm90Key | None = None) -> GatePlan | None:
        """The gated call's kept ``GatePlan`` (``_GATE_PLANS``, as ``forward_with_gate`` keeps it); ``key``: a
        packed call's ``gate_key`` (its varlen arguments' max length chose it)."""
        if key is None:
            key = self.gate_key(p, None)
        return kept_plan(_GATE_PLANS, (key, p, q.device), lambda: self.gate_plan(q, p, key))

    def launch_sinked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnProblem, varlen: VarlenArgs | None,
        key: FwdSm90Key, logits: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``FwdLauncher.launch_sinked`` through the kernel's sink slot (the ``(nheads,)`` logits, one load per tile):
        filling the LSE buffer with them was one more launch, 3.6 us beside a 139 us kernel at hdim 128, 1k,
        causal on an H100 (perf/NOTES.md session 41). Dense calls keep a ``SinkPlan``."""
        logits = logits.contiguous()
        if varlen is None:
            result = run_kept_plan(_SINK_PLANS, (key, p, q.device), lambda: self.sink_plan(q, p, key), q, k, v,
                                   logits)
            if result is not None:
                return result
        compiled = compile_cache.get(key, self.compile)
        ctas, counter, *_ = self.extra_args(key, q.device, current_stream_handle(device_index(q.device)))
        out, lse = launch_forward(compiled, key, q, k, v, p, varlen, None, None,
                                  (ctas, counter, None, None, None, logits))
        return out.contiguous(), lse  # (out is a view where v ran padded)

    def sink_plan(self, q: torch.Tensor, p: AttnProblem, key: FwdSm90Key) -> SinkPlan | None:
        """A ``SinkPlan`` of the sink ``key`` for dense ``p``, None where the kernel takes the inputs padded."""
        if key.head_dim != p.head_dim or key.head_dim_v != p.head_dim_v:
            return None
        return SinkPlan(*self._plan_parts(q, p, key))

    def gate_plan(self, q: torch.Tensor, p: AttnProblem, key: FwdSm90Key) -> GatePlan | None:
        """A ``GatePlan`` of the gated ``key`` (``gate_key``) for ``p`` (a varlen problem: ``PackedGatePlan``, for
        packed self-attention), None where the kernel takes the inputs padded (launch_forward's way)."""
        if p.batch == 0 or p.seqlen_q == 0 or p.seqlen_k == 0 or p.nheads == 0:
            return None
        if key.head_dim != p.head_dim or key.head_dim_v != p.head_dim_v or key.softcap:  # (no softcap with a gate)
            return None
        if p.is_varlen:
            return PackedGatePlan(*self._plan_parts(q, p, key)) if not key.seqused_q else None
        return GatePlan(*self._plan_parts(q, p, key))

    def _plan_parts(self, q: torch.Tensor, p: AttnProblem, key: FwdSm90Key) -> tuple[Any, ...]:
        """``(fn, key, p, family, head, counter_device)`` of a gate, FP8 or sink plan: the compiled function, the
        scalars up to ``max_ctas``, the tile counter's device where the schedule is dynamic."""
        fn = compile_cache.get(key, self.compile)
        index = device_index(q.device)
        max_ctas, counter, *_ = self.extra_args(key, q.device, current_stream_handle(index))
        window_left, window_right = window_args(p) if key.local else (0, 0)
        softcap = float(p.softcap) if key.softcap else 1.0
        head = (float(p.softmax_scale), window_left, window_right, softcap, max_ctas)
        return fn, key, p, self, head, None if counter is None else index

    def gate_key(self, p: AttnProblem, varlen: VarlenArgs | None) -> FwdSm90Key:
        """The gated call's key: the plain call's with one head per tile, no spanning tiles and no clusters
        (the combinations the gate's tests run), the bias as the QK^T GEMM's k16 slice asked for from
        ``configs.FWD_SM90_GATE_SLICE_MIN_SEQLEN_K`` keys (``_TORCH`` where the slice is built by torch
        ops: no Triton) (varlen: ``max_seqlen_k`` given as an int), with one Q stage where two leave no room
        for the slice (hdim 128 up to ``configs.FWD_SM90_Q_RING_MAX_SEQLEN``: 242,688 bytes of smem with two).
        Dense calls' keys are kept per problem (``_GATE_KEYS``)."""
        min_keys = (configs.FWD_SM90_GATE_SLICE_MIN_SEQLEN_K if _has_triton()
                    else configs.FWD_SM90_GATE_SLICE_MIN_SEQLEN_K_TORCH)
        arch = target_arch()
        memo = (p, min_keys, arch, configs.FWD_SM90_GATE_SKIP_ZERO_PV, configs.FWD_SM90_GATE_SKIP_DECAYED,
                configs.FWD_GATE_PDL)
        key = _GATE_KEYS.get(memo) if varlen is None else None
        if key is not None:
            return key
        keys = p.seqlen_k if varlen is None else varlen.max_seqlen_k
        long_keys = isinstance(keys, int) and keys >= min_keys
        skips = {"gate_skip_pv": True} if configs.FWD_SM90_GATE_SKIP_ZERO_PV else {}
        if configs.fwd_gate_pdl(arch):
            skips["gate_pdl"] = True
        if (configs.FWD_SM90_GATE_SKIP_DECAYED and p.window_left < 0 and _has_triton()
                and (p.seqlen_k if varlen is None else skippable_packed(varlen))
                >= configs.FWD_SM90_GATE_SKIP_DECAYED_MIN_SEQLEN_K):
            # (causal or not, no left window: gate_blocks.py's bound; its table by Triton: the torch build's ~30 ops
            # per call made every call host-bound)
            skips["gate_skip_decayed"] = True
        key = self.variant_key(p, varlen, gate=True, gate_slice=long_keys, pack_gqa=1, span_heads=False,
                               cluster_m=1, **skips)[1]
        if long_keys and key.q_stages > 1 and not gate_slice(key):
            one_stage = dataclasses.replace(key, q_stages=1)
            key = one_stage if gate_slice(one_stage) else key
        if varlen is None:
            if len(_GATE_KEYS) >= 1024:
                _GATE_KEYS.clear()
            _GATE_KEYS[memo] = key
        return key


def live_blocks(key: FwdSm90Key, p: AttnProblem, q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None,
                packed: tuple[torch.Tensor, int] | None = None) -> torch.Tensor | None:
    """The live-block table (``gate_blocks.first_live_blocks``) of a ``gate_skip_decayed`` key's call, else None;
    ``bias``: the call's fp32 bias rows; ``packed``: packed self-attention's ``(cu_seqlens, max_seqlen)``."""
    if not key.gate_skip_decayed:
        return None
    from .gate_blocks import first_live_blocks

    if bias is None or key.varlen and packed is None:
        raise ValueError("a gate_skip_decayed key's launch needs the fp32 bias rows (packed: and its cu_seqlens)")
    return first_live_blocks(q, k, bias, p.softmax_scale, key.tile_m, key.tile_n, key.causal, packed)


def skippable_packed(varlen: VarlenArgs) -> int:
    """The max length of a packed call the skips of decayed work serve (``configs.GATE_SKIP_DECAYED_VARLEN``: packed
    self-attention, one ``cu_seqlens`` for queries and keys (the same memory), no seqused, an int ``max_seqlen_k``;
    the tables need Triton: without it, building them per sequence would read cu_seqlens on the host), else 0."""
    cu_q, cu_k = varlen.cu_seqlens_q, varlen.cu_seqlens_k
    if (not configs.GATE_SKIP_DECAYED_VARLEN or cu_q.data_ptr() != cu_k.data_ptr() or cu_q.shape != cu_k.shape
            or varlen.seqused_q is not None or varlen.seqused_k is not None
            or not isinstance(varlen.max_seqlen_k, int) or not _has_triton()):
        return 0
    return varlen.max_seqlen_k


def fake_live_blocks() -> Any:
    """The compile-time stand-in of the live-block table: ``(batch, nheads, m_blocks)`` int32, contiguous."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    shape = tuple(cute.sym_int() for _ in range(3))
    return make_fake_tensor(cutlass.Int32, shape, stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)


def fake_sink_logits() -> Any:
    """The compile-time stand-in of a sink key's logits: ``(nheads,)`` fp32, contiguous."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    return make_fake_tensor(cutlass.Float32, (cute.sym_int(),), stride=(1,), assumed_align=4)


def gate_slice_dtype(key: FwdSm90Key) -> torch.dtype | None:
    """The dtype of K's k16 slice where ``key``'s gated kernel takes one (``gate_slice``: q's), else None."""
    return (torch.float16 if key.dtype == "fp16" else torch.bfloat16) if gate_slice(key) else None


@functools.lru_cache(maxsize=1024)  # (a pure function of the key, asked on every gated call)
def gate_slice(key: FwdSm90Key) -> bool:
    """Whether ``key``'s gated kernel takes the bias as the QK^T GEMM's extra k16 slice (else fp32 rows):
    where the key asks for it (``gate_slice``: long keys) and it fits, ``fwd_budget.gate_in_gemm`` with the
    own sO and Q ring ``FlashFwdSm90`` derives from the key (16-bit, one K/V ring: the gate has no
    spanning tiles)."""
    from ..kernels.sm90.fwd_budget import gate_in_gemm

    own_sO = key.persistent or key.head_dim_v > key.head_dim
    return key.gate and key.gate_slice and gate_in_gemm(2, key.head_dim, key.head_dim_v, key.tile_m, key.tile_n, key.num_stages, own_sO, key.q_stages)


def gate_k_slice(bias: torch.Tensor, dtype: torch.dtype, varlen: bool) -> torch.Tensor:
    """K's extra k16 slice of the gated forward (kernels/sm90/fwd.py ``gate_in_gemm``): the bias (fp32, dense
    ``(batch, nheads, seqlen_k)``, varlen ``(nheads, total_k)``) as ``GATE_PARTS`` 16-bit parts per key and
    query head, each the rest of the ones before rounded (as ``gate._parts``: their sum is the bias to fp32's
    precision), zeros in the other columns; ``(batch, seqlen_k, nheads, GATE_COLS)`` | ``(total_k, nheads,
    GATE_COLS)`` (the kernel's k16 slice less the columns it zeroes itself), ``dtype`` (q's). This runs on every
    gated call: on CUDA with Triton one kernel (``kernels/triton/gate_slice.py``, bit for bit the build below), else
    six small ops into one buffer."""
    from ..kernels.sm90.fwd_budget import GATE_COLS, GATE_PARTS

    batch = 1 if varlen else bias.shape[0]
    if bias.is_cuda and _has_triton() and batch <= 65535:  # (batch is the kernel's grid z)
        return _gate_k_slice_triton(bias, dtype, varlen, GATE_COLS, GATE_PARTS)
    return gate_k_slice_torch(bias, dtype, varlen)


def gate_k_slice_torch(bias: torch.Tensor, dtype: torch.dtype, varlen: bool) -> torch.Tensor:
    """``gate_k_slice`` by torch ops (any device)."""
    from ..kernels.sm90.fwd_budget import GATE_COLS, GATE_PARTS

    rows = bias.t() if varlen else bias.transpose(1, 2)  # keys before heads, as k
    k_slice = torch.empty(*rows.shape, GATE_COLS, dtype=dtype, device=bias.device)
    k_slice[..., GATE_PARTS:] = 0
    rest = rows.float()
    for i in range(GATE_PARTS):
        k_slice[..., i] = rest  # (rounded to dtype)
        if i + 1 < GATE_PARTS:
            rest = rest - k_slice[..., i]  # (fp32: the bf16 part promotes)
    return k_slice


@functools.lru_cache(maxsize=1)
def _has_triton() -> bool:
    """Whether the Triton slice kernel imports (installed and working), once per process."""
    import importlib

    try:
        importlib.import_module(f"{__package__.rsplit('.', 1)[0]}.kernels.triton.gate_slice")
    except Exception:  # noqa: BLE001 - missing or broken: the torch build serves
        return False
    return True


def _gate_k_slice_triton(bias: torch.Tensor, dtype: torch.dtype, varlen: bool, slice_cols: int,
                         parts: int) -> torch.Tensor:
    """``gate_k_slice`` by one Triton kernel (CUDA ``bias``)."""
    from ..kernels.triton.gate_slice import gate_slice_kernel

    rows = (bias.unsqueeze(0) if varlen else bias).float()  # (batch, nheads, seqlen_k)
    batch, nheads, seqlen = rows.shape
    k_slice = torch.empty(batch, seqlen, nheads, slice_cols, dtype=dtype, device=bias.device)
    if k_slice.numel() > 0:
        block_h = min(_next_pow2(nheads), 16)
        grid = (-(-seqlen // 64), -(-nheads // block_h), batch)
        args = (rows, k_slice, seqlen, nheads, rows.stride(0), rows.stride(1), rows.stride(2))
        meta = dict(PARTS=parts, SLICE=slice_cols, BLOCK_S=64, BLOCK_H=block_h, num_warps=4)
        on_device_of(bias, lambda: gate_slice_kernel[grid](*args, **meta))
    return k_slice[0] if varlen else k_slice


def on_device_of(t: torch.Tensor, launch: Callable[[], None]) -> None:
    """``launch()`` (Triton kernels) with ``t``'s device current: Triton launches on the current device and
    stream."""
    if not t.is_cuda or t.device.index == torch.cuda.current_device():
        launch()
    else:
        with torch.cuda.device(t.device):
            launch()


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _fp8_problem(hdim: int) -> AttnProblem:
    """A causal e4m3 problem with unpacked heads (``all_keys``' FP8 representatives)."""
    return AttnProblem(
        batch=1, seqlen_q=4096, seqlen_k=4096, nheads=8, nheads_k=8, head_dim=hdim, head_dim_v=hdim,
        dtype=torch.float8_e4m3fn, softmax_scale=1.0, causal=True, window_left=-1, window_right=0, softcap=0.0,
        is_varlen=False,
    )


def pack_gqa_factor(p: AttnProblem, tile_m: int, varlen: bool) -> int:
    """Query heads per KV head to pack into one tile's rows (1: none), FA3's rule in our words: pack
    when the query tiles of one head would be less than 90 % as full as packed ones (short seqlen_q:
    decode, chunked prefill). Packed tiles also read each K/V block once for all g heads. Needs a
    dense layout and g dividing tile_m (a tile holds whole queries)."""
    g = p.nheads // p.nheads_k
    if g == 1 or varlen or tile_m % g != 0:
        return 1

    def fill(rows: int) -> float:
        return rows / (-(-rows // tile_m) * tile_m)

    return g if fill(p.seqlen_q) < 0.9 * fill(p.seqlen_q * g) else 1


def _dynamic(key: FwdSm90Key) -> bool:
    """Persistent causal/local kernels take tiles from an atomic counter (costs differ per tile)."""
    return key.persistent and (key.causal or key.local)


class GatePlan(FwdPlan):
    """``FwdPlan`` of a dense gated call (``FwdSm90.gate_plan``): the call's gate tensor (K's k16 slice or the
    fp32 bias rows, as ``forward_with_gate`` builds it) goes into the kernel's gate slot."""

    __slots__ = ()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                 gate: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``bias``: the fp32 bias rows, read for the live-block table of a ``gate_skip_decayed`` key."""
        out = q.new_empty(self.out_shape)
        lse = q.new_empty(self.lse_shape, dtype=torch.float32)
        counter = None if self.counter_device is None else tile_counter(self.counter_device)
        self.fn(q, k, v, out, lse, *self.head, counter, gate, None, live_blocks(self.key, self.problem, q, k, bias),
                None, None, None, None, None)
        return out, lse


class PackedGatePlan(GatePlan):
    """``GatePlan`` of a gated call on packed self-attention (``FwdSm90.gate_plan`` of a varlen problem: out
    ``(total, nheads, head_dim_v)``, the LSE ``(nheads, total)``); the call's cu_seqlens (int32, contiguous: the
    caller checked) go in for queries and keys alike, no seqused."""

    __slots__ = ()

    def __init__(self, *parts: Any) -> None:
        super().__init__(*parts)
        self.out_shape, self.lse_shape = varlen_out_shapes(self.problem)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                 gate: torch.Tensor, cu_seqlens: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 max_seqlen: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``bias``, ``max_seqlen``: the fp32 bias rows and the call's max length, read for the live-block table of
        a ``gate_skip_decayed`` key (``configs.GATE_SKIP_DECAYED_VARLEN``)."""
        out = q.new_empty(self.out_shape)
        lse = q.new_empty(self.lse_shape, dtype=torch.float32)
        counter = None if self.counter_device is None else tile_counter(self.counter_device)
        live = live_blocks(self.key, self.problem, q, k, bias, (cu_seqlens, max_seqlen))
        self.fn(q, k, v, out, lse, *self.head, counter, gate, None, live, None, cu_seqlens, cu_seqlens, None, None)
        return out, lse


class SinkPlan(FwdPlan):
    """``FwdPlan`` of a dense sinked call (``FwdSm90.sink_plan``): the call's ``(nheads,)`` fp32 logits go into the
    kernel's sink slot."""

    __slots__ = ()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                 logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = q.new_empty(self.out_shape)
        lse = q.new_empty(self.lse_shape, dtype=torch.float32)
        counter = None if self.counter_device is None else tile_counter(self.counter_device)
        self.fn(q, k, v, out, lse, *self.head, counter, None, None, None, logits, None, None, None, None)
        return out, lse


_GATE_PLANS: dict[tuple[Any, ...], GatePlan | None] = {}  # (gated key, problem, device) -> plan (forward_with_gate)
# problem -> gate_scan_args (a stale entry after a threshold change costs only a slice built or dropped again:
# forward_with_gate decides from its own key)
_GATE_SCAN_ARGS: dict[AttnProblem, tuple[torch.dtype | None, str]] = {}
# (dense problem, slice threshold, arch, FWD_SM90_GATE_SKIP_ZERO_PV, _DECAYED) -> gate_key
_GATE_KEYS: dict[tuple[AttnProblem, int, str, bool, bool], FwdSm90Key] = {}


class Fp8Plan(FwdPlan):
    """``FwdPlan`` of an e4m3 call (``FwdSm90.plan_fp8``): q, k, v go in as their bytes, O comes out
    bf16, and the call's ``q/k/v_descale`` (the signature fixed which are given and their shapes, dtypes and
    device; None: 1) become the kernel's descales: per tensor (``(batch, nheads_k)`` each) stacked into
    ``(3, batch, nheads_k)``; per block (``key.fp8_block_scales``, ``fp8.descales``' shapes: q's per tile of
    rows, k's and v's per key block) stacked where all three are given at the full ``(batch, nheads,
    blocks)`` (MHA, as many key blocks as query blocks), else each given one copied into fresh ones. The
    plan holds no tensor: a CUDA graph that captured a call must not read one that an evicted plan frees."""

    __slots__ = ("fill_shape", "stack")

    def __init__(self, fn: Any, key: Any, problem: AttnProblem, family: Any, head: tuple[Any, ...],
                 counter_device: int | None, fill_shape: tuple[int, ...]) -> None:
        super().__init__(fn, key, problem, family, head, counter_device)
        self.fill_shape = fill_shape  # the ones of an omitted descale (per block: of all three)
        self.stack: bool | None = None  # per block: whether the calls' descales stack (their first call says)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                 descales: tuple[torch.Tensor | None, ...] = (None, None, None)) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.key.fp8_block_scales:
            ones = None
            if any(d is None for d in descales):
                ones = torch.ones(self.fill_shape, dtype=torch.float32, device=q.device)
            descale = torch.stack([ones if d is None else d for d in descales])  # type: ignore[misc]
        else:
            if self.stack is None:
                self.stack = all(d is not None and tuple(d.shape) == self.fill_shape[1:] for d in descales)
            if self.stack:
                descale = torch.stack(descales)  # type: ignore[arg-type]
            else:
                descale = block_descales(descales, self.fill_shape, q.device)
        out = torch.empty(self.out_shape, dtype=torch.bfloat16, device=q.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        counter = None if self.counter_device is None else tile_counter(self.counter_device)
        self.fn(q.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8), out, lse, *self.head, counter, None,
                descale, None, None, None, None, None, None)
        return out, lse
