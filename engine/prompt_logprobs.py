"""Prompt logprobs (vLLM's ``prompt_logprobs``, OpenAI's ``echo``): each prompt token's
log-probability given the tokens before it, collected chunk by chunk during prefill.

The logits at position p predict token p + 1, so a chunk computing positions [start, end)
yields the entries of prompt tokens start + 1 .. min(end, P - 1) (P prompt tokens; the
logits at P - 1 are the first sampled token's). The first prompt token has no entry: a
request's list holds tokens 1 .. P - 1. Only rows that ask get the extra lm_head rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.scheduler import ScheduledBatch
from engine.sequence import TokenLogprobs


@dataclass(frozen=True)
class PromptSpan:
    """Row ``row`` of a step needs logits at its positions ``[start, end)`` for its prompt."""

    row: int
    start: int
    end: int
    token_offset: int  # index in the step's flattened tokens of position ``start``


def prompt_spans(batch: ScheduledBatch) -> list[PromptSpan]:
    """The positions of the step whose logits score a later prompt token, per asking row."""
    spans = []
    offset = 0
    for row, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
        start = seq.num_computed_tokens
        end = min(start + num_new, seq.num_prompt_tokens - 1)
        if seq.params.prompt_logprobs is not None and start < end:
            spans.append(PromptSpan(row, start, end, offset))
        offset += num_new
    return spans


def logit_indices(spans: list[PromptSpan]) -> list[int]:
    """Indices into the step's tokens of every span's positions, span after span."""
    return [s.token_offset + i for s in spans for i in range(s.end - s.start)]


def collect(
    batch: ScheduledBatch, spans: list[PromptSpan], logits: torch.Tensor
) -> list[tuple[int, list[TokenLogprobs]]]:
    """(row, entries for prompt tokens start + 1 .. end) per span, from ``logits`` [M, V]
    (the rows of ``logit_indices(spans)``): the raw model distribution, fp32."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [M, V]
    targets = [t for s in spans for t in batch.seqs[s.row].token_ids[s.start + 1 : s.end + 1]]
    chosen = logp.gather(-1, torch.tensor(targets, device=logp.device)[:, None]).squeeze(-1)
    num_top = max(batch.seqs[s.row].params.prompt_logprobs or 0 for s in spans)
    values, ids = logp.topk(num_top, dim=-1)  # [M, k]
    chosen_l, ids_l, values_l = chosen.tolist(), ids.tolist(), values.tolist()
    out = []
    i = 0
    for s in spans:
        k = batch.seqs[s.row].params.prompt_logprobs or 0
        entries = []
        for _ in range(s.end - s.start):
            top = dict(zip(ids_l[i][:k], values_l[i][:k], strict=True))
            entries.append(TokenLogprobs(targets[i], chosen_l[i], top))
            i += 1
        out.append((s.row, entries))
    return out
