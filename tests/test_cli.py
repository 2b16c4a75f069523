"""The command line and the main job's output without a GPU (CPU tier, nothing compiled: a stand-in
compile cache answers every kernel at once)."""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest

from flashattn_hopper import cli, dispatch, jit

from ._subprocess import REPO

WIDTH = 120


class _InstantCache:
    """compile_cache stand-in: every kernel 'compiles' in no time, one event each as the real one records."""

    def __init__(self) -> None:
        self.stats = jit.CacheStats()

    def get(self, key, build):
        self.stats.compiles += 1
        self.stats.events.append((key.name, "compile", 0.0))
        return object()


@pytest.fixture
def no_compile(monkeypatch):
    monkeypatch.setattr(jit, "compile_cache", _InstantCache())
    monkeypatch.setattr(cli, "_set_target_arch", lambda target: None)  # the DSL may be set up for another arch


def _all_helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    helps = {"": parser.format_help()}
    for action in parser._subparsers._group_actions:
        for name, sub in action.choices.items():
            helps[name] = sub.format_help()
    return helps


def test_help_is_plain_text():
    for name, text in _all_helps(cli.build_parser()).items():
        for markup in ("``", ":class:", ":func:", ".. "):
            assert markup not in text, (name, markup, text)


def test_cache_without_action_lists():
    assert cli.build_parser().parse_args(["cache"]).action == "info"
    assert cli.build_parser().parse_args(["cache", "clear"]).action == "clear"


@pytest.mark.parametrize("target", sorted(dispatch.BACKENDS_FOR_TARGET))
def test_progress_lines_fit_120_columns(target):
    """Every kernel precompile builds, at its worst: the last of the list, FAILED, 999 s."""
    keys = [(f, k) for b in dispatch.BACKENDS_FOR_TARGET[target] for f in dispatch.families(b) for k in f.all_keys(target)]
    for family, key in keys:
        row = {"status": "FAILED", "source": "compile", "seconds": 999.99, "display_name": key.display_name}
        line = cli.progress_line(len(keys), len(keys), row)
        assert len(line) <= WIDTH, line
    for family in {f for f, _ in keys}:
        header = cli.family_header(family, target, [k for f, k in keys if f is family])
        assert all(len(line) <= WIDTH for line in header.splitlines()), header


def test_ampere_kernels_on_hopper_are_explained():
    fwd, bwd = dispatch.FWD_KERNELS["sm80"], dispatch.BWD_KERNELS["sm80"]
    fwd_header = cli.family_header(fwd, "sm_90a", fwd.all_keys("sm_90a"))
    bwd_header = cli.family_header(bwd, "sm_90a", bwd.all_keys("sm_90a"))
    assert "Ampere forward built for Hopper" in fwd_header and "does not cover" in fwd_header
    assert "Ampere backward built for Hopper" in bwd_header and "backward" in bwd_header
    assert "Hopper" not in cli.family_header(fwd, "sm_80", fwd.all_keys("sm_80"))


def test_precompile_output_and_report(no_compile, isolated_cache, tmp_path, capsys):
    report_path = tmp_path / "report.json"
    status = cli.cmd_precompile(argparse.Namespace(arch="sm90", hdim=None, dtype=None, report=str(report_path)))
    assert status == 0
    out = capsys.readouterr().out.splitlines()
    assert all(len(line) <= WIDTH for line in out), max(out, key=len)
    report = json.loads(report_path.read_text())
    expected = sum(len(f.all_keys("sm_90a")) for b in dispatch.BACKENDS_FOR_TARGET["sm_90a"] for f in dispatch.families(b))
    assert report["arch"] == "sm90" and len(report["kernels"]) == expected
    assert {"kernel", "display_name", "status", "source", "seconds"} <= set(report["kernels"][0])
    assert out[-2].startswith(f"precompile --arch sm90: {expected} kernels in ") and out[-1].startswith("cache dir ")
    assert any(line.startswith("-- fwd_sm80 for sm_90a") for line in out)


def _load_run_py():
    spec = importlib.util.spec_from_file_location("perf_run", REPO / "perf" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_main_job_without_gpu_states_time_fits_120_columns_and_ends_with_total(no_compile, isolated_cache, monkeypatch,
                                                                               capsys):
    """perf/run.py with no GPU, its two precompile processes run in this process instead."""
    run = _load_run_py()

    def precompile_in_process(argv):
        assert argv[1:4] == ["-m", "flashattn_hopper", "precompile"]
        return cli.main(argv[3:])

    monkeypatch.setattr(run.subprocess, "call", precompile_in_process)
    assert run.precompile_all() == 0
    out = capsys.readouterr().out.splitlines()
    assert all(len(line) <= WIDTH for line in out), max(out, key=len)
    assert "Expect 10-15 minutes" in out[2]
    total = sum(len(f.all_keys(t)) for a, t in dispatch.PRECOMPILE_TARGETS.items()
                for b in dispatch.BACKENDS_FOR_TARGET[t] for f in dispatch.families(b))
    assert out[-1].startswith(f"== total: {total} kernels (sm90: "), out[-1]
    assert f"{total} compiled, 0 already cached, 0 failed" in out[-1]
    sm90_section = next(i for i, line in enumerate(out) if line.startswith("== precompile --arch sm90"))
    assert "Ampere kernels built for Hopper" in out[sm90_section] + out[sm90_section + 1]
