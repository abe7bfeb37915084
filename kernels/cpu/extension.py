"""The C++ CPU kernels (``*.cpp`` here), built together as one extension.

``python -m kernels.cpu.extension`` builds it into torch's extension cache (about two
minutes here, once per checkout and source version; ``scripts/install`` runs it), with a
stamp beside the library of what it was built from: sources, flags, torch, Python and
compiler. Serving workers never build it (``load(build=False)``): one that finds it
missing or stale says so in one line, naming that command, and runs on aten's products.
Library use and tests build it on first use (``available()``). Without AVX2 or a C++
compiler, ``available()`` is False and callers keep their plain-torch path;
``TANDEM_CPU_KERNELS=0`` turns the kernels off.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = [
    "bf16_linear.cpp",
    "paged_attention.cpp",
    "fp8_dequant.cpp",
    "gguf_linear.cpp",
    "lora_sgmv.cpp",
]
HEADERS = ["vec.h"]  # included by the sources: in the stamp, not compiled on their own
PANEL = 16  # output columns per packed bf16 panel, as in bf16_linear.cpp
DISABLE_ENV = "TANDEM_CPU_KERNELS"  # "0" turns the kernels off (aten's path everywhere)
BUILD_COMMAND = "python -m kernels.cpu.extension"
# One build directory per checkout (its path hashed into the name): two checkouts would
# otherwise rebuild each other's copy in turn, each build invalidating the other's.
NAME = "tandem_cpu_kernels_" + hashlib.sha1(str(_HERE.resolve()).encode()).hexdigest()[:8]
BUILD_WAIT_S = 900.0  # how long a build waits for another live process's build to end
BUILD_LOCK = "tandem.flock"  # in the build directory; holds the builder's pid


@dataclass(frozen=True)
class Extension:
    """One C++ extension: what it is built from, and where its library lies."""

    name: str
    sources: tuple[Path, ...]
    headers: tuple[Path, ...] = ()
    cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()
    build_root: Path | None = None  # None: torch's extension cache (TORCH_EXTENSIONS_DIR)

    @property
    def build_dir(self) -> Path:
        if self.build_root is not None:
            return self.build_root / self.name
        from torch.utils import cpp_extension

        return Path(cpp_extension._get_build_directory(self.name, verbose=False))  # private

    @property
    def library(self) -> Path:
        return self.build_dir / f"{self.name}.so"

    @property
    def stamp_path(self) -> Path:
        return self.build_dir / f"{self.name}.stamp"

    def stamp(self) -> str:
        """What a built library must match: sources and headers, flags, torch and Python.
        Not the compiler (``$CXX``): a worker started without the installer's environment
        must still find the library current."""
        digest = hashlib.sha256()
        parts = [self.name, *self.cflags, "|", *self.ldflags, "|", torch.__version__]
        parts += [sys.version.split()[0]]
        for part in parts:
            digest.update(part.encode() + b"\0")
        for path in (*self.sources, *self.headers):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        return digest.hexdigest()

    def is_current(self) -> bool:
        """Whether the library is built from the current sources, flags and torch."""
        try:
            return self.stamp_path.read_text().strip() == self.stamp() and self.library.exists()
        except FileNotFoundError:
            return False

    def load(self) -> None:
        """Loads the built library: its static initializers register its ops."""
        torch.ops.load_library(str(self.library))

    def build(self, wait_s: float = BUILD_WAIT_S) -> None:
        """Builds (where not current) and loads the library, holding the build lock."""
        from torch.utils import cpp_extension

        with build_lock(self.build_dir, wait_s):
            if not self.is_current():  # another process may have built it meanwhile
                self.stamp_path.unlink(missing_ok=True)  # a stamp vouches for a whole library
                built = cpp_extension.load(
                    name=self.name,
                    sources=[str(path) for path in self.sources],
                    extra_include_paths=sorted({str(path.parent) for path in self.headers}),
                    extra_cflags=list(self.cflags),
                    extra_ldflags=list(self.ldflags),
                    build_directory=str(self.build_dir),
                    is_python_module=False,
                )
                if Path(str(built)) != self.library:  # torch renames a process's second build
                    raise RuntimeError(f"{self.name} built as {built}: built here before")
                partial = self.stamp_path.with_suffix(".stamp.partial")
                partial.write_text(self.stamp() + "\n")
                partial.replace(self.stamp_path)
        self.load()  # a no-op where cpp_extension.load has loaded it


@contextlib.contextmanager
def build_lock(build_dir: Path, wait_s: float) -> Iterator[None]:
    """Holds the build directory's flock, which the kernel releases when its holder dies.
    torch's own lock file (``lock``) has no owner: one found by the flock's new holder was
    left by a build that died, and is removed at once. Waits up to ``wait_s`` for a live
    builder, then raises TimeoutError."""
    build_dir.mkdir(parents=True, exist_ok=True)
    path = build_dir / BUILD_LOCK
    with open(path, "a+") as held:
        deadline, is_waiting = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = path.read_text().strip() or "unknown"
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{path} is still held by a build (pid {holder}) after {wait_s:.0f} s"
                    ) from None
                if not is_waiting:
                    logger.warning(
                        "waiting up to %.0f s for %s's build (pid %s)", wait_s, path, holder
                    )
                    is_waiting = True
                time.sleep(0.2)
        held.truncate(0)
        held.write(f"{os.getpid()}\n")
        held.flush()
        left = build_dir / "lock"
        if left.exists():
            logger.warning("removing %s, left by a build whose process died", left)
            left.unlink(missing_ok=True)
        yield


KERNELS = Extension(
    NAME,
    sources=tuple(_HERE / name for name in SOURCES),
    headers=tuple(_HERE / name for name in HEADERS),
    cflags=("-O3", "-mavx2", "-mfma", "-fopenmp"),
    ldflags=("-fopenmp",),
)
_loaded: bool | None = None  # this process's answer, set by the first load


def available() -> bool:
    """Whether the kernels are loaded; the first call loads them, building them where
    missing or stale (serving workers call ``load(build=False)`` first)."""
    return load(build=True) if _loaded is None else _loaded


def load(*, build: bool) -> bool:
    """Loads the kernels once per process; every later call returns the first answer.
    ``build`` False (serving workers): only an up-to-date prebuilt library; a missing or
    stale one is logged in one line and the kernels stay off."""
    global _loaded
    if _loaded is None:
        _loaded = _load(KERNELS, build)
        if _loaded:
            _register_fakes()
    return _loaded


def _load(extension: Extension, build: bool) -> bool:
    if not _applies():
        return False
    try:
        if extension.is_current():
            extension.load()
        elif build:
            extension.build()
        else:
            why = (
                "stale (other sources, flags or torch)" if extension.library.exists() else "missing"
            )
            logger.warning(
                "CPU kernels %s: %s; this process does not build them, so bf16 products and "
                "decode attention run on aten, several times slower. `%s` builds them.",
                why,
                extension.library,
                BUILD_COMMAND,
            )
            return False
    except Exception as exc:  # no compiler, headers, ninja...: the torch paths still work
        logger.warning(
            "CPU kernels not built (%s); bf16 products and decode attention run on aten, "
            "several times slower. Install a C++ compiler and ninja to get them.",
            exc,
        )
        return False
    return True


@functools.cache  # once per process: a fake can be registered only once
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

    @torch.library.register_fake("tandem_cpu::fp8_dequant")
    def _(
        weight: torch.Tensor, scale: torch.Tensor, block_k: int, out_dtype: torch.dtype
    ) -> torch.Tensor:
        return weight.new_empty(weight.shape, dtype=out_dtype)

    @torch.library.register_fake("tandem_cpu::gguf_linear")
    def _(
        x: torch.Tensor, packed: torch.Tensor, qtype: int, n: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return x.new_empty((x.shape[0], n))


def main(argv: list[str] | None = None) -> int:
    """Builds the kernels where missing or stale; exit 1 where they do not build."""
    parser = argparse.ArgumentParser(
        prog=BUILD_COMMAND,
        description="Build the C++ CPU kernels (kernels/cpu/*.cpp) into torch's extension "
        "cache, where serving workers load them (they never build them). About two minutes "
        "on two cores; nothing to do when the built library is up to date.",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="build nothing: exit 0 if the built library is up to date, else 1",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.check:
        current = KERNELS.is_current()
        print(f"{KERNELS.library}: {'up to date' if current else 'missing or stale'}")
        return 0 if current else 1
    if load(build=True):
        print(f"CPU kernels up to date: {KERNELS.library}")
        return 0
    return 1 if _applies() else 0  # no AVX2, or turned off: nothing to build


def _applies() -> bool:
    """Whether the kernels apply here: an AVX2 CPU, and ``TANDEM_CPU_KERNELS`` not 0."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return False
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        logger.info("CPU kernels not used: this CPU has no AVX2")
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
