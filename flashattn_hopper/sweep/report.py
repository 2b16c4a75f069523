"""Reporting for the perf sweep: result rows, the live table, CSV, Markdown, PNG plots, environment.

One `Result` per (shape, mask, pass, backend). The CSV is written row group by row group as the
sweep goes, so an interrupted sweep keeps what it measured; every row carries the environment
(GPU, driver, CUDA, torch, DSL, git sha, date, matmul rate) so rows from different runs can be
concatenated. matplotlib is optional and imported only when plotting (Agg canvas, no pyplot state).
"""

from __future__ import annotations

import csv
import datetime
import importlib.metadata
import math
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, TextIO

import torch

from .backends import BACKENDS, BASELINES, OURS

STATUSES = ("ok", "skipped", "wrong", "error")
PASS_LABEL = {"fwd": "fwd", "bwd": "bwd", "fwdbwd": "fwd+bwd"}
RESULT_COLUMNS = (
    "hdim", "hdim_v", "seqlen", "batch", "nheads", "nheads_k", "gqa", "causal", "pass", "dtype", "backend",
    "status", "tflops", "median_ms", "p20_ms", "p80_ms", "pct_matmul", "first_call_ms",
    *(f"vs_{b}" for b in BASELINES), "max_err", "err_bound", "note",
)
ENV_COLUMNS = (
    "date", "gpu", "capability", "driver", "cuda", "torch", "triton", "cutlass_dsl", "git_sha", "timer",
    "matmul_tflops", "sm_clock_max_mhz", "power_limit_w",
)
_STATUS_CELL = {"skipped": "skip", "wrong": "WRONG", "error": "error"}


@dataclass
class Result:
    """One measured (or skipped) cell. `speedup[baseline]` = our TFLOP/s / baseline TFLOP/s (ours only)."""

    hdim: int
    hdim_v: int
    seqlen: int
    batch: int
    nheads: int
    nheads_k: int
    causal: bool
    pass_: str
    dtype: str
    backend: str
    status: str
    median_ms: float | None = None
    p20_ms: float | None = None
    p80_ms: float | None = None
    tflops: float | None = None
    pct_matmul: float | None = None
    first_call_ms: float | None = None
    max_err: float | None = None
    err_bound: float | None = None
    note: str = ""
    speedup: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status: expected one of {STATUSES}, got {self.status!r}")

    @property
    def gqa(self) -> int:
        return self.nheads // self.nheads_k

    @property
    def row_key(self) -> tuple:
        return (self.hdim, self.hdim_v, self.gqa, self.seqlen, self.causal, self.pass_)

    def csv_row(self) -> dict[str, str]:
        row = {name: getattr(self, name) for name in RESULT_COLUMNS if hasattr(self, name)}
        row["pass"] = self.pass_
        for b in BASELINES:
            row[f"vs_{b}"] = self.speedup.get(b)
        return {k: _csv_value(v) for k, v in row.items()}


