"""Every benchmark script in bench/ answers ``--help`` (exit 0, a usage line) without
running anything: none of them breaks unseen (bench/gpu_step.py once failed at import for
months). One interpreter imports them all, as ``python bench/NAME.py --help`` would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Modules other scripts import, not scripts: no command line of their own.
LIBRARIES = {"serving_plots.py", "serving_sides.py"}

PROBE = """
import contextlib, io, json, runpy, sys
results = {}
scripts = sys.argv[1:]
for path in scripts:
    sys.argv = [path, "--help"]
    sys.path.insert(0, path.rsplit("/", 1)[0])  # as python puts a script's folder first
    out = io.StringIO()
    code = None
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            code = e.code
        except Exception as e:
            code = f"{type(e).__name__}: {e}"
    sys.path.pop(0)
    results[path] = [code, out.getvalue()[:200]]
print("RESULTS " + json.dumps(results))
"""


def test_every_bench_script_answers_help() -> None:
    scripts = sorted(p.name for p in (ROOT / "bench").glob("*.py") if p.name not in LIBRARIES)
    assert "gpu_step.py" in scripts and "parallel.py" in scripts
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *(f"bench/{s}" for s in scripts)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert lines, done.stderr[-3000:]
    results = json.loads(lines[-1].removeprefix("RESULTS "))
    broken = {path: code for path, (code, usage) in results.items() if code not in (0, None)}
    assert broken == {}
    silent = [path for path, (_, usage) in results.items() if "usage:" not in usage]
    assert silent == []
