"""Accepting draft tokens against the target's logits, per row, without host synchronisation.

Greedy rows accept while the draft equals the target's argmax. Sampled rows use lossless
rejection sampling, so the emitted tokens are distributed exactly as target-only sampling
under each row's logit bias, penalties, temperature, top-k, top-p and min-p. Penalties
apply at every verified position, counting the drafts before it as output (the target
distribution there is the one target-only sampling would have after emitting them); the
drafts themselves are proposed without them. Random numbers are keyed on
(request seed, token position) like ``engine.sampler``, so a seeded request samples the
same tokens however it is batched; with argmax drafts it samples exactly what it would
without speculation.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.sampler import FAULT, SamplingTensors, is_faulty, penalized
from engine.sampling_kernels import ACCEPT_SALT, TORCH_SAMPLING, SamplingKernels, first_rejection

_ACCEPT_SALT = ACCEPT_SALT  # keys the accept/reject coin apart from the token draw
DRAFT_SALT = 0x61C88647  # keys a sampled draft apart from the target's draw


def per_position(t: SamplingTensors, positions: torch.Tensor) -> SamplingTensors:
    """Row parameters repeated for each of S positions: [B, S] positions -> B*S rows."""
    s = positions.shape[1]

    def rep(x: torch.Tensor) -> torch.Tensor:
        return x[:, None].expand(-1, s).reshape(-1)

    return dataclasses.replace(
        t,
        temperature=rep(t.temperature),
        top_k=rep(t.top_k),
        top_p=rep(t.top_p),
        min_p=rep(t.min_p),
        seeds=rep(t.seeds),
        positions=positions.reshape(-1),
        penalties=None,  # applied to the logits before the rows are repeated
    )


def accept(
    logits: torch.Tensor,  # [B, K+1, V] fp32: target logits at the pending token and each draft
    draft_tokens: torch.Tensor,  # [B, K] int64
    sampling: SamplingTensors,  # per row; ``positions`` ignored (taken from ``first_positions``)
    first_positions: torch.Tensor,  # [B] int64: position of the token after the pending one
    draft_probs: torch.Tensor | None = None,  # [B, K, V] what each draft was sampled from
    kernels: SamplingKernels = TORCH_SAMPLING,  # where filters and rejection sampling run
    draft_lengths: torch.Tensor | None = None,  # [B] int64: drafts row b has (<= K); None: K
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``num_accepted`` [B] and ``next_tokens`` [B] (the bonus or recovered token);
    a row whose logits were not finite up to there accepts nothing and gets ``FAULT``.
    Sampled rows follow ``SamplingKernels.accept_sampled``'s rule (written there).

    A row with ``draft_lengths[b] = L < K`` verifies its first L drafts as a row of L
    would: the entries past them are padding, never accepted, and where all L are accepted
    its next token is drawn from the target's distribution at L, as the bonus token is
    (with argmax drafts: the very draw plain decoding makes there)."""
    b, s, v = logits.shape
    k = s - 1
    # Position i's distribution follows the output and drafts[:i]: [B, K+1, V]. Padding
    # counts there only at positions past it, whose distributions are never used.
    logits = penalized(logits, sampling.penalties, draft_tokens)
    if draft_lengths is not None:
        # Padding becomes -1, which no draw or argmax equals; sampled drafts' q there is 0,
        # so the residual at the first padding position is p itself.
        is_real = torch.arange(k, device=logits.device)[None, :] < draft_lengths[:, None]
        draft_tokens = draft_tokens.masked_fill(~is_real, -1)
        if draft_probs is not None:
            draft_probs = draft_probs * is_real[..., None]
    greedy = logits.argmax(dim=-1)  # [B, K+1]
    faulty = is_faulty(logits, greedy)  # [B, K+1]
    if sampling.all_greedy:
        return accept_argmax(greedy, faulty, draft_tokens)

    positions = first_positions[:, None] + torch.arange(s, device=logits.device)  # [B, K+1]
    flat = per_position(sampling, positions)
    probs = kernels.filtered_probs(logits.reshape(b * s, v), flat).view(b, s, v)  # p
    keys = kernels.row_keys(flat.seeds, flat.positions)  # [B*(K+1)]
    if draft_lengths is not None and kernels is not TORCH_SAMPLING:
        kernels = TORCH_SAMPLING  # padded drafts (-1): the torch rule handles them
    sampled_num, sampled_next = kernels.accept_sampled(probs, draft_tokens, keys, draft_probs)

    is_sampled = sampling.temperature > 0  # [B]
    greedy_num = first_rejection(draft_tokens == greedy[:, :k])
    num = torch.where(is_sampled, sampled_num, greedy_num)
    chosen = torch.where(is_sampled, sampled_next, greedy.gather(1, greedy_num[:, None])[:, 0])
    return _unless_faulty(num, chosen, faulty)


