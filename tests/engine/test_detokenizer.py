"""IncrementalDetokenizer on a real byte-level BPE tokenizer trained in-test: multi-byte
characters split over byte tokens, stop strings spanning tokens, held-back prefixes."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.detokenizer import IncrementalDetokenizer

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello there"]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
    )
    tok.train_from_iterator(CORPUS * 5, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    return ids


def feed(detok: IncrementalDetokenizer, ids: list[int], final: bool = True) -> list[str]:
    """One token at a time, the last one with ``final``, until a stop string is found (the
    engine finishes the request there); returns each step's new text."""
    deltas = []
    for i, t in enumerate(ids):
        deltas.append(detok.add([t], final=final and i == len(ids) - 1))
        assert "".join(deltas) == detok.text
        if detok.stopped_on is not None:
            break
    return deltas


def test_characters_are_split_over_byte_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    assert len(encode(tokenizer, "é")) == 2
    assert len(encode(tokenizer, "😀")) == 4


def test_no_partial_character_is_emitted(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "café 😀 ok"
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = feed(detok, ids, final=False)
    assert deltas == ["c", "a", "f", "", "é", " ", "", "", "", "😀", " ", "o", "k"]
    assert detok.text == text
    assert detok.stopped_on is None


def test_final_flushes_an_incomplete_character(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = encode(tokenizer, "ok😀")[:-2]  # two of the emoji's four bytes
    detok = IncrementalDetokenizer(tokenizer)
    assert feed(detok, ids, final=False)[-2:] == ["", ""]
    assert detok.text == "ok"
    assert detok.add([], final=True) == "\ufffd"
    assert detok.text == "ok\ufffd"


def test_stop_string_spanning_tokens_truncates_before_it(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    ids = encode(tokenizer, "hello STOP world")
    assert len(encode(tokenizer, "STOP")) == 4
    detok = IncrementalDetokenizer(tokenizer, stop=("STOP",))
    deltas = [detok.add([t]) for t in ids[: ids.index(encode(tokenizer, "P")[0]) + 1]]
    assert deltas == ["hello", " ", "", "", "", ""]  # "S", "ST", "STO" held back
    assert detok.text == "hello "
    assert detok.stopped_on == "STOP"


def test_stop_string_inside_one_add_call(tokenizer: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tokenizer, stop=("fox", "brown"))
    assert detok.add(encode(tokenizer, "the quick brown fox jumps")) == "the quick "
    assert detok.stopped_on == "brown"  # the earliest stop string wins


def test_partial_stop_prefix_is_released_when_not_completed(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    ids = encode(tokenizer, "hello STAR")
    detok = IncrementalDetokenizer(tokenizer, stop=("STOP",))
    assert feed(detok, ids, final=False) == ["hello", " ", "", "", "STA", "R"]
    assert detok.text == "hello STAR"
    assert detok.stopped_on is None


def test_final_flushes_a_partial_stop_prefix(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = encode(tokenizer, "hello STO")
    detok = IncrementalDetokenizer(tokenizer, stop=("STOP",))
    assert feed(detok, ids, final=True) == ["hello", " ", "", "", "STO"]
    assert detok.text == "hello STO"
    assert detok.stopped_on is None


def test_stop_string_found_on_the_final_token(tokenizer: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tokenizer, stop=("STOP",))
    feed(detok, encode(tokenizer, "ab STOP"), final=True)
    assert detok.text == "ab " and detok.stopped_on == "STOP"


def test_special_tokens_are_skipped(tokenizer: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    ids = [*encode(tokenizer, "hello"), tokenizer.eos_token_id]
    assert feed(detok, ids) == ["hello", ""]


def test_multibyte_stop_string_is_not_leaked(tokenizer: PreTrainedTokenizerFast) -> None:
    # "<" is held back as a stop prefix only once the next character is complete: while
    # "é" is half there the text ends in U+FFFD, which no stop string starts with.
    ids = encode(tokenizer, "ab<é>cd")
    detok = IncrementalDetokenizer(tokenizer, stop=("<é>",))
    deltas = feed(detok, ids, final=False)
    assert detok.stopped_on == "<é>"
    assert detok.text == "ab", deltas
    assert deltas == ["a", "b", "", "", "", ""]
