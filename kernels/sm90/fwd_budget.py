"""Shared-memory budget of the Hopper forward kernel, without the DSL.

The kernel (``fwd_sm90_smem.FwdSm90Smem._smem_bytes``) sizes its storage struct with this, and the
launcher (``flashattn_hopper/backends/sm90_fwd.py``) asks it whether a key's Q ring fits before it
builds the key, so both count the same bytes. Importing it pulls in no DSL module (like the
``kernels`` package itself), so the per-call key lookup stays cheap.
"""

SMEM_ALIGN = 1024  # 128-byte-swizzled TMA/WGMMA buffers must start on a 1024-byte boundary
SMEM_CAPACITY = 227 * 1024  # dynamic smem per CTA on H100/H200


def acc_registers(tile_m: int, tile_n: int, head_dim_v: int, p_bytes: int = 2) -> int:
    """Registers per MMA thread (64 rows per warpgroup) that S (fp32), O (fp32) and P (``p_bytes`` per
    element: 2 for 16-bit inputs, 1 for e4m3) take."""
    threads = tile_m // 64 * 128
    return (tile_m * tile_n + tile_m * head_dim_v) // threads + tile_m * tile_n * p_bytes // (4 * threads)


def smem_bytes(
    elem_bytes: int, head_dim: int, head_dim_v: int, tile_m: int, tile_n: int, kv_stages: int,
    own_sO: bool, q_stages: int = 1, gate: bool = False, gate_slice: bool = False,
) -> int:
    """Bytes of the storage struct: Q (q_stages buffers), K/V stages, optionally O, mbarriers, the
    gate's smem: its bias per K stage (fp32), or with ``gate_slice`` (``gate_in_gemm``) the QK^T GEMM's
    extra k16 slice (K's per stage, Q's once; 16-bit)."""
    return (
        _buffer(tile_m * head_dim * q_stages * elem_bytes)
        + (_buffer(tile_m * head_dim_v * elem_bytes) if own_sO else 0)
        + _buffer(tile_n * head_dim * kv_stages * elem_bytes)
        + _buffer(tile_n * head_dim_v * kv_stages * elem_bytes)
        + SMEM_ALIGN  # mbarriers
        + (gate_smem_bytes(elem_bytes, tile_m, tile_n, kv_stages, gate_slice) if gate else 0)
    )


# With the gate, the key bias can go through the tensor cores: the QK^T GEMM gets one more k16 slice, Q's
# holding ones in its first GATE_PARTS columns, K's the key's bias in GATE_PARTS 16-bit parts
# (flashattn_hopper/gate.py ``_parts``), zeros after; no add per score (13 % more instructions at hdim 64).
# Up to this head dim and where the slice's smem (K's per stage and Q's) fits beside the config's buffers
# (``gate_in_gemm``); else the fp32 bias is added per score (hdim 256's 128 x 80 needed 7 KB more than sm90
# has, hdim 128 with a Q ring 10 KB more).
GATE_GEMM_MAX_HEAD_DIM = 128
GATE_K = 16
GATE_PARTS = 3
# K's slice as the host builds it and TMA loads it: its first GATE_COLS columns (TMA's least row, 16 bytes, holds the
# GATE_PARTS parts); the kernel zeroes sKx's other columns once (Q's slice has zeros there, but 0 x a stale NaN in
# smem would be NaN). Half the bytes of all 16: the scan's writes were most of its time (hdim 64 1k: 14 us of a
# 27 us gated overhead, H100, perf/NOTES.md session 41).
GATE_COLS = 8


def gate_in_gemm(elem_bytes: int, head_dim: int, head_dim_v: int, tile_m: int, tile_n: int, kv_stages: int,
                 own_sO: bool, q_stages: int) -> bool:
    """Whether a gated forward of this configuration takes the bias through the QK^T GEMM (``GATE_K``
    slice): the kernel (``FlashFwdSm90``, with the own sO and Q ring its configuration asks for) and the
    launcher (which builds the slice or the fp32 rows) both decide with this."""
    return head_dim <= GATE_GEMM_MAX_HEAD_DIM and smem_bytes(
        elem_bytes, head_dim, head_dim_v, tile_m, tile_n, kv_stages, own_sO, q_stages, gate=True, gate_slice=True
    ) <= SMEM_CAPACITY


def gate_smem_bytes(elem_bytes: int, tile_m: int, tile_n: int, kv_stages: int, gate_slice: bool) -> int:
    """The gate's shared memory: the extra k16 slice (``gate_slice``) or the fp32 bias rows per K stage."""
    if gate_slice:
        return _buffer(tile_n * GATE_K * kv_stages * elem_bytes) + _buffer(tile_m * GATE_K * elem_bytes)
    return _buffer(gate_stage_floats(tile_n) * kv_stages * 4)


# The gate's TMA box starts at a 16-byte boundary: varlen sequences' keys start at any row, so their
# boxes begin up to 3 keys early and hold this many more (kernels/sm90/fwd_load.py ``_gate_view``).
GATE_BOX_SLACK = 4


def gate_stage_floats(tile_n: int) -> int:
    """fp32 slots per K stage of the gate's smem rows: a box of tile_n + ``GATE_BOX_SLACK`` keys rounded up
    to 32, so each stage's row starts on the 128 bytes a TMA destination needs (tile_n 112 or 80 would not)."""
    return -(-(tile_n + GATE_BOX_SLACK) // 32) * 32


def _buffer(num_bytes: int) -> int:
    """A buffer's bytes rounded up to the alignment every swizzled tile starts on."""
    return (num_bytes + SMEM_ALIGN - 1) // SMEM_ALIGN * SMEM_ALIGN


def fp8_smem_bytes(head_dim: int, head_dim_v: int, tile_m: int, tile_n: int, kv_stages: int,
                   v_colmajor: bool = False) -> int:
    """The FP8 kernel's storage (kernels/sm90/fwd_fp8.py): e4m3 Q and K/V stages, as many e4m3 V^T
    stages (not with ``v_colmajor``: the TMA writes V^T into the V stages), a bf16 sO of its own, mbarriers."""
    return (
        smem_bytes(1, head_dim, head_dim_v, tile_m, tile_n, kv_stages, False)
        + (0 if v_colmajor else _buffer(tile_n * head_dim_v * kv_stages))
        + _buffer(tile_m * head_dim_v * 2)
    )
