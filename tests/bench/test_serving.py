"""``bench/serving.py``'s refusals, before it starts anything."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "serving.py"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_without_llama_server_it_says_how_to_build_it_and_exits_2(tmp_path: Path) -> None:
    done = run("--quick", "--llama-dir", str(tmp_path))
    assert done.returncode == 2
    assert done.stdout == ""
    assert f"{tmp_path}/bin/llama-server" in done.stderr
    assert f"{tmp_path}/gguf/smollm2-bf16.gguf" in done.stderr
    assert "smollm2-q4_1.gguf" not in done.stderr  # --quick runs the bf16 GGUF only
    assert "scripts/build_llama_server --version 0.3.36" in done.stderr


def test_an_unknown_side_is_refused_naming_the_choices() -> None:
    done = run("--sides", "tandem,vllm")
    assert done.returncode == 2
    assert "--sides: unknown ['vllm']" in done.stderr
    choices = "tandem, tandem_eagle3, tandem_colocated, tandem_colocated_eagle3, llamacpp_bf16"
    assert choices in done.stderr
