"""flashattn_hopper: FlashAttention-3-class exact attention for NVIDIA Hopper, with an FA2 path for Ampere.

Kernels are written in the CuTe DSL, JIT-compiled at first use and cached in memory and on disk.
"""

import importlib.util as _importlib_util
import sys as _sys
from pathlib import Path as _Path


def _checkout_kernels() -> None:
    """Make ``flashattn_hopper.kernels`` importable straight from a source checkout.

    The repository keeps the kernels in a top-level ``kernels/`` that installs as
    ``flashattn_hopper.kernels``. When the checkout itself is first on ``sys.path`` (pytest's rootdir,
    ``PYTHONPATH=.``, or an editable install whose mapping the local setuptools does not honour),
    the subpackage would be missing; register it from the sibling folder in that case only.
    """
    name = __name__ + ".kernels"
    here = _Path(__file__).resolve().parent
    sibling = here.parent / "kernels"
    if name in _sys.modules or (here / "kernels").is_dir() or not (sibling / "__init__.py").is_file():
        return
    if _importlib_util.find_spec(name) is not None:
        return
    spec = _importlib_util.spec_from_file_location(name, sibling / "__init__.py", submodule_search_locations=[str(sibling)])
    if spec is None or spec.loader is None:
        return
    module = _importlib_util.module_from_spec(spec)
    _sys.modules[name] = module
    spec.loader.exec_module(module)


_checkout_kernels()

from .api import flash_attn_func, flash_attn_varlen_func  # noqa: E402

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]
__version__ = "0.1.0"
