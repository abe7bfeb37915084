"""Chat-like training prompts written by the target itself (self-instruct, as in Magpie).

An instruction-tuned model, given its chat template only up to the start of a user turn,
writes a user's message: sampled, it writes many different ones. The drafts need such
prompts because the corpus's chat prompts are built around Python's documentation, while
people ask a chat model about anything; the draft should see the target answer those.

Sampled from the bare user turn, a small target writes a few kinds of message again and
again ("I'm considering a career change..."). With ``openers``, sample i's user turn
starts with ``openers[i % len(openers)]`` ("Write", "Explain", "How do I", ...) and the
target writes the rest: one kind of request per opener, the way Magpie-style sets are
steered to cover tasks. The opener is part of the kept message.

Kept: messages that the target ended itself (EOS, not the length limit), of 3 words to
``MAX_PROMPT_CHARS`` characters, new (normalised), and disjoint from the held-out
evaluation prompts by the corpus's own rule. The kept texts are saved as JSON lines beside
the shards, so that a resumed set reuses the very same prompts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from training.corpus import Prompt, heldout_acceptor
from training.generation import generate

SOURCE = "self_instruct"
# Generic beginnings of a request, one per kind of task people ask a chat model for.
DEFAULT_OPENERS = (
    "Write",
    "Write a short",
    "Explain",
    "How do I",
    "How can I",
    "What is",
    "What are",
    "Why does",
    "Why do",
    "List",
    "Give me",
    "Summarize",
    "Compare",
    "Describe",
    "Can you help me",
    "Help me",
    "Create",
    "Suggest",
    "Tell me about",
    "Rewrite",
    "Plan",
    "Draft",
    "Should I",
    "Is it true that",
    "What is the best way to",
    "Recommend",
    "Outline",
    "Imagine",
    "Brainstorm",
    "Write a Python function",
    "Write a Python script",
    "Fix the bug in",
    "What does this code do",
    "Generate",
    "Teach me",
    "Convert",
    "Calculate",
    "Design",
    "Name",
    "When should I",
)
_SENTINEL = "\x00tandem-user-message\x00"

Log = Callable[[str], None]


@dataclass(frozen=True)
class SelfInstructRecipe:
    """What the generated messages depend on: a saved set is reused only under an equal one."""

    count: int
    seed: int
    temperature: float = 0.8
    top_p: float = 1.0  # the whole distribution: varied messages
    max_tokens: int = 96  # a message the target has not ended by then is dropped
    max_attempts_per_prompt: int = 3
    openers: tuple[str, ...] = ()  # sample i's message starts with openers[i % len]


def user_turn_prefix(tokenizer: Any) -> list[int]:
    """The chat template's ids up to where a user's message begins (system turn included)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=False
    )
    if _SENTINEL not in text:
        raise ValueError("self-instruct: the tokenizer's chat template drops the user message")
    return [int(t) for t in tokenizer.encode(text[: text.index(_SENTINEL)])]


def self_instruct_prompts(
    target_dir: Path,
    tokenizer: Any,
    recipe: SelfInstructRecipe,
    *,
    exclude: Iterable[str] = (),
    cache: Path | None = None,
    num_threads: int | None = None,
    max_num_seqs: int = 64,
    log: Log = print,
) -> list[Prompt]:
    """Up to ``recipe.count`` user messages sampled from the target (fewer only when
    ``recipe.max_attempts_per_prompt`` samples per wanted message run out); read from
    ``cache`` when it holds the same recipe's set, else written there."""
    if cache is not None and cache.is_file():
        header, *rows = cache.read_text(encoding="utf-8").splitlines()
        if json.loads(header) == {"recipe": _as_json(recipe)}:
            log(f"self-instruct: reusing {len(rows)} messages from {cache}")
            return [Prompt(SOURCE, json.loads(row)["prompt"]) for row in rows]
    from engine.sampling_params import SamplingParams
    from engine.sequence import FinishReason

    prefix = user_turn_prefix(tokenizer)
    openers = [tokenizer.encode(o, add_special_tokens=False) for o in recipe.openers] or [[]]
    eos = tokenizer.eos_token_id
    accept = heldout_acceptor(exclude)
    kept: list[Prompt] = []
    attempts = 0
    while len(kept) < recipe.count and attempts < recipe.count * recipe.max_attempts_per_prompt:
        # Ask for the missing ones plus a margin for those dropped; seeds never repeat.
        batch = min(
            recipe.count * recipe.max_attempts_per_prompt - attempts,
            max(max_num_seqs, (recipe.count - len(kept)) * 3 // 2),
        )
        params = [
            SamplingParams(
                max_tokens=recipe.max_tokens,
                temperature=recipe.temperature,
                top_p=recipe.top_p,
                seed=recipe.seed * 1_000_003 + attempts + i,
            )
            for i in range(batch)
        ]
        starts = [openers[(attempts + i) % len(openers)] for i in range(batch)]
        outputs, _ = generate(
            target_dir,
            [prefix + start for start in starts],
            params,
            num_threads=num_threads,
            max_num_seqs=max_num_seqs,
            desc="self-instruct",
            log=log,
        )
        attempts += batch
        for start, out in zip(starts, outputs, strict=True):
            if out.finish_reason != FinishReason.STOP or out.token_ids[-1:] != [eos]:
                continue
            ids = start + list(out.token_ids[:-1])
            text = tokenizer.decode(ids, skip_special_tokens=True).strip()
            prompt = Prompt(SOURCE, text)
            if len(text.split()) >= 3 and accept(prompt) and len(kept) < recipe.count:
                kept.append(prompt)
        log(f"self-instruct: {len(kept)}/{recipe.count} messages kept after {attempts} samples")
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        rows = [json.dumps({"recipe": _as_json(recipe)})]
        rows += [json.dumps({"prompt": p.text}) for p in kept]
        cache.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return kept


def _as_json(recipe: SelfInstructRecipe) -> dict[str, Any]:
    """The recipe as its JSON header reads back (a list of openers); without openers, as
    sets saved before openers existed wrote it."""
    fields = asdict(recipe)
    if recipe.openers:
        fields["openers"] = list(recipe.openers)
    else:
        del fields["openers"]
    return fields
