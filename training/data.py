"""Self-distillation data: chat prompts and the target's own greedy continuations.

Stored as one safetensors file per set or shard (int32 tokens, lengths and prompt lengths;
JSON strings in its metadata), never pickle, so that a rerun, a resume or another drafter
kind reuses it; a training run may read several (``load_sequence_files``).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from training.corpus import Prompt, build_corpus, corpus_sources
from training.generation import generate_continuations
from training.self_instruct import SelfInstructRecipe, self_instruct_prompts

Log = Callable[[str], None]


@dataclass
class SequenceSet:
    """Token sequences, each a prompt followed by the target's greedy continuation."""

    sequences: list[list[int]]
    prompt_lens: list[int]  # the continuation of sequence i starts at prompt_lens[i]
    special_token_ids: tuple[int, ...] = ()  # the tokenizer's special ids (mask candidates)

    def __post_init__(self) -> None:
        if len(self.sequences) != len(self.prompt_lens):
            raise ValueError(
                f"prompt_lens: {len(self.prompt_lens)} for {len(self.sequences)} sequences"
            )
        for i, (seq, n) in enumerate(zip(self.sequences, self.prompt_lens, strict=True)):
            if not 1 <= n < len(seq):
                raise ValueError(
                    f"sequence {i}: prompt length {n} leaves no continuation in {len(seq)} tokens"
                )

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    @property
    def num_continuation_tokens(self) -> int:
        return self.num_tokens - sum(self.prompt_lens)

    def subset(self, indices: Sequence[int]) -> SequenceSet:
        return SequenceSet(
            [self.sequences[i] for i in indices],
            [self.prompt_lens[i] for i in indices],
            self.special_token_ids,
        )

    @classmethod
    def concat(cls, parts: Sequence[SequenceSet]) -> SequenceSet:
        """The sequences of ``parts`` in order; all must come from one tokenizer."""
        specials = {p.special_token_ids for p in parts}
        if len(specials) > 1:
            raise ValueError(f"special_token_ids: the parts differ ({sorted(specials)})")
        return cls(
            [s for p in parts for s in p.sequences],
            [n for p in parts for n in p.prompt_lens],
            parts[0].special_token_ids,
        )

    def sha256(self) -> str:
        """A hash of the tokens and where each sequence ends (prompt lengths left out)."""
        digest = hashlib.sha256()
        for values in ([len(s) for s in self.sequences], [t for s in self.sequences for t in s]):
            digest.update(torch.tensor(values, dtype=torch.int64).numpy().tobytes())
        return digest.hexdigest()

    def split(self, val_fraction: float, seed: int) -> tuple[SequenceSet, SequenceSet]:
        """(train, validation): a seeded ``val_fraction`` share held out, at least one."""
        order = list(range(len(self)))
        random.Random(seed).shuffle(order)
        num_val = max(1, round(len(self) * val_fraction)) if len(self) > 1 else 0
        return self.subset(sorted(order[num_val:])), self.subset(sorted(order[:num_val]))

    def token_counts(self, vocab_size: int, continuations_only: bool = False) -> torch.Tensor:
        """How often each token id occurs: [V] int64."""
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for seq, n in zip(self.sequences, self.prompt_lens, strict=True):
            ids = torch.tensor(seq[n:] if continuations_only else seq, dtype=torch.int64)
            counts += torch.bincount(ids, minlength=vocab_size)
        return counts

    def save(self, path: Path, meta: dict[str, Any]) -> None:
        from safetensors.torch import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {
            "tokens": torch.tensor([t for s in self.sequences for t in s], dtype=torch.int32),
            "lengths": torch.tensor([len(s) for s in self.sequences], dtype=torch.int32),
            "prompt_lens": torch.tensor(self.prompt_lens, dtype=torch.int32),
        }
        metadata = {
            "special_token_ids": json.dumps(list(self.special_token_ids)),
            "meta": json.dumps(meta, sort_keys=True),
        }
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata=metadata)
        tmp.replace(path)

    @staticmethod
    def read_meta(path: Path) -> dict[str, Any]:
        """The metadata a file was saved with, without reading its sequences."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta: dict[str, Any] = json.loads((f.metadata() or {}).get("meta", "{}"))
        return meta

    @classmethod
    def load(cls, path: Path) -> tuple[SequenceSet, dict[str, Any]]:
        """The sequences and the metadata they were saved with."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            names = f.keys()
            if "tokens" not in names:
                raise ValueError(f"data: {path} holds no sequences (not from SequenceSet.save)")
            metadata = f.metadata() or {}
            tokens = f.get_tensor("tokens").tolist()
            lengths = f.get_tensor("lengths").tolist()
            prompt_lens = f.get_tensor("prompt_lens").tolist()
        sequences, start = [], 0
        for n in lengths:
            sequences.append(tokens[start : start + n])
            start += n
        special = tuple(json.loads(metadata.get("special_token_ids", "[]")))
        return cls(sequences, prompt_lens, special), json.loads(metadata.get("meta", "{}"))


