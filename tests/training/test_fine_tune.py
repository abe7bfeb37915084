"""``--init-from``: fine-tuning goes on from a trained draft, and an EAGLE-3 draft's
vocabulary is chosen again from the new data, keeping the rows it learned."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import cast

import pytest
import torch
from safetensors.torch import load_file

from engine.models.llama3 import Llama3Model
from engine.registry import load_model
from engine.spec.drafters import new_drafter
from tests.training.tiny_training import VOCAB, config, load_hf
from training.data import SequenceSet
from training.recipes import RECIPES, DraftOptions, draft_hf_config, draft_vocab
from training.train_draft import train_draft


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
