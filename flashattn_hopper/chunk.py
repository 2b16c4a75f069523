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

Segments: each sequence's come together and in order: first the one holding the queries with
``i + offset < 0`` (negative chunk indices: no keys; their out is 0 and LSE -inf, as for any row that sees no
key), then one per chunk ``ch < ceil(seqlen_k / c)`` of its keys; a sequence's last segment runs to the
sequence's physical end. The table has a fixed length, ``num_segments``, chosen from shapes alone (the
caller's): a varlen batch needs at most ``batch + sum(ceil(seqlen_k / c)) <= 2 * batch + ceil(total_k / c)``
segments whatever its lengths, so the table is right for any ``cu_seqlens`` (a ``max_seqlen_k`` that
understated the longest sequence once made each sequence's last segment hold several chunks: a silent wrong
answer); the entries past the last sequence's are empty. With ``seqused_*`` the chunks are those of the used
lengths, each segment's ``seqused`` is its used length, and the unused rows of a sequence trail its last
segment (past that segment's ``seqused``: never written, as without chunks). All of it is built with tensor
ops on the inputs' device: no host sync, and it traces under ``torch.compile``.
"""

from __future__ import annotations

import torch


def varlen_num_segments(batch: int, total_k: int, chunk: int) -> int:
    """Segments a varlen batch of ``batch`` sequences and ``total_k`` packed keys can need, from shapes alone:
    one negative-chunk segment per sequence plus ``ceil(len_k / chunk) <= len_k / chunk + 1`` each."""
    return 2 * batch + -(-total_k // chunk)


def dense_num_segments(batch: int, seqlen_k: int, chunk: int) -> int:
    """Segments of a dense batch: exactly ``1 + ceil(seqlen_k / chunk)`` per sequence."""
    return batch * (1 + -(-seqlen_k // chunk))


def _segment_table(lens_q: torch.Tensor, lens_k: torch.Tensor, chunk: int, num_segments: int):
    """``(seq, q_starts, k_starts, last)``, each ``(num_segments,)``: each segment's sequence (``batch`` for
    the empty entries past the last sequence's), where it starts inside its sequence (int64, 0 for the
    empty entries), and whether it is its sequence's last; for used lengths ``lens_q``/``lens_k``
    ``(batch,)`` int64. (Per-sequence values carry one zero entry at index ``batch``, so the empty entries
    index it too: a batch of no sequences needs no special case, and no Python ``max`` on a traced size.)"""
    batch = lens_q.shape[0]
    pad = lens_q.new_zeros(1)
    lens_q, lens_k = torch.cat([lens_q, pad]), torch.cat([lens_k, pad])
    counts = 1 + (lens_k[:-1] + chunk - 1) // chunk  # the negative-chunk segment + one per chunk of keys
    ends = torch.cumsum(counts, 0)
    index = torch.arange(num_segments, device=lens_q.device, dtype=torch.int64)
    seq = torch.searchsorted(ends, index, right=True)
    valid = seq < batch
    slot = index - torch.cat([ends - counts, counts.sum().reshape(1)])[seq]  # 0: negative chunks; 1 + ch
    ch = slot - 1
    offset = lens_k[seq] - lens_q[seq]
    q_starts = torch.minimum(torch.clamp(ch * chunk - offset, min=0), lens_q[seq])
    k_starts = torch.minimum(ch * chunk, lens_k[seq])
    real = valid & (slot > 0)
    last = valid & (index + 1 == torch.cat([ends, pad])[seq])
    return seq, torch.where(real, q_starts, 0), torch.where(real, k_starts, 0), last


def _cu_and_used(cu: torch.Tensor, used: torch.Tensor | None, seq: torch.Tensor, starts: torch.Tensor,
                 last: torch.Tensor):
    """Segment offsets ``(num_segments + 1,)`` int32 and, with ``used``, each segment's used length.

    A segment runs to the next one's start; a sequence's last segment runs to the sequence's physical end
    (its unused rows, past that segment's ``seqused``); the empty entries sit at the packed end
    (``cu[batch]``)."""
    cu64 = cu.to(torch.int64)
    begins = cu64[seq] + starts
    cu_seg = torch.cat([begins, cu64[-1:]]).to(torch.int32)
    if used is None:
        return cu_seg, None
    # Used end of each segment: the next segment's start, or the sequence's used length for its last one.
    used_end = torch.cat([used.to(torch.int64), used.new_zeros(1, dtype=torch.int64)])[seq]
    next_starts = torch.cat([starts[1:], starts[:1]])
    ends = torch.where(last, used_end, next_starts)
    return cu_seg, torch.where(seq < cu.shape[0] - 1, ends - starts, 0).to(torch.int32)


def segments(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    seqused_q: torch.Tensor | None,
    seqused_k: torch.Tensor | None,
    chunk: int,
    num_segments: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)`` of the chunk segments of a varlen batch.

    ``num_segments``: the table's length, at least what the batch needs (``varlen_num_segments`` of its
    shapes always is); a larger one only adds empty segments."""
    lens_q = (seqused_q if seqused_q is not None else cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.int64)
    lens_k = (seqused_k if seqused_k is not None else cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int64)
    seq, q_starts, k_starts, last = _segment_table(lens_q, lens_k, chunk, num_segments)
    cu_q, used_q = _cu_and_used(cu_seqlens_q, seqused_q, seq, q_starts, last)
    cu_k, used_k = _cu_and_used(cu_seqlens_k, seqused_k, seq, k_starts, last)
    return cu_q, cu_k, used_q, used_k


def dense_segments(
    batch: int, seqlen_q: int, seqlen_k: int, chunk: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_seqlens_q, cu_seqlens_k)`` of the chunk segments of a dense ``(batch, seqlen, ...)`` call
    viewed as packed ``(batch * seqlen, ...)``."""
    cu_q = torch.arange(batch + 1, device=device, dtype=torch.int32) * seqlen_q
    cu_k = torch.arange(batch + 1, device=device, dtype=torch.int32) * seqlen_k
    cu_seg_q, cu_seg_k, _, _ = segments(cu_q, cu_k, None, None, chunk, dense_num_segments(batch, seqlen_k, chunk))
    return cu_seg_q, cu_seg_k
