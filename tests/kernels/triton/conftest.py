"""The Triton kernels' tests: on CPU through Triton's interpreter, on CUDA compiled.

``TRITON_INTERPRET=1`` is read when a kernel is defined, so it is set here, before any test
module imports ``kernels.triton``. Tests marked ``gpu`` skip without CUDA, with the reason.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    early = sorted(m for m in sys.modules if m.startswith("kernels.triton."))
    if early and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"{early} imported before TRITON_INTERPRET=1 was set: their kernels would compile "
            "for a GPU this machine lacks; import kernels.triton lazily"
        )
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.skip("needs CUDA: bf16 and real shapes run compiled on a GPU only")


@pytest.fixture
def device() -> torch.device:
    """CUDA where there is one (compiled kernels), else the CPU (the interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