def load_sequence_files(paths: Sequence[Path]) -> tuple[SequenceSet, dict[str, Any]]:
    """The sequences of every file, concatenated in sorted path order (so that the order of
    ``paths`` does not matter); a directory stands for its ``*.safetensors`` files. The
    metadata lists each file with its sequence count and the metadata it was saved with."""
    files: set[Path] = set()
    for path in paths:
        if path.is_dir():
            shards = list(path.glob("*.safetensors"))
            if not shards:
                raise ValueError(f"data: {path} holds no *.safetensors files")
            files.update(f.resolve() for f in shards)
        elif path.is_file():
            files.add(path.resolve())
        else:
            raise ValueError(f"data: {path} is neither a file nor a directory")
    parts, records = [], []
    for file in sorted(files):
        part, meta = SequenceSet.load(file)
        parts.append(part)
        records.append({"path": str(file), "num_sequences": len(part), "meta": meta})
    return SequenceSet.concat(parts), {"files": records}


def chat_prompt_ids(tokenizer: Any, texts: Sequence[str], max_prompt_len: int) -> list[list[int]]:
    """Each text as one user message in the chat template (with the generation prompt),
    tokenized as ``LLM`` does; an over-long message is cut so that the whole fits."""

    def encode(message: str) -> list[int]:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
        )
        return [int(t) for t in tokenizer.encode(text)]

    prompts = []
    for text in texts:
        ids = encode(text)
        content = tokenizer.encode(text, add_special_tokens=False)
        keep = len(content)
        while len(ids) > max_prompt_len and keep > 0:
            keep = max(0, keep - (len(ids) - max_prompt_len) - 1)
            ids = encode(tokenizer.decode(content[:keep]))
        prompts.append(ids[-max_prompt_len:])
    return prompts


def special_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """Ids of the tokenizer's special tokens: spare ones (no bos/eos/pad/unk role) first."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    roles = {int(i) for i in getattr(tokenizer, "all_special_ids", [])}
    spare = {int(i) for i, tok in added.items() if getattr(tok, "special", False)} - roles
    return (*sorted(spare), *sorted(roles))


def length_batches(lengths: Sequence[int], batch_size: int, rng: random.Random) -> list[list[int]]:
    """Shuffled batches of indices; neighbours in length share a batch (less padding)."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    window = batch_size * 16
    batches = []
    for i in range(0, len(order), window):
        chunk = sorted(order[i : i + window], key=lambda j: lengths[j])
        batches += [chunk[k : k + batch_size] for k in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def pad(sequences: Sequence[list[int]], device: torch.device) -> torch.Tensor:
    """[B, L] int64, right-padded with 0."""
    width = max(len(s) for s in sequences)
    out = torch.zeros((len(sequences), width), dtype=torch.int64)
    for i, s in enumerate(sequences):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.int64)
    return out.to(device)


def prepare_sequences(
    target_dir: Path,
    path: Path,
    *,
    num_prompts: int,
    max_new_tokens: int,
    max_prompt_len: int,
    seed: int,
    num_threads: int | None,
    log: Log = print,
) -> tuple[SequenceSet, dict[str, Any]]:
    """Loads ``path`` when it was made with the same recipe; else builds the prompts from the
    training corpus, generates the continuations and saves them there."""
    recipe = _recipe(target_dir, num_prompts, max_new_tokens, max_prompt_len, seed)
    if path.is_file():
        data, meta = SequenceSet.load(path)
        if meta.get("recipe") == recipe:
            log(f"reusing {len(data)} generated sequences from {path}")
            return data, meta
        log(f"{path} was made with another recipe ({meta.get('recipe')}); generating again")
    corpus = _Corpus.build(target_dir, num_prompts, max_prompt_len, seed)
    data, meta = corpus.generate(
        range(len(corpus.prompts)), max_new_tokens, num_threads=num_threads, log=log
    )
    meta = {"recipe": recipe, **meta}
    data.save(path, meta)
    return data, meta


