"""Launcher of the Ampere FA2 backward: preprocess (kernels/bwd_pre.py), main (kernels/bwd_sm80.py)
and postprocess (kernels/bwd_post.py): keys, compile, launch.

One backward call is 3 launches (MHA) or 5 (GQA/MQA: the postprocess also converts the fp32 dK/dV
sums): pre (dPsum, LSE_log2, zero dQaccum) -> main (dK, dV; dQ reduce-added in fp32) -> post (dQ).
Head dims below the kernel's are zero-padded in Python, like the forward. ``deterministic`` is a
runtime flag of the main kernel (semaphore-ordered reduce-adds), not a separate compile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import configs
from ..jit import KernelKey, compile_cache, target_arch
from ..validate import AttnProblem
from .common import (
    DTYPE_NAMES, MAX_GRID_YZ, VarlenArgs, current_stream, cutlass_dtype, fake_bshd, pad_head_dim, to_cute,
)

SEQ_PAD = 128  # kernels/common/bwd_utils.py SEQ_PAD: scratch buffers pad seqlens to this
_PRE_TILE_M, _PRE_THREADS = 128, 128
_POST_TILE_M, _POST_THREADS = 64, 128


@dataclass(frozen=True)
class BwdPreKey(KernelKey):
    """bwd_pre_sm80: dPsum, LSE_log2, zeroed dQaccum; one per dtype and head dim."""

    dtype: str
    head_dim: int


@dataclass(frozen=True)
class BwdPostKey(KernelKey):
    """bwd_post_sm80: fp32 accumulator -> 16-bit. ``atom_m`` > 0: dQaccum in the fragment order of
    the main kernel's dQ MMA (same tile_m, num_threads, atom_m); 0: row-major (GQA dK/dV sums)."""

    dtype: str
    head_dim: int
    tile_m: int
    num_threads: int
    atom_m: int


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


