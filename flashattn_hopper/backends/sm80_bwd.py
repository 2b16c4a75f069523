"""Launcher of the Ampere FA2 backward: preprocess (kernels/common/bwd_pre.py), main (kernels/sm80/bwd.py)
and postprocess (kernels/common/bwd_post.py): keys, compile, launch.

One backward call is 3 launches (MHA) or 5 (GQA/MQA: the postprocess also converts the fp32 dK/dV
sums): pre (dPsum, LSE_log2, zero dQaccum) -> main (dK, dV; dQ reduce-added in fp32) -> post (dQ).
Dense and varlen (packed ``(total, h, d)``; scratch buffers at per-sequence padded offsets, sized from
``total + batch * SEQ_PAD``, so nothing here reads ``cu_seqlens``, ``seqused`` or ``max_seqlen``),
causal / sliding window / softcap, GQA/MQA. Head dims are zero-padded in Python up to the rows of
``configs.bwd_sm80_tiles(arch)`` that hold them, q/k's and v's each at its own width (192/128, 64/256
natively; the tile is ``configs.bwd_sm80_tile``'s; sm_90a targets get the larger-smem rows of
``BWD_SM80_TILES_SM90``). ``deterministic`` is a runtime
flag of the main kernel (semaphore-ordered reduce-adds), not a separate compile.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from .. import configs
from ..jit import KernelKey, compile_cache, target_arch
from ..packed import sequence_of_rows
from ..validate import AttnProblem
from .common import (
    DTYPE_NAMES, MAX_GRID_YZ, UNBOUNDED_WINDOW, VarlenArgs, cutlass_dtype, device_index, fake_bshd, ffi_compile,
    int_ready, mask_flags, num_sms, pad_head_dim, varlen_flags, window_args,
)

SEQ_PAD = 128  # kernels/common/bwd_utils.py SEQ_PAD: scratch buffers pad seqlens to this
_PRE_TILE_M = 128


def _pre_threads(head_dim: int) -> int:
    """Preprocess threads: 128, or 256 above head dim 128 (128 threads would hold 256 values each of O
    and dO at head dim 256 and spill ~25 registers; sm_80 and sm_90a, DSL 4.8.1)."""
    return 128 if head_dim <= 128 else 256
_POST_TILE_M, _POST_THREADS = 64, 128


@dataclass(frozen=True)
class BwdPreKey(KernelKey):
    """bwd_pre_sm80: dPsum, LSE_log2, zeroed dQaccum; per dtype, head dims (dQaccum's, O's) and
    varlen layout."""

    dtype: str
    head_dim: int
    head_dim_v: int
    varlen: bool = False
    seqused: bool = False  # seqused_q given (varlen only)
    sink: bool = False  # also a learnable sink's gradient parts (FlashBwdPreprocess ``sink_grad``)
    # > 0: dQaccum left as it is, the claim states of the sm90 main key's tiles of this many rows zeroed instead
    # (its ``dq_claim`` zeroes each tile itself)
    dq_state_tile_m: int = 0


@dataclass(frozen=True)
class BwdPostKey(KernelKey):
    """bwd_post_sm80: fp32 accumulator -> 16-bit. ``atom_m`` > 0: dQaccum in the fragment order of
    the sm80 main kernel's dQ MMA (same tile_m, num_threads, atom_m, dq_red_vec); ``dq_wgmma``: in the
    fragment order of the sm90 kernels' dQ WGMMA; neither: row-major (GQA dK/dV sums)."""

    dtype: str
    head_dim: int
    tile_m: int
    num_threads: int
    atom_m: int = 0  # 0: not the sm80 fragment order; a default so display names show the fragment mode
    varlen: bool = False
    seqused: bool = False  # seqused_q (dQ) or seqused_k (dK/dV) given (varlen only)
    dq_red_vec: int = 1  # fragment mode: the main kernel's dQ reduce-add width (the dQaccum order)
    # "rows" / "cols": dQaccum in the fragment order of the sm90 kernels' dQ WGMMA, its warpgroups
    # splitting the tile by rows or by head-dim columns (kernels/common/bwd_utils.tiled_mma_dq_sm90)
    dq_wgmma: str = ""
    # with any dq_wgmma: each warpgroup's part of a tile is a fragment block of its own (the sm90
    # kernel's dQ hand-off per warpgroup and its GQA dK/dV sums, kernels/sm90/bwd_store.py)
    wg_blocks: bool = False
    # the sm90 main key's ``dq_claim``: tiles whose state (the main kernel's semaphore slot) is 0 read as zeros
    dq_claimed: bool = False


@dataclass(frozen=True)
class BwdKey(KernelKey):
    dtype: str
    head_dim: int
    head_dim_v: int
    tile_m: int
    tile_n: int
    num_threads: int
    atom_m_sdp: int
    atom_n_dkv: int
    atom_m_dq: int
    causal: bool
    gqa: bool  # nheads != nheads_k: dK/dV summed over query heads in fp32 scratch
    stages_q: int = 2
    stages_do: int = 2
    dv_first: bool = False
    local: bool = False
    softcap: bool = False
    varlen: bool = False  # cu_seqlens_q and cu_seqlens_k given
    seqused_q: bool = False
    seqused_k: bool = False
    dq_red_vec: int = 1  # fp32 values per dQ reduce-add (configs.bwd_dq_red_vec)
    stmatrix_pds: bool = False  # P and dS to smem with stmatrix (sm_90 targets)
    # The call's last key blocks are split into segments (tail_plan): the key compiles the segments
    # kernel, launched after the whole-block kernel (this key with tail_split False).
    tail_split: bool = False


