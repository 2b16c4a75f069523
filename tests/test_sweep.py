"""CPU tier tests of the perf sweep: options, FLOP counting, shapes, the correctness gate, CSV /
Markdown / plot writing from synthetic timings, and the no-GPU exit. No GPU and no timing: a fake
timer stands in for do_bench, and small PyTorch functions stand in for our kernels."""

from __future__ import annotations

import argparse
import csv
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flashattn_hopper import sweep
from flashattn_hopper.sweep.backends import Skip, check_slice, describe_failure
from flashattn_hopper.sweep.report import (
    ENV_COLUMNS,
    RESULT_COLUMNS,
    CsvSink,
    Result,
    default_out_dir,
    fill_speedups,
    markdown,
    write_plots,
)
from flashattn_hopper.sweep.timing import DoBenchTimer, Timing, quantile

CPU = torch.device("cpu")
ENV = {"gpu": "Test GPU 80GB", "date": "2026-01-02", "torch": "2.x", "git_sha": "abc123", "matmul_tflops": 800.0,
       "timer": "fake"}


def parse(*argv: str) -> sweep.SweepConfig:
    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    return sweep.resolve_config(parser.parse_args(list(argv)))


# Options


def test_defaults_are_the_full_sweep():
    cfg = parse()
    assert cfg.hdims == (64, 128, 256)
    assert cfg.seqlens == (512, 1024, 2048, 4096, 8192, 16384)
    assert cfg.causal == (False, True)
    assert cfg.passes == ("fwd", "bwd", "fwdbwd")
    assert cfg.gqa == (1,)
    assert cfg.backends == ("auto", "sm90", "sm80", "cudnn", "flash", "efficient")
    assert (cfg.dtype, cfg.tokens, cfg.hidden, cfg.plots, cfg.quick, cfg.out) == ("bf16", 16384, 2048, True, False, None)


def test_quick_mode_is_a_handful_of_shapes_and_explicit_options_win():
    cfg = parse("--quick")
    assert (cfg.hdims, cfg.seqlens, cfg.causal, cfg.passes) == ((128,), (1024, 8192), (False, True), ("fwd",))
    shapes, _ = cfg.plan()
    assert len(shapes) * len(cfg.causal) * len(cfg.passes) == 4
    cfg = parse("--quick", "--passes", "bwd", "--hdims", "64")
    assert (cfg.hdims, cfg.passes, cfg.seqlens) == ((64,), ("bwd",), (1024, 8192))


def test_options_are_parsed_deduplicated_and_put_in_canonical_order():
    cfg = parse("--hdims", "128", "64", "128", "--seqlens", "1k", "4096", "16K", "--causal", "on",
                "--passes", "fwdbwd", "fwd", "--dtype", "fp16", "--gqa", "4", "--backends", "flash", "sm90",
                "--hdim-v", "64", "--out", "somewhere", "--no-plots", "--rep-ms", "50")
    assert cfg.hdims == (128, 64)
    assert cfg.seqlens == (1024, 4096, 16384)
    assert cfg.causal == (True,)
    assert cfg.passes == ("fwd", "fwdbwd")
    assert cfg.backends == ("sm90", "flash")
    assert (cfg.dtype, cfg.torch_dtype, cfg.gqa, cfg.hdim_v) == ("fp16", torch.float16, (4,), 64)
    assert (cfg.out, cfg.plots, cfg.rep_ms) == (Path("somewhere"), False, 50.0)


@pytest.mark.parametrize("argv", [["--seqlens", "abc"], ["--hdims", "0"], ["--causal", "maybe"],
                                  ["--passes", "sideways"], ["--backends", "xformers"], ["--rep-ms", "-1"]])
def test_bad_options_are_rejected_by_the_parser(argv, capsys):
    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(argv)
    assert "error" in capsys.readouterr().err


def test_recorded_command_repeats_the_sweep():
    cfg = parse("--hdims", "256", "--seqlens", "2k", "--causal", "off", "--passes", "bwd", "--gqa", "2", "8",
                "--backends", "sm80", "cudnn", "--tokens", "8192", "--hdim-v", "128")
    argv = cfg.command().split()
    assert argv[:4] == ["python", "-m", "flashattn_hopper", "sweep"]
    assert parse(*argv[4:]) == cfg


# FLOPs and shapes


def test_flops_forward_non_causal():
    assert sweep.attention_flops(2, 16, 1024, 1024, 128) == 4 * 2 * 16 * 1024 * 1024 * 128


