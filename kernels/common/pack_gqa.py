"""Pack GQA: the query heads that share one KV head become the rows of one query tile.

Purpose: with GQA/MQA (``nheads = g * nheads_k``) and short query sequences (decode, chunked
prefill), a ``tile_m``-row query tile of one head is mostly empty; packing the ``g`` query heads of
a KV head into the row mode fills it, and each K/V block is then loaded once for all ``g`` heads
instead of once per head (FA3's PackGQA).

Views (no data moves): a kernel-side Q/O view ``(s, d, h, b)`` becomes ``((g, s), d, h / g, b)``
and LSE ``(s, h, b)`` becomes ``((g, s), h / g, b)``; packed row ``r`` is query ``r // g`` of head
``kv_head * g + r % g`` (the head mode is the fast one, so consecutive rows of a tile are the
``g`` heads of one query). ``g`` is a compile-time constant, so a tile of ``tile_m`` rows is a
static ``(g, tile_m / g)`` box that TMA loads and stores like any other tile, and row masks
divide by a constant.

Constraints: dense layouts only (varlen keeps one head per tile), ``g`` divides ``tile_m``, and the
head mode's stride is a multiple of 16 bytes (every kernel-side stride already is).

Paper: FlashAttention-3 code (hopper/pack_gqa.h); design doc ``fa3_cute_design.md`` 1.13 (GQA).
"""

import cutlass.cute as cute


def pack_gqa_view(mX: cute.Tensor, qhead_per_kvhead: int, head_mode: int) -> cute.Tensor:
    """``(s, ..., h, ...)`` -> ``((g, s), ..., h / g, ...)``: the row mode absorbs ``g`` heads."""
    g = qhead_per_kvhead
    shape, stride = mX.shape, mX.stride
    rows = ((g, shape[0]), (stride[head_mode], stride[0]))
    heads = (shape[head_mode] // g, stride[head_mode] * g)
    new_shape = [rows[0]] + list(shape[1:])
    new_stride = [rows[1]] + list(stride[1:])
    new_shape[head_mode], new_stride[head_mode] = heads
    return cute.make_tensor(mX.iterator, cute.make_layout(tuple(new_shape), stride=tuple(new_stride)))


def packed_row_to_query(row, qhead_per_kvhead: int):
    """The query (sequence) index of packed row ``row``."""
    return row // qhead_per_kvhead if qhead_per_kvhead > 1 else row
