"""`--model NAME_OR_DIR` to a model directory, as engine.model_store resolves it, without the
engine: the router only reads config.json and the tokenizer of a prepared directory."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST = "tandem_model.json"  # written last by `tandem models prepare`: the directory is whole
GGUF_DIRS = ".gguf"  # under the cache root: GGUF files' model directories (engine.model_store)
# The names `tandem models prepare` knows (engine.model_store.MODELS; a test keeps them equal).
PREPARABLE_MODELS = ("smollm2",)


class ModelNotFoundError(LookupError):
    """A model name or directory that cannot be resolved; the message says what to run."""


def default_cache_dir() -> Path:
    """Where prepared models live: ``$TANDEM_CACHE/models``, else ``~/.cache/tandem/models``."""
    root = os.environ.get("TANDEM_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "tandem"
    return base / "models"


def resolve_model_dir(
    name_or_dir: str | Path, cache_dir: str | Path | None = None, tokenizer: str | None = None
) -> Path:
    """A model directory (one holding config.json) or the directory of a prepared model."""
    path = Path(name_or_dir).expanduser()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"--model: {path} is no file")
        tokenizer_dir = Path(tokenizer).expanduser().resolve() if tokenizer else None
        made = root / GGUF_DIRS / gguf_key(path, tokenizer_dir)
        if (made / MANIFEST).is_file():
            return made
        raise ModelNotFoundError(
            f"{path} has no model directory in {root / GGUF_DIRS} yet; `tandem models prepare "
            f"{path}` makes it (the router reads its config and tokenizer there), or start "
            "the cluster with `tandem serve --model FILE.gguf`"
        )
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        raise ModelNotFoundError(f"{path} is a directory but holds no config.json")
    name = str(name_or_dir)
    prepared = root / name
    if Path(name).name == name and not name.startswith(".") and (prepared / MANIFEST).is_file():
        return prepared
    hint = name if name in PREPARABLE_MODELS else "smollm2"
    raise ModelNotFoundError(
        f"model {name!r} is neither a directory with config.json nor a model "
        f"prepared in {root}. Run `tandem models prepare {hint}` and pass --model {hint}, "
        f"or pass a HF model directory. Preparable models: {', '.join(PREPARABLE_MODELS)}."
    )


def gguf_key(path: Path, tokenizer: Path | None) -> str:
    """engine.model_store.gguf_key, without the engine (a test keeps the two equal): the
    stem of the path given, and a hash of the file's place, size and time and the
    tokenizer directory."""
    st = path.stat()
    parts = [str(path.resolve()), str(st.st_size), str(st.st_mtime_ns), str(tokenizer or "")]
    return f"{path.stem}-{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:12]}"


def served_name(model_dir: Path) -> str:
    """engine.model_store.served_name: the manifest's ``served_name`` (a GGUF file's
    stem), else the directory's name."""
    manifest = model_dir / MANIFEST
    if manifest.is_file():
        name = json.loads(manifest.read_text()).get("served_name")
        if isinstance(name, str) and name:
            return name
    return model_dir.name
