"""The draft trainer on a tiny target: training lowers the loss, the saved draft loads and
speeds up the engine losslessly, training from the feature cache matches training without
it, data files concatenate in order, a run resumes exactly where it stopped, and the CLI
trains and reports errors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from safetensors.torch import load_file

import training.train_draft as train_module
from engine.models.llama3 import Llama3Model
from engine.registry import load_model
from engine.spec.drafters import load_drafter
from tests.training.tiny_training import NEW_TOKENS, K, config, run_engine
from training.cli import register_train_draft
from training.data import SequenceSet, load_sequence_files
from training.evaluate import decoding_acceptance
from training.features import TargetFeatures
from training.train_draft import train_draft


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


def test_device_is_checked_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="device: 'gpu0' is not a torch device"):
        config(tmp_path, tmp_path / "out", "eagle3", device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="this machine has no CUDA device"):
            config(tmp_path, tmp_path / "out", "eagle3", device="cuda")
    assert config(tmp_path, tmp_path / "out", "eagle3", device="cpu").device == "cpu"


def test_num_layers_follow_the_drafter_kind(tmp_path: Path) -> None:
    for kind in ("eagle", "eagle3"):
        with pytest.raises(ValueError, match=f"num_layers: an {kind} draft has one layer"):
            config(tmp_path, tmp_path / "out", kind, num_layers=2)
        assert config(tmp_path, tmp_path / "out", kind, num_layers=None).options().num_layers == 1
    assert config(tmp_path, tmp_path / "out", "dflash", num_layers=None).options().num_layers == 2
    assert config(tmp_path, tmp_path / "out", "dflash", num_layers=3).options().num_layers == 3


def test_a_time_budget_stops_training_mid_epoch_and_decays_the_rate_over_it(
    tiny: tuple[Path, SequenceSet], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clock that moves 1 s each time it is read: a 5 s budget stops the first of 5
    epochs after a few steps, which are evaluated once and saved (no checkpoint); the
    rate warms up and decays over the budget's time, whatever the step."""
    target, data = tiny
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0
        return now[0]

    monkeypatch.setattr(train_module.time, "monotonic", clock)
    out = tmp_path / "boxed"
    manifest = train_draft(
        config(target, out, "eagle3", epochs=5, time_budget_s=5.0), data, log=lambda _: None
    )
    (epoch,) = manifest["history"]
    monkeypatch.undo()
    whole = train_draft(config(target, tmp_path / "whole", "eagle3"), data, log=lambda _: None)
    assert 0 < epoch["steps"] < whole["history"][0]["steps"]  # cut before the epoch's end
    assert manifest["heldout_tau"] is not None and (out / "manifest.json").is_file()
    assert not (out / "checkpoint").exists()
    # Warmup over the budget's first 5 % and decay over the rest, in time, at any step.
    boxed = config(target, out, "eagle3", time_budget_s=100.0, warmup_fraction=0.05)
    assert train_module.lr_at(900, 1000, boxed, elapsed_s=2.5) == pytest.approx(0.5 * boxed.lr)
    assert train_module.lr_at(5, 1000, boxed, elapsed_s=5.0) == pytest.approx(boxed.lr)
    assert train_module.lr_at(5, 1000, boxed, elapsed_s=52.5) == pytest.approx(0.55 * boxed.lr)
    assert train_module.lr_at(5, 1000, boxed, elapsed_s=100.0) == pytest.approx(0.1 * boxed.lr)


def test_named_sets_are_decoded_by_the_trained_draft_as_its_hold_out_is(
    tiny: tuple[Path, SequenceSet], tmp_path: Path
) -> None:
    """``evaluate_on``: the trainer's own held-out split, named, decodes to the manifest's
    held-out decoding tau; a set of its training sequences, to a tau of its own; both in
    the manifest written to disk."""
    target, data = tiny
    train, val = data.split(0.1, seed=0)  # as the trainer splits
    out = tmp_path / "named"
    sets = {"heldout": val, "seen": train.subset(range(4))}
    manifest = train_draft(
        config(target, out, "eagle3", epochs=3), data, log=lambda _: None, evaluate_on=sets
    )
    taus = manifest["decoding_tau_on"]
    assert set(taus) == {"heldout", "seen"}
    assert taus["heldout"] == round(manifest["heldout_decoding_tau"], 4)
    assert taus["seen"] >= 1.0
    assert json.loads((out / "manifest.json").read_text())["decoding_tau_on"] == taus
