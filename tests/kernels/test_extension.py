"""Building and loading the CPU kernels: load-only never compiles, a stamp says what is
current, and a build lock whose holder died is taken over at once.

Each test builds a one-function extension in its own directory (a couple of seconds), or
loads the real one without building it: never rebuild the real one here."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from kernels.cpu import extension
from kernels.cpu.extension import Extension

needs_avx2 = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="the CPU kernels need AVX2",
)

TINY_SOURCE = 'extern "C" int tandem_tiny() { return 1; }\n'  # no torch headers: fast

# A build killed mid-way: holds the build lock and torch's lock file until SIGKILL.
HOLD_THE_LOCK = """
import sys, time
from pathlib import Path
from kernels.cpu.extension import build_lock
build_dir = Path(sys.argv[1])
with build_lock(build_dir, wait_s=5):
    (build_dir / "lock").touch()
    print("holding", flush=True)
    time.sleep(600)
"""

# The real kernels in a fresh process, building forbidden: their ops and fakes are there.
LOAD_ONLY = """
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import cpp_extension
from kernels.cpu import extension
cpp_extension.load = None  # building would fail
assert extension.load(build=False)
ops = torch.ops.tandem_cpu
for name in ("pack_bf16", "bf16_linear", "bf16_dot_supported", "paged_attention"):
    getattr(ops, name)
with FakeTensorMode():
    packed = ops.pack_bf16(torch.empty(40, 64, dtype=torch.bfloat16))
print(tuple(packed.shape))
"""


def tiny_extension(root: Path, name: str = "tandem_tiny", source: str = TINY_SOURCE) -> Extension:
    (root / "src").mkdir(parents=True, exist_ok=True)
    (root / "src" / "tiny.cpp").write_text(source)
    return Extension(name, sources=(root / "src" / "tiny.cpp",), build_root=root / "build")


@pytest.fixture(scope="module")
def built_tiny(tmp_path_factory: pytest.TempPathFactory) -> Extension:
    tiny = tiny_extension(tmp_path_factory.mktemp("tiny"))
    tiny.build()
    assert tiny.is_current()
    return tiny


def no_build(*args: object, **kwargs: object) -> None:
    raise AssertionError("compiled while building was forbidden")


def kernel_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == extension.__name__]


@needs_avx2
def test_load_only_takes_a_current_library_and_names_the_command_for_a_stale_one(
    built_tiny: Extension,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.delenv(extension.DISABLE_ENV, raising=False)
    monkeypatch.setattr(cpp_extension, "load", no_build)
    caplog.set_level(logging.INFO, logger=extension.__name__)
    assert extension._load(built_tiny, build=False)
    assert str(built_tiny.library) in torch.ops.loaded_libraries
    edited = tiny_extension(tmp_path / "edited", source=TINY_SOURCE + "// edited\n")
    stale = {
        "flags": dataclasses.replace(built_tiny, cflags=("-DCHANGED",)),
        "source": dataclasses.replace(built_tiny, sources=edited.sources),
        "missing": dataclasses.replace(built_tiny, build_root=tmp_path / "empty"),
    }
    for what, ext in stale.items():
        caplog.clear()
        assert not extension._load(ext, build=False), what
        (line,) = kernel_warnings(caplog)
        assert ("missing" if what == "missing" else "stale") in line, line
        assert extension.BUILD_COMMAND in line and "run on aten" in line
    monkeypatch.setattr(torch, "__version__", "0.0.0")  # another torch
    assert not built_tiny.is_current()


@needs_avx2
def test_a_build_waits_for_a_live_builder_and_takes_over_at_once_from_a_killed_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tiny = tiny_extension(tmp_path, name="tandem_tiny_locked")  # one name, one build a process
    command = [sys.executable, "-c", HOLD_THE_LOCK, str(tiny.build_dir)]
    holder = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        with pytest.raises(TimeoutError, match=f"pid {holder.pid}"):
            tiny.build(wait_s=0.5)  # a live builder: waited for, within the bound
        assert f"build (pid {holder.pid})" in caplog.text
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=10)
    finally:
        holder.kill()
        holder.wait()
    assert (tiny.build_dir / "lock").exists()  # torch's lock, left by the killed build
    caplog.clear()
    start = time.monotonic()
    tiny.build(wait_s=0.5)  # would raise if it waited for the dead holder
    assert time.monotonic() - start < 60  # the old rule waited 600 s
    assert not (tiny.build_dir / "lock").exists()
    assert tiny.is_current() and str(tiny.library) in torch.ops.loaded_libraries
    assert "left by a build whose process died" in caplog.text
    assert "waiting" not in caplog.text


def test_the_command_checks_without_building(
    built_tiny: Extension,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(cpp_extension, "load", no_build)
    monkeypatch.setattr(extension, "KERNELS", built_tiny)
    assert extension.main(["--check"]) == 0
    assert "up to date" in capsys.readouterr().out
    monkeypatch.setattr(extension, "KERNELS", dataclasses.replace(built_tiny, build_root=tmp_path))
    assert extension.main(["--check"]) == 1
    assert "missing or stale" in capsys.readouterr().out


@needs_avx2
def test_the_prebuilt_kernels_load_without_building_with_their_ops_and_fakes() -> None:
    if not extension.KERNELS.is_current():
        pytest.skip(f"the CPU kernels are not built here: `{extension.BUILD_COMMAND}` builds them")
    env = {k: v for k, v in os.environ.items() if k != extension.DISABLE_ENV}
    out = subprocess.run(
        [sys.executable, "-c", LOAD_ONLY], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[-2] == "(3, 64, 16)"
