"""Held-out acceptance: greedy drafting simulated through the serving path.

Each (sequence, anchor p) row runs the draft exactly as a decode step would: ``extend``
over the committed positions 0..p in a fresh paged draft cache with the torch backend,
then ``propose`` after the known next token t[p+1]. The drafts are compared with the
target's own greedy tokens t[p+2]..; tau = 1 + the mean number accepted in a row.

Anchors drawn uniformly weigh every position alike, but decoding does not: a step that
accepts five drafts skips the next five positions, a step that accepts none is followed
by another one position later, so the hard stretches of a text take most of the steps.
``decoding_acceptance`` walks each continuation as greedy decoding runs it, from the
prompt's end, one step after the last, and counts what the engine's ``SpecDecodeStats``
count; its tau is what serving reports on the same text. ``tandem train-draft`` prints
both.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.kv_cache import KVCacheParams, PagedKVCache
from engine.spec.drafters.base import Drafter, ProposeArgs, SelectFn
from engine.spec.stats import SpecDecodeStats
from training.data import SequenceSet
from training.features import BLOCK_SIZE, prefill_layout

Anchor = tuple[int, int]  # (sequence index, last committed position p)


@dataclass
class Acceptance:
    tau: float  # 1 + mean accepted drafts of the first k
    tau_full: float  # the same over all drafts the drafter proposes (DFlash: block_size - 1)
    accepted_per_position: list[float]  # share of rows accepting draft j
    num_anchors: int
    decoding_tau: float | None = None  # tau as decoding the texts would show it
    decoding_steps: int = 0  # the verifying steps that decoding took


def propose_at(
    drafter: Drafter,
    sequences: Sequence[list[int]],
    features: Sequence[torch.Tensor],  # per sequence [len_i, F]
    anchors: Sequence[Anchor],
    k: int,
    select: SelectFn,
) -> torch.Tensor:
    """``k`` drafts after each anchor via ``extend`` and ``propose`` on a paged cache: [R, k]."""
    device = features[0].device
    lookahead = k + max(k, drafter.fixed_num_draft_tokens or 0) + 3
    lengths = [p + 1 for _, p in anchors]
    layout = prefill_layout(lengths, device, [n + lookahead for n in lengths])
    params = KVCacheParams.from_config(drafter.config, BLOCK_SIZE)
    kv = PagedKVCache(params, int(layout.block_tables.max()) + 1, device)
    backend = TorchAttentionBackend()
    shifted = [t for i, p in anchors for t in sequences[i][1 : p + 2]]  # t_{j+1} at j
    state = drafter.extend(
        torch.tensor(shifted, device=device),
        torch.cat([features[i][: p + 1] for i, p in anchors]).to(drafter.config.dtype),
        layout,
        backend.build_metadata(layout),
        kv.layers,
        backend,
    )
    args = ProposeArgs(
        last_index=layout.input_row_offsets[1:] - 1,
        last_positions=torch.tensor([p for _, p in anchors], device=device),
        next_tokens=torch.tensor([sequences[i][p + 1] for i, p in anchors], device=device),
        block_tables=layout.block_tables,
        block_size=BLOCK_SIZE,
        max_context_len=max(lengths) + lookahead,
    )
    return drafter.propose(state, args, k, select, kv.layers, backend)


def accepted_prefix(
    drafter: Drafter,
    sequences: Sequence[list[int]],
    features: Sequence[torch.Tensor],
    anchors: Sequence[Anchor],
    num_drafts: int,
) -> torch.Tensor:
    """[R, num_drafts]: 1 where greedy draft j after each anchor and every draft before it
    equal the target's own tokens t[p+2+j], else 0."""
    drafts = propose_at(drafter, sequences, features, anchors, num_drafts, lambda x, j: x.argmax())
    truth = torch.tensor([sequences[i][p + 2 : p + 2 + num_drafts] for i, p in anchors])
    return (drafts.cpu() == truth).long().cumprod(dim=1)


def eval_anchors(data: SequenceSet, span: int, per_seq: int, seed: int) -> list[Anchor]:
    """Up to ``per_seq`` positions p per sequence with p+1 the first continuation token or
    later, and the ``span`` tokens after p+1 all known."""
    rng = random.Random(seed)
    anchors = []
    for i, (seq, n) in enumerate(zip(data.sequences, data.prompt_lens, strict=True)):
        valid = list(range(n - 1, len(seq) - 1 - span))
        anchors += [(i, p) for p in sorted(rng.sample(valid, min(per_seq, len(valid))))]
    return anchors


@torch.no_grad()
def heldout_acceptance(
    drafter: Drafter,
    data: SequenceSet,
    features: Sequence[torch.Tensor],
    k: int = 5,
    per_seq: int = 8,
    seed: int = 0,
    chunk: int = 64,
) -> Acceptance:
    """Greedy acceptance of ``drafter`` on ``data`` (the target's own continuations)."""
    num_drafts = drafter.fixed_num_draft_tokens or k
    anchors = eval_anchors(data, max(k, num_drafts), per_seq, seed)
    if not anchors:
        return Acceptance(1.0, 1.0, [], 0)
    match = torch.cat(
        [
            accepted_prefix(drafter, data.sequences, features, anchors[i : i + chunk], num_drafts)
            for i in range(0, len(anchors), chunk)
        ]
    ).float()
    return Acceptance(
        tau=1.0 + match[:, :k].sum(1).mean().item(),
        tau_full=1.0 + match.sum(1).mean().item(),
        accepted_per_position=[round(x, 4) for x in match.mean(0).tolist()],
        num_anchors=len(anchors),
    )


@torch.no_grad()
def decoding_acceptance(
    drafter: Drafter,
    data: SequenceSet,
    features: Sequence[torch.Tensor],
    k: int = 5,
    max_new_tokens: int | None = None,
    chunk: int = 64,
) -> SpecDecodeStats:
    """The counters greedy speculative decoding of each continuation would show, K = ``k``
    (DFlash: its block): after the prefill has emitted t[n], a step with positions 0..p
    committed verifies the drafts against t[p+2..], emits the ``a`` accepted and the
    target's next token, and the next step starts at p + a + 1. A sequence stops at
    ``max_new_tokens`` emitted or where a step's drafts run past its known tokens."""
    num_drafts = drafter.fixed_num_draft_tokens or k
    stats = SpecDecodeStats()
    rows = [(i, n - 1, 1) for i, n in enumerate(data.prompt_lens)]  # (sequence, p, emitted)

    def running(row: tuple[int, int, int]) -> bool:
        i, p, emitted = row
        within = max_new_tokens is None or emitted < max_new_tokens
        return within and p + 1 + num_drafts < len(data.sequences[i])

    rows = [r for r in rows if running(r)]
    while rows:
        stepped = []
        for start in range(0, len(rows), chunk):
            part = rows[start : start + chunk]
            anchors = [(i, p) for i, p, _ in part]
            match = accepted_prefix(drafter, data.sequences, features, anchors, num_drafts)
            accepted = match.sum(1).tolist()
            stats.record(num_drafts, accepted)
            stepped += [
                (i, p + a + 1, e + a + 1) for (i, p, e), a in zip(part, accepted, strict=True)
            ]
        rows = [r for r in stepped if running(r)]
    return stats
