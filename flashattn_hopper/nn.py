"""``MultiheadAttention``: the attention layer of a GPT block on our kernels.

One fused q/k/v projection (GQA: ``num_kv_heads`` divides ``num_heads``), rotary position
embedding applied to q and k before the kernel (GPT-NeoX layout: the two halves of each head rotate
together), causal / sliding-window / softcap options, and an output projection. Input is
``(batch, seqlen, embed_dim)``, or packed ``(total, embed_dim)`` with ``cu_seqlens`` (int32
``(batch + 1,)``) and ``max_seqlen``, where positions restart at each sequence. Works in eager mode,
under ``torch.compile(fullgraph=True)`` and under ``torch.autocast``.
"""

from __future__ import annotations

import torch
from torch import nn

from .api import flash_attn_func, flash_attn_varlen_func
from .packed import sequence_of_rows


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``(len(positions), head_dim // 2)`` in fp32 for the GPT-NeoX rotary embedding."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``(..., tokens, heads, head_dim)`` rotated by position: its two halves as (real, imaginary)
    parts; cos/sin ``(tokens, head_dim // 2)``. Computed in fp32, returned in x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


def packed_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Each packed token's position inside its own sequence (no host read of ``cu_seqlens``)."""
    tokens = torch.arange(total, device=cu_seqlens.device, dtype=torch.int32)
    return tokens - cu_seqlens[sequence_of_rows(cu_seqlens, total)]


class MultiheadAttention(nn.Module):
    """Self-attention with ``num_heads`` query heads of ``embed_dim // num_heads`` and ``num_kv_heads``
    key/value heads. ``rotary_base=None`` turns the rotary embedding off; ``deterministic=True`` makes
    the backward bitwise repeatable (a little slower)."""

    def __init__(
        self, embed_dim: int, num_heads: int, num_kv_heads: int | None = None, *, bias: bool = False,
        causal: bool = True, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
        rotary_base: float | None = 10000.0, deterministic: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim ({embed_dim}) must be a multiple of num_heads ({num_heads})")
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        if rotary_base is not None and self.head_dim % 2 != 0:
            raise ValueError(f"rotary embedding needs an even head dim, got {self.head_dim}")
        self.causal, self.window_size, self.softcap, self.rotary_base = causal, window_size, softcap, rotary_base
        self.deterministic = deterministic  # bitwise-repeatable backward (flash-attn's option)
        factory = {"device": device, "dtype": dtype}
        self.qkv = nn.Linear(embed_dim, (num_heads + 2 * num_kv_heads) * self.head_dim, bias=bias, **factory)
        self.out = nn.Linear(num_heads * self.head_dim, embed_dim, bias=bias, **factory)

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
    ) -> torch.Tensor:
        """x ``(batch, seqlen, embed_dim)``, or ``(total, embed_dim)`` with ``cu_seqlens``."""
        packed = cu_seqlens is not None
        if packed != (x.dim() == 2):
            raise ValueError(
                "x must be (batch, seqlen, embed_dim) without cu_seqlens or (total, embed_dim) with them, "
                f"got shape {tuple(x.shape)} and cu_seqlens={'given' if packed else None}"
            )
        tokens = x.shape[:-1]
        qkv = self.qkv(x).view(*tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=-2)
        if self.rotary_base is not None:
            if packed:
                positions = packed_positions(cu_seqlens, x.shape[0])
            else:
                positions = torch.arange(x.shape[1], device=x.device)
            cos, sin = rotary_cos_sin(positions, self.head_dim, self.rotary_base)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        options = {
            "causal": self.causal, "window_size": self.window_size, "softcap": self.softcap,
            "deterministic": self.deterministic,
        }
        if packed:
            out = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **options)
        else:
            out = flash_attn_func(q, k, v, **options)
        return self.out(out.reshape(*tokens, self.num_heads * self.head_dim))
