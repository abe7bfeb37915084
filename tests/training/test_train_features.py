"""What the trainer shows a draft equals what serving shows it: training attention gives the
serving path's logits, and cached fp16 target features give the loss of fresh ones."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
import torch
from safetensors.torch import load_file

from engine.models.llama3 import Llama3Model
from engine.registry import load_model
from engine.spec.drafters import DraftLogits, new_drafter
from tests.training.tiny_training import build_target, gen, load_hf
from training.attention import TrainAttentionBackend
from training.data import SequenceSet, pad
from training.evaluate import propose_at
from training.feature_cache import load_or_compute
from training.features import TargetFeatures
from training.objectives import Batch, Objective, sample_anchors
from training.recipes import RECIPES, DraftOptions, draft_hf_config


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
