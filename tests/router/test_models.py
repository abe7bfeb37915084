"""The router resolves --model as engine.model_store does, without importing the engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import model_store
from router import models as router_models
from router.models import PREPARABLE_MODELS, ModelNotFoundError, resolve_model_dir


def test_a_prepared_name_resolves_to_the_engines_directory(smollm2_dir: Path) -> None:
    assert resolve_model_dir("smollm2") == model_store.resolve_model("smollm2") == smollm2_dir


def test_a_directory_resolves_to_itself(tmp_path: Path, smollm2_dir: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    for given in (tmp_path, str(tmp_path), str(smollm2_dir)):
        assert resolve_model_dir(given) == model_store.resolve_model(given)


def test_a_prepared_model_in_a_given_cache(tmp_path: Path) -> None:
    prepared = tmp_path / "mine"
    prepared.mkdir()
    (prepared / model_store.MANIFEST).write_text("{}")
    (tmp_path / ".mine.tmp-1").mkdir()  # a conversion under way is not a model
    (tmp_path / ".mine.tmp-1" / model_store.MANIFEST).write_text("{}")
    assert resolve_model_dir("mine", tmp_path) == model_store.resolve_model("mine", tmp_path)
    for missing in (".mine.tmp-1", "half-prepared"):
        with pytest.raises(ModelNotFoundError):
            resolve_model_dir(missing, tmp_path)


@pytest.mark.parametrize("name", ["no-such-model", "smollm2"])
def test_a_missing_model_says_what_the_engine_says(tmp_path: Path, name: str) -> None:
    with pytest.raises(model_store.ModelNotFoundError) as engine:
        model_store.resolve_model(name, cache_dir=tmp_path)
    with pytest.raises(ModelNotFoundError) as router:
        resolve_model_dir(name, cache_dir=tmp_path)
    assert str(router.value) == str(engine.value)


def test_a_directory_without_config_says_what_the_engine_says(tmp_path: Path) -> None:
    with pytest.raises(model_store.ModelNotFoundError) as engine:
        model_store.resolve_model(tmp_path)
    with pytest.raises(ModelNotFoundError) as router:
        resolve_model_dir(tmp_path)
    assert str(router.value) == str(engine.value)


def test_the_preparable_names_are_the_engines() -> None:
    assert tuple(model_store.MODELS) == PREPARABLE_MODELS
    assert model_store.MANIFEST == "tandem_model.json"


def test_a_gguf_file_resolves_to_the_directory_the_engine_made(tmp_path: Path) -> None:
    """The router finds a GGUF file's model directory by the engine's key (it cannot make
    one: that needs transformers); its served name is the file's stem."""
    gguf = tmp_path / "Tiny.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")  # only its path, size and time count here
    with pytest.raises(ModelNotFoundError, match=r"tandem models prepare .*Tiny\.Q4_1\.gguf"):
        resolve_model_dir(gguf, tmp_path / "cache")
    key = model_store.gguf_key(gguf, None)
    assert router_models.gguf_key(gguf, None) == key
    assert router_models.gguf_key(gguf, tmp_path) == model_store.gguf_key(gguf, tmp_path) != key
    # A link (a hub snapshot's, to a blob named by its hash) keeps its own stem.
    link = tmp_path / "Linked.Q4_1.gguf"
    link.symlink_to(gguf)
    assert router_models.gguf_key(link, None).startswith("Linked.Q4_1-")
    made = tmp_path / "cache" / model_store.GGUF_DIRS / key
    made.mkdir(parents=True)
    (made / model_store.MANIFEST).write_text('{"served_name": "Tiny.Q4_1"}')
    assert resolve_model_dir(str(gguf), tmp_path / "cache") == made
    assert router_models.served_name(made) == model_store.served_name(made) == "Tiny.Q4_1"
    assert router_models.served_name(tmp_path) == model_store.served_name(tmp_path)
    assert router_models.GGUF_DIRS == model_store.GGUF_DIRS
