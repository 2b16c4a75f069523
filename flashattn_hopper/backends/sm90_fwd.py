"""Launcher of the Hopper FA3 forward (kernels/fwd_sm90.py). Not written yet (issue 4): every problem
is refused with a reason, so automatic dispatch on Hopper uses the sm80 kernels meanwhile."""

from __future__ import annotations

from typing import Any

import torch

from ..jit import KernelKey
from ..validate import AttnProblem
from .common import VarlenArgs


class FwdSm90:
    backend = "sm90"
    kind = "fwd_sm90"

    def can_implement(self, p: AttnProblem) -> str | None:
        return "the Hopper (sm90) forward kernel is not implemented yet; backend='sm80' runs on Hopper"

    def all_keys(self, arch: str) -> list[KernelKey]:
        return []

    def compile(self, key: KernelKey, options: str | None = None) -> Any:
        raise NotImplementedError(self.can_implement(None))  # type: ignore[arg-type]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnProblem, varlen: VarlenArgs | None,
        out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError(self.can_implement(p))
