"""What a draft learns, through its own ``extend`` and ``propose`` (so training and serving
cannot diverge); only attention runs on the dense ``TrainAttentionBackend``.

Each batch first runs ``extend`` teacher-forced over every position (the context), then
``propose`` from anchors p in the continuations, where ``select`` feeds back the target's
own next tokens (training-time test) and keeps the logits for the loss:

- chain (EAGLE, EAGLE-3): draft j after anchor p runs at position p + j over its own
  previous output, sees the context <= p and its chain entries, and is scored against
  t[p+2+j]; step losses weigh 0.8**j. EAGLE adds a feature loss on step 0.
- block (DFlash): the block [t[p+1], MASK...] at p+1.. sees the context <= p and the whole
  block; position j+1 is scored against t[p+2+j] with weight exp(-j/4).

"Scored against t[p+2+j]" is cross-entropy with the target's greedy token, or, with soft
labels (``Batch.soft``), with the target's own distribution over that token's position cut
to its top k: what EAGLE-3 distils. The greedy token is that distribution's mode; the
distribution also says how sure the target was and what came second, which a draft
trained on a few thousand sequences learns from too (measured: drafts/README.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.spec.drafters.base import Drafter, DraftLogits, KVLayers, ProposeArgs
from training.attention import TrainAttentionBackend, context_layout
from training.features import SoftLabels


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, L] int64, right-padded with 0
    lengths: torch.Tensor  # [B] int64
    prompt_lens: torch.Tensor  # [B] int64: continuation starts here
    soft: SoftLabels | None = None  # the target's top-k next tokens: train on those


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, with grad
    step_losses: list[float]  # cross-entropy per draft position
    step_accuracy: list[float]  # teacher-forced top-1 accuracy per draft position
    num_rows: int  # anchors that carried a loss
    logits: list[DraftLogits]  # per draft position: teacher-forced scores of R = B * A rows


def sample_anchors(
    batch: Batch, max_anchors: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors p with t[p+1] the first continuation token or later and t[p+2] known:
    ([B, A] positions, [B, A] bool real). ``max_anchors`` 0: every such position."""
    lo = batch.prompt_lens - 1
    counts = (batch.lengths - 3 - lo + 1).clamp(min=0)  # p in lo .. len-3
    width = int(counts.max()) if max_anchors <= 0 else min(max_anchors, int(counts.max()))
    width = max(width, 1)
    anchors = lo[:, None].repeat(1, width)
    is_real = torch.zeros_like(anchors, dtype=torch.bool)
    for b, n in enumerate(counts.tolist()):
        picked = torch.randperm(n, generator=generator)[:width].sort().values if n else None
        if picked is not None:
            anchors[b, : picked.numel()] += picked.to(anchors.device)
            is_real[b, : picked.numel()] = True
    return anchors, is_real


def masked_ce(
    scores: DraftLogits,
    labels: torch.Tensor,
    is_valid: torch.Tensor,
    soft: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, float]:
    """Mean cross-entropy over valid rows whose label the drafter can emit (a reduced draft
    vocabulary lacks some), over the tokens it scores; top-1 accuracy (against ``labels``)
    over all valid rows.

    ``soft``: ([R, k] probabilities, [R, k] target ids), the target's top k. The loss is
    then the cross-entropy with that distribution, kept to the tokens the drafter can emit
    and renormalised there; rows with none of them carry no loss."""
    with torch.no_grad():
        correct = (scores.argmax() == labels) & is_valid
        accuracy = correct.sum().item() / max(int(is_valid.sum()), 1)
    if soft is None:
        index = scores.index_of(labels)
        keep = is_valid & (index >= 0)
        if not bool(keep.any()):
            return scores.values.sum() * 0.0, accuracy
        return F.cross_entropy(scores.values[keep], index[keep]), accuracy
    probs, token_ids = soft
    index = scores.index_of(token_ids)  # [R, k]
    weights = probs * ((index >= 0) & is_valid[:, None])
    mass = weights.sum(dim=-1)  # [R]
    keep = mass > 0
    if not bool(keep.any()):
        return scores.values.sum() * 0.0, accuracy
    log_q = scores.values[keep].log_softmax(dim=-1).gather(1, index[keep].clamp(min=0))
    p = weights[keep] / mass[keep, None]
    return -(p * log_q).sum(dim=-1).mean(), accuracy


