"""`tandem draft-data`: the target's self-distillation data in shards of the corpus, made
shard by shard, kept when already there with the same recipe, and read back whole by
train-draft's ``--data``."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.engine.tiny_models import build_tiny_llama
from tests.services.tiny_tokenizer import save_char_tokenizer
from training.cli import register_draft_data
from training.corpus import build_corpus
from training.data import SequenceSet, chat_prompt_ids, load_sequence_files
from training.self_instruct import DEFAULT_OPENERS

VOCAB = 64


def draft_data(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    register_draft_data(parser.add_subparsers())
    args = parser.parse_args(["draft-data", *argv])
    code: int = args.func(args)
    return code


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("draft_data_target")
    build_tiny_llama(out, "mha_plain", vocab_size=VOCAB, num_layers=1)
    save_char_tokenizer(out, VOCAB)
    return out


def options(target: Path, out: Path, **overrides: object) -> list[str]:
    values: dict[str, object] = dict(
        target=target, out=out, num_prompts=10, shard_size=4, max_new_tokens=5
    )
    values.update(max_prompt_len=40, threads=1, **overrides)
    return [s for k, v in values.items() for s in (f"--{k.replace('_', '-')}", str(v))]


def test_shards_are_made_once_and_read_back_as_the_corpus(
    target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "shards"
    assert draft_data(*options(target, out, num_shards=2)) == 0
    first = sorted(out.glob("*.safetensors"))
    assert [p.name for p in first] == ["shard000.safetensors", "shard001.safetensors"]
    stamps = [p.stat().st_mtime_ns for p in first]

    capsys.readouterr()
    assert draft_data(*options(target, out)) == 0  # all: only the third shard is new
    log = capsys.readouterr().out
    assert "shard 1/3: " in log and "is there" in log and "shard 3/3: generating" in log
    assert [p.stat().st_mtime_ns for p in first] == stamps
    data, meta = load_sequence_files([out])
    assert len(data) == 10 and [f["num_sequences"] for f in meta["files"]] == [4, 4, 2]
    assert [f["meta"]["recipe"]["shard"] for f in meta["files"]] == [0, 1, 2]
    per_source: Counter[str] = Counter()
    for f in meta["files"]:
        per_source.update(f["meta"]["prompts_per_source"])
    assert per_source == Counter(p.source for p in build_corpus(10, seed=1))
    for seq, n in zip(data.sequences, data.prompt_lens, strict=True):
        assert 1 <= len(seq) - n <= 5 and n <= 40

    # Another recipe makes the shard again.
    assert draft_data(*options(target, out, max_new_tokens=3, num_shards=1)) == 0
    again, meta0 = SequenceSet.load(out / "shard000.safetensors")
    assert meta0["recipe"]["max_new_tokens"] == 3
    assert all(len(s) - n <= 3 for s, n in zip(again.sequences, again.prompt_lens, strict=True))


def test_bad_arguments_say_what_is_wrong(
    target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert draft_data("--target", str(target), "--out", str(tmp_path), "--shard-size", "0") == 2
    assert "shard_size: must be positive, got 0" in capsys.readouterr().err
    assert draft_data("--target", str(tmp_path / "nowhere"), "--out", str(tmp_path)) == 2
    assert "tandem draft-data: error:" in capsys.readouterr().err


def test_self_instruct_messages_join_the_shards_and_are_sampled_once(
    target: Path, tmp_path: Path
) -> None:
    out = tmp_path / "shards"
    args = dict(num_prompts=4, self_instruct=6)
    assert draft_data(*options(target, out, num_shards=1, **args)) == 0
    cache = out / "self_instruct.jsonl"
    header, *rows = cache.read_text().splitlines()
    assert json.loads(header)["recipe"]["count"] == 6
    messages = [json.loads(row)["prompt"] for row in rows]
    assert 1 <= len(messages) <= 6
    stamp = cache.stat().st_mtime_ns
    assert draft_data(*options(target, out, **args)) == 0  # the other shards
    assert cache.stat().st_mtime_ns == stamp  # built from the same messages, not sampled again

    data, meta = load_sequence_files([out])
    assert len(data) == 4 + len(messages)
    assert all(f["meta"]["recipe"]["self_instruct"] == 6 for f in meta["files"])
    per_source: Counter[str] = Counter()
    for f in meta["files"]:
        per_source.update(f["meta"]["prompts_per_source"])
    expected = Counter(p.source for p in build_corpus(4, seed=1))
    assert per_source == expected + Counter({"self_instruct": len(messages)})
    prompts = {tuple(s[:n]) for s, n in zip(data.sequences, data.prompt_lens, strict=True)}
    tokenizer = AutoTokenizer.from_pretrained(target)
    for ids in chat_prompt_ids(tokenizer, messages, 40):
        assert tuple(ids) in prompts


def test_self_instruct_openers_begin_the_messages_in_turn(
    target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "shards"
    args = ["--self-instruct", "12", "--self-instruct-openers"]
    assert draft_data(*options(target, out, num_prompts=0, num_shards=1), *args) == 0
    header, *rows = (out / "self_instruct.jsonl").read_text().splitlines()
    assert json.loads(header)["recipe"]["openers"] == list(DEFAULT_OPENERS)
    messages = [json.loads(row)["prompt"] for row in rows]
    assert messages and all(m.startswith(DEFAULT_OPENERS) for m in messages)
    assert len({next(o for o in DEFAULT_OPENERS if m.startswith(o)) for m in messages}) > 1
    _, meta = SequenceSet.load(out / "shard000.safetensors")
    assert meta["recipe"]["self_instruct_openers"] == list(DEFAULT_OPENERS)

    # Openers steer self-instruct messages: without any asked for, they are refused.
    none = options(target, tmp_path / "none", num_prompts=4)
    assert draft_data(*none, "--self-instruct-openers") == 2
    assert "self_instruct_openers: given, but no self_instruct" in capsys.readouterr().err
