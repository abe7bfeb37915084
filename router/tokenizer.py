"""The router's tokenizer: `tokenizers` for text and jinja2 for the chat template, giving the
token ids of transformers' AutoTokenizer without importing it (its import loads torch)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# The named special tokens a chat template sees as variables (transformers' special_tokens_map).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class RouterTokenizer:
    """Encodes text and renders chats as the model's HF tokenizer does."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})  # name -> token text, e.g. eos_token
        self._template = compile_chat_template(chat_template) if chat_template else None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens included (a token's text for logprobs)."""
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=False))

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, str]],
        *,
        tokenize: bool = False,
        add_generation_prompt: bool = True,
    ) -> str | list[int]:
        """The conversation as the template renders it (or its ids: the rendered text
        encoded without added special tokens, as transformers does)."""
        if self._template is None:
            raise ValueError("the model has no chat template")
        text = self._template.render(
            {
                **self.special_tokens,
                "messages": [dict(m) for m in messages],
                "add_generation_prompt": add_generation_prompt,
                "tools": None,
                "documents": None,
            }
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def load_tokenizer(model_dir: Path) -> RouterTokenizer | None:
    """The model's tokenizer, or None for a directory without one (token ids only)."""
    model_dir = Path(model_dir)
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        return None
    if not (model_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"{model_dir}: the router reads tokenizer.json (a fast tokenizer); save the model's "
            "tokenizer with transformers' save_pretrained to write one"
        )
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    special_tokens = {
        name: _token_text(config[name]) for name in SPECIAL_TOKEN_NAMES if config.get(name)
    }
    # A named special token missing from the vocabulary is added, as transformers does.
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    missing = [t for t in dict.fromkeys(special_tokens.values()) if t not in vocab]
    if missing:
        tokenizer.add_special_tokens([AddedToken(t, special=True) for t in missing])
    return RouterTokenizer(tokenizer, _chat_template(model_dir, config), special_tokens)


def _token_text(value: str | dict[str, Any]) -> str:
    """A tokenizer_config.json token: a string, or a serialized AddedToken."""
    return value["content"] if isinstance(value, dict) else str(value)


def _chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's (the default of a named set)."""
    path = model_dir / CHAT_TEMPLATE_FILE
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        template = {t["name"]: t["template"] for t in template}
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) else None


# ---- rendering, as transformers renders a chat template


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` of the template, refusing underscore names (no way to internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's signature trick
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r}: no underscores")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers): renders its body."""

    tags = {"generation"}  # noqa: RUF012  # jinja reads it per class, never mutates it

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON without jinja's HTML escaping (templates put it in prompts, not pages)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template compiled in a sandbox: templates come with models, untrusted."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_Generation, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env.from_string(source)
