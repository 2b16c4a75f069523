"""Forward benchmark of the Hopper FA3 kernel and its technique ablations (not a test).

    python perf/bench_fwd_sm90.py [--hdims 64 128 256] [--seqlens 512 1024 2048 4096 8192 16384]
                                  [--causal off on] [--variants full overlap serial] [--no-baselines]
                                  [--repeat N] [--head-dim-v DV] [--steady SECS] [--no-sm80]
    python perf/bench_fwd_sm90.py --features [--hdims 128]

FA3-paper sizes: bf16, batch * seqlen = 16k tokens, nheads * hdim = 2048. Per cell it times
- sm90 variants of kernels/sm90/fwd.py: ``full`` (intra-WG overlap + ping-pong, the shipped config),
  ``overlap`` (intra-WG overlap, no ping-pong), ``serial`` (neither: QK^T, softmax, P.V in sequence),
  ``persistent`` / ``nonpersistent`` (``full`` with one CTA per SM walking tiles / one CTA per tile),
  ``cta-epilogue`` (one O store per tile behind a barrier over every MMA warpgroup),
  ``memset-counter`` (causal: a freshly zeroed tile counter per call instead of the stream's own),
  ``padded-v`` (with ``--head-dim-v`` below hdim: V zero-padded to q's head dim, the 192 row's tile),
  ``stages3`` / ``stages4`` (a K/V ring of 3 / 4 shared-memory stages instead of 2),
  ``cluster2`` / ``cluster1`` (clusters of 2 CTAs sharing K/V by TMA multicast / no clusters;
  non-causal cells only, '-' under causal), ``per-head-order`` / ``sections-32mb`` / ``sections-8mb``
  (causal only, '-' otherwise: tiles head by head, longest first within each / longest first across
  sections of heads whose K/V fit in 32 / 8 MiB, instead of the shipped 16), ``span`` / ``no-span``
  (tiles whose warpgroups take consecutive 64-row blocks across (batch, head) pairs, or not; span is
  non-causal only, '-' under causal), ``eager-rescale`` (O rescaled on every key block instead of
  only when a row's max grows by more than 2**8), ``q2`` / ``q1`` (two Q buffers, the next tile's Q
  loading under this tile, or one; '-' where shared memory has no room for two);
- ``sm80`` (our Ampere FA2 kernel on the same GPU), SDPA ``cudnn`` and SDPA ``flash`` (FA2).
Each output is checked against SDPA cuDNN before it is timed. Timing: triton ``do_bench`` median
(warm-up 25 ms, 100 ms of reps) when triton imports, else CUDA events; ``--steady SECS``: calls back to
back (replayed from a CUDA graph) for SECS after 0.5 s untimed, the clock settled at the power cap
(make_steady_timer); ``--repeat N`` times every column
N times, interleaved (a clock drift hits all alike), and reports the median. FLOPs = 2*b*h*s^2*(d + d_v) (x1/2 causal).
Prints a Markdown table of TFLOP/s and the ratio of the first sm90 column to cuDNN.

``--features``: sliding window, softcap and varlen (16k tokens in sequences of mixed lengths) on
sm90 against our sm80 kernel (the Hopper fallback before these features existed) and dense sm90;
FLOPs count only the (query, key) pairs the mask leaves visible.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

# name: FwdSm90Key fields overridden in the shipped key (configs.sm90_fwd_tile's row for the seqlen)
VARIANTS = {
    "full": {}, "overlap": {"pingpong": False}, "serial": {"intra_wg_overlap": False, "pingpong": False},
    "persistent": {"persistent": True}, "nonpersistent": {"persistent": False},
    "cta-epilogue": {"wg_local_epilogue": False, "span_heads": False},  # one O store per tile, CTA-wide barrier
    "memset-counter": {"memset_counter": True},  # causal: a torch.zeros tile counter per call (before 2026-11-21)
    "padded-v": {"pad_v": True},  # --head-dim-v below hdim: V zero-padded to q's head dim (before 2026-11-21)
    "stages3": {"num_stages": 3}, "stages4": {"num_stages": 4},  # K/V ring depth (shipped: 2)
    # clusters of 2 CTAs along M sharing K/V by TMA multicast / none (non-causal cells only)
    "cluster2": {"cluster_m": 2}, "cluster1": {"cluster_m": 1},
    # causal: tiles head by head, longest first within each (before session 9), or longest first
    # across sections of heads whose K/V fit in 32 / 8 MiB of L2 (shipped: 16)
    "per-head-order": {"section_l2_mb": 0}, "sections-32mb": {"section_l2_mb": 32},
    "sections-8mb": {"section_l2_mb": 8},
    # non-causal: tiles whose warpgroups take consecutive 64-row blocks across heads, or not
    "span": {"span_heads": True}, "no-span": {"span_heads": False},
    # the O rescale on every block (before session 13) instead of the lazy one
    "eager-rescale": {"lazy_rescale": False},
    # a ring of 2 Q buffers / 1 (persistent kernels with room for their own sO; '-' otherwise)
    "q2": {"q_stages": 2}, "q1": {"q_stages": 1},
}


def sm90_variant_fn(q, k, v, causal, overrides, tile_mn=None):
    """A callable running kernels/sm90/fwd.py with the shipped key for this shape, some fields
    overridden (compiled once); ``tile_mn`` = (tile_m, tile_n) overrides the tile."""
    from flashattn_hopper.backends.common import current_stream, int_to_cute, to_cute
    from flashattn_hopper.backends.sm90_fwd import FwdSm90, q_ring_fits
    from flashattn_hopper import configs
    from flashattn_hopper.jit import compile_cache, target_arch

    family = FwdSm90()
    head_dim_v = v.shape[-1]
    dtype = "bf16" if q.dtype == torch.bfloat16 else "fp16"
    key = family._key(target_arch(), dtype, q.shape[-1], q.shape[1], v.shape[-1], causal=causal)
    overrides = dict(overrides)
    if overrides.get("cluster_m", 1) > 1 and causal:
        return None  # clusters need every CTA of one to visit the same key blocks
    if overrides.get("cluster_m", 1) > 1:
        overrides.setdefault("span_heads", False)  # a kernel takes clusters or spanning tiles
    if "section_l2_mb" in overrides and not causal:
        return None  # the section order is the causal/local tile order only
    if overrides.get("span_heads") and (causal or -(-q.shape[1] // 64) < key.tile_m // 64 - 1):
        return None  # spanning: the same key blocks for every warpgroup, a tile over <= 2 heads
    if any(f in overrides for f in ("num_stages", "intra_wg_overlap")):
        overrides.setdefault("span_heads", False)  # (ring depth / order variants of the plain tiles)
    memset_counter = overrides.pop("memset_counter", False)
    if overrides.pop("pad_v", False) and v.shape[-1] != q.shape[-1]:
        tile = configs.sm90_fwd_tile(q.shape[-1], causal, q.shape[1])
        overrides.update(head_dim_v=q.shape[-1], tile_m=tile.tile_m, tile_n=tile.tile_n)
        v = torch.nn.functional.pad(v, (0, q.shape[-1] - v.shape[-1]))
    if "pingpong" in overrides:
        overrides["pingpong"] = overrides["pingpong"] and key.pingpong
    key = dataclasses.replace(key, **overrides)
    if tile_mn is not None:
        key = dataclasses.replace(key, tile_m=tile_mn[0], tile_n=tile_mn[1])
    if key.q_stages > 1 and not (
        key.persistent and q_ring_fits(key.tile_m, key.tile_n, key.head_dim, key.head_dim_v,
                                       key.num_stages * (2 if key.span_heads else 1))
    ):
        if "q_stages" in overrides:
            return None  # no room for a second Q buffer beside the own sO (hdim 192/256)
        key = dataclasses.replace(key, q_stages=1)  # (a variant that takes the room, e.g. stages3)
    compiled = compile_cache.get(key, family.compile)
    b, s, h, d = q.shape
    out = torch.empty(b, s, h, key.head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, h, s, dtype=torch.float32, device=q.device)
    args = [to_cute(t) for t in (q, k, v, out, lse)]
    scale = d**-0.5
    # extra_args: the CTA count and (causal) the default stream's self-resetting tile counter, taken
    # once and outside any graph capture, then shared by every stream the calls run on (the default
    # one, a steady timer's capture and replays): right only because the bench's calls run one after
    # another (the API keeps one counter per stream and captures a memset of a fresh one per call).
    extra = family.extra_args(key, q.device)

    def run():
        counter = extra[1]
        if memset_counter and counter is not None:
            counter = int_to_cute(torch.zeros(1, dtype=torch.int32, device=q.device))
        compiled(*args, scale, 0, 0, 1.0, extra[0], counter, *extra[2:], None, None, None, None, current_stream(q.device))
        return out[..., :head_dim_v]

    return run


def make_steady_timer(secs: float):
    """Milliseconds per call of ``fn`` run back to back for ~``secs`` after ~0.5 s of the same (not
    timed): the steady state of a GPU busy with one kernel, where long forwards run at the board's
    power cap and the clock settles to what each kernel's energy per FLOP allows
    (perf/power_probe.py); do_bench's 100 ms of calls, each behind an L2 flush, end before it settles.
    The calls replay from a CUDA graph of ~2 ms of them (CUDA events around the replays, no L2 flush),
    so the host's per-call time (100-170 us on the H100 nodes, perf/README.md) never idles the GPU
    between short kernels."""
    def replays(graph, n: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / n

    def timer(fn) -> float:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            fn()
        end.record()
        torch.cuda.synchronize()
        calls = max(int(2.0 / (start.elapsed_time(end) / 3)), 1)  # (host-bound estimate: at most ~2 ms)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        ms = replays(graph, 1)
        replays(graph, max(int(500 / ms), 1))
        ms = replays(graph, max(int(secs * 1000 / ms), 5)) / calls
        graph.reset()
        return ms

    return timer


def make_timer(flush: bool = True):
    """A callable's time in ms: triton ``do_bench``'s median (an L2 flush before every call, each call timed alone);
    ``flush=False``: back-to-back calls instead (``back_to_back_timer``), as a training loop runs them."""
    if not flush:
        return back_to_back_timer
    try:
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")
    except ImportError:
        def timer(fn, reps=50):
            for _ in range(5):
                fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(reps):
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            return sorted(times)[len(times) // 2]

        return timer


def back_to_back_timer(fn, calls: int = 10, reps: int = 15) -> float:
    """ms per call of ``calls`` back-to-back calls between two CUDA events (no flush: L2 keeps what the previous call
    left, as in a training loop), the median over ``reps``, after a warm-up of as many calls."""
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def time_interleaved(timer, fns: dict, names: list[str], repeat: int, flops: float) -> dict[str, float]:
    """TFLOP/s of each named callable, the median over ``repeat`` rounds. Rounds interleave the
    columns, so a clock or thermal drift hits them all alike, and round ``r`` starts at column ``r``
    (mod the count): the first timed column read up to 4 % low against the same kernel timed later
    in its round (H100, 2026-11-21, perf/NOTES.md "Session 10")."""
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeat):
        shift = r % max(len(names), 1)
        for name in names[shift:] + names[:shift]:
            times[name].append(timer(fns[name]))
    return {name: flops / sorted(ms)[len(ms) // 2] / 1e9 for name, ms in times.items()}


def format_cells(tflops: dict, cols: list[str]) -> list[str]:
    """Table cells: TFLOP/s, or the column's note (WRONG(...), ERR(...)), or '-'."""
    return [f"{tflops[c]:.0f}" if isinstance(tflops.get(c), float) else str(tflops.get(c, "-")) for c in cols]


