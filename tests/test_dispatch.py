"""Backend choice, kernel table and compile keys (CPU tier: the device is simulated)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashattn_hopper import configs, dispatch
from flashattn_hopper.backends.common import VarlenArgs
from flashattn_hopper.env import settings
from flashattn_hopper.jit import KernelKey
from flashattn_hopper.validate import AttnProblem

CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def fake_gpu(clean_settings):
    monkeypatch = clean_settings

    def use(capability, name="Fake GPU"):
        monkeypatch.setattr(dispatch, "device_capability", lambda device: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)

    return use


def problem(**overrides):
    base = dict(batch=2, seqlen_q=128, seqlen_k=128, nheads=4, nheads_k=4, head_dim=128, head_dim_v=128,
                dtype=torch.bfloat16, softmax_scale=0.1, causal=False, window_left=-1, window_right=-1,
                softcap=0.0, is_varlen=False)
    base.update(overrides)
    return AttnProblem(**base)


@pytest.mark.parametrize("capability,expected", [((9, 0), "sm90"), ((8, 0), "sm80"), ((8, 6), "sm80"), ((8, 9), "sm80")])
def test_backend_by_capability(fake_gpu, capability, expected):
    fake_gpu(capability)
    assert dispatch.select_backend(CUDA0, None) == (expected, False)


def test_arch_below_sm80_names_found_and_supported(fake_gpu):
    fake_gpu((7, 5), "Tesla T4")
    with pytest.raises(RuntimeError, match=r"Tesla T4 \(compute capability 7.5\).*supported: compute capability 8.x"):
        dispatch.select_backend(CUDA0, None)


def test_sm90_requested_on_ampere(fake_gpu):
    fake_gpu((8, 0), "A100")
    with pytest.raises(ValueError, match=r"backend='sm90' needs a Hopper GPU .* A100 \(compute capability 8.0\)"):
        dispatch.select_backend(CUDA0, "sm90")


def test_sm80_forced_on_hopper(fake_gpu):
    fake_gpu((9, 0))
    assert dispatch.select_backend(CUDA0, "sm80") == ("sm80", True)


def test_env_forces_backend(fake_gpu, monkeypatch):
    fake_gpu((9, 0))
    monkeypatch.setenv("FLASHATTN_HOPPER_BACKEND", "sm80")
    settings.cache_clear()
    assert dispatch.select_backend(CUDA0, None) == ("sm80", True)


def test_env_backend_invalid(clean_settings):
    clean_settings.setenv("FLASHATTN_HOPPER_BACKEND", "sm70")
    settings.cache_clear()
    with pytest.raises(ValueError, match="FLASHATTN_HOPPER_BACKEND must be one of sm90, sm80"):
        settings()


def test_auto_on_hopper_picks_the_sm90_kernels(fake_gpu, monkeypatch):
    fake_gpu((9, 0))
    monkeypatch.setattr(dispatch, "check_target_arch", lambda device: "sm_90a")
    assert dispatch.fwd_kernel_for(CUDA0, None, problem()).backend == "sm90"


def test_explicit_sm90_never_falls_back(fake_gpu):
    fake_gpu((9, 0))
    with pytest.raises(NotImplementedError, match="head dims .* sm90 backend"):
        dispatch.fwd_kernel_for(CUDA0, "sm90", problem(head_dim=320, head_dim_v=320))


@pytest.mark.parametrize("by_default", [False, True])
def test_auto_backward_on_hopper_runs_sm90_where_it_can(fake_gpu, monkeypatch, by_default):
    """Hopper backward for q and v head dims equal (up to 256) or q/k over 128 with v from 128 up to
    q/k's (the wide kernel); the Ampere backward for the rest unless sm90 is asked for explicitly,
    which then raises and says why. While the Hopper backward is opt-in (``SM90_BWD_BY_DEFAULT``
    False), only backend="sm90" runs it."""
    fake_gpu((9, 0))
    monkeypatch.setattr(dispatch, "check_target_arch", lambda device: "sm_90a")
    monkeypatch.setattr(dispatch, "SM90_BWD_BY_DEFAULT", by_default)
    auto = "sm90" if by_default else "sm80"
    for dims in ((64, 64), (128, 128), (96, 96), (256, 256), (192, 192), (192, 128), (256, 192), (160, 104)):
        p = problem(head_dim=dims[0], head_dim_v=dims[1])
        assert dispatch.bwd_kernel_for(CUDA0, None, p, False).backend == auto
        assert dispatch.bwd_kernel_for(CUDA0, None, p, True).backend == auto
        assert dispatch.bwd_kernel_for(CUDA0, "sm90", p, False).backend == "sm90"
    for dims in ((64, 256), (128, 256), (96, 192), (192, 256), (256, 64)):
        p = problem(head_dim=dims[0], head_dim_v=dims[1])
        assert dispatch.bwd_kernel_for(CUDA0, None, p, False).backend == "sm80"
        with pytest.raises(NotImplementedError, match="sm90 backward"):
            dispatch.bwd_kernel_for(CUDA0, "sm90", p, False)


@pytest.mark.parametrize("overrides,match", [
    (dict(head_dim=320, head_dim_v=320), "head dims"),
    (dict(nheads=70000, nheads_k=70000), "nheads"),
    (dict(batch=70000), "batch"),
])
def test_sm80_refuses_what_it_lacks_with_a_reason(fake_gpu, overrides, match):
    fake_gpu((8, 0))
    with pytest.raises(NotImplementedError, match=match):
        dispatch.fwd_kernel_for(CUDA0, None, problem(**overrides))


def test_target_arch_mismatch_is_explained(fake_gpu, monkeypatch):
    fake_gpu((9, 0))
    monkeypatch.setattr(dispatch, "target_arch", lambda: "sm_80")
    dispatch._checked_target_arch.cache_clear()
    with pytest.raises(RuntimeError, match="compiles for sm_80 .* set it to sm_90a"):
        dispatch.check_target_arch(CUDA0)


@pytest.mark.parametrize("head_dim,head_dim_v,expected", [(64, 64, 64), (32, 32, 64), (80, 80, 96), (128, 64, 128), (8, 8, 64), (192, 192, 192), (320, 320, None)])
def test_kernel_head_dim_padding(head_dim, head_dim_v, expected):
    assert configs.kernel_head_dim(configs.FWD_SM80_TILES, head_dim, head_dim_v) == expected


@pytest.mark.parametrize("head_dim,head_dim_v,expected", [(192, 128, (192, 128, 128, 128)), (128, 64, (128, 64, 128, 128)), (80, 40, (96, 96, 128, 128)), (128, 96, (128, 128, 128, 128)), (64, 128, (64, 128, 128, 128)), (64, 256, (64, 256, 128, 80)), (96, 192, (96, 192, 128, 112))])
def test_sm90_key_runs_v_head_dim_at_its_own_width(head_dim, head_dim_v, expected):
    key = dispatch.FWD_KERNELS["sm90"].key(problem(head_dim=head_dim, head_dim_v=head_dim_v, seqlen_q=4096, seqlen_k=4096), "sm_90a")
    assert (key.head_dim, key.head_dim_v, key.tile_m, key.tile_n) == expected


@pytest.mark.parametrize("head_dim,head_dim_v,nheads_k,deterministic,expected", [
    (96, 96, 4, False, (96, 96, 64, 128)), (80, 80, 4, False, (96, 96, 64, 128)), (72, 72, 2, True, (96, 96, 64, 128)),
    (128, 96, 4, False, (128, 128, 64, 128)), (96, 128, 4, False, (128, 128, 64, 128)), (96, 64, 4, False, None),
    (192, 192, 4, False, (192, 192, 64, 96)), (192, 128, 2, False, (192, 128, 64, 96)),
    (192, 128, 2, True, (192, 128, 64, 96)), (160, 104, 4, False, (192, 128, 64, 96)),
    (256, 256, 2, False, (256, 256, 64, 64)), (256, 128, 2, False, (256, 128, 64, 96)),
    (240, 100, 4, False, (256, 128, 64, 96)), (256, 128, 2, True, (256, 128, 64, 96)),
    (256, 192, 4, False, (256, 192, 64, 64)),
])
def test_sm90_backward_rows(head_dim, head_dim_v, nheads_k, deterministic, expected):
    """The sm90 backward's (q/k, v) widths and tile per problem: 65-96 natively at 96, a 96 / 128 pair at 128 (q and
    v at one width; never the sm80 backward), 192 and 256/128 on 96-key blocks (deterministic GQA too)."""
    family = dispatch.BWD_KERNELS["sm90"]
    p = problem(head_dim=head_dim, head_dim_v=head_dim_v, nheads_k=nheads_k)
    if expected is None:
        assert family.can_implement(p, deterministic) is not None
        return
    assert family.can_implement(p, deterministic) is None
    key = family.keys(p, "sm_90a", deterministic=deterministic)[1]
    assert (key.head_dim, key.head_dim_v, key.tile_m, key.tile_n) == expected


@pytest.mark.parametrize("head_dim,causal,seqlen,expected", [
    (64, False, 512, (192, 128)), (64, True, 512, (128, 128)), (64, True, 1536, (128, 128)), (64, True, 2048, (192, 128)),
    (256, False, 768, (128, 64)), (256, False, 1024, (128, 80)), (256, True, 1024, (128, 64)), (256, True, 2048, (128, 80)),
    (128, True, 512, (128, 128)),
    (192, False, 1024, (128, 64)), (192, False, 2048, (128, 112)), (192, True, 2048, (128, 64)), (192, True, 4096, (128, 112)),
])
def test_sm90_short_sequence_tiles(head_dim, causal, seqlen, expected):
    p = problem(head_dim=head_dim, head_dim_v=head_dim, seqlen_q=seqlen, seqlen_k=seqlen, causal=causal)
    key = dispatch.FWD_KERNELS["sm90"].key(p, "sm_90a")
    assert (key.tile_m, key.tile_n) == expected


def test_sm90_clusters_only_for_dense_unmasked_unpacked_calls(monkeypatch):
    """A row with clusters (hdim 256's; perf/bench_fwd_sm90.py's cluster2 variant elsewhere) keys them
    only for calls whose CTAs all visit the same key blocks: dense, no causal/local mask, no pack_gqa."""
    family = dispatch.FWD_KERNELS["sm90"]
    clustered = {(k.head_dim, k.causal, k.varlen) for k in family.all_keys("sm_90a") if k.cluster_m > 1}
    assert clustered == {(256, False, False)}
    monkeypatch.setitem(configs.FWD_SM90_TILES, 128, dataclasses.replace(configs.FWD_SM90_TILES[128], cluster_m=2))
    long = dict(head_dim=128, head_dim_v=128, seqlen_q=16384, seqlen_k=16384)
    assert family.key(problem(**long), "sm_90a").cluster_m == 2
    assert family.key(problem(**long, causal=True), "sm_90a").cluster_m == 1
    assert family.key(problem(**long, window_left=256, window_right=0), "sm_90a").cluster_m == 1
    decode = dict(long, seqlen_q=1, nheads=32, nheads_k=4)
    assert family.key(problem(**decode), "sm_90a").pack_gqa == 8
    assert family.key(problem(**decode), "sm_90a").cluster_m == 1
    varlen = VarlenArgs(None, None, None, None, None, None)
    assert family.key(problem(**long, is_varlen=True), "sm_90a", varlen=varlen).cluster_m == 1


def test_sm90_spanning_tiles_only_where_a_tile_spans_two_heads_at_most(monkeypatch):
    """A row with spanning tiles keys them only for dense, unmasked, unpacked calls whose heads have at
    least tile_m / 64 - 1 blocks of 64 rows (so a tile spans at most two (batch, head) pairs) and
    whose whole tiles would pad enough rows for spanning to pay."""
    family = dispatch.FWD_KERNELS["sm90"]
    monkeypatch.setitem(configs.FWD_SM90_TILES, 64, dataclasses.replace(configs.FWD_SM90_TILES[64], span_heads=True))
    dims = dict(head_dim=64, head_dim_v=64)
    assert family.key(problem(**dims, seqlen_q=512, seqlen_k=512), "sm_90a").span_heads
    assert family.key(problem(**dims, seqlen_q=65, seqlen_k=512), "sm_90a").span_heads  # 2 blocks, 3 WGs
    assert not family.key(problem(**dims, seqlen_q=64, seqlen_k=512), "sm_90a").span_heads
    # only where 192-row tiles would pad >= 2 % of the rows (configs.span_pays)
    assert family.key(problem(**dims, seqlen_q=4096, seqlen_k=4096), "sm_90a").span_heads  # 3.1 %
    assert not family.key(problem(**dims, seqlen_q=8192, seqlen_k=8192), "sm_90a").span_heads  # 0.8 %
    assert not family.key(problem(**dims, seqlen_q=6144, seqlen_k=6144), "sm_90a").span_heads  # none
    assert not family.key(problem(**dims, seqlen_q=4096, seqlen_k=4096, causal=True), "sm_90a").span_heads
    assert not family.key(
        problem(**dims, seqlen_q=4096, seqlen_k=4096, window_left=256, window_right=0), "sm_90a"
    ).span_heads
    assert not family.key(problem(**dims, seqlen_q=100, seqlen_k=4096, nheads=32, nheads_k=4), "sm_90a").span_heads
    varlen = VarlenArgs(None, None, None, None, None, None)
    assert not family.key(problem(**dims, seqlen_q=4096, seqlen_k=4096, is_varlen=True), "sm_90a", varlen=varlen).span_heads
    # a row with clusters too runs clusters where they pay (the kernel takes one or the other)
    monkeypatch.setitem(configs.FWD_SM90_TILES, 64, dataclasses.replace(configs.FWD_SM90_TILES[64], cluster_m=2))
    key = family.key(problem(**dims, seqlen_q=8257, seqlen_k=8257), "sm_90a")  # 192-row tiles pad 2.3 %
    assert key.cluster_m == 2 and not key.span_heads
    key = family.key(problem(**dims, seqlen_q=4096, seqlen_k=4096), "sm_90a")
    assert key.cluster_m == 1 and key.span_heads


@pytest.mark.parametrize("seqlen_q,seqlen_k,cluster_m", [
    (1024, 1024, 1), (4096, 4096, 1), (8191, 8191, 1), (8192, 8192, 2), (8320, 8320, 2), (16384, 16384, 2),
    (16384, 4096, 1), (4096, 16384, 1), (8192, 9000, 2),
])
def test_sm90_hdim256_clusters_where_they_pay(seqlen_q, seqlen_k, cluster_m):
    """hdim 256 dense non-causal calls run clusters of 2 where seqlen_q and seqlen_k both reach
    configs.FWD_SM90_CLUSTER_MIN_SEQLEN (8320: 65 m_blocks, the last pair's second CTA computes a tile
    past the end); causal calls never, nor packed ones (pack_gqa keys take no clusters)."""
    family = dispatch.FWD_KERNELS["sm90"]
    dims = dict(head_dim=256, head_dim_v=256, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    assert family.key(problem(**dims), "sm_90a").cluster_m == cluster_m
    assert family.key(problem(**dims, causal=True), "sm_90a").cluster_m == 1
    assert family.key(problem(**dims, nheads=8, nheads_k=1), "sm_90a").cluster_m == cluster_m  # MQA, unpacked
    assert family._key("sm_90a", "bf16", 256, seqlen_q, causal=False, pack_gqa=8).cluster_m == 1


def test_sm90_causal_section_sizes():
    """(batch, head) pairs per section of the causal/local tile order (kernels/common/tile_scheduler.py):
    as many as fit 16 MiB of K/V, GQA groups counted once and kept whole, at most 16 pairs (at least
    one KV head's query heads)."""
    from flashattn_hopper.kernels.common.tile_scheduler import section_heads

    budget = 16 * 2**20
    bf16_bytes = lambda d, dv: (d + dv) * 2  # noqa: E731 (K's row plus V's)
    assert section_heads(5000, bf16_bytes(256, 256), 1, budget) == 3
    assert section_heads(5000, bf16_bytes(128, 128), 1, budget) == 6
    assert section_heads(8192, bf16_bytes(256, 256), 1, budget) == 2
    assert section_heads(16384, bf16_bytes(256, 256), 1, budget) == 1
    assert section_heads(100_000, bf16_bytes(128, 128), 1, budget) == 1  # never below one pair
    assert section_heads(512, bf16_bytes(64, 64), 1, budget) == 16  # the cap (128 would fit)
    assert section_heads(5000, bf16_bytes(256, 256), 4, budget) == 12  # 3 KV heads of 4 query heads
    assert section_heads(5000, bf16_bytes(128, 128), 4, budget) == 16  # 6 KV heads capped to 4
    assert section_heads(512, bf16_bytes(64, 64), 6, budget) == 12  # whole groups: 2 of 6, not 16
    assert section_heads(512, bf16_bytes(64, 64), 32, budget) == 32  # one group even past the cap
    assert section_heads(0, bf16_bytes(64, 64), 1, budget) == 16  # no keys: no division by zero


def test_key_holds_no_shapes():
    spec = dispatch.FWD_KERNELS["sm80"]
    short, long = spec.key(problem(batch=1, seqlen_q=17, seqlen_k=5), "sm_80"), spec.key(problem(batch=64, seqlen_q=8192, seqlen_k=8192), "sm_80")
    assert short == long and short.digest == long.digest
    assert short.name.startswith("fwd_sm80-sm_80-dtypebf16-head_dim128-head_dim_v128-tile_m")
    assert spec.key(problem(causal=True), "sm_80").name.endswith("-causal")


def test_key_rejects_tensors():
    @dataclasses.dataclass(frozen=True)
    class BadKey(KernelKey):
        max_seqlen: object

    with pytest.raises(TypeError, match="max_seqlen.*Python primitive"):
        BadKey(kernel="x", arch="sm_80", max_seqlen=torch.tensor(3))


def test_all_keys_cover_every_variant():
    keys = dispatch.FWD_KERNELS["sm80"].all_keys("sm_80")
    assert len(keys) == len(set(keys))
    # every head dim row, both dtypes, causal and not, dense and varlen
    for hdim in configs.FWD_SM80_TILES:
        for dtype in ("bf16", "fp16"):
            for causal in (False, True):
                for varlen in (False, True):
                    assert any(k.head_dim == hdim and k.dtype == dtype and k.causal == causal and k.varlen == varlen
                               for k in keys), (hdim, dtype, causal, varlen)


@pytest.mark.parametrize(
    "seqlen_q,nheads,nheads_k,varlen,expected",
    [
        (1, 32, 4, False, 8),  # decode: one query of 8 heads fills 8 rows instead of 1
        (17, 16, 4, False, 4),
        (1024, 32, 4, False, 1),  # full tiles already
        (1, 32, 32, False, 1),  # MHA: nothing to pack
        (1, 12, 4, False, 1),  # g = 3 does not divide 128 rows
        (1, 32, 4, True, 1),  # varlen keeps one head per tile
    ],
)
def test_sm90_pack_gqa_choice(seqlen_q, nheads, nheads_k, varlen, expected):
    from flashattn_hopper.backends.sm90_fwd import pack_gqa_factor

    p = problem(seqlen_q=seqlen_q, nheads=nheads, nheads_k=nheads_k)
    assert pack_gqa_factor(p, 128, varlen) == expected


def test_sm90_keys_never_alias_sO_across_swizzle_atoms():
    """Every (head_dim, head_dim_v) the sm90 launcher keys builds a kernel whose sO, when it shares
    sQ's buffer, has sQ's swizzle atom (else a warpgroup's O could overwrite another's Q); built
    with one CTA per tile too, where sO always shares the buffer. The kernel itself refuses the rest."""
    pytest.importorskip("cutlass")
    import cutlass

    from flashattn_hopper.kernels.sm90.fwd import FlashFwdSm90

    family = dispatch.FWD_KERNELS["sm90"]
    for d in range(8, 257, 8):
        for dv in range(8, 257, 8):
            key = family.key(problem(head_dim=d, head_dim_v=dv, seqlen_q=4096, seqlen_k=4096), "sm_90a")
            for persistent in (True, False):
                FlashFwdSm90(cutlass.BFloat16, key.head_dim, key.head_dim_v, key.tile_m, key.tile_n, False,
                             persistent=persistent)
    with pytest.raises(ValueError, match="swizzle atom"):
        FlashFwdSm90(cutlass.BFloat16, 128, 96, 128, 128, False, persistent=False)


def test_sm90_q_ring_only_where_shared_memory_has_room():
    """The launcher keys two Q buffers only where the kernel accepts them: its estimate agrees with
    the kernel's shared-memory count, and every key it builds (table rows, short tiles, spanning
    tiles, each head-dim pair) constructs."""
    pytest.importorskip("cutlass")
    import cutlass

    from flashattn_hopper.backends.sm90_fwd import q_ring_fits
    from flashattn_hopper.kernels.sm90.fwd import _SMEM_CAPACITY, FlashFwdSm90

    for tile_m, tile_n in ((128, 64), (128, 80), (128, 112), (128, 128), (192, 128)):
        for d in (64, 96, 128, 192, 256):
            for kv_stages in (2, 4):
                smem = FlashFwdSm90._smem_bytes(cutlass.BFloat16, d, d, tile_m, tile_n, kv_stages, True, 2)
                assert q_ring_fits(tile_m, tile_n, d, d, kv_stages) == (smem <= _SMEM_CAPACITY)
    family = dispatch.FWD_KERNELS["sm90"]
    keys = list(family.all_keys("sm_90a"))
    for d, dv in ((64, 64), (96, 96), (128, 128), (128, 64), (192, 192), (192, 128), (256, 256)):
        for seqlen in (200, 512, 1024, 4096):
            for causal in (False, True):
                keys.append(family.key(problem(head_dim=d, head_dim_v=dv, seqlen_q=seqlen, seqlen_k=seqlen, causal=causal), "sm_90a"))
    assert any(key.q_stages == 2 for key in keys) and any(key.span_heads and key.q_stages == 2 for key in keys)
    for key in keys:
        family.kernel(key)  # raises where the key asks for what the kernel cannot hold


def test_window_sides_reach_the_kernels_as_int32():
    from flashattn_hopper.backends.common import UNBOUNDED_WINDOW, window_args

    assert window_args(problem(window_left=-1, window_right=0)) == (UNBOUNDED_WINDOW, 0)
    assert window_args(problem(window_left=2**40, window_right=UNBOUNDED_WINDOW - 1)) == (UNBOUNDED_WINDOW, UNBOUNDED_WINDOW - 1)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_sm80_backward_dq_order_agrees_between_main_and_postprocess(arch):
    """The main kernel reduce-adds dQ in an order set by its ``dq_red_vec``; the dQ postprocess reads
    it back with its own: every call's pair of keys (and every precompiled one) must agree, and the
    vector width exists only where PTX has ``red.global.add.v4.f32`` (sm_90). stmatrix P/dS stores
    likewise only on sm_90."""
    family = dispatch.BWD_KERNELS["sm80"]
    for head_dim in configs.bwd_sm80_tiles(arch):
        for causal in (False, True):
            for nheads_k in (4, 1):
                _, main, post_dq, post_kv = family.keys(
                    problem(head_dim=head_dim, head_dim_v=head_dim, causal=causal, nheads_k=nheads_k), arch
                )
                assert main.dq_red_vec == post_dq.dq_red_vec == configs.bwd_dq_red_vec(arch), main.name
                assert post_kv.dq_red_vec == 1  # row-major GQA dK/dV sums: no fragment order
                assert not main.stmatrix_pds or arch.startswith("sm_90"), main.name
    expected = 4 if arch.startswith("sm_90") else 1
    assert configs.bwd_dq_red_vec(arch) == expected
    main_keys = [k for k in family.all_keys(arch) if k.kernel == "bwd_sm80"]
    post_keys = [k for k in family.all_keys(arch) if k.kernel == "bwd_post_sm80" and k.atom_m]
    assert {k.dq_red_vec for k in main_keys} == {k.dq_red_vec for k in post_keys} == {expected}


def test_sm90_backward_dq_order_agrees_between_main_and_postprocess():
    """The sm90 main kernels add dQ in the fragment order of their dQ WGMMA (warpgroups splitting the
    tile by rows at tile_m 128, by columns at 64); the dQ postprocess rebuilds that WGMMA from its key.
    Every call's pair must agree, also where a flag changes the main tile (softcap at hdim 64). GQA dK/dV
    sums: per-warpgroup fragment order of the dK/dV WGMMA (the "rows" C layout) from the tile_n 128
    kernel, row-major from the wide one (tile_n 64)."""
    family = dispatch.BWD_KERNELS["sm90"]
    for head_dim in family.tiles:
        for flags in ({}, {"causal": True, "nheads_k": 1}, {"softcap": 5.0}):
            _, main, post_dq, post_kv = family.keys(problem(head_dim=head_dim, head_dim_v=head_dim, **flags), "sm_90a")
            split = "transposed" if main.dq_transposed else "rows" if main.dq_split_rows else "cols"
            assert (post_dq.tile_m, post_dq.dq_wgmma) == (main.tile_m, split), main.name
            assert not main.dq_transposed, main.name  # (tile_m 80 is opt-in: BWD_SM90_TILE_80)
            assert post_dq.num_threads == 256 and post_dq.dq_red_vec == 4 and post_dq.atom_m == 0
            if main.tile_n == 128:
                assert (post_kv.tile_m, post_kv.dq_wgmma, post_kv.wg_blocks, post_kv.dq_red_vec) == (128, "rows", True, 4)
            else:
                assert (post_kv.dq_wgmma, post_kv.wg_blocks, post_kv.dq_red_vec) == ("", False, 1)
    tile_80 = family.tile_80_key("sm_90a")
    post_dq = family._post_keys("sm_90a", "bf16", 128, 128, main=tile_80)[0]
    assert (post_dq.tile_m, post_dq.dq_wgmma) == (80, "transposed") and tile_80 in family.all_keys("sm_90a")


_C_LAYOUT_SCRIPT = """
import json, sys
import cutlass, cutlass.cute as cute
from flashattn_hopper.kernels.common.bwd_utils import tiled_mma_dq_sm90
head_dim, coords = int(sys.argv[1]), []

@cute.jit
def c_layout():
    tv = tiled_mma_dq_sm90(cutlass.BFloat16, head_dim, True).tv_layout_C
    for t in cutlass.range_constexpr(128):
        for i in cutlass.range_constexpr(head_dim // 2):
            coords.append(cute.crd2idx((t, i), tv))

c_layout()
print(json.dumps(coords))
"""


def test_sm90_gqa_sums_order_matches_the_wgmma_layout(tmp_path):
    """``wgmma_rows_order`` (the gate's fp32 dK read back from the GQA sums on the host) agrees with the
    DSL's C layout of the dK/dV WGMMA: value ``i`` of thread ``t`` sits at flat position
    ``((i // 4) * 128 + t) * 4 + i % 4`` of its warpgroup's tile (``fragment_accum``, vec 4). The
    layout is read in a subprocess: the DSL takes its target arch at import."""
    pytest.importorskip("cutlass")
    import json
    import subprocess
    import sys

    from flashattn_hopper.backends.sm80_bwd import wgmma_rows_order

    from ._subprocess import subprocess_env

    head_dim = 64
    script = tmp_path / "c_layout.py"  # (the DSL compiles functions from their source file)
    script.write_text(_C_LAYOUT_SCRIPT)
    run = subprocess.run([sys.executable, str(script), str(head_dim)], capture_output=True, text=True,
                         env=subprocess_env(CUTE_DSL_ARCH="sm_90a"), timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    coords = json.loads(run.stdout.strip().splitlines()[-1])  # (row + 64 * col) of value i of thread t
    order = wgmma_rows_order(head_dim)
    for t in range(128):
        for i in range(head_dim // 2):
            row, col = coords[t * (head_dim // 2) + i] % 64, coords[t * (head_dim // 2) + i] // 64
            assert int(order[row * head_dim + col]) == ((i // 4) * 128 + t) * 4 + i % 4, (t, i)
    assert sorted(order.tolist()) == list(range(64 * head_dim))


def test_sm80_backward_splits_only_the_last_wave_of_dense_unmasked_calls():
    """The split tail (kernels/sm80/bwd.py): a dense, unmasked, non-deterministic backward whose key
    blocks leave a short last wave on the GPU's SMs splits that wave's blocks into segments; causal,
    local, varlen and deterministic calls never do, nor calls whose blocks fill whole waves."""
    from flashattn_hopper.backends.sm80_bwd import TAIL_MAX_SEGMENTS, TAIL_MIN_M_BLOCKS, tail_plan

    # FA3-paper sizes on 132 SMs: hdim 64 (128x128 tiles) leaves 4 of 4096 blocks, hdim 128 68 of 2048.
    assert tail_plan(1, 16384, 16384, 32, 128, 128, 132) == (4, TAIL_MAX_SEGMENTS)
    assert tail_plan(1, 16384, 16384, 16, 64, 128, 132) == (68, 15)  # 1020 segments: 8 waves of T / 15
    assert tail_plan(1, 16384, 16384, 33, 128, 128, 132) == (0, 1)  # 4224 blocks: 32 whole waves
    assert tail_plan(32, 512, 512, 16, 64, 128, 132) == (0, 1)  # 8 query blocks: 2 segments gain nothing
    assert tail_plan(1, 2 * 128 * TAIL_MIN_M_BLOCKS - 1, 16384, 32, 128, 128, 132) == (4, 2)  # 8 query blocks: 2 segments at most
    for tail, segments in (tail_plan(b, s, s, h, 64, 128, 132) for b in (1, 3) for s in (1000, 4097) for h in (5, 16)):
        assert tail == 0 or (2 <= segments <= TAIL_MAX_SEGMENTS and -(-tail * segments // 132) / segments <= 0.9)

    family = dispatch.BWD_KERNELS["sm80"]
    split = dict(batch=1, seqlen_q=16384, seqlen_k=16384, nheads=32, head_dim=64, head_dim_v=64)
    for arch in ("sm_80", "sm_90a"):
        for nheads_k in (32, 8):
            p = problem(**split, nheads_k=nheads_k)
            assert family.keys(p, arch, sms=132)[1].tail_split
            assert not family.keys(p, arch)[1].tail_split  # no SM count: no split
            assert not family.keys(p, arch, deterministic=True, sms=132)[1].tail_split
            assert not family.keys(problem(**split, nheads_k=nheads_k, causal=True), arch, sms=132)[1].tail_split
            local = problem(**split, nheads_k=nheads_k, window_left=256, window_right=0)
            assert not family.keys(local, arch, sms=132)[1].tail_split
            varlen = VarlenArgs(None, None, None, None, None, None)
            assert not family.keys(p, arch, varlen, sms=132)[1].tail_split
            assert not family.keys(problem(**{**split, "nheads": 33}, nheads_k=33 if nheads_k == 32 else 11),
                                   arch, sms=132)[1].tail_split
    # every split key is precompiled beside its whole-block kernel
    keys = family.all_keys("sm_90a")
    for key in keys:
        if key.kernel == "bwd_sm80" and getattr(key, "tail_split", False):
            assert dataclasses.replace(key, tail_split=False) in keys


def test_sm90_gqa_loop_table_rows():
    """The table's masked ``gqa_loop`` bounds (H100, perf/NOTES.md session 37): causal GQA 4:1 at hdim 128 on the
    descending loop up to 8k (the training step's 8k x batch 2), the fp32 sums at 16k, and so hdim 96 (session 41);
    hdim 64 ascending at 1k, descending at 2k-4k, the sums from 8k."""
    family = dispatch.BWD_KERNELS["sm90"]

    def key(hdim, seqlen):
        nheads = 2048 // hdim // 4 * 4  # (hdim 96: 20 query heads of 5 KV heads)
        return family.keys(problem(batch=16384 // seqlen, seqlen_q=seqlen, seqlen_k=seqlen, nheads=nheads,
                                   nheads_k=nheads // 4, head_dim=hdim, head_dim_v=hdim, causal=True),
                           "sm_90a", sms=132)[1]

    for hdim in (128, 96):
        assert all(key(hdim, s).gqa_loop and key(hdim, s).loop_desc for s in (1024, 2048, 4096, 8192)), hdim
        assert not key(hdim, 16384).gqa_loop, hdim
    assert key(64, 1024).gqa_loop and not key(64, 1024).loop_desc
    assert all(key(64, s).gqa_loop and key(64, s).loop_desc for s in (2048, 4096))
    assert not key(64, 8192).gqa_loop


def test_sm90_gqa_loop_keys(monkeypatch):
    """A tile's ``gqa_loop`` keys real GQA problems of the tile_n 128 kernel only: not MHA, not dk_fp32's fp32-sum
    route, not the gate, not deterministic; its plan then has no fp32 sums (``kv_scratch``). "all": masked ones too
    where the chunked grid's z fits (varlen: its own grid); the table's "balanced": unmasked ones, and dense masked ones
    up to the row's ``loop_masked_max_seqlen`` queries and keys with >= 3 CTAs per SM, descending past its
    ``loop_desc_above``."""
    from flashattn_hopper.backends.sm80_bwd import kv_scratch
    from flashattn_hopper.backends.sm90_bwd import BWD_SM90_TILES

    family = dispatch.BWD_KERNELS["sm90"]
    for hdim in (64, 128, 192):
        monkeypatch.setitem(BWD_SM90_TILES, hdim, dataclasses.replace(BWD_SM90_TILES[hdim], gqa_loop="all"))
    gqa = problem(nheads=8, nheads_k=2, causal=True)
    key = family.keys(gqa, "sm_90a")[1]
    assert key.gqa and key.gqa_loop and not kv_scratch(key)
    assert not family.keys(problem(causal=True), "sm_90a")[1].gqa_loop
    assert kv_scratch(family.keys(gqa, "sm_90a", dk_fp32=True)[1])
    assert not family.keys(gqa, "sm_90a", gate=True)[1].gqa_loop
    many = problem(batch=8200, seqlen_q=8192, seqlen_k=8192, nheads=8, nheads_k=2, causal=True)  # z: 8200 x 8 chunks
    assert not family.keys(many, "sm_90a")[1].gqa_loop
    assert family.keys(dataclasses.replace(many, causal=False), "sm_90a")[1].gqa_loop
    varlen_args = VarlenArgs(None, None, None, None, None, None)
    assert family.keys(problem(nheads=8, nheads_k=2, causal=True, is_varlen=True), "sm_90a",
                       varlen=varlen_args)[1].gqa_loop
    monkeypatch.setitem(BWD_SM90_TILES, 128, dataclasses.replace(BWD_SM90_TILES[128], loop_desc_above=0))
    desc = family.keys(gqa, "sm_90a")[1]
    assert desc.gqa_loop and desc.loop_desc and not desc.dq_claim  # (masked loops only, no claims)
    assert not family.keys(problem(nheads=8, nheads_k=2), "sm_90a")[1].loop_desc
    wide = family.keys(problem(nheads=8, nheads_k=2, head_dim=192, head_dim_v=192), "sm_90a")[1]
    assert wide.tile_n == 96 and not wide.gqa_loop
    monkeypatch.setitem(BWD_SM90_TILES, 128, dataclasses.replace(BWD_SM90_TILES[128], gqa_loop=""))
    assert kv_scratch(family.keys(gqa, "sm_90a")[1])
    # "unmasked": GQA without causal / local masks, not deterministic
    monkeypatch.setitem(BWD_SM90_TILES, 128, dataclasses.replace(BWD_SM90_TILES[128], gqa_loop="unmasked"))
    assert family.keys(problem(nheads=8, nheads_k=2), "sm_90a")[1].gqa_loop
    assert not family.keys(gqa, "sm_90a")[1].gqa_loop
    assert not family.keys(problem(nheads=8, nheads_k=2, window_left=64, window_right=64), "sm_90a")[1].gqa_loop
    assert not family.keys(problem(nheads=8, nheads_k=2), "sm_90a", deterministic=True)[1].gqa_loop
    # "balanced": masked too, dense, up to loop_masked_max_seqlen, with >= 3 CTAs per SM
    monkeypatch.setitem(BWD_SM90_TILES, 128, dataclasses.replace(
        BWD_SM90_TILES[128], gqa_loop="balanced", loop_masked_max_seqlen=4096, loop_desc_above=1024))
    short = dict(batch=16, seqlen_q=1024, seqlen_k=1024, nheads=16, nheads_k=4, causal=True)  # 512 CTAs
    key = family.keys(problem(**short), "sm_90a", sms=132)[1]
    assert key.gqa_loop and not key.loop_desc and key.dq_claim  # (ascending up to loop_desc_above)
    assert not family.keys(problem(**{**short, "nheads_k": 1}), "sm_90a", sms=132)[1].gqa_loop  # MQA: 128 CTAs
    mid = {**short, "batch": 4, "seqlen_q": 4096, "seqlen_k": 4096}  # 512 CTAs, up to loop_masked_max_seqlen
    key = family.keys(problem(**mid), "sm_90a", sms=132)[1]
    assert key.gqa_loop and key.loop_desc and not key.dq_claim
    assert not family.keys(problem(**{**mid, "batch": 2, "seqlen_q": 8192, "seqlen_k": 8192}), "sm_90a",
                           sms=132)[1].gqa_loop
    assert not family.keys(problem(**{**short, "seqlen_q": 8192}), "sm_90a", sms=132)[1].gqa_loop
    assert family.keys(problem(**{**short, "nheads_k": 1, "causal": False}), "sm_90a", sms=132)[1].gqa_loop
    varlen = VarlenArgs(None, None, None, None, None, None)
    assert not family.keys(problem(**short, is_varlen=True), "sm_90a", varlen=varlen, sms=132)[1].gqa_loop


def test_varlen_plans_are_kept_and_take_each_calls_tensors(monkeypatch):
    """``configs.VARLEN_PLANS`` (on since session 40; CPU, a stand-in family): a plain varlen call's plan is made
    once, after the validation, from the call's varlen tensors (which are given: the keys' flags); a later call of
    the same shapes runs it with its own cu_seqlens and no validation; a seqused given keys another plan, which gets
    it per call."""
    from flashattn_hopper import api, configs, dispatch, flash_attn_varlen_func, validate

    made, calls = [], []

    class Family:
        def plan(self, q, p, key=None, varlen=None):
            made.append(varlen)
            return lambda q, k, v, varlen: calls.append(varlen) or (q + 1, q.new_zeros(p.nheads, p.seqlen_q))

    monkeypatch.setattr(configs, "VARLEN_PLANS", True)
    monkeypatch.setattr(validate, "_check_devices", lambda *a: None)  # (CPU tensors: the validation's other checks)
    monkeypatch.setattr(dispatch, "fwd_kernel_for", lambda *a: Family())
    api.clear_plans()
    q, k, v = (torch.randn(10, 2, 8, dtype=torch.bfloat16) for _ in range(3))
    cu, cu2 = torch.tensor([0, 4, 10], dtype=torch.int32), torch.tensor([0, 7, 10], dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, causal=True)
    assert torch.equal(out, q + 1) and len(made) == 1 and made[0].cu_seqlens_q is cu and calls[-1] is made[0]
    validations, validate_varlen = [], validate.validate_varlen
    monkeypatch.setattr(validate, "validate_varlen", lambda *a, **kw: validations.append(1))
    out, lse = flash_attn_varlen_func(q, k, v, cu2, cu2, 6, 6, causal=True, return_lse=True)
    assert len(made) == 1 and calls[-1].cu_seqlens_k is cu2 and not validations and lse.shape == (2, 10)
    monkeypatch.setattr(validate, "validate_varlen", validate_varlen)
    used = torch.tensor([3, 5], dtype=torch.int32)
    flash_attn_varlen_func(q, k, v, cu2, cu2, 6, 6, causal=True, seqused_k=used)
    assert len(made) == 2 and made[1].seqused_k is used and calls[-1].seqused_k is used
    with pytest.raises(ValueError, match="cu_seqlens_k must have length 3"):  # (another shape: validated again)
        flash_attn_varlen_func(q, k, v, cu2, cu2[:2], 6, 6, causal=True)
    api.clear_plans()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_fwd_plan_hands_the_kernel_the_general_launch_arguments(monkeypatch, causal):
    """``PackedFwdPlan`` (``configs.VARLEN_PLANS``' forward plan) hands the compiled sm90 kernel what
    ``launch_forward`` does for the same varlen key: the same tensors (each varlen tensor in its slot, seqused
    included), scalars, tile counter and empty slots. CPU: the kernel and device lookups are stand-ins."""
    pytest.importorskip("cutlass")
    from flashattn_hopper.backends import common, sm90_fwd

    from ._plan_launch import assert_same_launch, record_sm90_launches

    calls = record_sm90_launches(monkeypatch)
    family = sm90_fwd.FwdSm90()
    total, heads = 700, 4
    p = AttnProblem(batch=2, seqlen_q=total, seqlen_k=total, nheads=heads, nheads_k=2, head_dim=128, head_dim_v=128,
                    dtype=torch.bfloat16, softmax_scale=0.125, causal=causal, window_left=-1,
                    window_right=0 if causal else -1, softcap=0.0, is_varlen=True)
    cu, used = torch.tensor([0, 300, 700], dtype=torch.int32), torch.tensor([250, 400], dtype=torch.int32)
    varlen = VarlenArgs(cu, cu, used, used, 400, 400)
    q = torch.zeros(total, heads, 128, dtype=torch.bfloat16)
    k, v = (torch.zeros(total, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    key = family.key(p, "sm_90a", varlen)
    extra = family.extra_args(key, q.device, 0)
    common.launch_forward(lambda *args: calls.append(args), key, q, k, v, p, varlen, None, None, extra)
    plan = family.plan(q, p, varlen=varlen)
    assert type(plan).__name__ == "PackedFwdPlan"
    plan(q, k, v, varlen)
    general, planned = calls
    assert_same_launch(planned, general)
