"""The held-out prompt sets ship as package data of ``training``: a built wheel carries them,
and the corpus finds them through ``importlib.resources`` wherever it is installed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib.resources import files
from pathlib import Path

from training.corpus import HELDOUT_NAMES, load_heldout

ROOT = Path(__file__).resolve().parents[2]


def test_heldout_read_through_importlib_resources() -> None:
    for name in HELDOUT_NAMES:
        text = files("training").joinpath("heldout", f"{name}.jsonl").read_text("utf-8")
        prompts = [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
        assert load_heldout(name) == prompts


def test_installed_wheel_finds_heldout(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "training", src / "training", ignore=shutil.ignore_patterns("__pycache__")
    )
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run(
        [*pip, "-w", str(tmp_path / "dist"), str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:  # a pure-Python wheel installs by unpacking
        assert {f"training/heldout/{n}.jsonl" for n in HELDOUT_NAMES} <= set(z.namelist())
        z.extractall(site)
    # -S: no site-packages, so neither the checkout nor an editable install is importable.
    code = (
        "import json, training.corpus as c; "
        "print(json.dumps([c.__file__, {n: c.load_heldout(n) for n in c.HELDOUT_NAMES}]))"
    )
    out = subprocess.run(
        [sys.executable, "-S", "-c", code],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(site)},
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    module_file, sets = json.loads(out.stdout)
    assert Path(module_file).is_relative_to(site)
    assert sets == {name: load_heldout(name) for name in HELDOUT_NAMES}