def prepare_shards(
    target_dir: Path,
    out_dir: Path,
    *,
    num_prompts: int,
    shard_size: int,
    num_shards: int | None,
    max_new_tokens: int,
    max_prompt_len: int,
    seed: int,
    num_threads: int | None,
    max_num_seqs: int = 64,
    self_instruct: int = 0,
    self_instruct_openers: Sequence[str] = (),
    log: Log = print,
) -> list[Path]:
    """Self-distillation data in shards of ``shard_size`` sequences (``shardNNN.safetensors``
    in ``out_dir``), for sets larger than one sitting: the corpus's ``num_prompts`` prompts
    and ``self_instruct`` messages the target writes itself (``training.self_instruct``,
    kept in ``out_dir/self_instruct.jsonl``; each begun with the next of
    ``self_instruct_openers`` when given), shuffled together, cut into shards; the first
    ``num_shards`` (None: all) are made. A shard
    already there with the same recipe is kept, so a stopped run resumes where it was and a
    later run with a larger ``num_shards`` adds to the set; the corpus is built only when a
    shard must be made. Returns the paths of the shards there now (fewer than asked when
    the corpus runs dry)."""
    if shard_size <= 0:
        raise ValueError(f"shard_size: must be positive, got {shard_size}")
    corpus: _Corpus | None = None  # built once a shard must be made: a resumed set needs none
    if self_instruct < 0:
        raise ValueError(f"self_instruct: must be >= 0, got {self_instruct}")
    wanted = -(-(num_prompts + self_instruct) // shard_size)
    wanted = wanted if num_shards is None else min(num_shards, wanted)
    base = _recipe(target_dir, num_prompts, max_new_tokens, max_prompt_len, seed)
    if self_instruct:  # absent when 0: sets made before self-instruct keep their recipe
        base["self_instruct"] = self_instruct
    if self_instruct_openers and not self_instruct:
        raise ValueError("self_instruct_openers: given, but no self_instruct messages asked for")
    if self_instruct_openers:
        base["self_instruct_openers"] = list(self_instruct_openers)
    paths = []
    for index in range(wanted):
        path = out_dir / f"shard{index:03d}.safetensors"
        recipe = {**base, "shard_size": shard_size, "shard": index}
        if path.is_file() and SequenceSet.read_meta(path).get("recipe") == recipe:
            log(f"shard {index + 1}/{wanted}: {path} is there")
            paths.append(path)
            continue
        if corpus is None:
            corpus = _Corpus.build(
                target_dir,
                num_prompts,
                max_prompt_len,
                seed,
                self_instruct=self_instruct,
                self_instruct_openers=tuple(self_instruct_openers),
                self_instruct_cache=out_dir / "self_instruct.jsonl",
                num_threads=num_threads,
                max_num_seqs=max_num_seqs,
                log=log,
            )
        rows = range(index * shard_size, min((index + 1) * shard_size, len(corpus.prompts)))
        if not rows:  # the corpus ran dry before num_prompts
            break
        log(f"shard {index + 1}/{wanted}: generating {path}")
        data, meta = corpus.generate(
            rows, max_new_tokens, num_threads=num_threads, max_num_seqs=max_num_seqs, log=log
        )
        data.save(path, {"recipe": recipe, **meta})
        paths.append(path)
    return paths


def _recipe(
    target_dir: Path, num_prompts: int, max_new_tokens: int, max_prompt_len: int, seed: int
) -> dict[str, Any]:
    """What generated data depends on: a saved set is reused only under an equal recipe."""
    return {
        "target": str(target_dir),
        "num_prompts": num_prompts,
        "max_new_tokens": max_new_tokens,
        "max_prompt_len": max_prompt_len,
        "seed": seed,
    }


@dataclass
class _Corpus:
    """The training prompts of a recipe, as text and as the target's chat-template ids."""

    target_dir: Path
    tokenizer: Any
    prompts: list[Prompt]
    prompt_ids: list[list[int]]

    @classmethod
    def build(
        cls,
        target_dir: Path,
        num_prompts: int,
        max_prompt_len: int,
        seed: int,
        *,
        self_instruct: int = 0,
        self_instruct_openers: tuple[str, ...] = (),
        self_instruct_cache: Path | None = None,
        num_threads: int | None = None,
        max_num_seqs: int = 64,
        log: Log = print,
    ) -> _Corpus:
        """The corpus's prompts, plus ``self_instruct`` messages by the target (disjoint
        from them and from the held-out sets), shuffled together when there are both."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(target_dir)
        prompts = build_corpus(num_prompts, seed=seed)
        if self_instruct:
            prompts += self_instruct_prompts(
                target_dir,
                tokenizer,
                SelfInstructRecipe(count=self_instruct, seed=seed, openers=self_instruct_openers),
                exclude=[p.text for p in prompts],
                cache=self_instruct_cache,
                num_threads=num_threads,
                max_num_seqs=max_num_seqs,
                log=log,
            )
            random.Random(seed).shuffle(prompts)
        if not prompts:
            raise ValueError("corpus: no training prompts found on this machine")
        ids = chat_prompt_ids(tokenizer, [p.text for p in prompts], max_prompt_len)
        return cls(target_dir, tokenizer, prompts, ids)

    def generate(
        self,
        rows: Sequence[int],
        max_new_tokens: int,
        *,
        num_threads: int | None,
        max_num_seqs: int = 64,
        log: Log = print,
    ) -> tuple[SequenceSet, dict[str, Any]]:
        """The target's continuations of the prompts ``rows``, and what to record of them."""
        prompt_ids = [self.prompt_ids[i] for i in rows]
        continuations, stats = generate_continuations(
            self.target_dir,
            prompt_ids,
            max_new_tokens,
            num_threads=num_threads,
            max_num_seqs=max_num_seqs,
            log=log,
        )
        data = SequenceSet(
            [p + c for p, c in zip(prompt_ids, continuations, strict=True)],
            [len(p) for p in prompt_ids],
            special_token_ids(self.tokenizer),
        )
        sources: dict[str, int] = {}
        for i in rows:
            sources[self.prompts[i].source] = sources.get(self.prompts[i].source, 0) + 1
        meta = {
            "corpus_sources": corpus_sources(),
            "prompts_per_source": sources,
            "generation": stats,
        }
        return data, meta
