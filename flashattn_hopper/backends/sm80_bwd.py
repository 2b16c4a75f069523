"""Launcher of the Ampere FA2 backward: preprocess (kernels/common/bwd_pre.py), main (kernels/sm80/bwd.py)
and postprocess (kernels/common/bwd_post.py): keys, compile, launch.

One backward call is 3 launches (MHA) or 5 (GQA/MQA: the postprocess also converts the fp32 dK/dV
sums): pre (dPsum, LSE_log2, zero dQaccum) -> main (dK, dV; dQ reduce-added in fp32) -> post (dQ).
Dense and varlen (packed ``(total, h, d)``; scratch buffers at per-sequence padded offsets, sized from
``total + batch * SEQ_PAD``, so nothing here reads ``cu_seqlens``, ``seqused`` or ``max_seqlen``),
causal / sliding window / softcap, GQA/MQA. Head dims are zero-padded in Python up to a row of
``configs.bwd_sm80_tiles(arch)`` (both to the same row: 192/128 runs as 192; sm_90a targets get the
larger-smem rows of ``BWD_SM80_TILES_SM90``). ``deterministic`` is a runtime
flag of the main kernel (semaphore-ordered reduce-adds), not a separate compile.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch

from .. import configs
from ..jit import KernelKey, compile_cache, target_arch
from ..validate import AttnProblem
from .common import (
    DTYPE_NAMES, MAX_GRID_YZ, UNBOUNDED_WINDOW, VarlenArgs, current_stream, cutlass_dtype, fake_bshd, int_ready,
    int_to_cute, kernel_arg, launch, mask_flags, num_sms, pad_head_dim, to_cute, window_args,
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
    """bwd_pre_sm80: dPsum, LSE_log2, zeroed dQaccum; per dtype, head dim and varlen layout."""

    dtype: str
    head_dim: int
    varlen: bool = False
    seqused: bool = False  # seqused_q given (varlen only)


@dataclass(frozen=True)
class BwdPostKey(KernelKey):
    """bwd_post_sm80: fp32 accumulator -> 16-bit. ``atom_m`` > 0: dQaccum in the fragment order of
    the main kernel's dQ MMA (same tile_m, num_threads, atom_m, dq_red_vec); 0: row-major (GQA dK/dV
    sums)."""

    dtype: str
    head_dim: int
    tile_m: int
    num_threads: int
    atom_m: int = 0  # 0: row-major (the GQA dK/dV sums); a default so display names show the fragment mode
    varlen: bool = False
    seqused: bool = False  # seqused_q (dQ) or seqused_k (dK/dV) given (varlen only)
    dq_red_vec: int = 1  # fragment mode: the main kernel's dQ reduce-add width (the dQaccum order)


@dataclass(frozen=True)
class BwdKey(KernelKey):
    dtype: str
    head_dim: int
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


def _fake(dtype: Any, shape: tuple[Any, ...], divisibility: int = 1) -> Any:
    """A fake tensor with ``to_cute``'s ABI: dynamic shapes and strides, unit last stride. Every extent
    must be symbolic: ``to_cute`` passes all of them, and a static one shifts the strides the kernel
    reads (a static 2 once made the split tail's dV sums land on the dK sums two blocks on)."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    if any(isinstance(extent, int) for extent in shape):
        raise TypeError(f"fake tensor extents must be symbolic (cute.sym_int), got {shape}")

    strides = tuple(cute.sym_int64(divisibility=divisibility) for _ in range(len(shape) - 1))
    return make_fake_tensor(dtype, shape, stride=(*strides, 1), assumed_align=16)


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
    return t.contiguous()


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


def _int_arg(t: torch.Tensor | None) -> Any:
    return None if t is None else int_to_cute(int_ready(t))


class BwdSm80:
    """FA2-style backward: parallel over key blocks, dQ by fp32 reduce-adds, dK/dV in registers."""

    backend = "sm80"
    kind = "bwd_sm80"
    tiles = configs.BWD_SM80_TILES

    def can_implement(self, p: AttnProblem, deterministic: bool) -> str | None:
        if configs.kernel_head_dim(self.tiles, p.head_dim, p.head_dim_v) is None:
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
             sms: int | None = None) -> tuple[BwdPreKey, BwdKey, BwdPostKey, BwdPostKey]:
        """(pre, main, post for dQ, post for the GQA dK/dV sums). ``sms``: the GPU's SM count, for the
        split tail of dense unmasked non-deterministic calls (None: no split)."""
        hdim = configs.kernel_head_dim(self.tiles, p.head_dim, p.head_dim_v)
        assert hdim is not None, "can_implement() must accept the problem first"
        dtype = DTYPE_NAMES[p.dtype]
        causal, local = mask_flags(p)
        is_varlen = varlen is not None
        su_q = is_varlen and varlen.seqused_q is not None
        su_k = is_varlen and varlen.seqused_k is not None
        main = self._main_key(
            arch, dtype, hdim, causal, p.nheads != p.nheads_k, local=local, softcap=p.softcap > 0.0,
            varlen=is_varlen, seqused_q=su_q, seqused_k=su_k,
        )
        if sms is not None and not (deterministic or is_varlen or causal or local):
            plan = tail_plan(p.batch, p.seqlen_q, p.seqlen_k, p.nheads, main.tile_m, main.tile_n, sms)
            if plan[0] > 0:
                main = dataclasses.replace(main, tail_split=True)
        post_dq, post_kv = self._post_keys(arch, dtype, hdim, is_varlen, su_q, su_k)
        return (
            BwdPreKey(kernel="bwd_pre_sm80", arch=arch, dtype=dtype, head_dim=hdim, varlen=is_varlen, seqused=su_q),
            main, post_dq, post_kv,
        )

    def _main_key(self, arch: str, dtype: str, hdim: int, causal: bool, gqa: bool, **flags: bool) -> BwdKey:
        t = configs.bwd_sm80_tiles(arch)[hdim]
        return BwdKey(
            kernel=self.kind, arch=arch, dtype=dtype, head_dim=hdim, tile_m=t.tile_m, tile_n=t.tile_n,
            num_threads=t.num_threads, atom_m_sdp=t.atom_m_sdp, atom_n_dkv=t.atom_n_dkv, atom_m_dq=t.atom_m_dq,
            causal=causal, gqa=gqa, stages_q=t.stages_q, stages_do=t.stages_do,
            dv_first=t.dv_first, dq_red_vec=configs.bwd_dq_red_vec(arch), stmatrix_pds=t.stmatrix_pds,
            **flags,
        )

    def _post_keys(self, arch: str, dtype: str, hdim: int, varlen: bool = False, seqused_q: bool = False,
                   seqused_k: bool = False) -> tuple[BwdPostKey, BwdPostKey]:
        """(dQ postprocess, GQA dK/dV postprocess)."""
        t = configs.bwd_sm80_tiles(arch)[hdim]
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
        sliding window and causal softcap. Rarer ones (fp16 features, GQA at 96-256, seqused, varlen
        GQA, window + varlen, ...) compile on first use."""
        keys: list[KernelKey] = []
        for hdim in self.tiles:
            common = hdim in (64, 128)
            for dtype in ("bf16", "fp16") if common else ("bf16",):
                keys.append(BwdPreKey(kernel="bwd_pre_sm80", arch=arch, dtype=dtype, head_dim=hdim))
                post_dq, post_kv = self._post_keys(arch, dtype, hdim)
                keys.extend((post_dq, post_kv) if common else (post_dq,))
                for causal in (False, True):
                    for gqa in (False, True) if common else (False,):
                        keys.append(self._main_key(arch, dtype, hdim, causal, gqa))
                        # Dense unmasked calls split their last wave (tail_plan) with a segments kernel;
                        # sm_80's d128 MHA one spills 1 register (1 LDL + 1 STL; it runs at most one
                        # short wave) and compiles on first use.
                        if not causal and (arch.startswith("sm_90") or gqa or hdim != 128):
                            keys.append(self._main_key(arch, dtype, hdim, causal, gqa, tail_split=True))
        if 128 in self.tiles:
            keys.append(BwdPreKey(kernel="bwd_pre_sm80", arch=arch, dtype="bf16", head_dim=128, varlen=True))
            keys.append(self._post_keys(arch, "bf16", 128, varlen=True)[0])
            # Causal only: non-causal varlen d128 spills 1 register on sm_80 (1 LDL + 1 STL; varlen seqlens
            # live in registers, dense ones in the parameter bank); it compiles on first use.
            keys.append(self._main_key(arch, "bf16", 128, True, False, varlen=True))
            keys.append(self._main_key(arch, "bf16", 128, False, False, local=True))
            keys.append(self._main_key(arch, "bf16", 128, True, False, softcap=True))
        return keys

    # ------------------------------------------------------------------ compile

    def compile(self, key: KernelKey, options: str | None = None) -> Any:
        import cutlass
        import cutlass.cute as cute

        kwargs = {"options": options} if options else {}
        dtype = cutlass_dtype(key.dtype)  # type: ignore[attr-defined]
        f32, i32 = cutlass.Float32, cutlass.Int32
        varlen = getattr(key, "varlen", False)
        # Scratch buffers get their own symbols: a shared symbol asserts equal extents at run time.
        b, s_q, s_k, h, h_k, d, s_pad, acc_len, acc_k, b1, nb = (cute.sym_int() for _ in range(11))
        sem_q = tuple(cute.sym_int() for _ in range(3))
        sem_kv = tuple(cute.sym_int() for _ in range(3))
        stream = cute.runtime.make_fake_stream()

        def qkv(seqlen: Any, heads: Any) -> Any:  # dense (b, s, h, d) or packed (total, h, d)
            return _fake_packed(dtype, seqlen, heads, d) if varlen else fake_bshd(dtype, b, seqlen, heads, d)

        if key.kernel == "bwd_pre_sm80":
            from ..kernels.common.bwd_pre import FlashBwdPreprocess

            pre: BwdPreKey = key  # type: ignore[assignment]
            kernel = FlashBwdPreprocess(dtype, pre.head_dim, _PRE_TILE_M, _pre_threads(pre.head_dim))
            lse = _fake(f32, (h, s_q)) if varlen else _fake(f32, (b, h, s_q))
            fakes = (
                qkv(s_q, h), qkv(s_q, h), lse, _fake(f32, (b, h, s_pad)), _fake(f32, (b, h, s_pad)),
                _fake(f32, (b, h, acc_len), 4),
            )
            ints = (_fake_ints(b1) if varlen else None, _fake_ints(nb) if pre.seqused else None)
            return cute.compile(kernel, *fakes, *ints, stream, **kwargs)
        if key.kernel == "bwd_post_sm80":
            from ..kernels.common.bwd_post import FlashBwdPostprocess

            pk: BwdPostKey = key  # type: ignore[assignment]
            kernel = FlashBwdPostprocess(
                dtype, pk.head_dim, pk.tile_m, pk.num_threads, pk.atom_m or None, pk.dq_red_vec
            )
            ints = (_fake_ints(b1) if varlen else None, _fake_ints(nb) if pk.seqused else None)
            fakes = (_fake(f32, (b, h, acc_len), 4), qkv(s_q, h))
            return cute.compile(kernel, *fakes, f32(1.0), *ints, stream, **kwargs)
        if key.kernel != self.kind:
            raise ValueError(f"not a key of this family: {key.name}")
        from ..kernels.sm80.bwd import FlashBwdSm80

        k: BwdKey = key  # type: ignore[assignment]
        kernel = FlashBwdSm80(
            dtype, k.head_dim, k.tile_m, k.tile_n, k.num_threads, k.atom_m_sdp, k.atom_n_dkv, k.atom_m_dq,
            k.causal, k.gqa, is_local=k.local, has_softcap=k.softcap, stages_q=k.stages_q,
            stages_do=k.stages_do, dv_first=k.dv_first, dq_red_vec=k.dq_red_vec,
            stmatrix_pds=k.stmatrix_pds, tail_split=k.tail_split, arch=k.arch,
        )
        if k.gqa:
            dkv = (_fake(f32, (b, h_k, acc_k), 4), _fake(f32, (b, h_k, acc_k), 4))
        else:
            dkv = (qkv(s_k, h_k), qkv(s_k, h_k))
        fakes = (
            qkv(s_q, h), qkv(s_k, h_k), qkv(s_k, h_k), qkv(s_q, h), _fake(f32, (b, h, s_pad)),
            _fake(f32, (b, h, s_pad)), _fake(f32, (b, h, acc_len), 4), *dkv, _fake(i32, sem_q),
            _fake(i32, sem_kv),
        )
        ints = (
            _fake_ints(b1) if varlen else None, _fake_ints(b1) if varlen else None,
            _fake_ints(nb) if k.seqused_q else None, _fake_ints(nb) if k.seqused_k else None,
        )
        scalars = (f32(1.0), i32(0), i32(0), f32(1.0), i32(0), i32(0), i32(0))
        tail = _fake(f32, (cute.sym_int(), cute.sym_int(), cute.sym_int()), 4) if k.tail_split and not k.gqa else None
        return cute.compile(kernel, *fakes, *scalars, *ints, tail, stream, **kwargs)

    # ------------------------------------------------------------------ launch

    def backward(
        self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, p: AttnProblem, varlen: VarlenArgs | None, deterministic: bool,
        dq: torch.Tensor | None = None, dk: torch.Tensor | None = None, dv: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dq, dk, dv shaped like q, k, v. ``dq``/``dk``/``dv`` given (internal: tests pass NaN-poisoned
        buffers, all three or none): contiguous, q's dtype, the kernel's padded head dim; the results
        are these buffers (views of them where the head dim is padded)."""
        if p.batch == 0 or p.seqlen_q == 0 or p.seqlen_k == 0 or p.nheads == 0:
            # No keys or no queries: every gradient is 0.
            if dq is not None:
                return dq.zero_(), dk.zero_(), dv.zero_()
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dev = q.device
        sms = num_sms(dev.index if dev.index is not None else torch.cuda.current_device())
        pre_key, main_key, post_dq_key, post_kv_key = self.keys(p, target_arch(), varlen, deterministic, sms)
        pre = compile_cache.get(pre_key, self.compile)
        # Split tail: the whole-block kernel skips the last key blocks, the segments kernel runs them.
        main, segments = compile_cache.get(main_key, self.compile), None
        if main_key.tail_split:
            segments = main
            main = compile_cache.get(dataclasses.replace(main_key, tail_split=False), self.compile)
        post_dq = compile_cache.get(post_dq_key, self.compile)
        post_kv = compile_cache.get(post_kv_key, self.compile) if main_key.gqa else None
        d = main_key.head_dim
        q_k, k_k, v_k, out_k, dout_k = (_ready(pad_head_dim(t, d)) for t in (q, k, v, out, dout))
        lse_k = _ready(lse)
        b, s_q, s_k, h, h_k = p.batch, p.seqlen_q, p.seqlen_k, p.nheads, p.nheads_k
        f32 = torch.float32
        if varlen is not None:
            # One "batch" row of scratch; sequence i starts at its padded offset (kernels/common/bwd_utils.py).
            b_scr = 1
            s_q_pad = -(-(s_q + b * SEQ_PAD) // SEQ_PAD) * SEQ_PAD
            s_k_pad = -(-(s_k + b * SEQ_PAD) // SEQ_PAD) * SEQ_PAD
            q_shape, k_shape = (s_q, h, d), (s_k, h_k, d)
            ints = tuple(_int_arg(t) for t in (varlen.cu_seqlens_q, varlen.cu_seqlens_k, varlen.seqused_q,
                                                  varlen.seqused_k))
        else:
            b_scr, s_q_pad, s_k_pad = b, -(-s_q // SEQ_PAD) * SEQ_PAD, -(-s_k // SEQ_PAD) * SEQ_PAD
            q_shape, k_shape = (b, s_q, h, d), (b, s_k, h_k, d)
            ints = (None, None, None, None)
        lse_log2 = torch.empty(b_scr, h, s_q_pad, dtype=f32, device=dev)
        dpsum = torch.empty(b_scr, h, s_q_pad, dtype=f32, device=dev)
        dq_accum = torch.empty(b_scr, h, s_q_pad * d, dtype=f32, device=dev)
        # Rows past seqused are never written by the kernels: they must read 0.
        if dq is None:
            dq = (torch.zeros if main_key.seqused_q else torch.empty)(q_shape, dtype=q.dtype, device=dev)
            dk = (torch.zeros if main_key.seqused_k else torch.empty)(k_shape, dtype=q.dtype, device=dev)
            dv = (torch.zeros if main_key.seqused_k else torch.empty)(k_shape, dtype=q.dtype, device=dev)
        else:
            _check_given(dq, q_shape, q.dtype, "dq")
            _check_given(dk, k_shape, q.dtype, "dk")
            _check_given(dv, k_shape, q.dtype, "dv")
            if main_key.seqused_q:
                dq.zero_()
            if main_key.seqused_k:
                dk.zero_(), dv.zero_()
        if main_key.gqa:
            dk_main = torch.zeros(b_scr, h_k, s_k_pad * d, dtype=f32, device=dev)
            dv_main = torch.zeros(b_scr, h_k, s_k_pad * d, dtype=f32, device=dev)
        else:
            dk_main, dv_main = dk, dv
        if deterministic:
            sem_q = torch.zeros(b_scr, h, s_q_pad // main_key.tile_m, dtype=torch.int32, device=dev)
            sem_kv = (torch.zeros(b_scr, h_k, s_k_pad // main_key.tile_n, dtype=torch.int32, device=dev)
                      if main_key.gqa else sem_q)
        else:
            sem_q = sem_kv = _unused_semaphore(dev.index)
        tail_blocks, tail_segments, tail_sums = 0, 1, None
        if main_key.tail_split:
            tail_blocks, tail_segments = tail_plan(b, s_q, s_k, h, main_key.tile_m, main_key.tile_n, sms)
            if not main_key.gqa:  # MHA: the split blocks' partial dK/dV sums and arrival counts
                tail_sums = torch.zeros(max(tail_blocks, 1), 2, main_key.tile_n * d, dtype=f32, device=dev)
                sem_kv = torch.zeros(1, 1, max(tail_blocks, 1), dtype=torch.int32, device=dev)
        scale, one = kernel_arg(float(p.softmax_scale)), kernel_arg(1.0)
        window_left, window_right = window_args(p) if main_key.local else (0, 0)
        softcap = float(p.softcap) if main_key.softcap else 1.0
        scalars = (scale, *(kernel_arg(x) for x in (
            window_left, window_right, softcap, int(deterministic), tail_blocks, tail_segments)))
        cu_q, cu_k, su_q, su_k = (kernel_arg(x) for x in ints)
        with torch.cuda.device(dev):
            stream = current_stream(dev)
            lse_log2_arg, dpsum_arg, dq_accum_arg, dout_arg = (to_cute(t) for t in (lse_log2, dpsum, dq_accum, dout_k))
            launch(
                pre, to_cute(out_k), dout_arg, to_cute(lse_k), lse_log2_arg, dpsum_arg, dq_accum_arg, cu_q, su_q, stream,
            )
            main_args = (
                *(to_cute(t) for t in (q_k, k_k, v_k)), dout_arg, lse_log2_arg, dpsum_arg, dq_accum_arg,
                *(to_cute(t) for t in (dk_main, dv_main, sem_q, sem_kv)), *scalars, cu_q, cu_k, su_q, su_k,
            )
            launch(main, *main_args, kernel_arg(None), stream)
            if segments is not None and tail_blocks > 0:
                launch(segments, *main_args, kernel_arg(None) if tail_sums is None else to_cute(tail_sums), stream)
            launch(post_dq, dq_accum_arg, to_cute(dq), scale, cu_q, su_q, stream)
            if post_kv is not None:
                launch(post_kv, to_cute(dk_main), to_cute(dk), scale, cu_k, su_k, stream)
                launch(post_kv, to_cute(dv_main), to_cute(dv), one, cu_k, su_k, stream)
        if d != p.head_dim:
            dq, dk = dq[..., : p.head_dim], dk[..., : p.head_dim]
        if d != p.head_dim_v:
            dv = dv[..., : p.head_dim_v]
        return dq, dk, dv