class Objective:
    """The shared skeleton: context, anchors, teacher-forced ``propose``, weighted CE."""

    def __init__(
        self, drafter: Drafter, num_drafts: int, max_anchors: int, weights: list[float]
    ) -> None:
        self.drafter, self.num_drafts, self.max_anchors = drafter, num_drafts, max_anchors
        self.weights = weights

    def __call__(
        self,
        batch: Batch,
        features: torch.Tensor,  # [B, L, F] fp32
        backend: TrainAttentionBackend,
        kv: KVLayers,
        generator: torch.Generator,
    ) -> LossOutput:
        b, n = batch.tokens.shape
        device = batch.tokens.device
        shifted = torch.cat([batch.tokens[:, 1:], batch.tokens[:, :1] * 0], dim=1)  # t_{i+1}
        flat_features = features.reshape(b * n, -1)
        state = self.drafter.extend(
            shifted.reshape(-1),
            flat_features,
            context_layout(b, n, device),
            backend.start(b, n),
            kv,
            backend,
        )
        anchors, is_real = sample_anchors(batch, self.max_anchors, generator)
        rows = torch.arange(b, device=device)[:, None].expand_as(anchors).reshape(-1)  # [R]
        p = anchors.reshape(-1)
        k = self.num_drafts
        label_pos = p[:, None] + 2 + torch.arange(k, device=device)  # [R, k]
        is_valid = is_real.reshape(-1)[:, None] & (label_pos < batch.lengths[rows][:, None])
        labels = batch.tokens[rows[:, None], label_pos.clamp(max=n - 1)]  # [R, k]
        # The target's distribution over t[p+2+j] sits at position p+1+j.
        soft = None
        if batch.soft is not None:
            soft = batch.soft.at(rows[:, None], (label_pos - 1).clamp(max=n - 1))
        logits: list[DraftLogits] = []

        def select(step_logits: DraftLogits, j: int) -> torch.Tensor:
            logits.append(step_logits)
            return labels[:, j]  # teacher forcing: the token an accepted chain would see

        backend.set_anchors(anchors)
        span = n + 2 * k + 2  # every position a row may touch; one dummy block per row
        self.drafter.propose(
            state,
            ProposeArgs(
                last_index=rows * n + p,
                last_positions=p,
                next_tokens=batch.tokens[rows, p + 1],
                block_tables=torch.zeros((rows.numel(), 1), dtype=torch.int64, device=device),
                block_size=span,
                max_context_len=span,
            ),
            k,
            select,
            kv,
            backend,
        )
        loss = flat_features.new_zeros(())
        step_losses, step_accuracy = [], []
        for j, step_logits in enumerate(logits):
            step_soft = (soft[0][:, j], soft[1][:, j]) if soft else None
            ce, accuracy = masked_ce(step_logits, labels[:, j], is_valid[:, j], step_soft)
            loss = loss + self.weights[j] * ce
            step_losses.append(ce.item())
            step_accuracy.append(accuracy)
        loss = loss + self.extra_loss(state, flat_features, rows * n + p, is_real.reshape(-1))
        return LossOutput(loss, step_losses, step_accuracy, int(is_real.sum()), logits)

    def extra_loss(
        self,
        state: torch.Tensor | None,
        features: torch.Tensor,
        last_index: torch.Tensor,
        is_real: torch.Tensor,
    ) -> torch.Tensor:
        return features.new_zeros(())


class EagleObjective(Objective):
    """EAGLE-1: chain CE plus ``feature_weight`` x smooth-L1 between the draft's state at p
    and the target's next hidden state h[p+1] (what EAGLE regresses)."""

    def __init__(self, drafter: Drafter, num_drafts: int, max_anchors: int) -> None:
        super().__init__(drafter, num_drafts, max_anchors, [0.8**j for j in range(num_drafts)])
        self.feature_weight = 0.1

    def extra_loss(
        self,
        state: torch.Tensor | None,
        features: torch.Tensor,
        last_index: torch.Tensor,
        is_real: torch.Tensor,
    ) -> torch.Tensor:
        assert state is not None
        index = last_index[is_real]
        return self.feature_weight * F.smooth_l1_loss(state[index], features[index + 1])


def chain_objective(drafter: Drafter, num_drafts: int, max_anchors: int) -> Objective:
    return Objective(drafter, num_drafts, max_anchors, [0.8**j for j in range(num_drafts)])


def block_objective(drafter: Drafter, num_drafts: int, max_anchors: int) -> Objective:
    k = drafter.fixed_num_draft_tokens or num_drafts
    return Objective(drafter, k, max_anchors, [math.exp(-j / 4) for j in range(k)])


def describe(out: LossOutput) -> dict[str, Any]:
    """The loss, CE and accuracy per draft position, rounded, for logs and the manifest."""
    return {
        "loss": round(out.loss.item(), 4),
        "ce": [round(x, 4) for x in out.step_losses],
        "acc": [round(x, 3) for x in out.step_accuracy],
    }