def accept_argmax(
    greedy: torch.Tensor,  # [B, K+1] int64: the target's argmax at each position
    faulty: torch.Tensor,  # [B, K+1] bool: logits there were not finite (``is_faulty``)
    draft_tokens: torch.Tensor,  # [B, K] int64
    draft_lengths: torch.Tensor | None = None,  # [B] int64, as ``accept``'s
) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``accept`` returns for rows that are all greedy, from the argmax alone (a
    packed verify takes it from its unpadded logits). Padding past a row's drafts is
    never accepted: a draft there becomes -1, which no argmax equals."""
    k = draft_tokens.shape[1]
    if draft_lengths is not None:
        is_real = torch.arange(k, device=greedy.device)[None, :] < draft_lengths[:, None]
        draft_tokens = draft_tokens.masked_fill(~is_real, -1)
    num = first_rejection(draft_tokens == greedy[:, :k])
    return _unless_faulty(num, greedy.gather(1, num[:, None]).squeeze(1), faulty)


def _unless_faulty(
    num: torch.Tensor, next_tokens: torch.Tensor, faulty: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with a non-finite position among the ones they emit: nothing accepted, FAULT."""
    steps = torch.arange(faulty.shape[1], device=faulty.device)
    is_hit = (faulty & (steps[None, :] <= num[:, None])).any(dim=1)
    return num.masked_fill(is_hit, 0), next_tokens.masked_fill(is_hit, FAULT)


def accept_synthetic(
    logits: torch.Tensor,  # [B, K+1, V]
    sampling: SamplingTensors,
    first_positions: torch.Tensor,  # [B]
    rates: torch.Tensor,  # [K] probability of accepting the draft at each position
    kernels: SamplingKernels = TORCH_SAMPLING,
    draft_lengths: torch.Tensor | None = None,  # [B]: as ``accept``'s, padding never accepted
) -> tuple[torch.Tensor, torch.Tensor]:
    """NOT LOSSLESS, for benchmarks with random weights only: accept the draft at position j
    with probability ``rates[j]`` whatever it is, then emit the target's own choice."""
    b, s, _ = logits.shape
    logits = penalized(logits, sampling.penalties)  # drafts not counted: not lossless anyway
    if s == 1:  # no drafts: no coin
        num = torch.zeros(b, dtype=torch.int64, device=logits.device)
    else:
        positions = first_positions[:, None] + torch.arange(s - 1, device=logits.device)
        seeds = sampling.seeds[:, None].expand(-1, s - 1)
        keys = kernels.row_keys(seeds.reshape(-1), positions.reshape(-1))
        r = kernels.uniform(keys ^ _ACCEPT_SALT, 1).view(b, s - 1)
        is_accepted = r < rates[None, :]
        if draft_lengths is not None:
            is_accepted &= torch.arange(s - 1, device=r.device)[None, :] < draft_lengths[:, None]
        num = first_rejection(is_accepted)
    at = logits.gather(1, num[:, None, None].expand(-1, 1, logits.shape[-1])).squeeze(1)
    greedy = at.argmax(dim=-1)
    if sampling.all_greedy:
        return num, greedy
    rows = dataclasses.replace(sampling, positions=first_positions + num)
    keys = kernels.row_keys(sampling.seeds, rows.positions)
    drawn = kernels.draw(kernels.filtered_probs(at, rows), keys)
    return num, torch.where(sampling.temperature > 0, drawn, greedy)