def _csv_value(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def pivot(results: Iterable[Result]) -> list[tuple[tuple, dict[str, Result]]]:
    """Rows of a table, in first-seen order: (hdim, hdim_v, gqa, seqlen, causal, pass) -> {backend: cell}."""
    rows: dict[tuple, dict[str, Result]] = {}
    for r in results:
        rows.setdefault(r.row_key, {})[r.backend] = r
    return list(rows.items())


def fill_speedups(results: Iterable[Result]) -> None:
    """Set each of our ok cells' ratio to every ok baseline cell of the same row (same FLOPs)."""
    for _, cells in pivot(results):
        for ours in (cells.get(b) for b in OURS):
            if ours is None or ours.status != "ok":
                continue
            for b in BASELINES:
                base = cells.get(b)
                if base is not None and base.status == "ok":
                    ours.speedup[b] = base.median_ms / ours.median_ms


def table_layout(results: Iterable[Result]) -> tuple[list[str], list[tuple[str, str]]]:
    """(backends present, in canonical order; (ours, baseline) ratio pairs where both timed something)."""
    results = list(results)
    present = [b for b in BACKENDS if any(r.backend == b for r in results)]
    timed = {r.backend for r in results if r.status == "ok"}
    pairs = [(o, b) for o in OURS if o in timed for b in BASELINES if b in timed]
    return present, pairs


def ours_for_ratio(cells: dict[str, Result]) -> Result | None:
    """The live table's 'ours': auto (what users get), else sm90, else sm80 -- the first that ran."""
    return next((cells[o] for o in OURS if o in cells and cells[o].status == "ok"), None)


def cell_text(r: Result | None, value: Callable[[Result], float | None], fmt: str = "{:.1f}") -> str:
    if r is None:
        return ""
    if r.status != "ok":
        return _STATUS_CELL[r.status]
    v = value(r)
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def key_cells(key: tuple) -> list[str]:
    hdim, hdim_v, gqa, seqlen, causal, pass_ = key
    return [str(hdim) if hdim == hdim_v else f"{hdim}/{hdim_v}", str(gqa), str(seqlen),
            "yes" if causal else "no", PASS_LABEL[pass_]]


KEY_HEADERS = ["hdim", "gqa", "seqlen", "causal", "pass"]


class LiveTable:
    """Rows printed as they complete, prefixed by a [done/total] counter; notes printed once each."""

    def __init__(self, backends: list[str], total: int, stream: TextIO | None = None):
        self.backends = [b for b in BACKENDS if b in backends]
        has_ours = any(b in OURS for b in self.backends)
        self.baselines = [b for b in BASELINES if b in self.backends] if has_ours else []
        self.total, self.done, self.stream = total, 0, stream or sys.stdout
        self._seen_notes: set[str] = set()
        self._status_shown = False
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._counter_width = 2 * len(str(total)) + 3
        self._columns = [(h, w) for h, w in zip(KEY_HEADERS, (7, 3, 6, 6, 7))]
        self._columns += [(b, max(7, len(b))) for b in self.backends]
        self._columns += [(f"ours/{b}", len(b) + 5) for b in self.baselines]

    def _print(self, text: str) -> None:
        if self._status_shown:
            self.stream.write("\r\x1b[K")
            self._status_shown = False
        print(text, file=self.stream, flush=True)

    def header(self) -> None:
        self._print("TFLOP/s per backend (causal counts half the FLOPs)"
                    + ("; ours/x = our TFLOP/s over x's, ours = auto (backend=None), else sm90, else sm80"
                       if self.baselines else ""))
        self._print(" " * self._counter_width + " " + " ".join(h.rjust(w) for h, w in self._columns))

    def row(self, key: tuple, cells: dict[str, Result]) -> None:
        self.done += 1
        values = key_cells(key)
        values += [cell_text(cells.get(b), lambda r: r.tflops) for b in self.backends]
        ours = ours_for_ratio(cells)
        values += [_ratio_text(ours, b) for b in self.baselines]
        counter = f"[{self.done}/{self.total}]".rjust(self._counter_width)
        self._print(counter + " " + " ".join(v.rjust(w) for v, (_, w) in zip(values, self._columns)))

    def note(self, text: str) -> None:
        if text not in self._seen_notes:
            self._seen_notes.add(text)
            self._print(f"    note: {text}")

    def status(self, text: str) -> None:
        """A transient 'working on' line, only on a terminal (logs get the rows alone)."""
        if self._tty:
            self.stream.write("\r\x1b[K" + text[:120])
            self.stream.flush()
            self._status_shown = True


class CsvSink:
    """results.csv, appended one group of rows at a time and flushed, environment on every row."""

    def __init__(self, path: Path, env: dict[str, str]):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._env = {k: _csv_value(env.get(k)) for k in ENV_COLUMNS}
        self._file = open(self.path, "w", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=[*RESULT_COLUMNS, *ENV_COLUMNS])
        self._writer.writeheader()
        self._file.flush()

    def write(self, results: Iterable[Result]) -> None:
        for r in results:
            self._writer.writerow({**r.csv_row(), **self._env})
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> CsvSink:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _md_table(headers: list[str], rows: list[list[str]], right_from: int = 0) -> list[str]:
    align = ["---" if i < right_from else "---:" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return lines


def markdown(results: list[Result], env: dict[str, str], details: list[tuple[str, str]] = ()) -> str:
    """The whole results.md: environment, then TFLOP/s (+ ratios), time, % of matmul, first call, notes."""
    backends, pairs = table_layout(results)
    rows = pivot(results)
    gpu = env.get("gpu", "unknown GPU")
    out = [f"# Attention sweep: {gpu}, {env.get('date', '')}", ""]
    env_rows = [
        ("GPU", f"{gpu} (sm {env.get('capability', '?')}, max SM clock {env.get('sm_clock_max_mhz') or '?'} MHz, "
                f"power limit {env.get('power_limit_w') or '?'} W)"),
        ("driver / CUDA", f"{env.get('driver') or '?'} / {env.get('cuda') or '?'}"),
        ("torch / triton / nvidia-cutlass-dsl",
         f"{env.get('torch') or '?'} / {env.get('triton') or 'not installed'} / {env.get('cutlass_dsl') or 'not installed'}"),
        ("git", env.get("git_sha") or "unknown"),
        ("timer", env.get("timer", "")),
        ("dense matmul", f"{_csv_value(env.get('matmul_tflops')) or '?'} TFLOP/s (8192^3 torch.mm, same run)"),
        *details,
    ]
    out += _md_table(["", ""], [[k, str(v)] for k, v in env_rows], right_from=2) + [""]
    key_h = KEY_HEADERS

    def section(title: str, intro: str, value, fmt: str, with_ratios: bool = False) -> None:
        headers = key_h + backends + ([f"{o}/{b}" for o, b in pairs] if with_ratios else [])
        body = []
        for key, cells in rows:
            line = key_cells(key) + [cell_text(cells.get(b), value, fmt) for b in backends]
            if with_ratios:
                line += [_ratio_text(cells.get(o), b) for o, b in pairs]
            body.append(line)
        out.extend([f"## {title}", "", intro, ""] + _md_table(headers, body, right_from=len(key_h)) + [""])

    section("TFLOP/s", "Causal counts half the FLOPs; bwd counts 2.5x the forward FLOPs, fwd+bwd 3.5x. "
            "`ours/baseline` is our TFLOP/s over the baseline's (above 1: ours is faster). "
            "skip / WRONG / error: see Notes.", lambda r: r.tflops, "{:.1f}", with_ratios=True)
    section("Median time (ms)", "Median of timed calls, with p20-p80 where the timer gives them.",
            _time_with_spread, "{}")
    section("% of dense matmul", "TFLOP/s as a share of the 8192^3 matmul rate measured in the same run.",
            lambda r: r.pct_matmul, "{:.1f}")
    section("First call (ms)", "Wall time of the first call of each config, JIT compile or disk-cache load "
            "included; never part of a median. fwd+bwd = first fwd + first bwd.",
            lambda r: r.first_call_ms, "{:.1f}")
    out += ["## Notes", ""] + (notes_lines(results) or ["None: every cell ran and passed the check."]) + [""]
    return "\n".join(out)


def _ratio_text(ours: Result | None, baseline: str) -> str:
    if ours is None or ours.status != "ok":
        return ""
    return cell_text(ours, lambda r: r.speedup.get(baseline), "{:.2f}")


def _time_with_spread(r: Result) -> str:
    if r.p20_ms is None or r.p80_ms is None or math.isnan(r.p20_ms) or math.isnan(r.p80_ms):
        return f"{r.median_ms:.3f}"
    return f"{r.median_ms:.3f} [{r.p20_ms:.3f}-{r.p80_ms:.3f}]"


def notes_lines(results: Iterable[Result]) -> list[str]:
    groups: dict[tuple[str, str, str], list[Result]] = {}
    for r in results:
        if r.status != "ok":
            groups.setdefault((r.backend, r.status, r.note), []).append(r)
    lines = []
    for (backend, status, note), cells in groups.items():
        passes = [label for p, label in PASS_LABEL.items() if any(c.pass_ == p for c in cells)]
        lines.append(f"- **{backend}** {status} ({len(cells)} cells; {', '.join(passes)}): {note or 'no message'}")
    return lines


def write_markdown(path: Path, results: list[Result], env: dict[str, str], details: list[tuple[str, str]] = ()) -> Path:
    path = Path(path)
    path.write_text(markdown(results, env, details) + "\n")
    return path


def write_plots(out_dir: Path, results: list[Result], env: dict[str, str], dpi: int = 90) -> list[Path] | None:
    """One PNG per (hdim, gqa): TFLOP/s vs seqlen, a panel per (mask, pass), a line per backend.
    Returns None when matplotlib is not importable."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    out_dir = Path(out_dir)
    backends, _ = table_layout(results)
    written = []
    for (hdim, hdim_v, gqa), group in _group(results, lambda r: (r.hdim, r.hdim_v, r.gqa)).items():
        masks = sorted({r.causal for r in group})
        passes = [p for p in PASS_LABEL if any(r.pass_ == p for r in group)]
        fig = Figure(figsize=(4.2 * len(passes), 3.2 * len(masks)), constrained_layout=True)
        FigureCanvasAgg(fig)
        axes = fig.subplots(len(masks), len(passes), squeeze=False, sharex=True)
        seqlens = sorted({r.seqlen for r in group})
        for i, causal in enumerate(masks):
            for j, pass_ in enumerate(passes):
                ax = axes[i][j]
                _plot_panel(ax, [r for r in group if r.causal == causal and r.pass_ == pass_], backends, env)
                ax.set_title(f"{'causal' if causal else 'no mask'}, {PASS_LABEL[pass_]}", fontsize=9)
                ax.set_xscale("log", base=2)
                ax.minorticks_off()
                ax.set_xticks(seqlens)
                ax.set_xticklabels([_seqlen_label(s) for s in seqlens], fontsize=8)
                ax.tick_params(axis="y", labelsize=8)
                ax.grid(True, alpha=0.3)
                if i == len(masks) - 1:
                    ax.set_xlabel("seqlen", fontsize=8)
                if j == 0:
                    ax.set_ylabel("TFLOP/s", fontsize=8)
        head = f"hdim {hdim}" if hdim == hdim_v else f"hdim {hdim}/{hdim_v}"
        dtype = group[0].dtype
        fig.suptitle(f"{env.get('gpu', '')}: {dtype}, {head}, GQA {gqa}, {env.get('date', '')}", fontsize=10)
        legend = {}
        for ax in (ax for row in axes for ax in row):
            for handle, label in zip(*ax.get_legend_handles_labels()):
                legend.setdefault(label, handle)
        if legend:
            axes[0][0].legend(list(legend.values()), list(legend), fontsize=7, loc="lower center", ncol=3)
        name = f"tflops_hdim{hdim}" + (f"x{hdim_v}" if hdim_v != hdim else "") + (f"_gqa{gqa}" if gqa != 1 else "")
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=dpi)
        written.append(path)
    return written


def _plot_panel(ax, cells: list[Result], backends: list[str], env: dict[str, str]) -> None:
    for b in backends:
        pts = sorted((r.seqlen, r.tflops) for r in cells if r.backend == b and r.status == "ok")
        if pts:
            xs, ys = zip(*pts)
            style = {"linewidth": 2.0, "linestyle": "-"} if b in OURS else {"linewidth": 1.2, "linestyle": "--"}
            # One colour per backend in every panel and figure, whatever is missing where.
            ax.plot(xs, ys, marker="o", markersize=3, label=b, color=f"C{BACKENDS.index(b)}", **style)
    try:
        ax.axhline(float(env.get("matmul_tflops")), color="gray", linestyle=":", linewidth=1, label="matmul")
    except (TypeError, ValueError):
        pass
    ax.set_ylim(bottom=0)
    if not ax.lines:
        ax.text(0.5, 0.5, "no results", ha="center", va="center", transform=ax.transAxes, fontsize=8)


def _group(results: Iterable[Result], key: Callable) -> dict:
    groups: dict = {}
    for r in results:
        groups.setdefault(key(r), []).append(r)
    return groups


def _seqlen_label(s: int) -> str:
    return f"{s // 1024}k" if s >= 1024 and s % 1024 == 0 else str(s)


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._]+", "-", text).strip("-") or "unknown-gpu"


def default_out_dir(gpu_name: str, date: str, quick: bool, root: Path = Path("perf/results")) -> Path:
    """perf/results/<gpu>-<date>[-quick], with -2, -3... rather than overwriting an earlier run."""
    base = f"{slug(gpu_name)}-{date}" + ("-quick" if quick else "")
    candidate, n = Path(root) / base, 2
    while (candidate / "results.csv").exists():
        candidate, n = Path(root) / f"{base}-{n}", n + 1
    return candidate


def _run(cmd: list[str], timeout: float = 10) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip()


def _version(dist: str, module: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return str(getattr(__import__(module), "__version__", "?"))
    except Exception:  # absent or unloadable: either way there is no version to report
        return ""


def _git_sha() -> str:
    root = str(Path(__file__).resolve().parent.parent)
    sha = _run(["git", "-C", root, "rev-parse", "--short=12", "HEAD"])
    if not sha:
        return ""
    dirty = _run(["git", "--no-optional-locks", "-C", root, "status", "--porcelain", "--untracked-files=no"])
    return sha + ("-dirty" if dirty else "")


def _nvidia_smi(device: torch.device) -> dict[str, str]:
    fields = ("driver_version", "clocks.max.sm", "power.limit")
    cmd = ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]
    try:
        cmd.append(f"--id=GPU-{torch.cuda.get_device_properties(device).uuid}")
    except Exception:  # older torch without .uuid: nvidia-smi's first GPU is the best guess
        pass
    lines = _run(cmd).splitlines()
    if not lines:
        return {}
    values = [v.strip() for v in lines[0].split(",")]
    return dict(zip(("driver", "sm_clock_max_mhz", "power_limit_w"), values))


def collect_environment(device: torch.device, timer_description: str) -> dict[str, str]:
    major, minor = torch.cuda.get_device_capability(device)
    env = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(device),
        "capability": f"{major}.{minor}",
        "cuda": torch.version.cuda or "",
        "torch": torch.__version__,
        "triton": _version("triton", "triton"),
        "cutlass_dsl": _version("nvidia-cutlass-dsl", "cutlass"),
        "git_sha": _git_sha(),
        "timer": timer_description,
    }
    env.update(_nvidia_smi(device))
    return env
