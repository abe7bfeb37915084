"""The draft trainer on a tiny target: training lowers the loss, the saved draft loads and
speeds up the engine losslessly, training attention equals serving attention, cached fp16
target features train like features computed per batch, and a run resumes exactly where it
stopped."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from safetensors.torch import load_file

import training.train_draft as train_module
from engine.llm_engine import EngineConfig, LLMEngine
from engine.models.llama3 import Llama3Model
from engine.registry import load_model
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from engine.spec.drafters import DraftLogits, load_drafter, new_drafter
from engine.spec.stats import SpecDecodeStats
from tests.engine.tiny_models import build_tiny_llama
from training.attention import TrainAttentionBackend
from training.cli import register_train_draft
from training.data import SequenceSet, load_sequence_files, pad
from training.evaluate import decoding_acceptance, propose_at
from training.feature_cache import load_or_compute
from training.features import TargetFeatures
from training.generation import generate_continuations
from training.objectives import Batch, Objective, sample_anchors
from training.recipes import RECIPES, DraftOptions, draft_hf_config, draft_vocab
from training.train_draft import TrainConfig, train_draft

VOCAB = 128
NEW_TOKENS = 40
K = 4  # drafts per step when serving (DFlash: its block of 4, so 3)


def build_target(out: Path, shape: str) -> Path:
    build_tiny_llama(out, shape, vocab_size=VOCAB, num_layers=2)
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, SequenceSet]:
    """A tiny target and its own fp32 greedy continuations of a few random prompts: loops
    of period 1 to 13, so a draft must learn which token follows which in context."""
    target = build_target(tmp_path_factory.mktemp("target"), "mha_plain")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (8,), generator=gen).tolist() for _ in range(9)]
    continuations, _ = generate_continuations(
        target, prompts, NEW_TOKENS, dtype="float32", log=lambda _: None
    )
    data = SequenceSet(
        [p + c for p, c in zip(prompts, continuations, strict=True)], [len(p) for p in prompts]
    )
    return target, data


def config(target: Path, out: Path, kind: str, **overrides: object) -> TrainConfig:
    values: dict[str, object] = dict(
        target=str(target),
        kind=kind,
        out=str(out),
        epochs=20,
        batch_size=2,
        lr=2e-2,
        anchors_per_seq=0,
        intermediate_size=64,
        num_layers=1,
        block_size=4,
        draft_vocab_size=96,
        val_fraction=0.1,
        threads=1,
    )
    values.update(overrides)
    return TrainConfig(**values)  # type: ignore[arg-type]


def run_engine(
    target: Path, prompt: list[int], draft: Path | None, max_tokens: int = NEW_TOKENS
) -> tuple[list[int], SpecDecodeStats]:
    spec = None if draft is None else SpeculativeConfig(draft_model=str(draft), num_draft_tokens=K)
    engine = LLMEngine(
        EngineConfig(model=str(target), dtype="float32", kv_cache_memory=8 << 20, speculative=spec)
    )
    engine.add_request("r", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.token_ids
    return tokens, engine.spec.stats if engine.spec is not None else SpecDecodeStats()


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "dflash"])
def test_training_lowers_loss_and_the_draft_serves(
    tiny: tuple[Path, SequenceSet], tmp_path: Path, kind: str
) -> None:
    target, data = tiny
    out = tmp_path / kind
    manifest = train_draft(config(target, out, kind), data, log=lambda _: None)
    losses = [h["loss"] for h in manifest["history"]]
    assert losses[-1] <= 0.7 * losses[0], losses
    assert (out / "manifest.json").is_file()

    model = cast(Llama3Model, load_model(target, dtype="float32")[0])
    assert load_drafter(out, model, torch.device("cpu")).kind == kind
    saved = load_file(out / "model.safetensors")
    assert {t.dtype for t in saved.values() if t.is_floating_point()} == {torch.float16}

    train, _ = data.split(0.1, seed=0)  # as the trainer splits
    longest_loop = max(train.sequences, key=lambda s: len(set(s[8:])))
    plain, _ = run_engine(target, longest_loop[:8], None)
    spec, stats = run_engine(target, longest_loop[:8], out)
    assert spec == plain == longest_loop[8:]
    assert stats.mean_accepted_length > 1.5, stats.as_dict()

    # The trainer's decoding walk over the same text counts what the engine counted, as
    # long as every step's drafts fall inside the known continuation.
    budget = NEW_TOKENS - K - 1
    _, served = run_engine(target, longest_loop[:8], out, budget)
    drafter = load_drafter(out, model, torch.device("cpu"))
    features = TargetFeatures(model, drafter, torch.device("cpu")).ragged([longest_loop])
    walked = decoding_acceptance(drafter, SequenceSet([longest_loop], [8]), features, K, budget)
    assert walked.as_dict() == served.as_dict()
    assert walked.num_drafts < budget  # speculation took fewer steps than tokens


@pytest.mark.parametrize("shape", ["mha_plain", "gqa3_llama3rope_tied_bias_hd40"])
@pytest.mark.parametrize("kind", ["eagle", "eagle3", "dflash"])
def test_training_attention_equals_serving_attention(
    tiny: tuple[Path, SequenceSet], tmp_path: Path, kind: str, shape: str
) -> None:
    """Teacher-forced drafting on the dense training backend gives the logits that the
    serving path (paged cache, torch backend, one row per anchor) gives, for every step."""
    _, data = tiny
    target_dir = build_target(tmp_path / shape, shape)
    target = cast(Llama3Model, load_model(target_dir, dtype="float32")[0])
    opts = DraftOptions(64, 1, 4, 3, 96, 0)
    hf = draft_hf_config(RECIPES[kind], load_hf(target_dir), opts, data)
    drafter = new_drafter(kind, hf, target, torch.device("cpu"), seed=1)
    with torch.no_grad():  # larger than the default init, so attention is not uniform
        for name, p in cast(torch.nn.Module, drafter).named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
    seqs = data.sequences[:3]
    batch = Batch(
        pad(seqs, torch.device("cpu")),
        torch.tensor([len(s) for s in seqs]),
        torch.tensor(data.prompt_lens[:3]),
    )
    features = TargetFeatures(target, drafter, torch.device("cpu"))
    k = drafter.fixed_num_draft_tokens or 3
    kv = [(torch.empty(0), torch.empty(0)) for _ in range(drafter.config.num_hidden_layers)]
    objective = Objective(drafter, k, 5, [1.0] * k)
    feats, _ = features.padded(seqs)
    trained = objective(batch, feats, TrainAttentionBackend(), kv, gen(7)).logits

    anchors, _ = sample_anchors(batch, 5, gen(7))
    rows = [(b, int(p)) for b in range(len(seqs)) for p in anchors[b]]
    width = batch.tokens.shape[1]  # the objective feeds padding past a sequence's end
    teacher = torch.tensor(
        [[int(batch.tokens[b, min(p + 2 + j, width - 1)]) for j in range(k)] for b, p in rows]
    )
    served: list[DraftLogits] = []

    def select(logits: DraftLogits, j: int) -> torch.Tensor:
        served.append(logits)
        return teacher[:, j]

    with torch.no_grad():
        propose_at(drafter, seqs, features.ragged(seqs), rows, k, select)
    assert len(trained) == len(served) == k
    for j, (a, b) in enumerate(zip(trained, served, strict=True)):
        assert a.values.shape == b.values.shape  # the draft vocabulary, not spread out
        full = a.full().detach()  # -inf where the draft cannot emit: equal there too
        torch.testing.assert_close(full, b.full(), rtol=1e-4, atol=1e-4, msg=f"step {j}")


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "dflash"])
def test_cached_fp16_features_give_the_loss_of_features_computed_per_batch(
    tiny: tuple[Path, SequenceSet], tmp_path: Path, kind: str
) -> None:
    """The cache holds the fp32 features rounded to fp16, so a batch's loss moves by no
    more than that rounding; a second run reads the file, other sequences replace it."""
    target_dir, data = tiny
    target = cast(Llama3Model, load_model(target_dir, dtype="float32")[0])
    opts = DraftOptions(64, 1, 4, 3, 96, 0)
    hf = draft_hf_config(RECIPES[kind], load_hf(target_dir), opts, data)
    drafter = new_drafter(kind, hf, target, torch.device("cpu"), seed=1)
    features = TargetFeatures(target, drafter, torch.device("cpu"))
    cache, info = load_or_compute(tmp_path, kind, target_dir, features, data, 4, lambda _: None)
    assert not info["is_reused"]
    assert load_file(info["file"])["features"].dtype == torch.float16

    indices = [5, 0, 7]
    seqs = [data.sequences[i] for i in indices]
    (fresh, _), (cached, _) = features.padded(seqs), cache.padded(indices)  # [B, L, F] fp32
    assert cached.dtype == torch.float32
    torch.testing.assert_close(cached, fresh, rtol=2**-11, atol=1e-6)  # fp16: 11-bit mantissa
    batch = Batch(
        pad(seqs, torch.device("cpu")),
        torch.tensor([len(s) for s in seqs]),
        torch.tensor([data.prompt_lens[i] for i in indices]),
    )
    k = drafter.fixed_num_draft_tokens or 3
    kv = [(torch.empty(0), torch.empty(0)) for _ in range(drafter.config.num_hidden_layers)]
    objective = RECIPES[kind].objective(drafter, k, 0)
    a, b = (objective(batch, f, TrainAttentionBackend(), kv, gen(3)).loss for f in (fresh, cached))
    torch.testing.assert_close(b, a, rtol=1e-4, atol=0)

    again, info_again = load_or_compute(
        tmp_path, kind, target_dir, features, data, 4, lambda _: None
    )
    assert info_again["is_reused"] and info_again["file"] == info["file"]
    assert torch.equal(again.store["features"], cache.store["features"])
    _, other = load_or_compute(
        tmp_path, kind, target_dir, features, data.subset(range(4)), 4, lambda _: None
    )
    assert other["file"] != info["file"]
    assert [p.name for p in tmp_path.glob("features-*")] == [Path(other["file"]).name]


def test_soft_labels_are_the_target_top_k_at_every_position_and_cached_beside_features(
    tiny: tuple[Path, SequenceSet], tmp_path: Path
) -> None:
    """``--soft-labels K``: position i holds the target's K likeliest tokens for i + 1 (the
    greedy continuation's token first), cached in fp16 / int32 under their own key."""
    target_dir, data = tiny
    target = cast(Llama3Model, load_model(target_dir, dtype="float32")[0])
    opts = DraftOptions(64, 1, 4, 3, 96, 0)
    hf = draft_hf_config(RECIPES["eagle3"], load_hf(target_dir), opts, data)
    drafter = new_drafter("eagle3", hf, target, torch.device("cpu"), seed=1)
    features = TargetFeatures(target, drafter, torch.device("cpu"), top_k=5)
    seqs = data.sequences[:3]
    feats, soft = features.padded(seqs)
    assert soft is not None and soft.probs.shape == soft.token_ids.shape == (*feats.shape[:2], 5)
    plain, none = TargetFeatures(target, drafter, torch.device("cpu")).padded(seqs)
    assert none is None and torch.equal(feats, plain)

    for b, seq in enumerate(seqs):
        logits = full_logits(target, seq)  # [len, V]
        probs, ids = logits.softmax(dim=-1).topk(5, dim=-1)
        n = len(seq)
        torch.testing.assert_close(soft.probs[b, :n], probs, rtol=1e-5, atol=1e-6)
        assert torch.equal(soft.token_ids[b, :n], ids)
        assert (soft.probs[b, n:] == 0).all()
        start = data.prompt_lens[b]  # the continuation is the target's own greedy choice
        assert soft.token_ids[b, start - 1 : n - 1, 0].tolist() == seq[start:]

    log = lambda _: None  # noqa: E731
    cache, info = load_or_compute(tmp_path, "eagle3", target_dir, features, data, 4, log)
    stored = load_file(info["file"])
    assert (stored["top_probs"].dtype, stored["top_ids"].dtype) == (torch.float16, torch.int32)
    cached_feats, cached_soft = cache.padded([0, 1, 2])
    assert cached_soft is not None and torch.equal(cached_soft.token_ids, soft.token_ids)
    torch.testing.assert_close(cached_feats, feats, rtol=2**-11, atol=1e-6)
    torch.testing.assert_close(cached_soft.probs, soft.probs, rtol=2**-11, atol=1e-6)
    plain_features = TargetFeatures(target, drafter, torch.device("cpu"))
    _, plain_info = load_or_compute(
        tmp_path / "plain", "eagle3", target_dir, plain_features, data, 4, log
    )
    assert Path(plain_info["file"]).name != Path(info["file"]).name  # a different key
    assert "top_probs" not in load_file(plain_info["file"])