# Split tail: at most this many segments per key block, each at least this many query blocks long
# (a segment reloads its K/V and reduce-adds a whole fp32 dK/dV tile: short ones cost more than
# they balance).
TAIL_MAX_SEGMENTS = 16
TAIL_MIN_M_BLOCKS = 4


def tail_plan(batch: int, seqlen_q: int, seqlen_k: int, nheads: int, tile_m: int, tile_n: int,
              num_sms: int) -> tuple[int, int]:
    """``(tail_blocks, tail_segments)`` of a dense unmasked backward (kernels/sm80/bwd.py, split
    tail). Its ``N`` key blocks run one CTA per SM, so the last wave holds ``r = N mod num_sms`` of
    them, each as long as a whole one (``T``), while the other SMs idle. Split into ``s`` segments,
    those ``r * s`` CTAs of ``T / s`` take ``ceil(r * s / num_sms) * T / s``: ``s`` minimises that
    (the smallest on ties), from 2 to ``TAIL_MAX_SEGMENTS`` with at least ``TAIL_MIN_M_BLOCKS``
    query blocks each, and the tail is split only when that saves at least a tenth of ``T``
    (``r`` = 4 of 132 SMs: ``s`` = 16, ``T / 16``; ``r`` = 68: ``s`` = 15, ``0.53 T``).
    ``(0, 1)``: no split."""
    num_blocks = -(-seqlen_k // tile_n) * nheads * batch
    tail = num_blocks % num_sms
    max_segments = min(TAIL_MAX_SEGMENTS, -(-seqlen_q // tile_m) // TAIL_MIN_M_BLOCKS)
    if tail == 0 or max_segments < 2:
        return 0, 1
    segments = min(range(2, max_segments + 1), key=lambda s: (-(-tail * s // num_sms) / s, s))
    if -(-tail * segments // num_sms) / segments > 0.9:
        return 0, 1
    return tail, segments


def _fake(dtype: Any, shape: tuple[Any, ...], divisibility: int = 1, align: int = 16) -> Any:
    """A fake tensor with ``to_cute``'s ABI: dynamic shapes and strides, unit last stride. Every extent
    must be symbolic: ``to_cute`` passes all of them, and a static one shifts the strides the kernel
    reads (a static 2 once made the split tail's dV sums land on the dK sums two blocks on). ``align``:
    the data pointer's alignment in bytes the call checks (a user's tensor read as it is: its own)."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    if any(isinstance(extent, int) for extent in shape):
        raise TypeError(f"fake tensor extents must be symbolic (cute.sym_int), got {shape}")

    strides = tuple(cute.sym_int64(divisibility=divisibility) for _ in range(len(shape) - 1))
    return make_fake_tensor(dtype, shape, stride=(*strides, 1), assumed_align=align)


def _fake_packed(dtype: Any, total: Any, heads: Any, dim: Any) -> Any:
    """A fake varlen ``(total, heads, dim)`` tensor (strides multiples of 8, as ``_ready`` makes them)."""
    return _fake(dtype, (total, heads, dim), 8)


def _fake_ints(n: Any) -> Any:
    import cutlass
    from cutlass.cute.runtime import make_fake_tensor

    return make_fake_tensor(cutlass.Int32, (n,), stride=(1,), assumed_align=4)


def _ready(t: torch.Tensor) -> torch.Tensor:
    """Unit last stride, other strides non-zero multiples of 8, 16-byte aligned (dout may be expanded)."""
    strides = t.stride()
    if t.data_ptr() % 16 == 0 and strides[-1] == 1 and all(s > 0 and s % 8 == 0 for s in strides[:-1]):
        return t
    return t.clone(memory_format=torch.contiguous_format)  # (contiguous() keeps a misaligned view as it is)


# (sm90 trace keys: 2 CTAs x 2 MMA warpgroups x 2 blocks x 16 points of kernels/sm90/bwd_loop.py ``store_stamps``)
TRACE_SLOTS = 128


def _unused_semaphore(device_index: int) -> torch.Tensor:
    """The semaphore slots' tensor when deterministic=0 (the kernel never touches it then): one
    int32 per device, allocated once instead of a zeroed one per call; a fresh one under CUDA graph
    capture (the graph's memory pool is not for tensors that outlive it)."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(1, 1, 1, dtype=torch.int32, device=torch.device("cuda", device_index))
    return _device_semaphore(device_index)


@functools.cache
def _device_semaphore(device_index: int) -> torch.Tensor:
    return torch.zeros(1, 1, 1, dtype=torch.int32, device=torch.device("cuda", device_index))


def _check_given(t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, name: str) -> None:
    """A gradient buffer passed to ``backward``: the kernels write it in place, as they would their own."""
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or not t.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous {dtype} tensor of shape {tuple(shape)}, got {t.dtype} {tuple(t.shape)} "
            f"with strides {t.stride()}"
        )


class BwdSm80:
    """FA2-style backward: parallel over key blocks, dQ by fp32 reduce-adds, dK/dV in registers."""

    backend = "sm80"
    kind = "bwd_sm80"
    tiles = configs.BWD_SM80_TILES

    def kernel_dims(self, p: AttnProblem) -> tuple[int, int] | None:
        """The (q/k, v) head dims the kernels run ``p`` at (``configs.kernel_head_dims`` of this family's table)."""
        return configs.kernel_head_dims(self.tiles, p.head_dim, p.head_dim_v)

    def can_implement(self, p: AttnProblem, deterministic: bool) -> str | None:
        if self.kernel_dims(p) is None:
            return (
                f"head dims ({p.head_dim}, {p.head_dim_v}) are not implemented by the sm80 backward; "
                f"supported: head dims up to {max(self.tiles)}"
            )
        if p.softcap < 0.0:
            return f"softcap must be >= 0 (0 disables it), got {p.softcap}"
        if p.nheads > MAX_GRID_YZ:
            return f"nheads ({p.nheads}) must be <= {MAX_GRID_YZ} (CUDA grid y limit)"
        if not p.is_varlen and p.batch > MAX_GRID_YZ:
            return f"batch ({p.batch}) must be <= {MAX_GRID_YZ} (CUDA grid z limit); use the varlen API"
        if max(p.seqlen_q, p.seqlen_k) >= UNBOUNDED_WINDOW:
            return f"seqlen_q/seqlen_k ({p.seqlen_q}, {p.seqlen_k}) must be < 2**30 on the sm80 backward"
        return None

    # ------------------------------------------------------------------ keys

    def keys(self, p: AttnProblem, arch: str, varlen: VarlenArgs | None = None, deterministic: bool = False,
             sms: int | None = None, dk_fp32: bool = False,
             gate: bool = False, sink: bool = False) -> tuple[BwdPreKey, BwdKey, BwdPostKey, BwdPostKey]:
        """(pre, main, post for dQ, post for the GQA dK/dV sums). ``sms``: the GPU's SM count, for the
        split tail of dense unmasked non-deterministic calls (None: no split). ``dk_fp32``: the main
        kernel sums dK in fp32 scratch as for GQA, whatever the head counts (``BwdPlan``). ``gate``: the
        main key's gate variant (families with ``gate_slots``). ``sink``: the preprocess takes a learnable
        sink's gradient too."""
        dims = self.kernel_dims(p)
        assert dims is not None, "can_implement() must accept the problem first"
        hdim, hdim_v = dims
        dtype = DTYPE_NAMES[p.dtype]
        causal, local = mask_flags(p)
        is_varlen = varlen is not None
        su_q = is_varlen and varlen.seqused_q is not None
        su_k = is_varlen and varlen.seqused_k is not None
        main = self._main_key(
            arch, dtype, hdim, hdim_v, causal, dk_fp32 or p.nheads != p.nheads_k, local=local, softcap=p.softcap > 0.0,
            varlen=is_varlen, seqused_q=su_q, seqused_k=su_k, **self._mode_flags(deterministic),
            **self._gqa_flags(p, dk_fp32, is_varlen, sms), **self._gate_flags(p, gate, deterministic, varlen),
        )
        if sms is not None and self.splits_tail and not (deterministic or is_varlen or causal or local):
            plan = tail_plan(p.batch, p.seqlen_q, p.seqlen_k, p.nheads, main.tile_m, main.tile_n, sms)
            if plan[0] > 0:
                main = dataclasses.replace(main, tail_split=True)
        post_dq, post_kv = self._post_keys(arch, dtype, hdim, hdim_v, is_varlen, su_q, su_k, main=main)
        return (
            BwdPreKey(kernel="bwd_pre_sm80", arch=arch, dtype=dtype, head_dim=hdim, head_dim_v=hdim_v,
                      varlen=is_varlen, seqused=su_q, sink=sink,
                      **({"dq_state_tile_m": main.tile_m} if getattr(main, "dq_claim", False) else {})),
            main, post_dq, post_kv,
        )

    # The split tail (a segments kernel for the last wave of dense unmasked calls): this family's.
    splits_tail = True
    # Tensor slots after the main kernel's split-tail argument (sm90: the gate's bias and dG's sums).
    gate_slots = 0

    def _mode_flags(self, deterministic: bool) -> dict[str, bool]:
        """Main-key fields of the call's mode; here none (``deterministic`` is a runtime argument)."""
        return {}

    def _gqa_flags(self, p: AttnProblem, dk_fp32: bool, varlen: bool, sms: int | None) -> dict[str, bool]:
        """Main-key options of a GQA problem (``_main_key`` pops them); here none."""
        return {}

    def _gate_flags(self, p: AttnProblem, gate: bool, deterministic: bool,
                    varlen: VarlenArgs | None) -> dict[str, bool]:
        """Main-key fields of a gated call (``gate``: the main key's gate variant); here the gate alone."""
        return {"gate": True} if gate else {}

    def _main_key(self, arch: str, dtype: str, hdim: int, hdim_v: int, causal: bool, gqa: bool,
                  **flags: bool) -> BwdKey:
        t = configs.bwd_sm80_tile(arch, hdim, hdim_v)
        return BwdKey(
            kernel=self.kind, arch=arch, dtype=dtype, head_dim=hdim, head_dim_v=hdim_v, tile_m=t.tile_m, tile_n=t.tile_n,
            num_threads=t.num_threads, atom_m_sdp=t.atom_m_sdp, atom_n_dkv=t.atom_n_dkv, atom_m_dq=t.atom_m_dq,
            causal=causal, gqa=gqa, stages_q=t.stages_q, stages_do=t.stages_do,
            dv_first=t.dv_first, dq_red_vec=configs.bwd_dq_red_vec(arch), stmatrix_pds=t.stmatrix_pds,
            **flags,
        )

    def _post_keys(self, arch: str, dtype: str, hdim: int, hdim_v: int, varlen: bool = False,
                   seqused_q: bool = False, seqused_k: bool = False,
                   main: KernelKey | None = None) -> tuple[BwdPostKey, BwdPostKey]:
        """(dQ postprocess, GQA dK postprocess; the dV one is this with ``head_dim_v``). ``main``: the
        call's main key (the table's tile here either way)."""
        t = configs.bwd_sm80_tile(arch, hdim, hdim_v)
        return (
            BwdPostKey(kernel="bwd_post_sm80", arch=arch, dtype=dtype, head_dim=hdim, tile_m=t.tile_m,
                       num_threads=t.num_threads, atom_m=t.atom_m_dq, varlen=varlen, seqused=seqused_q,
                       dq_red_vec=configs.bwd_dq_red_vec(arch)),
            BwdPostKey(kernel="bwd_post_sm80", arch=arch, dtype=dtype, head_dim=hdim, tile_m=_POST_TILE_M,
                       num_threads=_POST_THREADS, atom_m=0, varlen=varlen, seqused=seqused_k),
        )

    def all_keys(self, arch: str) -> list[KernelKey]:
        """The variants users hit, for precompile and the compile-only tests: head dims 64
        and 128 dense in both dtypes (causal or not, MHA or GQA); 96/192/256 bf16 dense MHA (causal or
        not), each non-causal one with its split-tail segments kernel; bf16 d128 causal varlen (MHA),
        sliding window and causal softcap; bf16 64/256 causal (MHA and GQA). Rarer ones (fp16 features, GQA at 96-256, seqused, varlen
        GQA, window + varlen, ...) compile on first use."""
        keys: list[KernelKey] = []
        for hdim in self.tiles:
            common = hdim in (64, 128)
            for dtype in ("bf16", "fp16") if common else ("bf16",):
                keys.append(BwdPreKey(kernel="bwd_pre_sm80", arch=arch, dtype=dtype, head_dim=hdim, head_dim_v=hdim))
                post_dq, post_kv = self._post_keys(arch, dtype, hdim, hdim)
                keys.extend((post_dq, post_kv) if common else (post_dq,))
                for causal in (False, True):
                    for gqa in (False, True) if common else (False,):
                        keys.append(self._main_key(arch, dtype, hdim, hdim, causal, gqa))
                        # Dense unmasked calls split their last wave (tail_plan) with a segments kernel;
                        # sm_80's d128 MHA one spills 1 register (1 LDL + 1 STL; it runs at most one
                        # short wave) and compiles on first use.
                        if not causal and (arch.startswith("sm_90") or gqa or hdim != 128):
                            keys.append(self._main_key(arch, dtype, hdim, hdim, causal, gqa, tail_split=True))
        if 128 in self.tiles:
            keys.append(BwdPreKey(kernel="bwd_pre_sm80", arch=arch, dtype="bf16", head_dim=128, head_dim_v=128,
                                  varlen=True))
            keys.append(self._post_keys(arch, "bf16", 128, 128, varlen=True)[0])
            # Causal only: non-causal varlen d128 spills 1 register on sm_80 (1 LDL + 1 STL; varlen seqlens
            # live in registers, dense ones in the parameter bank); it compiles on first use.
            keys.append(self._main_key(arch, "bf16", 128, 128, True, False, varlen=True))
            keys.append(self._main_key(arch, "bf16", 128, 128, False, False, local=True))
            keys.append(self._main_key(arch, "bf16", 128, 128, True, False, softcap=True))
        # q/k and v at their own widths (one code path for 192/128, 64/256, 96/192): 64/256 causal,
        # MHA and GQA (with the dV sums' postprocess at v's width).
        keys.append(BwdPreKey(kernel="bwd_pre_sm80", arch=arch, dtype="bf16", head_dim=64, head_dim_v=256))
        post_dq, post_k = self._post_keys(arch, "bf16", 64, 256)
        keys += [post_dq, dataclasses.replace(post_k, head_dim=256)]
        keys += [self._main_key(arch, "bf16", 64, 256, True, gqa) for gqa in (False, True)]
        return keys

    # ------------------------------------------------------------------ compile

    def compile(self, key: KernelKey, options: str | None = None) -> Any:
        import cutlass
        import cutlass.cute as cute

        dtype = cutlass_dtype(key.dtype)  # type: ignore[attr-defined]
        f32, i32 = cutlass.Float32, cutlass.Int32
        varlen = getattr(key, "varlen", False)
        # Scratch buffers get their own symbols: a shared symbol asserts equal extents at run time.
        b, s_q, s_k, h, h_k, d, d_v, s_pad, acc_len, acc_k, acc_v, b1, nb = (cute.sym_int() for _ in range(13))
        sem_q = tuple(cute.sym_int() for _ in range(3))
        sem_kv = tuple(cute.sym_int() for _ in range(3))

        def qkv(seqlen: Any, heads: Any, dim: Any = d) -> Any:  # dense (b, s, h, d) or packed (total, h, d)
            return _fake_packed(dtype, seqlen, heads, dim) if varlen else fake_bshd(dtype, b, seqlen, heads, dim)

        if key.kernel == "bwd_pre_sm80":
            from ..kernels.common.bwd_pre import FlashBwdPreprocess

            pre: BwdPreKey = key  # type: ignore[assignment]
            kernel = FlashBwdPreprocess(
                dtype, pre.head_dim, _PRE_TILE_M, _pre_threads(pre.head_dim_v), head_dim_v=pre.head_dim_v,
                pdl=configs.bwd_pdl(pre.arch), sink_grad=pre.sink, state_tile_m=pre.dq_state_tile_m,
            )
            lse = _fake(f32, (h, s_q)) if varlen else _fake(f32, (b, h, s_q))
            fakes = (
                qkv(s_q, h, d_v), qkv(s_q, h, d_v), lse, _fake(f32, (b, h, s_pad)), _fake(f32, (b, h, s_pad)),
                _fake(f32, (b, h, acc_len), 4),
            )
            ints = (_fake_ints(b1) if varlen else None, _fake_ints(nb) if pre.seqused else None)
            # (the sink's logits as the user's fp32 tensor: a view may start at any 4-byte offset)
            sink = (_fake(f32, (h,), align=4), _fake(f32, (b, h, cute.sym_int()))) if pre.sink else (None, None)
            state = _fake(i32, sem_q) if pre.dq_state_tile_m else None
            return ffi_compile(kernel, *fakes, *ints, *sink, state, options=options)
        if key.kernel == "bwd_post_sm80":
            from ..kernels.common.bwd_post import FlashBwdPostprocess

            pk: BwdPostKey = key  # type: ignore[assignment]
            kernel = FlashBwdPostprocess(
                dtype, pk.head_dim, pk.tile_m, pk.num_threads, pk.atom_m or None, pk.dq_red_vec,
                wgmma_split=pk.dq_wgmma or None, wg_blocks=pk.wg_blocks, pdl=configs.bwd_pdl(pk.arch),
                dq_claimed=pk.dq_claimed,
            )
            ints = (_fake_ints(b1) if varlen else None, _fake_ints(nb) if pk.seqused else None)
            fakes = (_fake(f32, (b, h, acc_len), 4), qkv(s_q, h))
            state = _fake(i32, sem_q) if pk.dq_claimed else None
            return ffi_compile(kernel, *fakes, f32(1.0), *ints, state, options=options)
        if key.kernel != self.kind:
            raise ValueError(f"not a key of this family: {key.name}")
        from ..kernels.sm80.bwd import FlashBwdSm80

        k: BwdKey = key  # type: ignore[assignment]
        kernel = FlashBwdSm80(
            dtype, k.head_dim, k.head_dim_v, k.tile_m, k.tile_n, k.num_threads, k.atom_m_sdp, k.atom_n_dkv, k.atom_m_dq,
            k.causal, k.gqa, is_local=k.local, has_softcap=k.softcap, stages_q=k.stages_q,
            stages_do=k.stages_do, dv_first=k.dv_first, dq_red_vec=k.dq_red_vec,
            stmatrix_pds=k.stmatrix_pds, tail_split=k.tail_split, arch=k.arch,
        )
        if k.gqa:
            dkv = (_fake(f32, (b, h_k, acc_k), 4), _fake(f32, (b, h_k, acc_v), 4))
        else:
            dkv = (qkv(s_k, h_k), qkv(s_k, h_k, d_v))
        fakes = (
            qkv(s_q, h), qkv(s_k, h_k), qkv(s_k, h_k, d_v), qkv(s_q, h, d_v), _fake(f32, (b, h, s_pad)),
            _fake(f32, (b, h, s_pad)), _fake(f32, (b, h, acc_len), 4), *dkv, _fake(i32, sem_q),
            _fake(i32, sem_kv),
        )
        ints = (
            _fake_ints(b1) if varlen else None, _fake_ints(b1) if varlen else None,
            _fake_ints(nb) if k.seqused_q else None, _fake_ints(nb) if k.seqused_k else None,
        )
        scalars = (f32(1.0), i32(0), i32(0), f32(1.0), i32(0), i32(0), i32(0))
        tail = _fake(f32, (cute.sym_int(), cute.sym_int(), cute.sym_int()), 4) if k.tail_split and not k.gqa else None
        return ffi_compile(kernel, *fakes, *scalars, *ints, tail, options=options)

    # ------------------------------------------------------------------ launch

    def backward(
        self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, p: AttnProblem, varlen: VarlenArgs | None, deterministic: bool,
        dq: torch.Tensor | None = None, dk: torch.Tensor | None = None, dv: torch.Tensor | None = None,
        dk_fp32: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dq, dk, dv shaped like q, k, v. ``dq``/``dk``/``dv`` given (internal: tests pass NaN-poisoned
        buffers, all three or none): contiguous, q's dtype, the kernel's padded head dim; the results
        are these buffers (views of them where the head dim is padded). ``dk_fp32`` (internal, for
        ``gate.py``, whose dG is a column of dK): dk in fp32, not rounded to q's dtype."""
        if p.batch == 0 or p.seqlen_q == 0 or p.seqlen_k == 0 or p.nheads == 0:
            # No keys or no queries: every gradient is 0.
            if dq is not None:
                return dq.zero_(), dk.zero_(), dv.zero_()
            dk_zero = torch.zeros_like(k, dtype=torch.float32 if dk_fp32 else k.dtype)
            return torch.zeros_like(q), dk_zero, torch.zeros_like(v)
        # (kept per problem: the keys and the compile-cache lookups were most of a packed call's backward host time)
        plan = self.plan(p, varlen, deterministic, q.device, dk_fp32) if dk_fp32 else self.cached_plan(
            p, varlen, deterministic, q.device)
        return plan(dout, q, k, v, out, lse, varlen, dq, dk, dv)

    def cached_plan(self, p: AttnProblem, varlen: VarlenArgs | None, deterministic: bool, device: torch.device,
                    gate: bool = False, sink: bool = False) -> BwdPlan:
        """``plan``, kept per (family, problem, varlen flags, deterministic, device, gate, sink): a
        ``BwdPlan`` holds only what those fix (no tensors). For ``backward`` and the gated and sinked routes,
        which made one per call. The family object itself keys it (a benchmark's family with other tiles
        has its own plans); ``api.clear_plans`` forgets them."""
        memo = (self, p, varlen_flags(varlen), deterministic, device, gate, sink)
        plan = _PLAN_MEMO.get(memo)
        if plan is None:
            if len(_PLAN_MEMO) >= _MAX_PLAN_MEMO:
                _PLAN_MEMO.clear()
            plan = _PLAN_MEMO[memo] = self.plan(p, varlen, deterministic, device, gate=gate, sink=sink)
        return plan

    def plan(self, p: AttnProblem, varlen: VarlenArgs | None, deterministic: bool, device: torch.device,
             dk_fp32: bool = False, gate: bool = False, sink: bool = False) -> BwdPlan:
        """The compiled kernels and every static argument of a backward call of problem ``p`` (a
        non-empty one) on ``device``; ``varlen``: only which of its tensors are given matters.
        ``gate``: the main kernel's gate variant (``gate_slots``); ``sink``: the preprocess also takes a
        learnable sink's gradient (the plan's call then needs ``sink`` and returns it last)."""
        sms = num_sms(device_index(device))
        pre_key, main_key, post_dq_key, post_kv_key = self.keys(p, target_arch(), varlen, deterministic, sms, dk_fp32,
                                                                gate, sink)
        pre = compile_cache.get(pre_key, self.compile)
        # Split tail: the whole-block kernel skips the last key blocks, the segments kernel runs them.
        main, segments = compile_cache.get(main_key, self.compile), None
        if main_key.tail_split:
            segments = main
            main = compile_cache.get(dataclasses.replace(main_key, tail_split=False), self.compile)
        post_dq = compile_cache.get(post_dq_key, self.compile)
        kv_sums = kv_scratch(main_key)
        post_kv = compile_cache.get(post_kv_key, self.compile) if kv_sums else None
        post_v = post_kv  # the GQA dV sums' postprocess: at v's width
        if kv_sums and main_key.head_dim_v != main_key.head_dim:
            post_v = compile_cache.get(dataclasses.replace(post_kv_key, head_dim=main_key.head_dim_v), self.compile)
        tail_blocks, tail_segments = 0, 1
        if main_key.tail_split:
            tail_blocks, tail_segments = tail_plan(p.batch, p.seqlen_q, p.seqlen_k, p.nheads, main_key.tile_m,
                                                   main_key.tile_n, sms)
        return BwdPlan(p, main_key, (pre, main, segments, post_dq, post_kv, post_v), deterministic, tail_blocks,
                       tail_segments, dk_fp32, self.gate_slots, kv_fragment=post_kv_key.wg_blocks,
                       sink_warps=_pre_threads(pre_key.head_dim_v) // 32 if sink else 0)


def kv_scratch(main_key: KernelKey) -> bool:
    """Whether the main kernel sums dK/dV over query heads in fp32 scratch (GQA, or dk_fp32), a postprocess
    converting them: not the sm90 kernel's ``gqa_loop``, which stores them once per KV head."""
    return main_key.gqa and not getattr(main_key, "gqa_loop", False)


def wgmma_rows_order(head_dim: int, device: torch.device | None = None) -> torch.Tensor:
    """Gather index of one warpgroup's 64 x ``head_dim`` fp32 tile from the sm90 kernel's GQA-sum
    order (kernels/sm90/bwd.py ``epilogue_gqa``: ``fragment_accum`` over 128 threads, 4 values side
    by side) to row-major: ``row_major = tile[order]``. Value ``i`` of thread ``t`` of the m64nNk16
    WGMMA's C fragment is at row ``16 (t // 32) + (t % 32) // 4 + 8 ((i // 2) % 2)``, column
    ``2 (t % 4) + i % 2 + 8 (i // 4)`` (checked against the DSL's layout by a CPU test)."""
    pos = torch.arange(64 * head_dim, device=device)
    group, t, e = pos // 512, (pos % 512) // 4, pos % 4  # value i = 4 * group + e of thread t
    row = 16 * (t // 32) + (t % 32) // 4 + 8 * (e // 2)
    col = 2 * (t % 4) + e % 2 + 8 * group
    order = torch.empty_like(pos)
    order[row * head_dim + col] = pos
    return order


_PLAN_MEMO: dict[tuple[Any, ...], BwdPlan] = {}  # (BwdSm80.cached_plan)
_MAX_PLAN_MEMO = 1024


class BwdPlan:
    """One backward problem's kernels and static arguments, worked out once (``BwdSm80.plan``); a
    call allocates the scratch and the gradients and makes 3 TVM-FFI calls (5 with GQA, 4 with a
    split tail) on the inputs' device and current stream."""

    def __init__(self, p: AttnProblem, main_key: BwdKey, fns: tuple[Any, ...], deterministic: bool,
                 tail_blocks: int, tail_segments: int, dk_fp32: bool = False, gate_slots: int = 0,
                 kv_fragment: bool = False, sink_warps: int = 0) -> None:
        self.p, self.main_key, self.deterministic, self.dk_fp32 = p, main_key, deterministic, dk_fp32
        self.kv_fragment = kv_fragment  # GQA sums in per-warpgroup WGMMA fragment order (wgmma_rows_order)
        self.dq_claim = getattr(main_key, "dq_claim", False)  # (sm90 keys: dQaccum tiles claimed, BwdSm90Tile)
        self.kv_sums = kv_scratch(main_key)
        # (deterministic GQA: one dK/dV semaphore per key block, or per gcd(tile_n, SEQ_PAD) rows where blocks do not
        # tile the 128-row padded sequences: kernels/sm90/bwd_wide96.py KV_SEM_ROWS)
        self.kv_sem_rows = math.gcd(main_key.tile_n, SEQ_PAD)
        self.no_gate = (None,) * gate_slots  # the main kernel's gate slots of a call without one
        self.pre, self.main, self.segments, self.post_dq, self.post_kv, self.post_v = fns
        self.tail_blocks, self.tail_segments = tail_blocks, tail_segments
        d = self.d = main_key.head_dim
        d_v = self.d_v = main_key.head_dim_v
        b, s_q, s_k, h, h_k = p.batch, p.seqlen_q, p.seqlen_k, p.nheads, p.nheads_k
        if p.is_varlen:
            # One "batch" row of scratch; sequence i starts at its padded offset (kernels/common/bwd_utils.py).
            self.b_scr = 1
            self.s_q_pad = -(-(s_q + b * SEQ_PAD) // SEQ_PAD) * SEQ_PAD
            self.s_k_pad = -(-(s_k + b * SEQ_PAD) // SEQ_PAD) * SEQ_PAD
            self.q_shape, self.k_shape, self.v_shape = (s_q, h, d), (s_k, h_k, d), (s_k, h_k, d_v)
        else:
            # (query rows: whole tiles of the main kernel's tile_m too: 640 rows at tile_m 80)
            q_pad = math.lcm(SEQ_PAD, main_key.tile_m)
            self.b_scr, self.s_q_pad, self.s_k_pad = b, -(-s_q // q_pad) * q_pad, -(-s_k // SEQ_PAD) * SEQ_PAD
            self.q_shape, self.k_shape, self.v_shape = (b, s_q, h, d), (b, s_k, h_k, d), (b, s_k, h_k, d_v)
        self.rows_shape = (self.b_scr, h, self.s_q_pad)
        # The preprocess's sink gradient parts (sink_warps > 0): a slot per warp of each of its CTAs (grid
        # x: kernels/common/bwd_pre.py; varlen: num_varlen_tiles_upper_bound, some never written: zeros).
        pre_ctas = (s_q + b * (_PRE_TILE_M - 1) + _PRE_TILE_M - 1) // _PRE_TILE_M if p.is_varlen else self.s_q_pad // _PRE_TILE_M
        self.sink_parts_shape = (self.b_scr, h, pre_ctas * sink_warps) if sink_warps else None
        self.acc_shape = (self.b_scr, h, self.s_q_pad * d)
        self.padded = d != p.head_dim or d_v != p.head_dim_v
        window_left, window_right = window_args(p) if main_key.local else (0, 0)
        softcap = float(p.softcap) if main_key.softcap else 1.0
        self.scale = float(p.softmax_scale)
        self.scalars = (self.scale, window_left, window_right, softcap, int(deterministic), tail_blocks, tail_segments)

    def __call__(
        self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, varlen: VarlenArgs | None = None, dq: torch.Tensor | None = None,
        dk: torch.Tensor | None = None, dv: torch.Tensor | None = None, gate: tuple[torch.Tensor, ...] | None = None,
        rows_dpsum: bool = False, sink: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """``backward`` of the plan's problem (see there); ``varlen``: the call's varlen tensors;
        ``gate``: the main kernel's gate slots (a gate key's plan: ``BwdSm90.backward_with_gate``).
        ``rows_dpsum`` (dense only): also the preprocess's ``rowsum(dout * out)`` in fp32, ``(batch,
        nheads, seqlen_q)`` like the LSE (a view of its scratch; ``sinks.py``'s gradient reads it).
        ``sink`` (exactly for a plan made with ``sink``): the learnable sink's logits ``(nheads,)``, ``lse``
        the sinked LSE; its gradient ``(nheads,)`` fp32 is then returned last."""
        p, key, d, d_v, dev = self.p, self.main_key, self.d, self.d_v, q.device
        if self.padded:
            q, k = (pad_head_dim(t, d) for t in (q, k))
            v, out, dout = (pad_head_dim(t, d_v) for t in (v, out, dout))
        q, k, v, out, dout, lse = (_ready(t) for t in (q, k, v, out, dout, lse))
        f32 = torch.float32
        if varlen is not None:
            cu_q, cu_k, su_q, su_k = (None if t is None else int_ready(t) for t in (
                varlen.cu_seqlens_q, varlen.cu_seqlens_k, varlen.seqused_q, varlen.seqused_k))
        else:
            cu_q = cu_k = su_q = su_k = None
        lse_log2 = torch.empty(self.rows_shape, dtype=f32, device=dev)
        dpsum = torch.empty(self.rows_shape, dtype=f32, device=dev)
        dq_accum = torch.empty(self.acc_shape, dtype=f32, device=dev)
        # Rows past seqused are never written by the kernels: they must read 0.
        if dq is None:
            dq = (torch.zeros if key.seqused_q else torch.empty)(self.q_shape, dtype=q.dtype, device=dev)
            dk = (torch.zeros if key.seqused_k else torch.empty)(self.k_shape, dtype=q.dtype, device=dev)
            dv = (torch.zeros if key.seqused_k else torch.empty)(self.v_shape, dtype=q.dtype, device=dev)
        else:
            if self.dk_fp32:
                raise ValueError("dk_fp32 returns a new fp32 dk: pass no dq/dk/dv buffers with it")
            _check_given(dq, self.q_shape, q.dtype, "dq")
            _check_given(dk, self.k_shape, q.dtype, "dk")
            _check_given(dv, self.v_shape, q.dtype, "dv")
            if key.seqused_q:
                dq.zero_()
            if key.seqused_k:
                dk.zero_(), dv.zero_()
        if self.kv_sums:
            dk_main = torch.zeros(self.b_scr, p.nheads_k, self.s_k_pad * d, dtype=f32, device=dev)
            dv_main = torch.zeros(self.b_scr, p.nheads_k, self.s_k_pad * d_v, dtype=f32, device=dev)
        else:
            dk_main, dv_main = dk, dv
        dq_state = None
        if self.deterministic:
            sem_q = torch.zeros(self.b_scr, p.nheads, self.s_q_pad // key.tile_m, dtype=torch.int32, device=dev)
            sem_kv = (torch.zeros(self.b_scr, p.nheads_k, self.s_k_pad // self.kv_sem_rows, dtype=torch.int32,
                                  device=dev) if self.kv_sums else sem_q)
        elif getattr(key, "trace", False):  # (sm90 debug timeline: the kernel stores its clocks there)
            # (then every CTA's span: 6 int32 each, kernels/sm90/bwd_loop.py ``store_cta_span``; an upper bound of
            # the grid, varlen's included)
            ctas = (self.s_k_pad // key.tile_n + p.batch + 1) * p.nheads * self.b_scr
            sem_q = sem_kv = self.trace_stamps = torch.zeros(1, 1, TRACE_SLOTS + 6 * ctas, dtype=torch.int32, device=dev)
        elif self.dq_claim:  # (sm90: each dQaccum tile's claim state, zeroed by the preprocess)
            sem_q = dq_state = torch.empty(self.b_scr, p.nheads, self.s_q_pad // key.tile_m, dtype=torch.int32,
                                           device=dev)
            sem_kv = _unused_semaphore(device_index(dev))
        else:
            sem_q = sem_kv = _unused_semaphore(device_index(dev))
        tail_sums = None
        if self.tail_blocks > 0 and not key.gqa:  # MHA: the split blocks' partial dK/dV sums and arrival counts
            tail_sums = torch.zeros(self.tail_blocks, 2, key.tile_n * max(d, d_v), dtype=f32, device=dev)
            sem_kv = torch.zeros(1, 1, self.tail_blocks, dtype=torch.int32, device=dev)
        sink_parts = None
        if (sink is not None) != (self.sink_parts_shape is not None):
            raise ValueError("sink must be given exactly to a plan made with sink=True")
        if sink is not None:
            sink = sink.detach().to(device=dev, dtype=f32).contiguous()
            sink_parts = (torch.zeros if p.is_varlen else torch.empty)(self.sink_parts_shape, dtype=f32, device=dev)
        self.pre(out, dout, lse, lse_log2, dpsum, dq_accum, cu_q, su_q, sink, sink_parts, dq_state)
        main_args = (q, k, v, dout, lse_log2, dpsum, dq_accum, dk_main, dv_main, sem_q, sem_kv, *self.scalars,
                     cu_q, cu_k, su_q, su_k)
        self.main(*main_args, None, *(self.no_gate if gate is None else gate))
        if self.segments is not None and self.tail_blocks > 0:
            self.segments(*main_args, tail_sums)
        self.post_dq(dq_accum, dq, self.scale, cu_q, su_q, dq_state)
        if self.post_kv is not None:
            if self.dk_fp32:
                dk = self._dk_from_scratch(dk_main, cu_k, su_k)
            else:
                self.post_kv(dk_main, dk, self.scale, cu_k, su_k, None)
            self.post_v(dv_main, dv, 1.0, cu_k, su_k, None)
        if d != p.head_dim:
            dq, dk = dq[..., : p.head_dim], dk[..., : p.head_dim]
        if d_v != p.head_dim_v:
            dv = dv[..., : p.head_dim_v]
        extra = ()
        if rows_dpsum:
            if p.is_varlen:
                raise ValueError("rows_dpsum: dense problems only (varlen rows sit at padded scratch offsets)")
            extra = (dpsum[:, :, : p.seqlen_q],)
        if sink_parts is not None:
            extra = (*extra, sink_parts.sum((0, 2)))
        return (dq, dk, dv, *extra)

    def _dk_from_scratch(self, dk_main: torch.Tensor, cu_k: torch.Tensor | None,
                         su_k: torch.Tensor | None) -> torch.Tensor:
        """dK in fp32, scaled, from the main kernel's sums (rows of ``(b_scr, h_k, s_k_pad, d)``; varlen:
        sequence i from its padded start, ``kernels/common/bwd_utils.scratch_offset``); rows past
        ``seqused_k`` read 0, as the 16-bit path's."""
        p, d = self.p, self.d
        if self.kv_fragment:
            dk_main = dk_main.view(self.b_scr, p.nheads_k, -1, 64 * d)[..., wgmma_rows_order(d, dk_main.device)]
        rows = dk_main.reshape(self.b_scr, p.nheads_k, self.s_k_pad, d)
        if cu_k is None:
            dk = rows[:, :, : p.seqlen_k].transpose(1, 2) * self.scale
            return dk.contiguous()
        total_k = p.seqlen_k  # varlen: the packed key rows
        seq = sequence_of_rows(cu_k, total_k)
        starts = cu_k.to(torch.int64)
        pad_starts = (starts[:-1] + torch.arange(p.batch, device=cu_k.device) * SEQ_PAD) // SEQ_PAD * SEQ_PAD
        packed = torch.arange(total_k, device=cu_k.device)
        offset = packed - starts[seq]
        dk = rows[0][:, pad_starts[seq] + offset].transpose(0, 1) * self.scale
        # Rows past seqused_k, or past cu_seqlens_k[-1] (a caller's padding rows), are never written.
        length = su_k.to(torch.int64) if su_k is not None else starts[1:] - starts[:-1]
        return torch.where((offset < length[seq])[:, None, None], dk, torch.zeros_like(dk)).contiguous()