def test_flops_causal_counts_half():
    full = sweep.attention_flops(4, 8, 4096, 4096, 64)
    assert sweep.attention_flops(4, 8, 4096, 4096, 64, causal=True) == full / 2


@pytest.mark.parametrize("pass_, factor", [("fwd", 1.0), ("bwd", 2.5), ("fwdbwd", 3.5)])
def test_flops_backward_factors(pass_, factor):
    fwd = sweep.attention_flops(1, 16, 2048, 2048, 128, causal=True)
    assert sweep.attention_flops(1, 16, 2048, 2048, 128, causal=True, pass_=pass_) == fwd * factor


def test_flops_hdim_v_counts_qk_and_pv_separately():
    assert sweep.attention_flops(1, 2, 100, 300, 192, 128) == 2 * 1 * 2 * 100 * 300 * (192 + 128)
    assert sweep.attention_flops(1, 2, 100, 300, 128, 128) == sweep.attention_flops(1, 2, 100, 300, 128)


def test_flops_rejects_unknown_pass():
    with pytest.raises(ValueError, match="pass_"):
        sweep.attention_flops(1, 1, 1, 1, 64, pass_="forward")


@pytest.mark.parametrize("hdim, seqlen, batch, nheads", [(64, 512, 32, 32), (128, 8192, 2, 16), (256, 16384, 1, 8)])
def test_shapes_follow_the_fa3_paper(hdim, seqlen, batch, nheads):
    shape = sweep.make_shape(hdim, seqlen)
    assert (shape.batch, shape.nheads, shape.nheads_k, shape.hdim_v) == (batch, nheads, nheads, hdim)
    assert shape.batch * shape.seqlen == 16384 and shape.nheads * shape.hdim == 2048


def test_gqa_shapes_and_impossible_combinations():
    shape = sweep.make_shape(128, 1024, gqa=4)
    assert (shape.nheads, shape.nheads_k, shape.gqa) == (16, 4, 4)
    with pytest.raises(ValueError, match="GQA 16"):
        sweep.make_shape(256, 1024, gqa=16)
    shapes, notes = parse("--hdims", "64", "256", "--gqa", "16", "--seqlens", "1k").plan()
    assert [(s.hdim, s.nheads, s.nheads_k) for s in shapes] == [(64, 32, 2)]
    assert len(notes) == 1 and "hdim 256" in notes[0]


def test_check_slice_takes_the_last_batch_element_and_whole_kv_groups():
    mha = check_slice(sweep.make_shape(128, 1024))
    assert (mha.batch, mha.q_heads, mha.kv_heads) == (15, range(14, 16), range(14, 16))
    gqa = check_slice(sweep.make_shape(128, 1024, gqa=4))
    assert (gqa.q_heads, gqa.kv_heads) == (range(12, 16), range(3, 4))


# Failure classification and timers


def test_failures_become_skipped_or_error_notes():
    assert describe_failure(NotImplementedError("no bwd yet"), "sm80") == ("skipped", "not implemented: no bwd yet")
    assert describe_failure(ValueError("hdim 512 too big"), "sm90")[0] == "skipped"
    assert describe_failure(Skip("no SDPBackend.CUDNN_ATTENTION"), "cudnn")[0] == "skipped"
    assert describe_failure(RuntimeError("illegal memory access"), "sm90")[0] == "error"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.warn("Flash attention kernel not used because:")
        warnings.warn("Flash attention requires q, k, v to have the same last dimension")
    status, note = describe_failure(RuntimeError("No available kernel. Aborting execution."), "flash", seen)
    assert status == "skipped"
    assert note == "no SDPA kernel for these inputs: Flash attention requires q, k, v to have the same last dimension"


def test_quantile_interpolates_like_torch():
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    for q in (0.0, 0.2, 0.5, 0.8, 1.0):
        assert quantile(values, q) == pytest.approx(torch.quantile(torch.tensor(values), q).item())


def test_do_bench_timer_asks_for_median_and_quantiles():
    calls = []

    def do_bench(fn, warmup=25, rep=100, grad_to_none=None, quantiles=None, return_mode="mean"):
        calls.append((warmup, rep, grad_to_none, quantiles, return_mode))
        fn()
        return [2.0, 1.5, 2.5]

    x = torch.zeros(1, requires_grad=True)
    timing = DoBenchTimer(do_bench, 10, 40)(lambda: None, grad_to_none=[x])
    assert timing == Timing(2.0, 1.5, 2.5)
    assert calls == [(10, 40, [x], [0.5, 0.2, 0.8], "median")]