def sharpened(target: Path, out: Path) -> Path:
    """A copy of ``target`` whose final norm weight is 30x: the same argmax everywhere."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(target, out)
    for path in out.glob("*.safetensors"):
        weights = load_file(path)
        weights["model.norm.weight"] = weights["model.norm.weight"] * 30
        save_file(weights, path, metadata={"format": "pt"})
    return out


def full_logits(target: Llama3Model, seq: list[int]) -> torch.Tensor:
    """The target's fp32 logits at every position of one sequence, from a fresh cache."""
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.kv_cache import KVCacheParams, PagedKVCache
    from training.features import BLOCK_SIZE, prefill_layout

    layout = prefill_layout([len(seq)], torch.device("cpu"))
    params = KVCacheParams.from_config(target.config, BLOCK_SIZE)
    kv = PagedKVCache(params, -(-len(seq) // BLOCK_SIZE), torch.device("cpu"))
    backend = TorchAttentionBackend()
    with torch.no_grad():
        out = target(
            torch.tensor(seq),
            layout.positions,
            kv.layers,
            backend,
            backend.build_metadata(layout),
            torch.arange(len(seq)),
        )
    return out.logits


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_training_on_soft_labels_lowers_their_loss_and_the_draft_serves(
    tiny: tuple[Path, SequenceSet], tmp_path: Path, kind: str
) -> None:
    """On a target as sure of its next token as a trained one (the random target's final
    norm scaled 30x: the same greedy tokens, logits 30x sharper), a draft trained only on
    the target's top 8 serves as the greedy-trained one does; labels shifted by a position
    would not. (The random target's own distribution is nearly flat: its top 8 teach
    little.)"""
    target, data = sharpened(tiny[0], tmp_path / "sharp"), tiny[1]
    out = tmp_path / "draft"
    manifest = train_draft(config(target, out, kind, soft_labels=8), data, log=lambda _: None)
    assert manifest["config"]["soft_labels"] == 8
    losses = [h["loss"] for h in manifest["history"]]
    assert losses[-1] < losses[0] - 1.0, losses

    train, _ = data.split(0.1, seed=0)  # as the trainer splits
    longest_loop = max(train.sequences, key=lambda s: len(set(s[8:])))
    plain, _ = run_engine(target, longest_loop[:8], None)
    spec, stats = run_engine(target, longest_loop[:8], out)
    assert spec == plain == longest_loop[8:]
    tau = stats.mean_accepted_length
    assert tau > 2.0, tau  # 3.4 (EAGLE-3) and 2.3 (DFlash); shifted labels: 1.4
    with pytest.raises(ValueError, match="soft_labels: must be >= 0, got -1"):
        config(target, tmp_path / "x", kind, soft_labels=-1)


def test_training_from_the_feature_cache_matches_training_without_it(
    tiny: tuple[Path, SequenceSet], tmp_path: Path
) -> None:
    target, data = tiny
    runs = [
        train_draft(
            config(target, tmp_path / str(is_cached), "eagle3", epochs=3, feature_cache=is_cached),
            data,
            log=lambda _: None,
        )
        for is_cached in (True, False)
    ]
    assert runs[0]["feature_cache"]["file"].startswith(str(tmp_path / "True" / "data"))
    assert runs[1]["feature_cache"] is None
    cached, fresh = ([h["loss"] for h in run["history"]] for run in runs)
    torch.testing.assert_close(cached, fresh, rtol=1e-4, atol=0)


def test_data_files_concatenate_in_sorted_order(
    tiny: tuple[Path, SequenceSet], tmp_path: Path
) -> None:
    _, data = tiny
    shards = tmp_path / "shards"
    data.subset(range(5, 9)).save(shards / "shard001.safetensors", {"shard": 1})
    data.subset(range(5)).save(shards / "shard000.safetensors", {"shard": 0})
    data.subset(range(2)).save(tmp_path / "extra.safetensors", {})
    loaded, meta = load_sequence_files([shards / "shard001.safetensors", shards])
    assert loaded.sequences == data.sequences and loaded.prompt_lens == data.prompt_lens
    assert [(Path(f["path"]).name, f["num_sequences"], f["meta"]) for f in meta["files"]] == [
        ("shard000.safetensors", 5, {"shard": 0}),
        ("shard001.safetensors", 4, {"shard": 1}),
    ]
    both, _ = load_sequence_files([shards, tmp_path / "extra.safetensors"])
    assert both.sequences == data.sequences[:2] + data.sequences  # "extra" < "shards/..."
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no"):
        load_sequence_files([tmp_path / "empty"])
    with pytest.raises(ValueError, match="neither a file nor a directory"):
        load_sequence_files([tmp_path / "nowhere"])
    SequenceSet(data.sequences[:1], data.prompt_lens[:1], (1,)).save(shards / "x.safetensors", {})
    with pytest.raises(ValueError, match="special_token_ids"):
        load_sequence_files([shards])


def test_resume_continues_exactly_where_a_run_stopped(
    tiny: tuple[Path, SequenceSet], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target, data = tiny
    whole = config(target, tmp_path / "whole", "eagle3", epochs=2)
    train_draft(whole, data, log=lambda _: None)

    real_save = train_module.save_checkpoint

    def crash_after_first(*args: Any, **kwargs: Any) -> None:
        real_save(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "save_checkpoint", crash_after_first)
    cut = config(target, tmp_path / "cut", "eagle3", epochs=2)
    with pytest.raises(KeyboardInterrupt):
        train_draft(cut, data, log=lambda _: None)
    monkeypatch.setattr(train_module, "save_checkpoint", real_save)
    lines: list[str] = []
    manifest = train_draft(
        config(target, tmp_path / "cut", "eagle3", epochs=2, resume=True), data, log=lines.append
    )
    assert any("resuming after epoch 1" in line for line in lines)
    assert manifest["feature_cache"]["is_reused"]  # read back from cut/data
    assert [h["epoch"] for h in manifest["history"]] == [1, 2]

    a = load_file(tmp_path / "whole" / "checkpoint" / "model.safetensors")
    b = load_file(tmp_path / "cut" / "checkpoint" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


def test_cli_trains_from_saved_sequences_and_reports_errors(
    tiny: tuple[Path, SequenceSet], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target, data = tiny
    data.subset(range(6)).save(tmp_path / "shards" / "shard000.safetensors", {"note": "test"})
    data.subset(range(6, 9)).save(tmp_path / "shards" / "shard001.safetensors", {})
    parser = argparse.ArgumentParser(prog="tandem")
    register_train_draft(parser.add_subparsers())

    def main(*argv: str) -> int:
        args = parser.parse_args(["train-draft", *argv])
        return int(args.func(args))

    common = ("--kind", "eagle", "--intermediate-size", "64", "--threads", "1")
    out = tmp_path / "draft"
    rc = main(
        "--target",
        str(target),
        "--out",
        str(out),
        "--data",
        str(tmp_path / "shards"),
        "--max-sequences",
        "8",
        "--batch-size",
        "4",
        *common,
    )
    assert rc == 0, capsys.readouterr().err
    assert (out / "config.json").is_file() and (out / "manifest.json").is_file()
    assert "eagle draft in" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    files = [(Path(f["path"]).name, f["num_sequences"]) for f in manifest["data"]["files"]]
    assert files == [("shard000.safetensors", 6), ("shard001.safetensors", 3)]
    assert manifest["data"]["num_sequences"] == 8
    assert Path(manifest["feature_cache"]["file"]).parent == out / "data"

    assert main("--target", str(tmp_path / "nowhere"), "--out", str(out), *common) == 2
    assert "tandem train-draft: error:" in capsys.readouterr().err
    rc = main("--target", str(target), "--out", str(out), "--data", str(tmp_path / "no"), *common)
    assert rc == 2
    assert "is neither a file nor a directory" in capsys.readouterr().err
    rc = main("--target", str(target), "--out", str(out), "--epochs", "0", *common)
    assert rc == 2
    assert "tandem train-draft: error: epochs: must be >= 1" in capsys.readouterr().err


def load_hf(target: Path) -> dict[str, object]:
    from engine.config import read_hf_config

    return read_hf_config(target)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_device_is_checked_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="device: 'gpu0' is not a torch device"):
        config(tmp_path, tmp_path / "out", "eagle3", device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="this machine has no CUDA device"):
            config(tmp_path, tmp_path / "out", "eagle3", device="cuda")
    assert config(tmp_path, tmp_path / "out", "eagle3", device="cpu").device == "cpu"


def test_init_from_fine_tunes_a_trained_draft(
    tiny: tuple[Path, SequenceSet], tmp_path: Path
) -> None:
    target, data = tiny
    base = train_draft(
        config(target, tmp_path / "base", "eagle3", epochs=3), data, log=lambda _: None
    )
    lines: list[str] = []
    tuned = train_draft(
        config(target, tmp_path / "tuned", "eagle3", epochs=1, init_from=str(tmp_path / "base")),
        data,
        log=lines.append,
    )
    assert f"starting from the draft in {tmp_path / 'base'}" in lines
    before = tuned["init_from"]["heldout_tau_before"]
    decoded = tuned["init_from"]["heldout_decoding_tau_before"]
    expected = f"before fine-tuning: held-out tau(K=5) {before:.3f} (decoding: {decoded:.3f})"
    assert expected in lines
    assert tuned["init_from"]["command"] == base["command"]
    assert tuned["init_from"]["heldout_tau"] == base["heldout_tau"]
    # It goes on from where the base draft ended (a fresh draft's first epoch is base's).
    assert tuned["history"][0]["loss"] < base["history"][-1]["loss"] < base["history"][0]["loss"]
    a, b = (load_file(tmp_path / name / "model.safetensors") for name in ("base", "tuned"))
    assert a.keys() == b.keys() and torch.equal(a["d2t"], b["d2t"])  # same data, same vocab
    assert all(not torch.equal(a[name], b[name]) for name in a if name not in ("d2t", "t2d"))

    with pytest.raises(ValueError, match="holds a eagle3 draft, not eagle"):
        train_draft(config(target, tmp_path / "x", "eagle", init_from=str(tmp_path / "base")), data)
    with pytest.raises(ValueError, match="init_from: --resume continues"):
        config(target, tmp_path / "x", "eagle3", init_from="base", resume=True)


def test_the_draft_vocabulary_is_the_most_frequent_tokens_then_the_preferred() -> None:
    data = SequenceSet([[3, 5, 6, 7, 7], [4, 3, 3]], [1, 2])  # continuations: 5, 6, 7, 7, 3
    assert draft_vocab(data, 10, 2).tolist() == [3, 7]  # 3, 5, 6 tie in continuations
    assert draft_vocab(data, 10, 3).tolist() == [3, 5, 7]  # 3 is also in prompts
    assert draft_vocab(data, 10, 3, torch.tensor([6, 9])).tolist() == [3, 6, 7]
    assert draft_vocab(data, 10, 6, torch.tensor([6, 9])).tolist() == [3, 4, 5, 6, 7, 9]


def test_refit_chooses_the_draft_vocabulary_again_and_keeps_learned_rows(
    tiny: tuple[Path, SequenceSet], tmp_path: Path
) -> None:
    target_dir, data = tiny
    target = cast(Llama3Model, load_model(target_dir, dtype="float32")[0])
    opts = DraftOptions(64, 1, 4, 3, 48, 0)
    hf = draft_hf_config(RECIPES["eagle3"], load_hf(target_dir), opts, data)
    old = new_drafter("eagle3", hf, target, torch.device("cpu"), seed=1)
    RECIPES["eagle3"].init_from_target(old, target, data)
    with torch.no_grad():
        old.lm_head.weight.normal_()  # "trained" rows, unlike the target's
        old.fc.weight.normal_()
    # New data with other frequent tokens: sequences of the tiny set, shifted in vocabulary.
    shifted = SequenceSet([[(t + 50) % VOCAB for t in s] for s in data.sequences], data.prompt_lens)
    refit = RECIPES["eagle3"].refit
    assert refit is not None
    new, new_hf = refit(old, hf, target, shifted, dataclasses.replace(opts, draft_vocab_size=40))
    assert new_hf["draft_vocab_size"] == 40 and hf["draft_vocab_size"] == 48
    ids = draft_vocab(shifted, VOCAB, 40, torch.arange(48) + old.d2t)
    assert torch.equal(torch.arange(40) + new.d2t, ids)
    old_ids = (torch.arange(48) + old.d2t).tolist()
    both = [i for i in ids.tolist() if i in old_ids]
    assert 0 < len(both) < 40  # some tokens kept, some new
    assert len(both) > sum(i in old_ids for i in draft_vocab(shifted, VOCAB, 40).tolist())
    for row, token in enumerate(ids.tolist()):
        expected = (
            old.lm_head.weight[old_ids.index(token)]
            if token in old_ids
            else torch.zeros(target.config.hidden_size)  # scores 0 until trained
        )
        assert torch.equal(new.lm_head.weight[row], expected), token
    assert torch.equal(new.fc.weight, old.fc.weight)
    assert torch.equal(
        new.midlayer.self_attn.qkv_proj.weight, old.midlayer.self_attn.qkv_proj.weight
    )
