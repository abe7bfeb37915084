"""LoRA adapters on the workers' and `tandem serve`'s command lines (``--lora-modules
NAME=PATH``, ``--allow-runtime-lora``, ``--max-loras``, ``--max-cpu-loras``,
``--max-lora-rank``), and how a worker tells routers which it serves: its heartbeat's
``loras`` figure, a JSON object of each adapter's name and its files' digest. A router
pairs a prefill and a decode worker for a request under an adapter only where both hold
it with the same digest (the same files), and sends the request's ``lora`` and
``lora_digest`` to both; their engines check the digest is still their adapter's
(engine.lora)."""

from __future__ import annotations

import argparse
import functools
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

# An adapter's name: what a request's `model` field carries. No spaces or commas (it goes
# on command lines and in /metrics labels).
LORA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")
LORA_FIGURE = "loras"  # the heartbeat figure


def add_lora_arguments(group: argparse._ActionsContainer) -> None:
    """``--lora-modules``, ``--max-loras`` and ``--max-lora-rank``: `tandem serve`'s and
    every worker's."""
    group.add_argument(
        "--lora-modules",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="serve a LoRA adapter (PEFT's format: a directory with adapter_config.json and "
        "adapter_model.safetensors) beside the model, under NAME: a request whose `model` is "
        "NAME runs under it. Repeat for more; drafts stay the base model's",
    )
    group.add_argument(
        "--allow-runtime-lora",
        action="store_true",
        help="let adapters be loaded and unloaded while serving (the router's POST "
        "/v1/load_lora_adapter and /v1/unload_lora_adapter, behind its auth token; each "
        "worker reads the adapter's directory on its own host). Off by default",
    )
    group.add_argument(
        "--max-loras",
        type=int,
        default=8,
        metavar="N",
        help="adapters one engine step runs, the earliest requests' first; requests under "
        "others wait their turn (default: 8)",
    )
    group.add_argument(
        "--max-cpu-loras",
        type=int,
        metavar="N",
        help="adapters whose weights stay in memory; the others are read again from their "
        "directories when a request names one, in place of the least recently used without "
        "requests (default: every adapter)",
    )
    group.add_argument(
        "--max-lora-rank",
        type=int,
        default=64,
        metavar="R",
        help="adapters of a higher rank are refused, at start or when loaded at run time "
        "(default: 64)",
    )


def parse_lora_modules(values: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """``--lora-modules`` values, NAME=PATH each, as (name, absolute path) pairs; a
    ValueError names what is wrong."""
    pairs: list[tuple[str, str]] = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not path:
            raise ValueError(f"--lora-modules: {value!r} is not NAME=PATH")
        if not LORA_NAME.fullmatch(name):
            raise ValueError(
                f"--lora-modules: name {name!r}: 1..128 characters of [A-Za-z0-9._:/-], "
                "starting with a letter or digit"
            )
        if any(name == other for other, _ in pairs):
            raise ValueError(f"--lora-modules: {name!r} is given twice")
        directory = Path(path).expanduser().resolve()
        if not directory.is_dir():
            raise ValueError(f"--lora-modules: {name}={path}: no such directory")
        pairs.append((name, str(directory)))
    return tuple(pairs)


def check_load_request(name: str, path: str, served_name: str) -> None:
    """A run-time load's ``lora_name`` and ``lora_path``, as the router and each worker
    check them: ValueError (INVALID_ARGUMENT, an HTTP 400) naming the field."""
    if not LORA_NAME.fullmatch(name):
        raise ValueError(
            f"lora_name: {name[:140]!r}: 1..128 characters of [A-Za-z0-9._:/-], starting "
            "with a letter or digit"
        )
    if name == served_name:
        raise ValueError(f"lora_name: {name!r} is the served model's name")
    if not path:
        raise ValueError("lora_path: is empty")


def check_lora_arguments(args: argparse.Namespace, prog: str) -> str | None:
    """What is wrong with the LoRA options (None: nothing); parses ``--lora-modules`` into
    ``args.lora_pairs``."""
    try:
        args.lora_pairs = parse_lora_modules(args.lora_modules)
    except ValueError as e:
        return str(e)
    if args.max_loras < 1:
        return f"--max-loras: must be at least 1, got {args.max_loras}"
    if args.max_lora_rank < 1:
        return f"--max-lora-rank: must be at least 1, got {args.max_lora_rank}"
    if args.max_cpu_loras is not None and args.max_cpu_loras < 1:
        return f"--max-cpu-loras: must be at least 1, got {args.max_cpu_loras}"
    return None


def lora_flags(args: argparse.Namespace) -> list[str]:
    """The LoRA options as a worker's command line takes them (`tandem serve`'s)."""
    flags: list[str] = []
    for name, path in args.lora_pairs:
        flags += ["--lora-modules", f"{name}={path}"]
    if args.allow_runtime_lora:
        flags.append("--allow-runtime-lora")
    if args.lora_pairs or args.allow_runtime_lora:
        flags += ["--max-loras", str(args.max_loras), "--max-lora-rank", str(args.max_lora_rank)]
        if args.max_cpu_loras is not None:
            flags += ["--max-cpu-loras", str(args.max_cpu_loras)]
    return flags


def lora_digests(lora_names: Mapping[str, tuple[int, int]]) -> dict[str, str]:
    """An engine's adapters (``LLMEngine.lora_names``: name -> (id, digest)) as name ->
    digest in hex: what heartbeats, requests and KV handshakes carry."""
    return {name: hex_digest(salt) for name, (_, salt) in sorted(lora_names.items())}


def hex_digest(salt: int) -> str:
    """An adapter's digest (``LoraAdapter.salt``) as the wire carries it; ``request_lora``
    reads it back."""
    return f"{salt:016x}"


def lora_figure(digests: Mapping[str, str]) -> dict[str, str]:
    """The heartbeat figure of a worker's adapters (``lora_digests``); none without any."""
    if not digests:
        return {}
    return {LORA_FIGURE: json.dumps(dict(digests), separators=(",", ":"))}


def worker_loras(stats: Mapping[str, str]) -> Mapping[str, str]:
    """A worker's adapters (name -> digest) from its heartbeat figures; empty when it has
    none, or publishes something unreadable. Read-only: the router asks for them in every
    pick, and the figure changes only when an adapter comes or goes, so each text is
    parsed once."""
    return _parse_loras(stats.get(LORA_FIGURE) or "")


@functools.lru_cache(maxsize=256)
def _parse_loras(raw: str) -> Mapping[str, str]:
    try:
        value = json.loads(raw) if raw else {}
    except ValueError:
        return MappingProxyType({})
    if not isinstance(value, dict):
        return MappingProxyType({})
    return MappingProxyType({str(k): str(v) for k, v in value.items()})


def request_lora(lora: str, digest: str) -> tuple[str | None, int | None]:
    """A worker request's ``lora`` and ``lora_digest`` as the engine takes them: the name
    (None: the base model) and the digest as an int (the engine checks it is its own)."""
    if not lora:
        return None, None
    try:
        return lora, int(digest, 16)
    except ValueError:
        raise ValueError(f"lora_digest: {digest[:40]!r} is not a hex digest") from None