def visible_pairs(s_q: int, s_k: int, causal: bool, window: tuple[int, int]) -> int:
    """(query, key) pairs the causal/window mask leaves visible (bottom-right aligned)."""
    left, right = window
    right = 0 if causal else right
    i = torch.arange(s_q, dtype=torch.int64)
    hi = torch.clamp(i + s_k - s_q + (right if right >= 0 else s_k), max=s_k - 1)
    lo = torch.clamp(i + s_k - s_q - (left if left >= 0 else s_k), min=0)
    return int(torch.clamp(hi - lo + 1, min=0).sum())


def bench_features(timer, hdims: list[int]) -> None:
    """TFLOP/s of window / softcap / varlen on sm90 and sm80 (and the dense sm90 kernel)."""
    from flashattn_hopper import flash_attn_func, flash_attn_varlen_func

    print("| hdim | case | sm90 | sm80 | sm90/sm80 |")
    print("|---|---|---|---|---|")
    for hdim in hdims:
        nheads = 2048 // hdim
        cases = [  # (name, seqlen, causal, window, softcap)
            ("dense s=8k causal", 8192, True, (-1, -1), 0.0),
            ("window (1024,0) s=8k", 8192, True, (1024, 0), 0.0),
            ("window (512,512) s=8k", 8192, False, (512, 512), 0.0),
            ("softcap 30 s=4k", 4096, False, (-1, -1), 30.0),
            ("softcap 30 s=4k causal", 4096, True, (-1, -1), 30.0),
        ]
        for name, seqlen, causal, window, softcap in cases:
            batch = max(16384 // seqlen, 1)
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(batch, seqlen, nheads, hdim, dtype=torch.bfloat16, device="cuda", generator=gen)
                       for _ in range(3))
            flops = 4 * batch * nheads * hdim * visible_pairs(seqlen, seqlen, causal, window)
            kw = dict(causal=causal, window_size=window, softcap=softcap)
            res = {}
            for backend in ("sm90", "sm80"):
                try:
                    res[backend] = flops / timer(lambda b=backend: flash_attn_func(q, k, v, backend=b, **kw)) / 1e9
                except Exception as e:  # noqa: BLE001 (report and keep going)
                    print(f"note: {backend} {name}: {e}", file=sys.stderr)
            _feature_row(hdim, name, res)
        gen = torch.Generator().manual_seed(0)
        for causal in (False, True):
            lens = [int(x) for x in torch.randint(256, 3840, (64,), generator=gen)]
            lens = lens[: next(i for i in range(1, 65) if sum(lens[:i]) >= 16384)]
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
            total = int(cu[-1])
            q, k, v = (torch.randn(total, nheads, hdim, dtype=torch.bfloat16, device="cuda") for _ in range(3))
            flops = 4 * nheads * hdim * sum(visible_pairs(n, n, causal, (-1, -1)) for n in lens)
            res = {}
            args = (q, k, v, cu, cu, max(lens), max(lens))
            for backend in ("sm90", "sm80"):
                res[backend] = flops / timer(
                    lambda b=backend: flash_attn_varlen_func(*args, causal=causal, backend=b)
                ) / 1e9
            _feature_row(hdim, f"varlen {len(lens)} seqs 256-3840 ({total} tok){' causal' if causal else ''}", res)


