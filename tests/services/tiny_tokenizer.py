"""A character-level tokenizer (with a chat template) that fits the tiny models' 64-token
vocabulary, so that text prompts, chat, detokenization and stop strings can be tested."""

from __future__ import annotations

import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: the tiny models' bos 1 and eos 2
CHARS = string.ascii_lowercase + string.ascii_uppercase + " " + "01234567"
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def save_char_tokenizer(model_dir: Path, vocab_size: int = 64) -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate([*SPECIALS, *CHARS])}
    assert len(vocab) == vocab_size, len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(model_dir))
    return fast
