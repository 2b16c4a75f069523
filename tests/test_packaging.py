"""The installed package is the whole package: ``pyproject.toml`` lists its packages by hand (kernels/
installs as ``flashattn_hopper.kernels``), so a new subpackage missing from the list works in an
editable checkout and breaks every wheel (``flashattn_hopper.backends`` was missing once: ``pip install .``
then failed at import with ModuleNotFoundError)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _package_dirs() -> dict[str, str]:
    """Every directory with an ``__init__.py`` under flashattn_hopper/ and kernels/, by package name."""
    found = {}
    for root, name in (("flashattn_hopper", "flashattn_hopper"), ("kernels", "flashattn_hopper.kernels")):
        for init in sorted((REPO / root).rglob("__init__.py")):
            rel = init.parent.relative_to(REPO / root)
            found[".".join((name, *rel.parts))] = str(Path(root, rel)).replace("\\", "/").rstrip("/.")
    return found


def test_pyproject_lists_every_package():
    if sys.version_info < (3, 11):
        pytest.skip("tomllib needs Python 3.11")
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = _package_dirs()
    assert sorted(config["packages"]) == sorted(dirs), "pyproject.toml [tool.setuptools] packages"
    assert {k: v.rstrip("/") for k, v in config["package-dir"].items()} == dirs, "[tool.setuptools.package-dir]"