def _fake(dtype: Any, shape: tuple[Any, ...], divisibility: int = 1) -> Any:
    """A fake tensor with ``to_cute``'s ABI: dynamic shapes and strides, unit last stride."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    strides = tuple(cute.sym_int64(divisibility=divisibility) for _ in range(len(shape) - 1))
    return make_fake_tensor(dtype, shape, stride=(*strides, 1), assumed_align=16)


def _ready(t: torch.Tensor) -> torch.Tensor:
    """Unit last stride, other strides non-zero multiples of 8, 16-byte aligned (dout may be expanded)."""
    strides = t.stride()
    if t.data_ptr() % 16 == 0 and strides[-1] == 1 and all(s > 0 and s % 8 == 0 for s in strides[:-1]):
        return t
    return t.contiguous()


class BwdSm80:
    """FA2-style backward: parallel over key blocks, dQ by fp32 reduce-adds, dK/dV in registers."""

    backend = "sm80"
    kind = "bwd_sm80"
    tiles = configs.BWD_SM80_TILES

    def can_implement(self, p: AttnProblem, deterministic: bool) -> str | None:
        if configs.kernel_head_dim(self.tiles, p.head_dim, p.head_dim_v) is None:
            return (
                f"head dims ({p.head_dim}, {p.head_dim_v}) are not implemented yet by the sm80 backward; "
                f"supported: head dims up to {max(self.tiles)}"
            )
        if p.is_varlen:
            return "varlen (cu_seqlens_q/cu_seqlens_k) is not implemented yet by the sm80 backward"
        if p.is_local and not (p.causal and p.window_left < 0):
            return "window_size (sliding-window attention) is not implemented yet by the sm80 backward"
        if p.softcap != 0.0:
            return "softcap is not implemented yet by the sm80 backward"
        if p.nheads > MAX_GRID_YZ or p.batch > MAX_GRID_YZ:
            return f"nheads ({p.nheads}) and batch ({p.batch}) must each be <= {MAX_GRID_YZ} (CUDA grid y/z limit)"
        return None

    # ------------------------------------------------------------------ keys

    def keys(self, p: AttnProblem, arch: str) -> tuple[BwdPreKey, BwdKey, BwdPostKey, BwdPostKey]:
        """(pre, main, post for dQ, post for the GQA dK/dV sums)."""
        hdim = configs.kernel_head_dim(self.tiles, p.head_dim, p.head_dim_v)
        assert hdim is not None, "can_implement() must accept the problem first"
        dtype = DTYPE_NAMES[p.dtype]
        main = self._main_key(arch, dtype, hdim, p.causal, p.nheads != p.nheads_k)
        return (BwdPreKey(kernel="bwd_pre_sm80", arch=arch, dtype=dtype, head_dim=hdim), main,
                *self._post_keys(arch, dtype, hdim))

    def _main_key(self, arch: str, dtype: str, hdim: int, causal: bool, gqa: bool) -> BwdKey:
        t = self.tiles[hdim]
        return BwdKey(
            kernel=self.kind, arch=arch, dtype=dtype, head_dim=hdim, tile_m=t.tile_m, tile_n=t.tile_n,
            num_threads=t.num_threads, atom_m_sdp=t.atom_m_sdp, atom_n_dkv=t.atom_n_dkv, atom_m_dq=t.atom_m_dq,
            causal=causal, gqa=gqa,
        )

    def _post_keys(self, arch: str, dtype: str, hdim: int) -> tuple[BwdPostKey, BwdPostKey]:
        t = self.tiles[hdim]
        return (
            BwdPostKey(kernel="bwd_post_sm80", arch=arch, dtype=dtype, head_dim=hdim, tile_m=t.tile_m,
                       num_threads=t.num_threads, atom_m=t.atom_m_dq),
            BwdPostKey(kernel="bwd_post_sm80", arch=arch, dtype=dtype, head_dim=hdim, tile_m=_POST_TILE_M,
                       num_threads=_POST_THREADS, atom_m=0),
        )

    def all_keys(self, arch: str) -> list[KernelKey]:
        """Every variant, for precompile and the compile-only tests."""
        keys: list[KernelKey] = []
        for hdim in self.tiles:
            for dtype in ("bf16", "fp16"):
                keys.append(BwdPreKey(kernel="bwd_pre_sm80", arch=arch, dtype=dtype, head_dim=hdim))
                keys.extend(self._post_keys(arch, dtype, hdim))
                for causal in (False, True):
                    for gqa in (False, True):
                        keys.append(self._main_key(arch, dtype, hdim, causal, gqa))
        return keys

    # ------------------------------------------------------------------ compile

    def compile(self, key: KernelKey, options: str | None = None) -> Any:
        import cutlass
        import cutlass.cute as cute

        kwargs = {"options": options} if options else {}
        dtype = cutlass_dtype(key.dtype)  # type: ignore[attr-defined]
        f32, i32 = cutlass.Float32, cutlass.Int32
        # Scratch buffers get their own symbols: a shared symbol asserts equal extents at run time.
        b, s_q, s_k, h, h_k, d, s_pad, acc_len, acc_k = (cute.sym_int() for _ in range(9))
        sem_q = tuple(cute.sym_int() for _ in range(3))
        sem_kv = tuple(cute.sym_int() for _ in range(3))
        stream = cute.runtime.make_fake_stream()
        if key.kernel == "bwd_pre_sm80":
            from ..kernels.bwd_pre import FlashBwdPreprocess

            kernel = FlashBwdPreprocess(dtype, key.head_dim, _PRE_TILE_M, _PRE_THREADS)  # type: ignore[attr-defined]
            fakes = (
                fake_bshd(dtype, b, s_q, h, d), fake_bshd(dtype, b, s_q, h, d), _fake(f32, (b, h, s_q)),
                _fake(f32, (b, h, s_pad)), _fake(f32, (b, h, s_pad)), _fake(f32, (b, h, acc_len), 4),
            )
            return cute.compile(kernel, *fakes, stream, **kwargs)
        if key.kernel == "bwd_post_sm80":
            from ..kernels.bwd_post import FlashBwdPostprocess

            pk: BwdPostKey = key  # type: ignore[assignment]
            kernel = FlashBwdPostprocess(dtype, pk.head_dim, pk.tile_m, pk.num_threads, pk.atom_m or None)
            fakes = (_fake(f32, (b, h, acc_len), 4), fake_bshd(dtype, b, s_q, h, d))
            return cute.compile(kernel, *fakes, f32(1.0), stream, **kwargs)
        if key.kernel != self.kind:
            raise ValueError(f"not a key of this family: {key.name}")
        from ..kernels.bwd_sm80 import FlashBwdSm80

        k: BwdKey = key  # type: ignore[assignment]
        kernel = FlashBwdSm80(
            dtype, k.head_dim, k.tile_m, k.tile_n, k.num_threads, k.atom_m_sdp, k.atom_n_dkv, k.atom_m_dq,
            k.causal, k.gqa,
        )
        if k.gqa:
            dkv = (_fake(f32, (b, h_k, acc_k), 4), _fake(f32, (b, h_k, acc_k), 4))
        else:
            dkv = (fake_bshd(dtype, b, s_k, h_k, d), fake_bshd(dtype, b, s_k, h_k, d))
        fakes = (
            fake_bshd(dtype, b, s_q, h, d), fake_bshd(dtype, b, s_k, h_k, d), fake_bshd(dtype, b, s_k, h_k, d),
            fake_bshd(dtype, b, s_q, h, d), _fake(f32, (b, h, s_pad)), _fake(f32, (b, h, s_pad)),
            _fake(f32, (b, h, acc_len), 4), *dkv, _fake(i32, sem_q), _fake(i32, sem_kv),
        )
        return cute.compile(kernel, *fakes, f32(1.0), i32(0), stream, **kwargs)

    # ------------------------------------------------------------------ launch

    def backward(
        self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, p: AttnProblem, varlen: VarlenArgs | None, deterministic: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dq, dk, dv shaped like q, k, v."""
        if p.batch == 0 or p.seqlen_q == 0 or p.seqlen_k == 0 or p.nheads == 0:
            # No keys: out = 0 for every query, so every gradient is 0.
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        pre_key, main_key, post_dq_key, post_kv_key = self.keys(p, target_arch())
        pre = compile_cache.get(pre_key, self.compile)
        main = compile_cache.get(main_key, self.compile)
        post_dq = compile_cache.get(post_dq_key, self.compile)
        post_kv = compile_cache.get(post_kv_key, self.compile) if main_key.gqa else None
        d = main_key.head_dim
        q_k, k_k, v_k, out_k, dout_k = (_ready(pad_head_dim(t, d)) for t in (q, k, v, out, dout))
        lse_k = _ready(lse)
        b, s_q, s_k, h, h_k = p.batch, p.seqlen_q, p.seqlen_k, p.nheads, p.nheads_k
        dev, f32 = q.device, torch.float32
        s_q_pad = -(-s_q // SEQ_PAD) * SEQ_PAD
        s_k_pad = -(-s_k // SEQ_PAD) * SEQ_PAD
        lse_log2 = torch.empty(b, h, s_q_pad, dtype=f32, device=dev)
        dpsum = torch.empty(b, h, s_q_pad, dtype=f32, device=dev)
        dq_accum = torch.empty(b, h, s_q_pad * d, dtype=f32, device=dev)
        dq = torch.empty(b, s_q, h, d, dtype=q.dtype, device=dev)
        dk = torch.empty(b, s_k, h_k, d, dtype=q.dtype, device=dev)
        dv = torch.empty(b, s_k, h_k, d, dtype=q.dtype, device=dev)
        if main_key.gqa:
            dk_main = torch.zeros(b, h_k, s_k_pad * d, dtype=f32, device=dev)
            dv_main = torch.zeros(b, h_k, s_k_pad * d, dtype=f32, device=dev)
        else:
            dk_main, dv_main = dk, dv
        if deterministic:
            num_m = -(-s_q // main_key.tile_m)
            num_n = -(-s_k // main_key.tile_n)
            sem_q = torch.zeros(b, h, num_m, dtype=torch.int32, device=dev)
            sem_kv = torch.zeros(b, h_k, num_n, dtype=torch.int32, device=dev) if main_key.gqa else sem_q
        else:
            sem_q = sem_kv = torch.zeros(1, 1, 1, dtype=torch.int32, device=dev)
        scale = p.softmax_scale
        with torch.cuda.device(dev):
            stream = current_stream(dev)
            pre(*(to_cute(t) for t in (out_k, dout_k, lse_k, lse_log2, dpsum, dq_accum)), stream)
            main(
                *(to_cute(t) for t in (q_k, k_k, v_k, dout_k, lse_log2, dpsum, dq_accum, dk_main, dv_main,
                                       sem_q, sem_kv)),
                scale, int(deterministic), stream,
            )
            post_dq(to_cute(dq_accum), to_cute(dq), scale, stream)
            if post_kv is not None:
                post_kv(to_cute(dk_main), to_cute(dk), scale, stream)
                post_kv(to_cute(dv_main), to_cute(dv), 1.0, stream)
        if d != p.head_dim:
            dq, dk = dq[..., : p.head_dim], dk[..., : p.head_dim]
        if d != p.head_dim_v:
            dv = dv[..., : p.head_dim_v]
        return dq, dk, dv
