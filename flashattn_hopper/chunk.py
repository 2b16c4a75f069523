"""Chunked attention (``attention_chunk``, Llama 4) as varlen attention over chunk segments.

With ``attention_chunk = c > 0``, query ``i`` of a sequence sees only the keys of its own chunk:
key ``j`` is visible iff ``j // c == (i + seqlen_k - seqlen_q) // c`` (bottom-right aligned, as
flash-attn 3), intersected with causal and ``window_size``. That is block-diagonal attention, so
each (sequence, chunk) is a sequence of its own: segment ``ch`` holds the queries with
``(i + offset) // c == ch`` and the keys with ``j // c == ch``, and the kernels' varlen path runs
them. Only the attended area is computed and no element mask is added beyond causal/window.

Why the causal and window bounds carry over unchanged: a segment's own bottom-right offset
``seg_len_k - seg_len_q`` equals ``offset + q_start - k_start`` (its last query is the sequence's
last query of the chunk, its last key the chunk's last key, and ``k_end = q_end + offset``), so
``j <= i + offset + right`` and ``j >= i + offset - left`` read the same in segment coordinates.

Segments per sequence: slot 0 holds the queries with ``i + offset < 0`` (negative chunk indices:
no keys; their out is 0 and LSE -inf, as for any row that sees no key), slot ``1 + ch`` holds chunk
``ch``. Every sequence gets the same number of slots, ``1 + ceil(max_seqlen_k / c)``; slots past a
sequence's last chunk are empty. With ``seqused_*`` the chunks are those of the used lengths, each
segment's ``seqused`` is its used length, and the unused rows of a slot trail its last segment
(past that segment's ``seqused``: never written, as without chunks). All of it is built with
tensor ops on the inputs' device: no host sync, and it traces under ``torch.compile``.
"""

from __future__ import annotations

import torch


def num_slots(max_seqlen_k: int, chunk: int) -> int:
    """Segments per sequence: the negative-chunk slot plus one per chunk of the longest key sequence."""
    return 1 + max(-(-max_seqlen_k // chunk), 0)


def _segment_starts(lens_q: torch.Tensor, lens_k: torch.Tensor, chunk: int, slots: int):
    """(q_starts, k_starts), each ``(batch, slots)`` int64: where each segment starts inside its
    sequence, for used lengths ``lens_q``/``lens_k`` ``(batch,)``."""
    offset = (lens_k - lens_q)[:, None]
    ch = torch.arange(slots - 1, device=lens_q.device, dtype=torch.int64)[None, :]
    zero = torch.zeros_like(offset)
    q_starts = torch.cat([zero, torch.minimum(torch.clamp(ch * chunk - offset, min=0), lens_q[:, None])], dim=1)
    k_starts = torch.cat([zero, torch.minimum(ch * chunk, lens_k[:, None])], dim=1)
    return q_starts, k_starts


def _cu_and_used(cu: torch.Tensor, used: torch.Tensor | None, starts: torch.Tensor):
    """Segment offsets ``(batch * slots + 1,)`` int32 and, with ``used``, each segment's used length.

    A segment's slot runs to the next segment's start; the last slot of a sequence runs to the
    sequence's physical end (its unused rows, past that segment's ``seqused``)."""
    batch, slots = starts.shape
    seq_start = cu[:-1].to(torch.int64)[:, None]
    begins = (seq_start + starts).reshape(-1)
    total = cu[-1:].to(torch.int64)
    cu_seg = torch.cat([begins, total]).to(torch.int32)
    if used is None:
        return cu_seg, None
    # Used end of each segment: the next segment's start, or the sequence's used length for the last.
    ends = torch.cat([starts[:, 1:], used.to(torch.int64)[:, None]], dim=1)
    return cu_seg, (ends - starts).reshape(-1).to(torch.int32)


def segments(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    seqused_q: torch.Tensor | None,
    seqused_k: torch.Tensor | None,
    chunk: int,
    max_seqlen_k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)`` of the chunk segments of a varlen batch.

    ``max_seqlen_k``: an upper bound on every sequence's (used) key length; it sets the number of
    slots, so a loose bound only adds empty segments."""
    lens_q = (seqused_q if seqused_q is not None else cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.int64)
    lens_k = (seqused_k if seqused_k is not None else cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int64)
    q_starts, k_starts = _segment_starts(lens_q, lens_k, chunk, num_slots(max_seqlen_k, chunk))
    cu_q, used_q = _cu_and_used(cu_seqlens_q, seqused_q, q_starts)
    cu_k, used_k = _cu_and_used(cu_seqlens_k, seqused_k, k_starts)
    return cu_q, cu_k, used_q, used_k


def dense_segments(
    batch: int, seqlen_q: int, seqlen_k: int, chunk: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_seqlens_q, cu_seqlens_k)`` of the chunk segments of a dense ``(batch, seqlen, ...)`` call
    viewed as packed ``(batch * seqlen, ...)``."""
    cu_q = torch.arange(batch + 1, device=device, dtype=torch.int32) * seqlen_q
    cu_k = torch.arange(batch + 1, device=device, dtype=torch.int32) * seqlen_k
    cu_seg_q, cu_seg_k, _, _ = segments(cu_q, cu_k, None, None, chunk, seqlen_k)
    return cu_seg_q, cu_seg_k
