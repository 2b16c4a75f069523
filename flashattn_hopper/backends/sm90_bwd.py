"""Launcher of the Hopper FA3 backward (kernels/common/bwd_pre.py, bwd_sm90.py, bwd_post.py). Not written yet
(after the Hopper forward, issue 4): every problem is refused with a reason."""

from __future__ import annotations

from typing import Any

import torch

from ..jit import KernelKey
from ..validate import AttnProblem
from .common import VarlenArgs

_NOT_YET = "the attention backward is not implemented yet on the sm90 backend (after the Hopper forward, issue 4)"


class BwdSm90:
    backend = "sm90"
    kind = "bwd_sm90"

    def can_implement(self, p: AttnProblem, deterministic: bool) -> str | None:
        return _NOT_YET

    def all_keys(self, arch: str) -> list[KernelKey]:
        return []

    def compile(self, key: KernelKey, options: str | None = None) -> Any:
        raise NotImplementedError(_NOT_YET)

    def backward(
        self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, p: AttnProblem, varlen: VarlenArgs | None, deterministic: bool,
        dq: torch.Tensor | None = None, dk: torch.Tensor | None = None, dv: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError(_NOT_YET)