def _feature_row(hdim: int, name: str, res: dict) -> None:
    a, b = res.get("sm90"), res.get("sm80")
    cells = [f"{x:.0f}" if x else "-" for x in (a, b)]
    ratio = f"{a / b:.2f}" if a and b else "-"
    print(f"| {hdim} | {name} | " + " | ".join(cells) + f" | {ratio} |", flush=True)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--causal", nargs="+", default=["off", "on"], choices=["off", "on"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--no-baselines", action="store_true", help="only the sm90 variants")
    ap.add_argument("--repeat", type=int, default=1,
                    help="time every column this many times, interleaved, and report the median (A/B runs)")
    ap.add_argument("--tiles", nargs="*", default=[], metavar="HDIM:MxN",
                    help="extra sm90-full columns with another tile, e.g. 64:192x128 128:128x176")
    ap.add_argument("--head-dim-v", type=int, default=None,
                    help="v's head dim (default: each hdim); cells with hdim < it are skipped")
    ap.add_argument("--features", action="store_true", help="window / softcap / varlen table instead")
    ap.add_argument("--steady", type=float, default=None, metavar="SECS",
                    help="time each column back to back from a CUDA graph for SECS after 0.5 s untimed (steady "
                         "clocks at the power cap) instead of do_bench")
    ap.add_argument("--no-sm80", action="store_true", help="leave out the sm80 column")
    args = ap.parse_args(argv)
    if args.features:
        print(f"# fwd features, bf16, nheads*hdim=2048, {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
        bench_features(make_timer(), args.hdims)
        return 0

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from flashattn_hopper import flash_attn_func

    timer = make_timer() if args.steady is None else make_steady_timer(args.steady)
    gpu = torch.cuda.get_device_name()
    timing = "do_bench" if args.steady is None else f"steady {args.steady:g} s"
    print(f"# fwd, bf16, 16k tokens, nheads*hdim=2048, {gpu}, torch {torch.__version__}, {timing}\n")
    extra_tiles = {}
    for spec in args.tiles:
        hd, mn = spec.split(":")
        extra_tiles.setdefault(int(hd), []).append(tuple(int(x) for x in mn.split("x")))
    extra_cols = sorted({f"sm90-{m}x{n}" for tiles in extra_tiles.values() for m, n in tiles})
    cols = [f"sm90-{v}" for v in args.variants] + extra_cols
    if not args.no_baselines:
        cols += (["cudnn", "flash"] if args.no_sm80 else ["sm80", "cudnn", "flash"])
    print("| hdim | seqlen | causal | " + " | ".join(cols) + f" | {cols[0]}/cudnn |")
    print("|" + "---|" * (len(cols) + 4))
    for hdim in args.hdims:
        for seqlen in args.seqlens:
            for causal in (c == "on" for c in args.causal):
                batch, nheads = max(16384 // seqlen, 1), 2048 // hdim
                hdim_v = args.head_dim_v or hdim
                if hdim_v > hdim:
                    continue
                gen = torch.Generator(device="cuda").manual_seed(0)
                q, k, v = (torch.randn(batch, seqlen, nheads, d, dtype=torch.bfloat16, device="cuda",
                                       generator=gen) for d in (hdim, hdim, hdim_v))
                qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    ref = sdpa(qt, kt, vt, is_causal=causal).transpose(1, 2)
                flops = 2 * batch * nheads * seqlen * seqlen * (hdim + hdim_v) * (0.5 if causal else 1.0)
                fns = {f"sm90-{name}": sm90_variant_fn(q, k, v, causal, VARIANTS[name]) for name in args.variants}
                fns = {name: fn for name, fn in fns.items() if fn is not None}
                for m, n in extra_tiles.get(hdim, []):
                    fns[f"sm90-{m}x{n}"] = sm90_variant_fn(q, k, v, causal, {}, (m, n))
                if not args.no_baselines and not args.no_sm80:
                    fns["sm80"] = lambda: flash_attn_func(q, k, v, causal=causal, backend="sm80")
                if not args.no_baselines:

                    def cudnn():
                        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                            return sdpa(qt, kt, vt, is_causal=causal)

                    def flash():
                        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                            return sdpa(qt, kt, vt, is_causal=causal)

                    fns["cudnn"], fns["flash"] = cudnn, flash
                tflops, timed = {}, []
                for name, fn in fns.items():
                    try:
                        out = fn()
                        if name.startswith("sm"):
                            err = (out.float() - ref.float()).abs().max().item()
                            if not err < 0.05:
                                tflops[name] = f"WRONG({err:.2g})"
                                continue
                        timed.append(name)
                    except Exception as e:  # report and keep going: one broken cell must not hide the rest
                        tflops[name] = f"ERR({type(e).__name__})"
                        print(f"note: {name} hdim{hdim} s{seqlen} causal={causal}: {e}", file=sys.stderr)
                tflops.update(time_interleaved(timer, fns, timed, args.repeat, flops))
                cells = format_cells(tflops, cols)
                full, cud = tflops.get(cols[0]), tflops.get("cudnn")
                ratio = f"{full / cud:.2f}" if isinstance(full, float) and isinstance(cud, float) else "-"
                print(f"| {hdim} | {seqlen} | {'on' if causal else 'off'} | " + " | ".join(cells) + f" | {ratio} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
