"""Packed (varlen) row bookkeeping shared by the host-side features: which sequence each packed row
belongs to, from ``cu_seqlens`` alone (tensor ops on its device: no host read, traceable)."""

from __future__ import annotations

import torch


def sequence_of_rows(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """int64 ``(total,)``: the index of the sequence each packed row lies in (``cu_seqlens`` int32
    ``(batch + 1,)``; an empty sequence owns no row)."""
    rows = torch.arange(total, device=cu_seqlens.device, dtype=torch.int64)
    return torch.searchsorted(cu_seqlens[1:].to(torch.int64).contiguous(), rows, right=True)
