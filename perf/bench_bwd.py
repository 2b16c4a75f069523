"""Backward benchmark on Hopper: our sm90 backward against cuDNN SDPA and FA4 (not a test).

    python perf/bench_bwd.py [--hdims 64 128] [--seqlens 512 ... 16384] [--causal off on]
                             [--repeat N] [--deterministic] [--sm80] [--tiles 64:128x128:1:rows ...]
                             [--hdim-v DV] [--group G] [--energy] [--no-flush]

FA3-paper sizes: bf16, batch * seqlen = 16k tokens, nheads * hdim = 2048, MHA. Times the backward
alone: ``torch.autograd.grad`` of a retained forward graph, for ours (``backend="sm90"``: preprocess,
main kernel, postprocess and their scratch allocations; ``--sm80``: also the Ampere backward), SDPA
pinned to CUDNN_ATTENTION on BHSD copies, and FA4 (``flash_attn.cute.flash_attn_func``, its sm90
backward) when it imports (a benchmark-only peer carried to the GPU machine as wheels; never imported
by the package). ``--tiles HDIM:MxN[:STAGES][:rows]``: one more column per spec, the sm90 backward
launcher with that tile at that head dim (``BwdSm90Tile``: tile_m x tile_n, Q/dO stages, dQ split by
rows), called directly on our forward's out/lse (A/B of tiles in one interleaved run). Before timing, every column's gradients are checked against cuDNN's on the same inputs
(max abs difference per gradient below 0.1: a wrong kernel gets no speed). Timing: triton ``do_bench``
median (``--no-flush``: back-to-back calls with no L2 flush between them, ``bench_fwd_sm90.back_to_back_timer``),
interleaved over ``--repeat`` rounds (``bench_fwd_sm90.time_interleaved``). FLOPs = 2.5 * 4 * b
* h * s^2 * d (x 1/2 causal); ``--group G``: G query heads per kv head (GQA; cuDNN with ``enable_gqa``); ``--hdim-v``: v (and dout) at that width, FLOPs 2.5 * 2 * b * h * s^2 * (d + dv). Prints a Markdown table of TFLOP/s and ours / the faster peer. ``--energy``: under each row, every column's
joules per backward, TFLOP/J, mean watts and SM clock over ~2 s of back-to-back calls (NVML's energy counter
through ``pynvml``, else ``nvidia-smi``): from 4k an H100's backward runs at its 700 W cap, where speed follows energy per FLOP.
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench_fwd_sm90 import format_cells, make_timer, time_interleaved

GRAD_TOLERANCE = 0.1


def fa4_func():
    """FA4's ``flash_attn_func`` if the benchmark-only wheels are installed, else None."""
    try:
        from flash_attn.cute import flash_attn_func  # type: ignore[import-not-found]
    except Exception as e:  # not installed, or its import fails: the column reads "-"
        print(f"note: FA4 not available ({type(e).__name__}: {e})", file=sys.stderr)
        return None
    return flash_attn_func


def parse_tile(spec: str):
    """``HDIM:MxN[:STAGES][:rows|:transposed][:pingpong][:packed][:claim|:masked][:loop][:desc][:asD]`` -> (hdim, an
    sm90 backward family whose table has that tile, as row D with ``asD``: HDIM then runs padded to D); ``pingpong``,
    ``packed`` and ``claim`` set ``BwdSm90Tile``'s flags of those names (``dq_claim`` "all"; ``masked``: "masked";
    ``loop``: ``gqa_loop`` "all"; ``desc``: ``loop_desc_above`` 0), so ``64:128x128:2:rows`` is the lockstep loop
    without ds_packed, the preprocess zeroing dQaccum, and hdim 64's default is
    ``64:128x128:2:rows:pingpong:packed:claim``)."""
    from flashattn_hopper.backends.sm90_bwd import BWD_SM90_PAIR_TILES, BWD_SM90_TILES, BwdSm90, BwdSm90Tile

    parts = spec.split(":")
    hdim, (tile_m, tile_n) = int(parts[0]), (int(x) for x in parts[1].split("x"))
    stages = int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else 2
    family = BwdSm90()
    # ``asD``: the tile as the table's row D, so that HDIM's problems run padded to D (a native row against padding)
    table_hdim = next((int(x[2:]) for x in parts if x.startswith("as") and x[2:].isdigit()), hdim)
    # (the table's other rows stay: v narrower than q/k takes its own row, e.g. --hdim-v 128)
    tile = BwdSm90Tile(tile_m=tile_m, tile_n=tile_n, num_stages=stages, dq_split_rows="rows" in parts,
                       dq_transposed="transposed" in parts, pingpong="pingpong" in parts, ds_packed="packed" in parts,
                       dq_claim="all" if "claim" in parts else "masked" if "masked" in parts else "",
                       gqa_loop="all" if "loop" in parts else "", loop_desc_above=0 if "desc" in parts else -1)
    family.tiles = {**{d: t for d, t in BWD_SM90_TILES.items() if d != hdim}, table_hdim: tile}
    # (and the tile for every v of that row: 256's 96-key 256/128 pair tile too)
    family.pair_tiles = {pair: t for pair, t in BWD_SM90_PAIR_TILES.items() if pair[0] != table_hdim}
    return hdim, family


