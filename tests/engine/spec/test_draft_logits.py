"""A reduced draft vocabulary is scored where it is: greedy drafts and the training loss
over its own tokens equal what the scores spread over the target vocabulary give."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.spec.drafters import DraftLogits
from engine.train.objectives import masked_ce

VOCAB = 40


def reduced(rows: int = 6) -> DraftLogits:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randperm(VOCAB, generator=gen)[:12].sort().values
    values = torch.randn((rows, 12), generator=gen).round(decimals=1)  # ties within rows
    values[0, 3] = values[0, 7] = values[0].max() + 1  # a tie for the top
    return DraftLogits(values, ids, VOCAB)


def test_greedy_drafts_and_the_spread_scores_agree() -> None:
    scores = reduced()
    assert scores.token_ids is not None
    full = scores.full()
    assert full.shape == (6, VOCAB)
    outside = torch.ones(VOCAB, dtype=torch.bool).index_fill(0, scores.token_ids, False)
    assert torch.isneginf(full[:, outside]).all()
    assert torch.equal(full[:, scores.token_ids], scores.values)
    assert torch.equal(scores.argmax(), full.argmax(dim=-1))  # ties: the lowest target id
    assert int(scores.argmax()[0]) == int(scores.token_ids[3])

    everyone = torch.arange(VOCAB)
    index = scores.index_of(everyone)
    assert torch.equal(index[scores.token_ids], torch.arange(12))
    assert (index[outside] == -1).all()

    dense = DraftLogits(full)  # the whole target vocabulary: nothing to map
    assert dense.full() is full and torch.equal(dense.index_of(everyone), everyone)
    assert torch.equal(dense.argmax(), scores.argmax())


def test_the_loss_over_the_draft_vocabulary_is_the_loss_over_the_spread_scores() -> None:
    scores = reduced()
    assert scores.token_ids is not None
    labels = torch.tensor([int(scores.token_ids[3]), 0, int(scores.token_ids[0]), 5, 39, 1])
    is_valid = torch.tensor([True, True, True, False, True, True])
    ce, accuracy = masked_ce(scores, labels, is_valid)

    full = scores.full()
    emittable = torch.isfinite(full.gather(1, labels[:, None]).squeeze(1))
    keep = is_valid & emittable
    assert int(keep.sum()) >= 2
    torch.testing.assert_close(ce, F.cross_entropy(full[keep], labels[keep]))
    correct = (full.argmax(dim=-1) == labels) & is_valid
    assert accuracy == int(correct.sum()) / int(is_valid.sum())