def test_do_bench_timer_handles_older_triton_signatures():
    def old_do_bench(fn, warmup=25, rep=100, grad_to_none=None, percentiles=(0.2, 0.8)):
        return (3.0, 2.0, 4.0)

    def plain_do_bench(fn, warmup=25, rep=100, grad_to_none=None):
        return 7.0

    assert DoBenchTimer(old_do_bench, 25, 100)(lambda: None) == Timing(3.0, 2.0, 4.0)
    timing = DoBenchTimer(plain_do_bench, 25, 100)(lambda: None)
    assert timing.median_ms == 7.0 and math.isnan(timing.p20_ms)


# Reports from synthetic timings


def _synthetic_results() -> list[Result]:
    shape = sweep.make_shape(128, 4096)
    flops = sweep.attention_flops(shape.batch, shape.nheads, 4096, 4096, 128, causal=True)

    def ok(backend, ms, pass_="fwd"):
        tflops = flops * sweep.PASS_FLOP_FACTOR[pass_] / (ms * 1e-3) / 1e12
        return Result(128, 128, 4096, shape.batch, shape.nheads, shape.nheads_k, True, pass_, "bf16", backend, "ok",
                      median_ms=ms, p20_ms=ms * 0.99, p80_ms=ms * 1.01, tflops=tflops, pct_matmul=tflops / 8,
                      first_call_ms=4321.0, max_err=1e-3, err_bound=4e-3)

    def bad(backend, status, note, pass_="fwd"):
        return Result(128, 128, 4096, shape.batch, shape.nheads, shape.nheads_k, True, pass_, "bf16", backend, status,
                      note=note)

    results = [ok("sm90", 1.0), bad("sm80", "wrong", "out: max|ours-ref| 0.5 > bound 0.01"), ok("cudnn", 1.25),
               ok("flash", 2.0), bad("efficient", "skipped", "no SDPA kernel | for these inputs"),
               bad("sm90", "skipped", "not implemented: no backward", "bwd"), ok("cudnn", 3.0, "bwd")]
    fill_speedups(results)
    return results


def test_speedups_are_ratios_of_medians_for_our_backends_only():
    results = _synthetic_results()
    sm90 = results[0]
    assert sm90.speedup == pytest.approx({"cudnn": 1.25, "flash": 2.0})
    assert sm90.speedup["cudnn"] == pytest.approx(sm90.tflops / results[2].tflops)
    assert all(not r.speedup for r in results[1:])


def test_csv_round_trip(tmp_path):
    results = _synthetic_results()
    path = tmp_path / "out" / "results.csv"
    with CsvSink(path, ENV) as sink:
        sink.write(results[:3])
        sink.write(results[3:])
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames == [*RESULT_COLUMNS, *ENV_COLUMNS]
    assert len(rows) == len(results)
    sm90, sm80 = rows[0], rows[1]
    assert (sm90["backend"], sm90["status"], sm90["pass"], sm90["causal"], sm90["hdim"]) == ("sm90", "ok", "fwd", "True", "128")
    assert float(sm90["tflops"]) == pytest.approx(results[0].tflops, rel=1e-5)
    assert float(sm90["median_ms"]) == 1.0 and float(sm90["first_call_ms"]) == 4321.0
    assert float(sm90["vs_cudnn"]) == pytest.approx(1.25) and sm90["vs_efficient"] == ""
    assert (sm80["status"], sm80["tflops"], sm80["median_ms"]) == ("wrong", "", "")
    assert sm80["note"].startswith("out: max|ours-ref|")
    for row in rows:
        assert (row["gpu"], row["date"], row["git_sha"], float(row["matmul_tflops"])) == (
            "Test GPU 80GB", "2026-01-02", "abc123", 800.0)


