"""IncrementalDetokenizer on a real byte-level BPE tokenizer trained in-test: multi-byte
characters split over byte tokens, stop strings spanning tokens, held-back prefixes."""

from __future__ import annotations

import random

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


class CountingTokenizer:
    """Records how many ids each decode call was given."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        self.tokenizer, self.lengths = tokenizer, []

    def decode(self, ids: list[int], **kwargs: object) -> str:
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_each_step_decodes_a_window_not_the_whole_output(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    """276 tokens one at a time, emoji split over byte tokens among them: the text is the
    whole output's, and no decode call sees more than the last few tokens."""
    ids = encode(tokenizer, "the lazy dog 😀 é " * 25)
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting)
    feed(detok, ids)
    assert len(ids) == 276 and detok.text == tokenizer.decode(ids)
    assert max(counting.lengths) <= 5  # 4 bytes of an emoji and the token before them


@pytest.mark.parametrize("seed", range(5))
def test_random_tokens_give_the_whole_decode(tokenizer: PreTrainedTokenizerFast, seed) -> None:
    """Byte tokens at random (invalid UTF-8 included) and special tokens, in random chunks:
    the emitted text is exactly what decoding all of them at once gives."""
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(300)]
    detok = IncrementalDetokenizer(tokenizer)
    i = 0
    while i < len(ids):
        n = rng.randint(1, 4)
        detok.add(ids[i : i + n], final=i + n >= len(ids))
        i += n
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=True)


PIECES = {0: "a", 1: " ", 2: ".", 3: "b"}


class CleanUpTokenizer:
    """``PIECES`` joined, then " ." made "." (as clean_up_tokenization_spaces does): a later
    token rewrites text an earlier window already held."""

    def decode(self, ids: list[int], **kwargs: object) -> str:
        return "".join(PIECES[i] for i in ids).replace(" .", ".")


def test_a_window_decoded_otherwise_in_context_falls_back_to_the_whole_output() -> None:
    detok = IncrementalDetokenizer(CleanUpTokenizer())
    assert [detok.add([t]) for t in (0, 1, 2, 3)] == ["a", " ", "", ""]
    assert detok.settled == "a.b"  # what decoding all four at once gives
    assert detok.add([1, 3], final=True) == ""  # text shown stays as shown
    assert detok.settled == "a.b b"
