"""Tile configurations per kernel family, as frozen tables. One comment per row says why.

A row is chosen by the *kernel* head dim: the user's head dims are padded (in Python, with zeros)
up to the smallest row that holds both ``head_dim`` and ``head_dim_v``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FwdTile:
    tile_m: int  # query rows per CTA
    tile_n: int  # key rows per mainloop iteration
    num_threads: int


# Ampere FA2 forward (kernels/fwd_sm80.py): 4 warps split along the query rows, 16-bit inputs.
# Smem = (tile_m + 2 * tile_n) * hdim * 2 B (Q + K + V, one stage each).
FWD_SM80_TILES: dict[int, FwdTile] = {
    # 128x128, 8 warps (16 query rows each): FA2's A100 tile at 4 warps spills 104-444 B at 255 regs/thread
    # in our kernel; 8 warps halve the S/P/O fragments per thread (209-250 regs, no spills; ptxas,
    # CuTe DSL 4.8.1, sm_80 and sm_90a, 2026-11-21).
    64: FwdTile(tile_m=128, tile_n=128, num_threads=256),
    # 128x64, 8 warps: at 4 warps 128x64 spills 108-196 B (FA2's C++ spills there too) and even 128x32
    # spills on sm_90a when causal; 8 warps give 204-216 regs, no spills.
    128: FwdTile(tile_m=128, tile_n=64, num_threads=256),
}


def kernel_head_dim(table: dict[int, FwdTile], head_dim: int, head_dim_v: int) -> int | None:
    """Smallest compiled head dim that holds both head dims, or None if the table has none."""
    need = max(head_dim, head_dim_v)
    fits = [d for d in sorted(table) if d >= need]
    return fits[0] if fits else None
