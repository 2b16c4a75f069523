"""A/B of source trees on one GPU machine: a timing script run against each tree in turn, rounds
alternated, medians compared (not a test).

    python perf/ab_trees.py --tree base=. --tree new=.device/new [--rounds 3] -- perf/prof_bwd.py --hdims 64 128

Each tree is a folder holding ``flashattn_hopper/`` and ``kernels/`` (a checkout, or ``git archive BRANCH
flashattn_hopper kernels | tar -x -C DIR``). Every run is a fresh process with that tree first on
``PYTHONPATH`` (``perf/`` next) and its own ``FLASHATTN_HOPPER_CACHE_DIR`` (so no tree reuses another's
compiled kernels); the package must not be installed in editable mode from another tree (the editable
finder would map ``flashattn_hopper.kernels`` there). Rounds go base, new, ..., base, new, ... so drift
on the machine (clocks, power) spreads over all trees. The script's output lines of the form
``LABEL: ... NAME VALUE us`` are collected (``--metric NAME``, default ``main``: ``perf/prof_bwd.py``'s
main-kernel time); the table shows each tree's median per label and its ratio to the first tree.
Before the rounds, each tree runs the script once untimed (``--no-warm`` skips it): its kernels compile
then, and trees warm up in parallel processes.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path


def tree_env(tree: Path, name: str) -> dict[str, str]:
    """The environment of a run against ``tree``: it first on the path, then ``perf/``; its own cache."""
    env = dict(os.environ)
    perf = Path(__file__).resolve().parent
    env["PYTHONPATH"] = os.pathsep.join([str(tree.resolve()), str(perf), env.get("PYTHONPATH", "")])
    env["FLASHATTN_HOPPER_CACHE_DIR"] = f"/tmp/ab_trees_cache_{name}"
    return env


def run(tree: Path, name: str, script: list[str], metric: str, log: list[str], timeout: float) -> dict[str, float]:
    """One run of the script against ``tree``; its values are printed at once (``# name label value``), so a
    call cut short still leaves the rounds done so far."""
    try:
        done = subprocess.run([sys.executable, *script], env=tree_env(tree, name), capture_output=True, text=True,
                              timeout=timeout)
        out, rc, err = done.stdout, done.returncode, done.stderr
    except subprocess.TimeoutExpired as e:
        out, rc, err = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout", ""
    log.append(f"== {name} rc={rc}\n{out}{err[-2000:] if rc != 0 else ''}")
    values = parse(out, metric)
    for label, value in values.items():
        print(f"# {name} | {label} | {value:.1f}", flush=True)
    return values


def parse(text: str, metric: str) -> dict[str, float]:
    """``{label: value}`` from lines ``LABEL: ... METRIC VALUE ...``."""
    values = {}
    for line in text.splitlines():
        m = re.match(rf"(.+?):.*\b{re.escape(metric)}\s+([0-9.]+)", line)
        if m:
            values[m.group(1).strip()] = float(m.group(2))
    return values


def main() -> None:
    argv = sys.argv[1:]
    script = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", required=True, help="NAME=DIR (the first is the baseline)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--metric", default="main", help="the value's name in the script's lines")
    ap.add_argument("--no-warm", action="store_true")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per run of the script")
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if not script:
        ap.error("give the timing script after --")
    trees = [(t.split("=", 1)[0], Path(t.split("=", 1)[1])) for t in args.tree]
    log: list[str] = []
    if not args.no_warm:
        procs = [subprocess.Popen([sys.executable, *script], env=tree_env(tree, name), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL) for name, tree in trees]
        for p in procs:
            try:
                p.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                p.kill()
    results: dict[str, dict[str, list[float]]] = {name: {} for name, _ in trees}
    for _ in range(args.rounds):
        for name, tree in trees:
            for label, value in run(tree, name, script, args.metric, log, args.timeout).items():
                results[name].setdefault(label, []).append(value)
    base = trees[0][0]
    labels = list(results[base])
    print(f"# {' vs '.join(n for n, _ in trees)}: median {args.metric} over {args.rounds} alternated rounds; "
          f"ratio to {base}")
    print("| shape | " + " | ".join(n for n, _ in trees) + " | " + " | ".join(f"{n}/{base}" for n, _ in trees[1:]) + " |")
    print("|---" * (1 + 2 * len(trees) - 1) + "|")
    for label in labels:
        med = {n: statistics.median(results[n][label]) for n, _ in trees if results[n].get(label)}
        cells = [f"{med[n]:.1f}" if n in med else "-" for n, _ in trees]
        ratios = [f"{med[n] / med[base]:.3f}" if n in med and base in med else "-" for n, _ in trees[1:]]
        print(f"| {label} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    failed = [entry for entry in log if " rc=0\n" not in entry]
    for entry in failed[:4]:
        print(entry, file=sys.stderr)


if __name__ == "__main__":
    main()
