"""What the requests of a load test ask: random prompts of chosen token lengths (token
ids for Tandem, text of about that many tokens for an HTTP server), shared-prefix groups
(for prefix caching), a JSONL file of prompts or chats, a built-in chat set, or a built-in
set of code edits.

The built-in sets and the word list come from Python's own standard library: the chats
from its module docstrings (``BUILTIN_MODULES``), the edits from its functions' sources
(``EDIT_MODULES``). Every client has them, they need no download, no torch and no server
package (the server's held-out prompts, training/heldout/, are the server's package data);
they are the same text for one Python version."""

from __future__ import annotations

import importlib
import inspect
import json
import random
import re
import textwrap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem_client.request import Prompt

# Stdlib modules whose docstrings are prose (the same text for one Python version).
BUILTIN_MODULES = (
    "argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses", "decimal",
    "difflib", "email", "fractions", "functools", "heapq", "json", "logging", "pickle",
    "random", "sqlite3", "statistics", "string", "textwrap", "threading", "unittest",
)  # fmt: skip
# Stdlib modules of plain Python functions, short enough to quote whole in a prompt.
EDIT_MODULES = (
    "base64", "bisect", "calendar", "colorsys", "difflib", "fnmatch", "fractions", "glob",
    "heapq", "html", "posixpath", "quopri", "shlex", "statistics", "string", "textwrap",
)  # fmt: skip
EDIT_LINES = (5, 40)  # a function's source lines, first and last included
QUESTIONS = (
    "Explain this in simple words: {}",
    "Summarize the following text in one sentence: {}",
    "Write a short poem inspired by this: {}",
    "What questions would a beginner ask about this? {}",
)


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: the prompt in a form the SDK takes, and how many tokens to ask
    for (``max_tokens``)."""

    prompt: Prompt
    output_len: int
    input_len: int | None = None  # the asked prompt length in tokens, where it is known


@dataclass(frozen=True)
class Lengths:
    """A length distribution: uniform over ``[mean * (1 - range_ratio), mean * (1 +
    range_ratio)]``, rounded, at least 1; fixed when ``range_ratio`` is 0."""

    mean: int
    range_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.mean < 1:
            raise ValueError(f"length must be >= 1, got {self.mean}")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range ratio must be in [0, 1), got {self.range_ratio}")

    def draw(self, rng: random.Random) -> int:
        low = max(1, round(self.mean * (1 - self.range_ratio)))
        high = max(low, round(self.mean * (1 + self.range_ratio)))
        return rng.randint(low, high)


def _docstrings() -> list[str]:
    docs = []
    for name in BUILTIN_MODULES:
        doc = importlib.import_module(name).__doc__ or ""
        docs.append(" ".join(doc.split()))
    return [d for d in docs if d]


def word_list() -> list[str]:
    """Distinct lowercase words of the built-in text, in a fixed order: most BPE
    tokenizers make one token of a common word after a space."""
    words = re.findall(r"[a-z]{2,12}", " ".join(_docstrings()).lower())
    return sorted(set(words))


def builtin_chats() -> list[list[dict[str, str]]]:
    """One-turn chats: a question about each sentence of the built-in text (sentences of 8
    to 60 words, no code)."""
    chats: list[list[dict[str, str]]] = []
    for i, doc in enumerate(_docstrings()):
        for sentence in re.split(r"(?<=[.!?])\s+", doc):
            if 8 <= len(sentence.split()) <= 60 and "::" not in sentence:
                question = QUESTIONS[(i + len(chats)) % len(QUESTIONS)].format(sentence)
                chats.append([{"role": "user", "content": question}])
    return chats


def _edit(name: str, params: list[str], turn: int) -> str:
    """One small change to ask of a function, in turn: rename a parameter, rename the
    function, or add a docstring."""
    if turn % 3 == 0 and params:
        old = params[turn // 3 % len(params)]
        return f"rename the parameter `{old}` to `{old}_value` everywhere it is used"
    if turn % 3 == 1:
        return f"rename the function `{name}` to `{name}_v2`"
    return "add a one-line docstring that says what it returns, or replace the one it has"


def builtin_edits() -> list[list[dict[str, str]]]:
    """One-turn chats, each asking for one function of the standard library back whole
    with one small change: the answer mostly repeats the prompt's code, as code edits,
    answers that quote and agent loops do."""
    chats: list[list[dict[str, str]]] = []
    for module_name in EDIT_MODULES:
        module = importlib.import_module(module_name)
        for name, function in sorted(vars(module).items()):
            if name.startswith("_") or not inspect.isfunction(function):
                continue
            if function.__module__ != module.__name__:
                continue
            try:
                source = textwrap.dedent(inspect.getsource(function))
            except (OSError, TypeError):  # no source file (a trimmed install)
                continue
            if not EDIT_LINES[0] <= source.count("\n") <= EDIT_LINES[1] or not source.isascii():
                continue
            params = [
                p.name
                for p in inspect.signature(function).parameters.values()
                if p.name not in ("self", "cls") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            ]
            change = _edit(name, params, len(chats))
            content = (
                f"Here is `{name}` from Python's `{module_name}` module:\n\n```python\n"
                f"{source}```\n\nRewrite it with one change: {change}. Reply with the whole "
                "function in one code block, and nothing else changed."
            )
            chats.append([{"role": "user", "content": content}])
    return chats


def random_requests(
    input_len: Lengths,
    output_len: Lengths,
    *,
    as_token_ids: bool,
    token_ids: tuple[int, int] = (100, 1000),
    prefix_len: int = 0,
    num_prefix_groups: int = 1,
    seed: int = 0,
) -> Iterator[RequestSpec]:
    """Endless random prompts: ``input_len`` tokens drawn at random, after a shared prefix
    of ``prefix_len`` tokens when it is > 0 (one of ``num_prefix_groups`` prefixes, in turn).
    Token ids in ``[low, high)`` for Tandem (``as_token_ids``), else text of as many words."""
    rng = random.Random(seed)
    words = word_list()
    low, high = token_ids

    def draw(n: int) -> list[int]:
        return [rng.randrange(low, high) for _ in range(n)]

    prefixes = [draw(prefix_len) for _ in range(num_prefix_groups)] if prefix_len else [[]]
    i = 0
    while True:
        n_in, n_out = input_len.draw(rng), output_len.draw(rng)
        ids = prefixes[i % len(prefixes)] + draw(n_in)
        i += 1
        prompt: Prompt = ids if as_token_ids else " ".join(words[t % len(words)] for t in ids)
        yield RequestSpec(prompt, n_out, len(ids))


def jsonl_requests(path: Path, output_len: Lengths, *, seed: int = 0) -> Iterator[RequestSpec]:
    """Endless requests from a JSONL file, shuffled once with ``seed`` then in turn: each
    line an object with ``prompt`` (text) or ``messages`` (a chat), and optionally
    ``max_tokens`` (else drawn from ``output_len``). ValueError naming the line for a bad
    one."""
    return cycle_prompts(read_jsonl(path), output_len, seed=seed)


def read_jsonl(path: Path) -> list[tuple[Prompt, int | None]]:
    """The prompts of a JSONL file and their ``max_tokens`` where given."""
    items: list[tuple[Prompt, int | None]] = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                prompt: Prompt = obj["messages"] if "messages" in obj else obj["prompt"]
                max_tokens = obj.get("max_tokens")
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(
                    f"{path}:{number}: expected an object with 'prompt' or 'messages' ({e})"
                ) from None
            items.append((prompt, int(max_tokens) if max_tokens is not None else None))
    if not items:
        raise ValueError(f"{path}: no prompts")
    return items


def cycle_prompts(
    items: Sequence[tuple[Prompt, int | None]], output_len: Lengths, *, seed: int = 0
) -> Iterator[RequestSpec]:
    """Endless requests from ``items``, shuffled once with ``seed``, then in turn."""
    rng = random.Random(seed)
    order = list(items)
    rng.shuffle(order)
    while True:
        for prompt, max_tokens in order:
            yield RequestSpec(prompt, max_tokens or output_len.draw(rng))


def builtin_requests(output_len: Lengths, *, seed: int = 0) -> Iterator[RequestSpec]:
    """Endless requests from the built-in chat set."""
    return cycle_prompts([(chat, None) for chat in builtin_chats()], output_len, seed=seed)


def edit_requests(output_len: Lengths, *, seed: int = 0) -> Iterator[RequestSpec]:
    """Endless requests from the built-in code edits."""
    return cycle_prompts([(chat, None) for chat in builtin_edits()], output_len, seed=seed)
