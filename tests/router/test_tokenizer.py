"""The router's tokenizer (tokenizers + jinja2, no transformers) gives the token ids of
transformers' AutoTokenizer, for plain text and for rendered chats."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from router.tokenizer import load_tokenizer
from router.validation import ModelInfo, RequestValidator, ValidationError
from tandem.v1 import generation_pb2 as gen
from tests.services.tiny_tokenizer import save_char_tokenizer

TEXTS = [
    "Hello world",
    "  leading and trailing spaces  ",
    "line one\nline two\n\ttab",
    "héllo wörld ✓ 日本語 🙂",
    "",
    "<|im_start|>user\nhi<|im_end|>",  # SmolLM2's specials inside the text
    "<s>ab</s> AB 0123",  # the tiny tokenizer's specials and characters
]
CHATS: list[list[dict[str, str]]] = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}],
    [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "tell me a joke"},
        {"role": "assistant", "content": "Why did the chicken cross the road"},
        {"role": "user", "content": "why"},
    ],
    [{"role": "user", "content": "héllo wörld ✓ 日本語 🙂"}],
    [{"role": "user", "content": ""}],
    [{"role": "system", "content": ""}, {"role": "user", "content": ""}],
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = tmp_path_factory.mktemp("tiny-tokenizer")
    save_char_tokenizer(model_dir)
    return model_dir


@pytest.fixture(params=["smollm2", "tiny"])
def model_dir(request: pytest.FixtureRequest, tiny_dir: Path) -> Path:
    if request.param == "tiny":
        return tiny_dir
    path: Path = request.getfixturevalue("smollm2_dir")
    return path


def reference_chat_ids(reference: Any, chat: list[dict[str, str]]) -> list[int]:
    out = reference.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    return list(out if isinstance(out, list) else out["input_ids"])


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_equals_transformers(model_dir: Path, add_special_tokens: bool) -> None:
    reference = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer = load_tokenizer(model_dir)
    assert tokenizer is not None
    for text in TEXTS:
        want = reference.encode(text, add_special_tokens=add_special_tokens)
        assert tokenizer.encode(text, add_special_tokens=add_special_tokens) == want, text


def test_chats_equal_apply_chat_template(model_dir: Path) -> None:
    reference = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer = load_tokenizer(model_dir)
    assert tokenizer is not None and tokenizer.chat_template == reference.chat_template
    for chat in CHATS:
        want = reference_chat_ids(reference, chat)
        assert want  # the template renders something for every conversation
        assert tokenizer.apply_chat_template(chat, tokenize=True) == want, chat
        text = tokenizer.apply_chat_template(chat)
        assert text == reference.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=True
        )


def test_the_validator_tokenizes_a_chat_as_transformers(smollm2_dir: Path) -> None:
    reference = AutoTokenizer.from_pretrained(str(smollm2_dir))
    model = ModelInfo.from_dir(smollm2_dir, "smollm2")
    validator = RequestValidator(model, load_tokenizer(smollm2_dir))
    for chat in CHATS:
        messages = [gen.ChatMessage(role=m["role"], content=m["content"]) for m in chat]
        request = gen.GenerateRequest(chat=gen.ChatMessages(messages=messages))
        assert validator.validate(request).prompt_token_ids == reference_chat_ids(reference, chat)


def test_a_template_in_tokenizer_config_with_dict_tokens(tmp_path: Path, tiny_dir: Path) -> None:
    """No chat_template.jinja: the template and the specials come from tokenizer_config.json."""
    (tmp_path / "tokenizer.json").write_text((tiny_dir / "tokenizer.json").read_text())
    config = {
        "bos_token": {"content": "<s>", "special": True},
        "eos_token": "</s>",
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
        "{{ eos_token }}",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer is not None
    assert tokenizer.apply_chat_template([{"role": "user", "content": "ab"}]) == "<s>ab</s>"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=True) == [
        1,
        3,
        4,
        2,
    ]


def test_a_directory_without_a_tokenizer_gives_none(tmp_path: Path) -> None:
    assert load_tokenizer(tmp_path) is None


def test_a_raising_template_is_the_validators_chat_error(tmp_path: Path, tiny_dir: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((tiny_dir / name).read_text())
    (tmp_path / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('roles must start with user') }}"
        "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    validator = RequestValidator(ModelInfo("tiny", 64, 256), load_tokenizer(tmp_path))
    chat = gen.ChatMessages(messages=[gen.ChatMessage(role="system", content="a")])
    with pytest.raises(ValidationError) as info:
        validator.validate(gen.GenerateRequest(chat=chat))
    assert str(info.value) == "chat: the chat template refused it: roles must start with user"
    chat = gen.ChatMessages(messages=[gen.ChatMessage(role="user", content="ab")])
    assert validator.validate(gen.GenerateRequest(chat=chat)).prompt_token_ids == [3, 4]


def test_the_sandbox_refuses_internals(tmp_path: Path, tiny_dir: Path) -> None:
    (tmp_path / "tokenizer.json").write_text((tiny_dir / "tokenizer.json").read_text())
    (tmp_path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    validator = RequestValidator(ModelInfo("tiny", 64, 256), load_tokenizer(tmp_path))
    chat = gen.ChatMessages(messages=[gen.ChatMessage(role="user", content="a")])
    with pytest.raises(ValidationError, match=r"^chat: the chat template refused it: "):
        validator.validate(gen.GenerateRequest(chat=chat))