def test_markdown_tables_and_notes():
    results = _synthetic_results()
    md = markdown(results, ENV, [("command", "`python -m flashattn_hopper sweep --quick`")])
    lines = md.splitlines()
    assert lines[0] == "# Attention sweep: Test GPU 80GB, 2026-01-02"
    for title in ("## TFLOP/s", "## Median time (ms)", "## % of dense matmul", "## First call (ms)", "## Notes"):
        assert title in lines
    header = next(l for l in lines if l.startswith("| hdim |"))
    assert header == ("| hdim | gqa | seqlen | causal | pass | sm90 | sm80 | cudnn | flash | efficient | "
                      "sm90/cudnn | sm90/flash |")
    fwd_row = next(l for l in lines if l.startswith("| 128 | 1 | 4096 | yes | fwd |"))
    cells = [c.strip() for c in fwd_row.strip("|").split("|")]
    assert cells[5:] == [f"{results[0].tflops:.1f}", "WRONG", f"{results[2].tflops:.1f}",
                         f"{results[3].tflops:.1f}", "skip", "1.25", "2.00"]
    assert "| 1.000 [0.990-1.010] |" in md and "| 4321.0 |" in md
    assert "- **sm80** wrong (1 cells; fwd): out: max|ours-ref| 0.5 > bound 0.01" in lines
    assert "- **sm90** skipped (1 cells; bwd): not implemented: no backward" in lines
    assert "`python -m flashattn_hopper sweep --quick`" in md


def test_plots_are_written_when_matplotlib_is_there(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is optional (plots only); not installed here")
    paths = write_plots(tmp_path, _synthetic_results(), ENV)
    assert [p.name for p in paths] == ["tflops_hdim128.png"]
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_are_skipped_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    assert write_plots(tmp_path, _synthetic_results(), ENV) is None
    assert list(tmp_path.iterdir()) == []


def test_results_folder_is_named_after_gpu_and_date_and_never_overwritten(tmp_path):
    first = default_out_dir("NVIDIA H100 80GB HBM3", "2026-01-02", quick=False, root=tmp_path)
    assert first == tmp_path / "NVIDIA-H100-80GB-HBM3-2026-01-02"
    first.mkdir()
    (first / "results.csv").write_text("")
    assert default_out_dir("NVIDIA H100 80GB HBM3", "2026-01-02", False, tmp_path).name.endswith("2026-01-02-2")
    assert default_out_dir("NVIDIA H100 80GB HBM3", "2026-01-02", True, tmp_path).name.endswith("2026-01-02-quick")


# The loop, end to end on CPU with stand-ins


class FakeTimer:
    """Calls fn once (so the timed closures run) and reports 1 ms."""

    description = "fake timer"

    def __call__(self, fn, grad_to_none=()):
        for t in grad_to_none:
            t.grad = None
        fn()
        return Timing(1.0, 0.9, 1.1)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * 1.5


def _sdpa_bshd(q, k, v, causal):
    gqa = q.shape[2] != k.shape[2]
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal, enable_gqa=gqa)
    return out.transpose(1, 2)


def stand_in(q, k, v, *, causal, backend):
    """sm90: not written yet; sm80: right forward, wrong gradients."""
    if backend == "sm90":
        raise NotImplementedError("the sm90 forward is not written yet")
    return _ScaleGrad.apply(_sdpa_bshd(q, k, v, causal))


def wrong_forward(q, k, v, *, causal, backend):
    return _sdpa_bshd(q, k, v, causal) * 1.05


def _tiny(*extra: str) -> sweep.SweepConfig:
    return parse("--hdims", "32", "--seqlens", "32", "64", "--tokens", "128", "--hidden", "64", *extra)


def _run(cfg, tmp_path, attn_fn, capsys=None):
    outcome = sweep.sweep(cfg, device=CPU, timer=FakeTimer(), env=ENV, out_dir=tmp_path, matmul_tflops=800.0,
                          attn_fn=attn_fn)
    return outcome, {(r.seqlen, r.causal, r.pass_, r.backend): r for r in outcome.results}


def test_sweep_checks_before_timing_and_records_every_cell(tmp_path, capsys):
    cfg = _tiny("--gqa", "2", "--causal", "on")
    outcome, cells = _run(cfg, tmp_path, stand_in)
    assert outcome.aborted is None
    assert len(outcome.results) == 2 * 3 * 6  # seqlens x passes x backends (auto, sm90, sm80 + 3 SDPA)
    sm80_fwd = cells[(64, True, "fwd", "sm80")]
    shape = sweep.make_shape(32, 64, 2, tokens=128, hidden=64)
    flops = sweep.attention_flops(shape.batch, shape.nheads, 64, 64, 32, causal=True)
    assert sm80_fwd.status == "ok" and sm80_fwd.tflops == pytest.approx(flops / 1e-3 / 1e12)
    assert sm80_fwd.pct_matmul == pytest.approx(100 * sm80_fwd.tflops / 800.0)
    assert sm80_fwd.first_call_ms > 0 and sm80_fwd.max_err <= sm80_fwd.err_bound
    for pass_ in ("bwd", "fwdbwd"):  # right output, wrong gradients: no speed
        cell = cells[(64, True, pass_, "sm80")]
        assert cell.status == "wrong" and cell.tflops is None and cell.note.startswith("dq:")
    assert {cells[(32, True, p, "sm90")].note for p in cfg.passes} == {"not implemented: the sm90 forward is not written yet"}
    assert all(cells[(32, True, p, "flash")].status == "ok" for p in cfg.passes)  # SDPA's flash kernel runs on CPU
    assert cells[(32, True, "fwd", "sm80")].speedup == {"flash": 1.0}
    assert all(cells[(32, True, p, b)].status == "skipped" for p in cfg.passes for b in ("cudnn", "efficient"))
    rows = list(csv.DictReader(open(tmp_path / "results.csv", newline="")))
    assert len(rows) == len(outcome.results)
    out = capsys.readouterr().out
    assert "[6/6]" in out and "note: sm90 fwd, bwd, fwd+bwd: skipped: not implemented" in out


