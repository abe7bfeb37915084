"""``--soft-labels K``: the target's top K next tokens at every position, cached beside the
features, and a draft trained on them alone serves as a greedy-trained one does."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
import torch
from safetensors.torch import load_file

from engine.models.llama3 import Llama3Model
from engine.registry import load_model
from engine.spec.drafters import new_drafter
from tests.training.tiny_training import config, load_hf, run_engine
from training.data import SequenceSet
from training.feature_cache import load_or_compute
from training.features import TargetFeatures
from training.recipes import RECIPES, DraftOptions, draft_hf_config
from training.train_draft import train_draft


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