def tile_column(family, q, k, v, dout, causal: bool, deterministic: bool):
    """The backward launcher of ``family`` (a tile candidate) on our sm90 forward's out and lse."""
    from flashattn_hopper import flash_attn_func, validate

    p = validate.validate_dense(q, k, v, None, causal, (-1, -1), 0.0)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True, backend="sm90")
    return lambda: family.backward(dout, q, k, v, out, lse, p, None, deterministic)


def gpu_query(field: str) -> float:
    """One NVML reading of the current CUDA device, e.g. ``total_energy_consumption`` (mJ) or ``clocks.sm``
    (MHz): through ``pynvml`` where it imports, else ``nvidia-smi``, both by the device's UUID (an index
    ignores CUDA_VISIBLE_DEVICES and may order cards otherwise)."""
    import subprocess

    uuid = f"GPU-{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}"
    try:
        import pynvml
    except ImportError:
        pynvml = None
    if pynvml is not None:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        if field == "total_energy_consumption":
            return float(pynvml.nvmlDeviceGetTotalEnergyConsumption(handle))
        if field == "clocks.sm":
            return float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM))
    run = subprocess.run(["nvidia-smi", f"--id={uuid}", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True)
    try:
        return float(run.stdout.strip())
    except ValueError:
        raise RuntimeError(f"nvidia-smi reads {field} as {run.stdout.strip()!r} ({run.stderr.strip()[:200]!r}, "
                           f"rc {run.returncode}) on this GPU") from None


def energy_per_call(fn, seconds: float = 2.0) -> tuple[float, float, float]:
    """(J per call, mean W, SM MHz while the calls run) of ``fn`` run back to back for about ``seconds``
    (warm; the energy counter read before the first call is queued and after the last one ends, the
    clock while the queue still runs). Under the power cap a backward's speed is its energy per FLOP's:
    this tells two kernels' joules apart (perf/NOTES.md session 26)."""
    import time

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    calls = max(int(seconds / max(time.perf_counter() - start, 1e-6)), 2)
    energy0 = gpu_query("total_energy_consumption")
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    clock = gpu_query("clocks.sm")  # (the host queues faster than the GPU runs: the queue is still busy)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    joules = (gpu_query("total_energy_consumption") - energy0) / 1000.0
    return joules / calls, joules / elapsed, clock


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--causal", nargs="+", default=["off", "on"], choices=["off", "on"])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--deterministic", action="store_true", help="ours with deterministic=True")
    ap.add_argument("--sm80", action="store_true", help="also time our Ampere backward")
    ap.add_argument("--tiles", nargs="+", default=[], help="HDIM:MxN[:STAGES][:rows] sm90 tile candidates")
    ap.add_argument("--hdim-v", type=int, default=None, help="v's head dim (default: q/k's)")
    ap.add_argument("--group", type=int, default=1, help="GQA: query heads per kv head (default 1: MHA)")
    ap.add_argument("--no-flush", action="store_true",
                    help="time back-to-back calls (no L2 flush between them, as a training loop) instead of do_bench's")
    ap.add_argument("--energy", action="store_true",
                    help="also each column's joules per backward, mean watts and clock (about 2 s of calls each)")
    args = ap.parse_args(argv)
    tile_cols = {spec: parse_tile(spec) for spec in args.tiles}

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from flashattn_hopper import flash_attn_func

    fa4 = fa4_func()
    timer = make_timer(flush=not args.no_flush)
    print(f"# bwd, bf16, 16k tokens, nheads*hdim=2048, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"deterministic={args.deterministic}, repeat={args.repeat}, query heads per kv head={args.group}"
          f"{', back-to-back calls (no L2 flush)' if args.no_flush else ''}\n")
    ours_cols = ["sm90", *(["sm80"] if args.sm80 else [])]
    cols = [*ours_cols, *tile_cols, "cudnn", "fa4"]
    print("| hdim | seqlen | causal | " + " | ".join(cols) + " | sm90/cudnn | sm90/fa4 | sm90/best |")
    print("|" + "---|" * (len(cols) + 6))
    for hdim in args.hdims:
        for seqlen in args.seqlens:
            for causal in (c == "on" for c in args.causal):
                # (query heads a multiple of the group: hdim 96's 21 heads take 20 with --group 4)
                batch, nheads = max(16384 // seqlen, 1), 2048 // hdim // args.group * args.group
                gen = torch.Generator(device="cuda").manual_seed(0)
                hdim_v = args.hdim_v or hdim
                q, k, v, dout = (torch.randn(batch, seqlen, heads, width, dtype=torch.bfloat16, device="cuda",
                                             generator=gen)
                                 for heads, width in ((nheads, hdim), (nheads // args.group, hdim),
                                                      (nheads // args.group, hdim_v), (nheads, hdim_v)))
                flops = 2.5 * 2 * batch * nheads * seqlen * seqlen * (hdim + hdim_v) * (0.5 if causal else 1.0)
                fns, layouts = {}, {}
                for col in ours_cols:
                    leaves = tuple(t.clone().requires_grad_() for t in (q, k, v))
                    out = flash_attn_func(*leaves, causal=causal, deterministic=args.deterministic, backend=col)
                    fns[col] = lambda o=out, x=leaves: torch.autograd.grad(o, x, dout, retain_graph=True)
                    layouts[col] = "bshd"
                for spec, (tile_hdim, family) in tile_cols.items():
                    if tile_hdim == hdim:
                        fns[spec] = tile_column(family, q, k, v, dout, causal, args.deterministic)
                        layouts[spec] = "bshd"
                bhsd = tuple(t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
                dout_bhsd = dout.transpose(1, 2).contiguous()
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    o = sdpa(*bhsd, is_causal=causal, enable_gqa=args.group > 1)
                fns["cudnn"] = lambda o=o: torch.autograd.grad(o, bhsd, dout_bhsd, retain_graph=True)
                layouts["cudnn"] = "bhsd"
                if fa4 is not None:
                    leaves4 = tuple(t.clone().requires_grad_() for t in (q, k, v))
                    o4 = fa4(*leaves4, causal=causal)
                    o4 = o4[0] if isinstance(o4, tuple) else o4
                    fns["fa4"] = lambda o=o4, x=leaves4: torch.autograd.grad(o, x, dout, retain_graph=True)
                    layouts["fa4"] = "bshd"
                tflops, timed = {}, []
                for name, fn in fns.items():
                    try:
                        fn()
                        timed.append(name)
                    except Exception as e:  # one broken cell must not hide the rest
                        tflops[name] = f"ERR({type(e).__name__})"
                        print(f"note: {name} hdim{hdim} s{seqlen} causal={causal}: {e}", file=sys.stderr)
                if "cudnn" in timed:
                    ref = fns["cudnn"]()
                    for col in [c for c in timed if c != "cudnn"]:
                        grads = fns[col]()
                        err = max((a - (b.transpose(1, 2) if layouts[col] == "bshd" else b)).abs().max().item()
                                  for a, b in zip(grads, ref))
                        if not err < GRAD_TOLERANCE:
                            tflops[col] = f"WRONG({err:.2g})"
                            timed.remove(col)
                tflops.update(time_interleaved(timer, fns, timed, args.repeat, flops))
                cells = format_cells(tflops, cols)
                ratios = []
                ours = tflops.get("sm90")
                peers = [tflops.get(p) for p in ("cudnn", "fa4")]
                best = max((p for p in peers if isinstance(p, float)), default=None)
                for base in (*peers, best):
                    ok = isinstance(ours, float) and isinstance(base, float)
                    ratios.append(f"{ours / base:.2f}" if ok else "-")
                dims = f"{hdim}" if hdim_v == hdim else f"{hdim}/{hdim_v}"
                print(f"| {dims} | {seqlen} | {'on' if causal else 'off'} | " + " | ".join(cells + ratios) + " |",
                      flush=True)
                if args.energy:  # (after the table row: its own lines, Markdown comments)
                    for name in timed:
                        joules, watts, clock = energy_per_call(fns[name])
                        print(f"<!-- energy {dims} {seqlen} {'on' if causal else 'off'} {name}: {joules * 1e3:.2f} mJ/call, "
                              f"{flops / joules / 1e12:.2f} TFLOP/J, {watts:.0f} W, {clock:.0f} MHz -->", flush=True)
                del fns
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
