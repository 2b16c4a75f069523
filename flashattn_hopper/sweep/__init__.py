"""Perf sweep: head dim x seqlen x mask x pass (fwd / bwd / fwd+bwd), ours against every baseline.

`python -m flashattn_hopper sweep [--quick] [options]` (or `python -m flashattn_hopper.sweep`).
Shapes follow the FA3 paper (section 4.1): batch x seqlen = 16k tokens, nheads x hdim = 2048 hidden.
Backends: ours (`sm90`, `sm80`) and PyTorch SDPA pinned to cuDNN, flash and memory-efficient kernels,
each skipped with a note where it cannot run. Per shape the backends are interleaved; per backend
the first full-size call is timed on its own (it JIT-compiles), its output (and gradients) are
checked against the fp32 reference, and only then is it timed. Reports TFLOP/s (causal counts half),
median time, ratio to each baseline and % of a dense matmul measured in the same run, as a live
table, `results.csv`, `results.md` and PNG plots under `perf/results/<gpu>-<date>/`. perf/README.md
says what is measured and how.

This module: the command line, the plan (shapes, FLOPs) and the loop. Timing is in `sweep.timing`,
backends and the correctness gate in `sweep.backends`, tables and plots in `sweep.report`.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TextIO

import torch

from .backends import (
    BACKENDS,
    BASELINES,
    OURS,
    Reference,
    Shape,
    ShapeInputs,
    Skip,
    check_backward,
    check_forward,
    describe_failure,
    load_attn_fn,
    make_runner,
    one_line,
    reference_tools,
)
from .report import (
    PASS_LABEL,
    CsvSink,
    LiveTable,
    Result,
    collect_environment,
    default_out_dir,
    fill_speedups,
    pivot,
    write_markdown,
    write_plots,
)
from .timing import Timer, clear_grads, make_timer, matmul_tflops, timed_first_call

PASSES = ("fwd", "bwd", "fwdbwd")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
CAUSAL_CHOICES = {"both": (False, True), "off": (False,), "on": (True,)}
# FA3 paper, section 4.1: 16k tokens per batch, hidden 2048.
TOKENS, HIDDEN = 16384, 2048
FULL_DEFAULTS = {
    "hdims": (64, 128, 256),
    "seqlens": (512, 1024, 2048, 4096, 8192, 16384),
    "causal": "both",
    "passes": PASSES,
    "gqa": (1,),
    "backends": BACKENDS,
}
# A handful of shapes for checking a change: 4 rows x 5 backends, well under a minute once compiled.
QUICK_DEFAULTS = {**FULL_DEFAULTS, "hdims": (128,), "seqlens": (1024, 8192), "passes": ("fwd",)}
# Backward does 5 matmuls to the forward's 2 (dQ, dK, dV, and S and dP recomputed): 2.5x.
PASS_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
# A first call this slow compiled something (or loaded it from the disk cache): say so as it happens.
SLOW_FIRST_CALL_MS = 1000.0


def attention_flops(
    batch: int,
    nheads: int,
    seqlen_q: int,
    seqlen_k: int,
    hdim: int,
    hdim_v: int | None = None,
    *,
    causal: bool = False,
    pass_: str = "fwd",
) -> float:
    """Matmul FLOPs of one call: 2*b*h*s_q*s_k*(d + d_v) forward (4*b*h*s_q*s_k*d when d_v == d),
    half of it causal (the convention of FA2/FA3's benchmarks, exact for s_q == s_k up to the
    diagonal), x2.5 for bwd and x3.5 for fwd+bwd."""
    if pass_ not in PASS_FLOP_FACTOR:
        raise ValueError(f"pass_: expected one of {', '.join(PASS_FLOP_FACTOR)}, got {pass_!r}")
    hdim_v = hdim if hdim_v is None else hdim_v
    flops = 2.0 * batch * nheads * seqlen_q * seqlen_k * (hdim + hdim_v)
    if causal:
        flops *= 0.5
    return flops * PASS_FLOP_FACTOR[pass_]


def make_shape(hdim: int, seqlen: int, gqa: int = 1, *, tokens: int = TOKENS, hidden: int = HIDDEN,
               hdim_v: int | None = None) -> Shape:
    """batch = tokens // seqlen (at least 1), nheads = hidden / hdim rounded, then down to a multiple of gqa."""
    nheads = max(1, round(hidden / hdim))
    nheads -= nheads % gqa
    if nheads == 0:
        raise ValueError(f"GQA {gqa} needs at least {gqa} query heads, but hidden {hidden} / hdim {hdim} "
                         f"gives {max(1, round(hidden / hdim))}")
    return Shape(max(1, tokens // seqlen), seqlen, nheads, nheads // gqa, hdim, hdim if hdim_v is None else hdim_v)


@dataclass(frozen=True)
class SweepConfig:
    hdims: tuple[int, ...]
    seqlens: tuple[int, ...]
    causal: tuple[bool, ...]
    passes: tuple[str, ...]
    gqa: tuple[int, ...]
    backends: tuple[str, ...]
    dtype: str = "bf16"
    hdim_v: int | None = None
    tokens: int = TOKENS
    hidden: int = HIDDEN
    quick: bool = False
    out: Path | None = None
    plots: bool = True
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    seed: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def plan(self) -> tuple[list[Shape], list[str]]:
        """Shapes in sweep order (hdim, gqa, seqlen), and a note for each combination that cannot exist."""
        shapes, notes = [], []
        for hdim in self.hdims:
            for gqa in self.gqa:
                try:
                    shapes += [make_shape(hdim, s, gqa, tokens=self.tokens, hidden=self.hidden, hdim_v=self.hdim_v)
                               for s in self.seqlens]
                except ValueError as exc:
                    notes.append(f"skipping hdim {hdim} with GQA {gqa}: {exc}")
        return shapes, notes

    def command(self) -> str:
        """A command line that repeats this sweep (recorded in results.md)."""
        causal = {v: k for k, v in CAUSAL_CHOICES.items()}[self.causal]
        parts = ["python -m flashattn_hopper sweep", "--hdims", *map(str, self.hdims), "--seqlens",
                 *map(str, self.seqlens), "--causal", causal, "--passes", *self.passes, "--dtype", self.dtype,
                 "--gqa", *map(str, self.gqa), "--backends", *self.backends]
        if self.hdim_v is not None:
            parts += ["--hdim-v", str(self.hdim_v)]
        if (self.tokens, self.hidden) != (TOKENS, HIDDEN):
            parts += ["--tokens", str(self.tokens), "--hidden", str(self.hidden)]
        if (self.warmup_ms, self.rep_ms) != (25.0, 100.0):
            parts += ["--warmup-ms", f"{self.warmup_ms:g}", "--rep-ms", f"{self.rep_ms:g}"]
        return " ".join(parts)


def parse_seqlen(text: str) -> int:
    """'4096', '4k' or '4K' -> 4096."""
    t = text.strip().lower()
    try:
        value = int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a sequence length such as 4096 or 4k, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive sequence length, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The sweep's options; unset list options take the full (or --quick) defaults."""
    full, quick = FULL_DEFAULTS, QUICK_DEFAULTS
    a = parser.add_argument
    a("--quick", action="store_true",
      help="a handful of shapes for checking a change (hdim 128, seqlen 1k and 8k, causal on and off, fwd), "
           "under a minute once the kernels are compiled; options given explicitly still apply")
    a("--hdims", type=_positive_int, nargs="+", metavar="D",
      help=f"head dims (default {' '.join(map(str, full['hdims']))}; quick: {quick['hdims'][0]})")
    a("--hdim-v", type=_positive_int, metavar="DV", help="value head dim, if not the same as each hdim")
    a("--seqlens", type=parse_seqlen, nargs="+", metavar="S",
      help="sequence lengths, 4096 or 4k (default 512 1k 2k 4k 8k 16k; quick: 1k 8k)")
    a("--causal", choices=tuple(CAUSAL_CHOICES), help="mask: both (default), on (causal only) or off")
    a("--passes", choices=PASSES, nargs="+", help="fwd, bwd, fwdbwd (default all three; quick: fwd)")
    a("--dtype", choices=tuple(DTYPES), default="bf16", help="input dtype (default bf16)")
    a("--gqa", type=_positive_int, nargs="+", metavar="G", help="query heads per KV head (default 1)")
    a("--backends", choices=BACKENDS, nargs="+",
      help="ours: auto (backend=None: what users get) sm90 sm80; baselines (PyTorch SDPA): cudnn flash efficient "
           "(default all)")
    a("--tokens", type=_positive_int, default=TOKENS, help=f"batch x seqlen (default {TOKENS})")
    a("--hidden", type=_positive_int, default=HIDDEN, help=f"nheads x hdim (default {HIDDEN})")
    a("--out", type=Path, metavar="DIR", help="results folder (default perf/results/<gpu>-<date>[-quick])")
    a("--no-plots", action="store_true", help="skip the PNG plots")
    a("--warmup-ms", type=_positive_float, default=25.0, help="warm-up per timing, excluded (default 25)")
    a("--rep-ms", type=_positive_float, default=100.0, help="time spent in timed calls per cell (default 100)")
    a("--seed", type=int, default=0, help="seed for the random inputs (default 0)")


def resolve_config(args: argparse.Namespace) -> SweepConfig:
    """Options as given, else the --quick or full defaults. ValueError names a bad option."""
    quick = bool(getattr(args, "quick", False))
    defaults = QUICK_DEFAULTS if quick else FULL_DEFAULTS

    def pick(name: str):
        value = getattr(args, name, None)
        return defaults[name] if value is None else value

    def unique_positive(name: str) -> tuple[int, ...]:
        values = tuple(dict.fromkeys(int(v) for v in pick(name)))
        if not values or any(v <= 0 for v in values):
            raise ValueError(f"--{name}: expected positive integers, got {list(pick(name))}")
        return values

    passes, backends = set(pick("passes")), set(pick("backends"))
    unknown = (passes - set(PASSES)) | (backends - set(BACKENDS))
    if unknown or not passes or not backends:
        raise ValueError(f"--passes / --backends: expected values from {PASSES} / {BACKENDS}, got "
                         f"{sorted(passes)} / {sorted(backends)}")
    dtype = getattr(args, "dtype", None) or "bf16"
    if dtype not in DTYPES:
        raise ValueError(f"--dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    causal = pick("causal")
    if causal not in CAUSAL_CHOICES:
        raise ValueError(f"--causal: expected one of {', '.join(CAUSAL_CHOICES)}, got {causal!r}")
    return SweepConfig(
        hdims=unique_positive("hdims"),
        seqlens=unique_positive("seqlens"),
        causal=CAUSAL_CHOICES[causal],
        passes=tuple(p for p in PASSES if p in passes),
        gqa=unique_positive("gqa"),
        backends=tuple(b for b in BACKENDS if b in backends),
        dtype=dtype,
        hdim_v=getattr(args, "hdim_v", None),
        tokens=getattr(args, "tokens", None) or TOKENS,
        hidden=getattr(args, "hidden", None) or HIDDEN,
        quick=quick,
        out=getattr(args, "out", None),
        plots=not getattr(args, "no_plots", False),
        warmup_ms=float(getattr(args, "warmup_ms", None) or 25.0),
        rep_ms=float(getattr(args, "rep_ms", None) or 100.0),
        seed=int(getattr(args, "seed", None) or 0),
    )


class SweepAborted(Exception):
    """The process cannot go on measuring (e.g. a kernel fault left the CUDA context unusable)."""


@dataclass
class SweepOutcome:
    results: list[Result] = field(default_factory=list)
    aborted: str | None = None


@dataclass
class _Context:
    cfg: SweepConfig
    device: torch.device
    timer: Timer
    matmul_tflops: float
    attn_fn: Callable | None
    attn_fn_note: str


def _cell(shape: Shape, causal: bool, pass_: str, dtype: str, backend: str, status: str, **kw) -> Result:
    return Result(hdim=shape.hdim, hdim_v=shape.hdim_v, seqlen=shape.seqlen, batch=shape.batch, nheads=shape.nheads,
                  nheads_k=shape.nheads_k, causal=causal, pass_=pass_, dtype=dtype, backend=backend, status=status,
                  **kw)


def _timed_fn(runner, out: torch.Tensor, pass_: str) -> Callable[[], object]:
    if pass_ == "fwd":
        return runner.forward
    if pass_ == "bwd":
        return lambda: out.backward(runner.dout, retain_graph=True)
    return lambda: runner.forward().backward(runner.dout)


def _probe_backward(runner, out: torch.Tensor, reference: Reference, device: torch.device):
    """(status, note, check, first_call_ms) of the first backward, which must also pass the check."""
    if not out.requires_grad:
        return "skipped", f"{runner.name} returned an output without autograd history: no backward", None, None
    try:
        _, first_ms = timed_first_call(lambda: out.backward(runner.dout, retain_graph=True), device)
    except Exception as exc:  # a failing backend becomes a noted cell; the sweep goes on
        status, note = describe_failure(exc, runner.name)
        return status, note, None, None
    try:
        check = check_backward(runner, reference)
    except Exception as exc:  # without a reference nothing vouches for the result
        return "error", one_line(f"reference check failed: {type(exc).__name__}: {exc}"), None, None
    return ("ok" if check.ok else "wrong"), check.note, check, first_ms


def measure_backend(name: str, inputs: ShapeInputs, causal: bool, reference: Reference, ctx: _Context) -> list[Result]:
    """All requested passes of one backend on one (shape, mask): probe, check, then time."""
    cfg, shape = ctx.cfg, inputs.shape

    def cell(pass_: str, status: str, **kw) -> Result:
        return _cell(shape, causal, pass_, cfg.dtype, name, status, **kw)

    try:
        runner = make_runner(name, inputs, causal, ctx.attn_fn, ctx.attn_fn_note)
    except Skip as exc:
        return [cell(p, "skipped", note=str(exc)) for p in cfg.passes]
    clear_grads(runner.leaves)
    # The first full-size forward is the probe: it may raise NotImplementedError or find no SDPA
    # kernel (SDPA says why in warnings), it compiles, and it is the output that gets checked.
    with warnings.catch_warnings(record=name in BASELINES) as seen:
        if seen is not None:
            warnings.simplefilter("always")
        try:
            with runner.context():
                out, fwd_first_ms = timed_first_call(runner.forward, ctx.device)
        except Exception as exc:  # a failing backend becomes a noted cell; the sweep goes on
            status, note = describe_failure(exc, name, seen or ())
            return [cell(p, status, note=note) for p in cfg.passes]
    try:
        fwd_check = check_forward(runner, out, reference)
    except Exception as exc:  # without a reference nothing vouches for the result
        note = one_line(f"reference check failed: {type(exc).__name__}: {exc}")
        return [cell(p, "error", note=note) for p in cfg.passes]
    if not fwd_check.ok:
        return [cell(p, "wrong", note=fwd_check.note, max_err=fwd_check.err, err_bound=fwd_check.bound)
                for p in cfg.passes]
    bwd = None
    if any(p != "fwd" for p in cfg.passes):
        bwd = _probe_backward(runner, out, reference, ctx.device)
    results = []
    for pass_ in cfg.passes:
        check, first_ms = fwd_check, fwd_first_ms
        if pass_ != "fwd":
            status, note, check, bwd_first_ms = bwd
            if status != "ok":
                errs = {"max_err": check.err, "err_bound": check.bound} if check else {}
                results.append(cell(pass_, status, note=note, **errs))
                continue
            first_ms = bwd_first_ms if pass_ == "bwd" else fwd_first_ms + bwd_first_ms
        try:
            with runner.context():
                timing = ctx.timer(_timed_fn(runner, out, pass_), grad_to_none=runner.leaves if pass_ != "fwd" else ())
        except Exception as exc:  # a failing backend becomes a noted cell; the sweep goes on
            status, note = describe_failure(exc, name)
            results.append(cell(pass_, status, note=note))
            continue
        flops = attention_flops(shape.batch, shape.nheads, shape.seqlen, shape.seqlen, shape.hdim, shape.hdim_v,
                                causal=causal, pass_=pass_)
        tflops = flops / (timing.median_ms * 1e-3) / 1e12
        results.append(cell(pass_, "ok", median_ms=timing.median_ms, p20_ms=timing.p20_ms, p80_ms=timing.p80_ms,
                            tflops=tflops, pct_matmul=100.0 * tflops / ctx.matmul_tflops, first_call_ms=first_ms,
                            max_err=check.err, err_bound=check.bound))
    clear_grads(runner.leaves)
    return results


def _ensure_device_usable(device: torch.device) -> None:
    if device.type != "cuda":
        return
    try:
        torch.cuda.synchronize(device)
    except Exception as exc:  # a sticky CUDA error: nothing later in this process can be trusted
        raise SweepAborted(one_line(f"the GPU context is unusable after an error ({exc}); rerun the rest "
                                    "of the sweep in a new process")) from exc


def _report_group(table: LiveTable, group: list[Result]) -> None:
    """Rows of one (shape, mask), then its notes: each distinct failure once, and slow first calls."""
    for key, cells in pivot(group):
        table.row(key, cells)
    failures: dict[tuple[str, str, str], list[str]] = {}
    for r in group:
        if r.status != "ok":
            failures.setdefault((r.backend, r.status, r.note), []).append(PASS_LABEL[r.pass_])
        elif r.first_call_ms and r.first_call_ms > SLOW_FIRST_CALL_MS and r.pass_ != "fwdbwd":
            table.note(f"{r.backend} {PASS_LABEL[r.pass_]}: first call {r.first_call_ms / 1e3:.1f} s at hdim "
                       f"{r.hdim} GQA {r.gqa}{' causal' if r.causal else ''} (compile or cache load; in no timing)")
    for (backend, status, note), passes in failures.items():
        table.note(f"{backend} {', '.join(passes)}: {status}: {note}")


def sweep(
    cfg: SweepConfig,
    *,
    device: torch.device,
    timer: Timer,
    env: dict,
    out_dir: Path,
    matmul_tflops: float,
    attn_fn: Callable | None = None,
    tools: Callable = reference_tools,
    stream: TextIO | None = None,
) -> SweepOutcome:
    """Run the plan, writing results.csv as it goes. `attn_fn` defaults to flash_attn_func."""
    attn_fn_note = ""
    if attn_fn is None and any(b in OURS for b in cfg.backends):
        attn_fn, attn_fn_note = load_attn_fn()
    ctx = _Context(cfg, device, timer, matmul_tflops, attn_fn, attn_fn_note)
    shapes, plan_notes = cfg.plan()
    table = LiveTable(list(cfg.backends), len(shapes) * len(cfg.causal) * len(cfg.passes), stream or sys.stdout)
    for note in plan_notes:
        table.note(note)
    table.header()
    outcome = SweepOutcome()
    torch.manual_seed(cfg.seed)
    need_bhsd = any(b in BASELINES for b in cfg.backends)
    with CsvSink(Path(out_dir) / "results.csv", env) as sink:
        group: list[Result] = []
        try:
            for shape in shapes:
                try:
                    inputs = ShapeInputs(shape, device=device, dtype=cfg.torch_dtype, need_bhsd=need_bhsd)
                except torch.cuda.OutOfMemoryError as exc:
                    inputs, input_error = None, one_line(f"out of memory allocating the inputs: {exc}")
                for causal in cfg.causal:
                    group = []
                    reference = Reference(inputs, causal, tools) if inputs is not None else None
                    for name in cfg.backends:
                        table.status(f"[{table.done + 1}/{table.total}] hdim {shape.hdim} seqlen {shape.seqlen} "
                                     f"{'causal' if causal else 'no mask'}: {name}")
                        if inputs is None:
                            group += [_cell(shape, causal, p, cfg.dtype, name, "error", note=input_error)
                                      for p in cfg.passes]
                            continue
                        group += measure_backend(name, inputs, causal, reference, ctx)
                        # A kernel fault is sticky; stop rather than blame the next backend for it.
                        _ensure_device_usable(device)
                    fill_speedups(group)
                    sink.write(group)
                    outcome.results += group
                    _report_group(table, group)
                    group = []
                inputs = reference = None
        except (SweepAborted, KeyboardInterrupt) as exc:
            outcome.aborted = str(exc) if isinstance(exc, SweepAborted) else "interrupted"
            fill_speedups(group)
            sink.write(group)
            outcome.results += group
            table.note(f"sweep stopped: {outcome.aborted}")
    return outcome


def gpu_problem() -> str | None:
    """Why this machine cannot run the sweep, in a sentence; None when it can."""
    if not torch.cuda.is_available():
        return (
            f"flashattn-hopper sweep: no CUDA GPU found (torch.cuda.is_available() is False; torch "
            f"{torch.__version__}, built for CUDA {torch.version.cuda or 'none'}). The sweep times attention "
            "kernels, so it needs a CUDA GPU (sm80 or newer; sm90 for the Hopper kernels). On a machine "
            "without a GPU, `python -m flashattn_hopper precompile` does the CPU part: it compiles the "
            "kernels into the disk cache."
        )
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return (f"flashattn-hopper sweep: {torch.cuda.get_device_name()} is sm{major}{minor}; the kernels and "
                "the SDPA flash baseline need sm80 or newer.")
    return None


def _details(cfg: SweepConfig, end_rate: float | None, seconds: float) -> list[tuple[str, str]]:
    rows = [
        ("shapes", f"batch x seqlen = {cfg.tokens} tokens, nheads x hdim = {cfg.hidden} hidden (FA3 paper 4.1); "
                   f"{cfg.dtype}; inputs torch.randn, seed {cfg.seed}"),
        ("check", "each backend's timed output (and gradients) vs the fp32 reference on one batch element and "
                  "its last heads: max|ours-ref| <= 2*max|pt-ref| + atol, before any timing"),
        ("command", f"`{cfg.command()}`"),
        ("sweep time", f"{seconds:.0f} s"),
    ]
    if end_rate is not None:
        rows.append(("dense matmul at the end", f"{end_rate:.1f} TFLOP/s"))
    return rows


def run(args: argparse.Namespace) -> int:
    """Entry point for `python -m flashattn_hopper sweep`. 0: done and every cell ran or was skipped;
    1: a cell was wrong or failed, or the sweep stopped early; 2: bad options or no usable GPU."""
    try:
        cfg = resolve_config(args)
    except ValueError as exc:
        print(f"flashattn-hopper sweep: {exc}", file=sys.stderr)
        return 2
    problem = gpu_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    timer = make_timer(cfg.warmup_ms, cfg.rep_ms, device)
    env = collect_environment(device, timer.description)
    out_dir = Path(cfg.out) if cfg.out else default_out_dir(env["gpu"], env["date"], cfg.quick)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"sweep on {env['gpu']} (sm {env['capability']}, driver {env.get('driver') or '?'}), torch "
          f"{env['torch']}; timer: {timer.description}\nresults: {out_dir}", flush=True)
    started = time.perf_counter()
    env["matmul_tflops"] = matmul_tflops(timer, device, cfg.torch_dtype)
    print(f"dense {cfg.dtype} matmul 8192^3: {env['matmul_tflops']:.1f} TFLOP/s", flush=True)
    outcome = sweep(cfg, device=device, timer=timer, env=env, out_dir=out_dir, matmul_tflops=env["matmul_tflops"])
    end_rate = None
    with contextlib.suppress(Exception):  # after an abort the GPU may be unusable; the rate is optional
        end_rate = matmul_tflops(timer, device, cfg.torch_dtype)
    if end_rate is not None and abs(end_rate / env["matmul_tflops"] - 1) > 0.05:
        print(f"warning: the matmul rate moved from {env['matmul_tflops']:.1f} to {end_rate:.1f} TFLOP/s during "
              "the sweep (clocks, power or thermal limits); compare results with care", flush=True)
    written = [write_markdown(out_dir / "results.md", outcome.results, env,
                              _details(cfg, end_rate, time.perf_counter() - started))]
    if cfg.plots:
        plots = write_plots(out_dir, outcome.results, env)
        if plots is None:
            print("matplotlib is not importable: no plots (results.csv and results.md are written)")
        else:
            written += plots
    counts = {s: sum(r.status == s for r in outcome.results) for s in ("ok", "skipped", "wrong", "error")}
    print(f"{counts['ok']} timed, {counts['skipped']} skipped, {counts['wrong']} wrong, {counts['error']} failed; "
          f"wrote {out_dir / 'results.csv'}, " + ", ".join(str(p) for p in written))
    if outcome.aborted:
        print(f"the sweep stopped early: {outcome.aborted}", file=sys.stderr)
    return 1 if outcome.aborted or counts["wrong"] or counts["error"] else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flashattn_hopper.sweep",
        description="Attention perf sweep: ours (sm90, sm80) against PyTorch SDPA (cuDNN, flash, efficient).",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))

