"""What the load test asks: random lengths within their ranges, shared prefixes in groups,
JSONL prompts and chats, the built-in chat set (from Python's own docstrings) and the
built-in code edits (from its functions' sources)."""

from __future__ import annotations

import json
import random
from itertools import islice
from pathlib import Path

import pytest

from loadtest.data import (
    Lengths,
    builtin_chats,
    builtin_edits,
    builtin_requests,
    edit_requests,
    jsonl_requests,
    random_requests,
    word_list,
)


def test_lengths_fixed_and_uniform() -> None:
    rng = random.Random(0)
    assert {Lengths(64).draw(rng) for _ in range(100)} == {64}
    drawn = [Lengths(100, 0.2).draw(rng) for _ in range(2000)]
    assert min(drawn) == 80 and max(drawn) == 120  # both ends reached, none beyond
    assert Lengths(1, 0.5).draw(rng) >= 1
    with pytest.raises(ValueError):
        Lengths(0)
    with pytest.raises(ValueError):
        Lengths(10, 1.0)


def test_random_token_ids() -> None:
    specs = list(
        islice(
            random_requests(
                Lengths(32, 0.25), Lengths(16, 0.5), as_token_ids=True, token_ids=(3, 64), seed=5
            ),
            200,
        )
    )
    for s in specs:
        assert isinstance(s.prompt, list) and len(s.prompt) == s.input_len
        assert 24 <= len(s.prompt) <= 40 and 8 <= s.output_len <= 24
        assert all(3 <= t < 64 for t in s.prompt)
    again = islice(
        random_requests(
            Lengths(32, 0.25), Lengths(16, 0.5), as_token_ids=True, token_ids=(3, 64), seed=5
        ),
        200,
    )
    assert list(again) == specs  # seeded


def test_shared_prefix_groups() -> None:
    specs = list(
        islice(
            random_requests(
                Lengths(8),
                Lengths(4),
                as_token_ids=True,
                prefix_len=16,
                num_prefix_groups=3,
                seed=1,
            ),
            9,
        )
    )
    prefixes = [tuple(s.prompt[:16]) for s in specs]  # type: ignore[index]
    assert len(set(prefixes)) == 3
    assert prefixes[0] == prefixes[3] == prefixes[6] != prefixes[1]  # groups in turn
    assert all(len(s.prompt) == 24 for s in specs)
    suffixes = {tuple(s.prompt[16:]) for s in specs}  # type: ignore[index]
    assert len(suffixes) == 9


def test_random_text_of_about_the_length() -> None:
    specs = list(
        islice(
            random_requests(
                Lengths(50), Lengths(4), as_token_ids=False, prefix_len=10, num_prefix_groups=2
            ),
            4,
        )
    )
    for s in specs:
        assert isinstance(s.prompt, str) and len(s.prompt.split()) == 60
    assert specs[0].prompt.split()[:10] == specs[2].prompt.split()[:10]  # type: ignore[union-attr]
    assert len(word_list()) > 300


def test_jsonl_prompts_and_chats(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    chat = [{"role": "user", "content": "Hi"}]
    lines = [{"prompt": "one"}, {"messages": chat, "max_tokens": 7}, {"prompt": "three"}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    specs = list(islice(jsonl_requests(path, Lengths(5), seed=0), 6))
    assert sorted(map(str, (s.prompt for s in specs[:3]))) == sorted(
        map(str, ["one", chat, "three"])
    )
    assert [s.prompt for s in specs[3:]] == [s.prompt for s in specs[:3]]  # in turn
    assert {s.output_len for s in specs if s.prompt == chat} == {7}
    assert {s.output_len for s in specs if s.prompt != chat} == {5}


def test_jsonl_bad_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"text": "no"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        next(jsonl_requests(path, Lengths(5)))


def test_builtin_chats() -> None:
    chats = builtin_chats()
    assert len(chats) >= 40
    for chat in chats:
        assert chat[0]["role"] == "user" and len(chat[0]["content"].split()) >= 8
    spec = next(builtin_requests(Lengths(9)))
    assert spec.output_len == 9 and spec.prompt in chats


def test_builtin_edits_quote_a_whole_function_and_ask_one_change() -> None:
    """Each edit quotes a public function of the standard library whole (its source
    compiles and defines that name) and asks for one of three kinds of change, in turn."""
    import ast
    import re

    edits = builtin_edits()
    assert len(edits) >= 40
    kinds = {"rename the parameter": 0, "rename the function": 0, "add a one-line docstring": 0}
    for chat in edits:
        [message] = chat
        text = message["content"]
        name = re.match(r"Here is `(\w+)` from Python's `[\w.]+` module", text)
        assert name and not name.group(1).startswith("_")
        code = text.split("```python\n", 1)[1].split("```", 1)[0]
        [tree] = ast.parse(code).body
        assert isinstance(tree, ast.FunctionDef) and tree.name == name.group(1)
        change = text.split("Rewrite it with one change: ", 1)[1]
        kind = next(k for k in kinds if change.startswith(k))
        kinds[kind] += 1
        if kind == "rename the parameter":
            param = re.match(r"rename the parameter `(\w+)`", change)
            assert param and param.group(1) in {
                a.arg for a in tree.args.args + tree.args.kwonlyargs
            }
    assert all(n >= 10 for n in kinds.values()), kinds
    spec = next(edit_requests(Lengths(200), seed=1))
    assert spec.output_len == 200 and spec.prompt in edits