def test_a_wrong_forward_never_gets_a_speed(tmp_path):
    _, cells = _run(_tiny("--passes", "fwd", "--backends", "sm80", "--causal", "off"), tmp_path, wrong_forward)
    for seqlen in (32, 64):
        cell = cells[(seqlen, False, "fwd", "sm80")]
        assert cell.status == "wrong" and cell.median_ms is None and cell.max_err > cell.err_bound


def test_a_broken_device_stops_the_sweep_and_keeps_what_it_measured(tmp_path, monkeypatch):
    calls = []

    def device_breaks_after_second_backend(device):
        calls.append(device)
        if len(calls) == 2:
            raise sweep.SweepAborted("the GPU context is unusable")

    monkeypatch.setattr(sweep, "_ensure_device_usable", device_breaks_after_second_backend)
    cfg = _tiny("--passes", "fwd", "--backends", "sm80", "flash", "--causal", "off")
    outcome, _ = _run(cfg, tmp_path, stand_in)
    assert outcome.aborted == "the GPU context is unusable"
    assert [(r.seqlen, r.backend, r.status) for r in outcome.results] == [(32, "sm80", "ok"), (32, "flash", "ok")]
    assert len(list(csv.DictReader(open(tmp_path / "results.csv", newline="")))) == 2


def test_missing_package_entry_point_skips_our_backends(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "load_attn_fn", lambda: (None, "flashattn_hopper.flash_attn_func could not be imported"))
    outcome, _ = _run(_tiny("--passes", "fwd", "--backends", "sm90", "flash", "--causal", "off"), tmp_path, None)
    ours = [r for r in outcome.results if r.backend == "sm90"]
    assert ours and all(r.status == "skipped" and "could not be imported" in r.note for r in ours)
    assert all(r.status == "ok" for r in outcome.results if r.backend == "flash")


def test_run_reports_and_fails_when_a_cell_is_wrong(tmp_path, monkeypatch, capsys):
    """run() around a stand-in sweep: what it prints, writes and returns (no GPU touched)."""
    monkeypatch.setattr(sweep, "gpu_problem", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(sweep, "make_timer", lambda *args: FakeTimer())
    monkeypatch.setattr(sweep, "collect_environment", lambda device, timer: dict(ENV, capability="9.0"))
    monkeypatch.setattr(sweep, "matmul_tflops", lambda *args: 800.0)
    monkeypatch.setattr(sweep, "sweep", lambda cfg, **kw: sweep.SweepOutcome(_synthetic_results()))
    assert sweep.main(["--quick", "--out", str(tmp_path), "--no-plots"]) == 1
    out = capsys.readouterr().out
    assert "dense bf16 matmul 8192^3: 800.0 TFLOP/s" in out
    assert "4 timed, 2 skipped, 1 wrong, 0 failed" in out
    md = (tmp_path / "results.md").read_text()
    assert "--hdims 128 --seqlens 1024 8192 --causal both --passes fwd" in md
    assert list(tmp_path.glob("*.png")) == []


# Without a GPU


def test_no_gpu_explains_itself_and_exits_non_zero(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sweep.main(["--quick"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU found" in err and "needs a CUDA GPU" in err
    assert "python -m flashattn_hopper precompile" in err


def test_cli_subcommand_reaches_the_sweep(monkeypatch, capsys):
    from flashattn_hopper import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["sweep", "--quick", "--hdims", "64"]) == 2
    assert "no CUDA GPU found" in capsys.readouterr().err
