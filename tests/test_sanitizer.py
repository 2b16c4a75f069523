"""compute-sanitizer over every kernel family (GPU tier, its own group; not in CI).

    python -m pytest -m sanitizer

memcheck and racecheck each run once over all of ``tests/sanitizer_cases.py`` (small calls of the
sm90 forward dense / varlen x non-causal / causal / local, clusters, pack_gqa, softcap; the sm80
forward and backward likewise; the default forward + backward path) and must report zero errors
and zero hazards. The kernels are compiled first in a plain process into a cache shared by both
tools, so the sanitized processes only load them. Marked ``slow`` too, so the fast tier skips it;
about 3 minutes on an H100.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from ._subprocess import REPO, subprocess_env

pytestmark = [pytest.mark.gpu, pytest.mark.sanitizer, pytest.mark.slow]

# What each tool prints when it found nothing.
CLEAN = {
    "memcheck": re.compile(r"ERROR SUMMARY: 0 errors"),
    "racecheck": re.compile(r"RACECHECK SUMMARY: 0 hazards displayed \(0 errors, 0 warnings\)"),
}


@pytest.fixture(scope="module")
def case_env(tmp_path_factory):
    """The environment of the sanitized runs, its disk cache filled by one plain run of every case."""
    if shutil.which("compute-sanitizer") is None:
        pytest.skip("compute-sanitizer is not on PATH (it ships with the CUDA toolkit)")
    env = subprocess_env(FLASHATTN_HOPPER_CACHE_DIR=str(tmp_path_factory.mktemp("sanitizer-cache")))
    env.pop("FLASHATTN_HOPPER_CACHE", None)
    plain = subprocess.run([sys.executable, "-m", "tests.sanitizer_cases"], env=env, cwd=REPO,
                           capture_output=True, text=True, timeout=900)
    assert plain.returncode == 0, plain.stdout[-2000:] + plain.stderr[-4000:]
    return env


@pytest.mark.parametrize("tool", list(CLEAN))
def test_every_kernel_family_is_clean_under(case_env, tool):
    cmd = ["compute-sanitizer", "--tool", tool, "--report-api-errors", "no", "--error-exitcode", "99",
           sys.executable, "-m", "tests.sanitizer_cases"]
    run = subprocess.run(cmd, env=case_env, cwd=REPO, capture_output=True, text=True, timeout=900)
    output = run.stdout + run.stderr
    # The case runner prints "case <name>" before each case: a report follows the case that made it.
    lines = [ln for ln in output.splitlines() if ln.startswith("case ") or "Error" in ln or "Race" in ln]
    assert run.returncode == 0 and CLEAN[tool].search(output), (
        f"{tool} found problems (exit {run.returncode}):\n" + "\n".join(lines[:80]) + "\n" + output[-3000:]
    )
