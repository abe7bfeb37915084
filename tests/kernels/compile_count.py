"""How many graphs torch.compile makes of a function: the kernels' callers must not
recompile for every batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class CountingCompiler:
    """``compile(fn)``: fn under torch.compile (dynamic shapes), graphs run as traced;
    ``count``: how many graphs were made."""

    def __init__(self) -> None:
        torch._dynamo.reset()
        self.count = 0

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        self.count += 1
        return gm.forward

    def compile(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        return torch.compile(fn, backend=self._backend, dynamic=True)
