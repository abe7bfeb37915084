"""A reduced draft vocabulary is scored where it is: greedy drafts and the training loss
over its own tokens equal what the scores spread over the target vocabulary give."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.spec.drafters import DraftLogits
from training.objectives import masked_ce

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


def test_the_soft_label_loss_is_the_cross_entropy_with_the_renormalised_target_top_k() -> None:
    scores = reduced()
    assert scores.token_ids is not None
    inside = scores.token_ids.tolist()
    outside = sorted(set(range(VOCAB)) - set(inside))
    # Row 0: all three inside; row 1: one outside (dropped, the rest renormalised);
    # row 2: all outside (no loss); row 3: not valid; rows 4, 5: inside.
    token_ids = torch.tensor(
        [
            [inside[3], inside[0], inside[5]],
            [inside[1], outside[0], inside[2]],
            [outside[1], outside[2], outside[3]],
            [inside[4], inside[6], inside[7]],
            [inside[8], inside[9], inside[10]],
            [inside[11], inside[2], inside[0]],
        ]
    )
    probs = torch.tensor(
        [[0.5, 0.3, 0.1], [0.4, 0.4, 0.1], [0.9, 0.05, 0.01]] + [[0.6, 0.2, 0.1]] * 3
    )
    labels = token_ids[:, 0]
    is_valid = torch.tensor([True, True, True, False, True, True])
    ce, accuracy = masked_ce(scores, labels, is_valid, (probs, token_ids))

    log_q = scores.full().log_softmax(dim=-1)
    expected = []
    for r in (0, 1, 4, 5):
        keep = torch.isfinite(log_q[r, token_ids[r]])
        p = probs[r] * keep
        expected.append(-(p / p.sum() * log_q[r, token_ids[r]].where(keep, 0.0)).sum())
    torch.testing.assert_close(ce, torch.stack(expected).mean())
    assert accuracy == masked_ce(scores, labels, is_valid)[1]  # against the greedy label

    one_hot = (torch.tensor([[1.0, 0.0, 0.0]]).expand(6, 3), token_ids)
    keep = is_valid & (scores.index_of(labels) >= 0)
    hard, _ = masked_ce(scores, labels, keep)
    torch.testing.assert_close(masked_ce(scores, labels, keep, one_hot)[0], hard)
