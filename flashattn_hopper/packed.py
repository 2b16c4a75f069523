"""Packed (varlen) row bookkeeping shared by the host-side features: which sequence each packed row
belongs to, from ``cu_seqlens`` alone (tensor ops on its device: no host read, traceable)."""

from __future__ import annotations

import torch


def sequence_of_rows(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """int64 ``(total,)``: the index of the sequence each packed row lies in (``cu_seqlens`` int32
    ``(batch + 1,)``; an empty sequence owns no row). Rows past ``cu_seqlens[-1]`` (a caller's
    padding, which varlen calls allow) count as the last sequence's, beyond its length, so that
    per-sequence lookups stay in range."""
    rows = torch.arange(total, device=cu_seqlens.device, dtype=torch.int64)
    seq = torch.searchsorted(cu_seqlens[1:].to(torch.int64).contiguous(), rows, right=True)
    return seq.clamp_(max=max(cu_seqlens.shape[0] - 2, 0))
