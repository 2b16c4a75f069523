"""Environment for tests that run the package in fresh processes."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def subprocess_env(**extra: str) -> dict[str, str]:
    """This environment with the checkout first on PYTHONPATH (keeping what the parent had: the GPU
    machine puts the DSL there), plus ``extra``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env
