"""Self-instruct prompts: SmolLM2 writes user messages when shown its chat template up to a
user turn; the kept ones are ended by the target, new, disjoint from what is excluded,
reproducible from their seeds, and reused from their cache only under the same recipe."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from training.corpus import MAX_PROMPT_CHARS, load_heldout, normalize
from training.self_instruct import SelfInstructRecipe, self_instruct_prompts, user_turn_prefix


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_the_prefix_is_the_template_up_to_the_users_message(tokenizer: Any) -> None:
    assert tokenizer.decode(user_turn_prefix(tokenizer)) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\n"
    )


def test_messages_are_kept_reproducibly_and_never_excluded_ones(
    smollm2_dir: Path, tokenizer: Any, tmp_path: Path
) -> None:
    recipe = SelfInstructRecipe(count=5, seed=3)
    lines: list[str] = []

    def run(recipe: SelfInstructRecipe, **kwargs: Any) -> list[str]:
        prompts = self_instruct_prompts(
            smollm2_dir, tokenizer, recipe, num_threads=2, log=lines.append, **kwargs
        )
        assert {p.source for p in prompts} <= {"self_instruct"}
        assert all(p.flavour == "chat" for p in prompts)
        return [p.text for p in prompts]

    cache = tmp_path / "self_instruct.jsonl"
    first = run(recipe, cache=cache)
    assert len(first) == 5 and len({normalize(t) for t in first}) == 5
    heldout = {normalize(t) for t in load_heldout("chat") + load_heldout("code")}
    for text in first:
        assert len(text.split()) >= 3 and len(text) <= MAX_PROMPT_CHARS
        assert text == text.strip() and "<|im_end|>" not in text and normalize(text) not in heldout

    lines.clear()
    assert run(recipe, cache=cache) == first  # from the cache, without generating
    assert lines == [f"self-instruct: reusing 5 messages from {cache}"]
    # The same seeds write the same messages; an excluded one is never kept.
    again = run(recipe, exclude=[first[0]])
    assert again[:4] == first[1:] and first[0] not in again and len(again) == 5
    # Another recipe is generated afresh and replaces the cache. (Its messages are not
    # compared with the first ones: it samples a smaller batch, and the bf16 products are
    # chosen per row count, per machine (kernels.cpu.gemm_plan), so its rows may round
    # differently.)
    lines.clear()
    two = run(SelfInstructRecipe(count=2, seed=3), cache=cache)
    assert len(two) == 2 and not any("reusing" in line for line in lines)
    assert len(cache.read_text().splitlines()) == 1 + 2
    lines.clear()
    assert run(SelfInstructRecipe(count=2, seed=3), cache=cache) == two
    assert lines == [f"self-instruct: reusing 2 messages from {cache}"]
