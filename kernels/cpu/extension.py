"""The C++ CPU kernels (``*.cpp`` here), built together on first use as one extension.

Compiled with ``torch.utils.cpp_extension`` into torch's extension cache (about two
minutes here, once per checkout and source version; ``scripts/install`` does it ahead).
Without AVX2 or a C++ compiler, ``available()`` is False and callers keep their
plain-torch path; ``TANDEM_CPU_KERNELS=0`` turns the kernels off.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = ["bf16_linear.cpp", "paged_attention.cpp"]
PANEL = 16  # output columns per packed bf16 panel, as in bf16_linear.cpp
DISABLE_ENV = "TANDEM_CPU_KERNELS"  # "0" turns the kernels off (aten's path everywhere)
# One build directory per checkout (its path hashed into the name): two checkouts would
# otherwise rebuild each other's copy in turn, each build invalidating the other's.
NAME = "tandem_cpu_kernels_" + hashlib.sha1(str(_HERE.resolve()).encode()).hexdigest()[:8]
# torch's build lock has no owner: a process killed mid-build (a worker stopped with
# SIGKILL) leaves it, and every later load waits on it for ever. A build takes about two
# minutes here; a lock older than this is taken for such a leftover and removed.
STALE_LOCK_S = 600.0


@functools.cache
def available() -> bool:
    """Whether the kernels are built and loaded (builds them on the first call)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return False
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        logger.info("CPU kernels not used: this CPU has no AVX2")
        return False
    try:
        from torch.utils import cpp_extension

        with contextlib.suppress(AttributeError, OSError):  # a private torch helper
            _remove_stale_lock(Path(cpp_extension._get_build_directory(NAME, verbose=False)))
        cpp_extension.load(
            name=NAME,
            sources=[str(_HERE / name) for name in SOURCES],
            extra_include_paths=[str(_HERE)],
            extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except Exception as exc:  # no compiler, headers, ninja...: the torch paths still work
        logger.warning(
            "CPU kernels not built (%s); bf16 products and decode attention run on aten, "
            "several times slower. Install a C++ compiler and ninja to get them.",
            exc,
        )
        return False
    _register_fakes()
    return True


def _remove_stale_lock(build_dir: Path) -> None:
    lock = build_dir / "lock"
    try:
        age_s = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age_s > STALE_LOCK_S:
        logger.warning("removing %s, left %.0f s ago by a build that did not finish", lock, age_s)
        lock.unlink(missing_ok=True)


def _register_fakes() -> None:
    """Shapes for torch.compile and the meta device: the ops are opaque to the compiler."""

    @torch.library.register_fake("tandem_cpu::pack_bf16")
    def _(weight: torch.Tensor, dot: bool = False) -> torch.Tensor:
        panels = (weight.shape[0] + PANEL - 1) // PANEL
        if dot:  # pairs of k per column: [panels, K/2, 2 * PANEL]
            return weight.new_empty((panels, weight.shape[1] // 2, 2 * PANEL))
        return weight.new_empty((panels, weight.shape[1], PANEL))

    @torch.library.register_fake("tandem_cpu::bf16_linear")
    def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], n))

    @torch.library.register_fake("tandem_cpu::paged_attention")
    def _(q: torch.Tensor, *args: object) -> torch.Tensor:
        return torch.empty_like(q, memory_format=torch.contiguous_format)
