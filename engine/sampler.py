"""Token sampling for a batch whose rows each carry their own parameters.

Everything is a tensor op on per-row parameter tensors (no host synchronisation),
and random numbers are a pure function of (request seed, token position), so batching,
chunking or speculation never change what a seeded request samples.

A draw inverts the row's cumulative distribution at one keyed uniform (``draw``). An
exponential race (argmax p_i / E_i) needs a keyed uniform per vocabulary entry: hashing
[B, V] int64 took 234 ms at batch 64 with SmolLM2's vocabulary on a 2-core CPU, more than
the model's own step; the draw takes 45 ms (``bench/sampling.py``).

Top-k, top-p and min-p are thresholds on the probabilities, found without sorting the
vocabulary (``threshold``: an exact radix select), since a sort of [64, 49152] cost as
much as the model's step too.

Logit bias and the frequency, presence and repetition penalties come first (``penalized``),
for greedy rows too, and only for the rows that set one: a batch without them pays nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.nn.utils.rnn import pad_sequence

from engine.sampling_params import SamplingParams
from kernels.reference.sampling import hash32 as hash32  # the keyed uniforms' torch ops
from kernels.reference.sampling import row_keys as row_keys
from kernels.reference.sampling import uniform as uniform


@dataclass
class PenaltyTensors:
    """Logit bias and penalties of the P rows of a batch that set any, with the tokens they
    count as flat (row in P, token id) lists, and per row the ids whose logits they may
    change (``candidates``): ``penalized`` touches only those."""

    rows: torch.Tensor  # [P] int64: the batch rows
    frequency: torch.Tensor  # [P] fp32
    presence: torch.Tensor  # [P] fp32
    repetition: torch.Tensor  # [P] fp32, 1 = off
    output: tuple[torch.Tensor, torch.Tensor]  # [L] row in P, [L] id: an entry per output token
    prompt: tuple[torch.Tensor, torch.Tensor] | None  # the same for the prompts: repetition
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # [N] row in P, id, bias
    candidates: torch.Tensor  # [P, M] int64: biased, prompt and output ids (padded with 0)
    uses_counts: bool  # some row has a frequency or presence penalty
    uses_repetition: bool  # some row has repetition_penalty != 1

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        token_ids: Sequence[Sequence[int]],  # per row: prompt, then output
        num_prompt_tokens: Sequence[int],
        device: torch.device,
    ) -> PenaltyTensors | None:
        """None when no row sets a penalty or bias."""
        rows = [i for i, p in enumerate(params) if p.uses_penalties]
        if not rows:
            return None
        ps = [params[i] for i in rows]
        counts = [bool(p.frequency_penalty or p.presence_penalty) for p in ps]
        repeats = [p.repetition_penalty != 1.0 for p in ps]
        outputs, prompts, biased, candidates = [], [], [], []
        for i, p, c, r in zip(rows, ps, counts, repeats, strict=True):
            # One conversion of the row's tokens (the host work is per row, not per token).
            known = torch.tensor(token_ids[i] if c or r else (), dtype=torch.int64)
            start = num_prompt_tokens[i] if c or r else 0
            outputs.append(known[start:])
            prompts.append(known[:start] if r else known[:0])
            biased.append(torch.tensor([t for t, _ in p.bias_pairs], dtype=torch.int64))
            # Every id whose logit the row's rules may change; padded with 0 below (a rule
            # applied to a token it does not concern leaves it as it is).
            candidates.append(torch.cat([biased[-1], prompts[-1], outputs[-1]]))

        def flat(lists: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            """(row in P, id) of every entry."""
            lengths = torch.tensor([len(x) for x in lists])
            which = torch.repeat_interleave(torch.arange(len(lists)), lengths)
            return which.to(device), torch.cat(lists).to(device)

        def f32(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        bias = None
        if any(p.logit_bias for p in ps):
            bias = (*flat(biased), f32([b for p in ps for _, b in p.bias_pairs]))
        return cls(
            rows=torch.tensor(rows, dtype=torch.int64, device=device),
            frequency=f32([p.frequency_penalty for p in ps]),
            presence=f32([p.presence_penalty for p in ps]),
            repetition=f32([p.repetition_penalty for p in ps]),
            output=flat(outputs),
            prompt=flat(prompts) if any(repeats) else None,
            bias=bias,
            candidates=pad_sequence(candidates, batch_first=True).to(device),
            uses_counts=any(counts),
            uses_repetition=any(repeats),
        )


def penalized(
    logits: torch.Tensor,  # [B, S, V]: S positions per row
    p: PenaltyTensors | None,
    drafts: torch.Tensor | None = None,  # [B, S-1]: the tokens at positions 1..S-1
) -> torch.Tensor:
    """The logits each row samples from, in vLLM's order: logit bias added; then, for a
    token in the prompt or the output, repetition divides a positive logit by the penalty
    and multiplies any other by it; then the OpenAI penalties subtract
    ``frequency * count + presence * (count > 0)``, counts over the output only. Position i
    counts ``drafts[:, :i]`` as output too, as if they had been sampled. Rows without
    penalties are left as they are; the logits themselves are not written. [B, S, V] fp32

    Only each row's candidate ids (and drafts) are gathered and written back: the work
    beyond one copy of the logits and three [P, V] tables grows with the rows' tokens.
    """
    if p is None:
        return logits
    _, s, v = logits.shape
    n, device = p.rows.shape[0], logits.device
    ids = p.candidates  # [P, M]
    if s > 1 and drafts is not None:
        ids = torch.cat([ids, drafts.index_select(0, p.rows)], dim=1)
    m = ids.shape[1]
    where = (  # [P, S, M] indices into [B, S, V]
        p.rows[:, None, None].expand(n, s, m),
        torch.arange(s, device=device)[None, :, None].expand(n, s, m),
        ids[:, None, :].expand(n, s, m),
    )
    out = logits.float().clone()
    x = out[where]  # [P, S, M]

    def table(index: tuple[torch.Tensor, ...], values: torch.Tensor, **kw: bool) -> torch.Tensor:
        """[P, V] of ``values`` at ``index``, gathered at the ids: [P, 1, M]"""
        dense = torch.zeros(n, v, dtype=values.dtype, device=device)
        return dense.index_put_(index, values, **kw).gather(1, ids)[:, None, :]

    if p.bias is not None:
        which, bias_ids, values = p.bias
        x = x + table((which, bias_ids), values)
    if p.uses_counts or p.uses_repetition:
        which, out_ids = p.output
        counts = table((which, out_ids), torch.ones(out_ids.shape, device=device), accumulate=True)
        if s > 1 and drafts is not None:
            # Draft j sits at position j+1: position i counts the drafts j < i.
            is_draft = ids[:, None, :] == drafts.index_select(0, p.rows)[:, :, None]  # [P, K, M]
            before = torch.cat([torch.zeros_like(is_draft[:, :1]), is_draft], dim=1)
            counts = counts + before.float().cumsum(dim=1)  # [P, S, M]
        is_seen = counts > 0
        if p.uses_repetition:
            seen = is_seen
            if p.prompt is not None:
                present = torch.ones(p.prompt[1].shape, dtype=torch.bool, device=device)
                seen = seen | table(p.prompt, present)
            rep = p.repetition[:, None, None]
            x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        if p.uses_counts:
            x = x - (p.frequency[:, None, None] * counts + p.presence[:, None, None] * is_seen)
    out[where] = x  # a repeated id is written its one value
    return out


@dataclass
class SamplingTensors:
    """Per-row sampling parameters on the logits' device; greedy rows have temperature 0."""

    temperature: torch.Tensor  # [B] fp32
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] fp32
    min_p: torch.Tensor  # [B] fp32
    seeds: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64: position the sampled token will take
    # Host-known when the batch is built, so a step skips what no row uses.
    all_greedy: bool  # no sampled row: skip the sampling path
    uses_top_k: bool  # some row has top_k > 0
    uses_top_p: bool  # some row has top_p < 1
    uses_min_p: bool  # some row has min_p > 0
    # Rows that set a penalty or logit bias; None when none does (or when not asked for).
    penalties: PenaltyTensors | None = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        seeds: list[int],
        positions: list[int],
        device: torch.device,
        token_ids: Sequence[Sequence[int]] | None = None,
        num_prompt_tokens: Sequence[int] | None = None,
    ) -> SamplingTensors:
        """``token_ids`` (per row: prompt, then output) and ``num_prompt_tokens`` are what
        penalties count; without them no penalty or bias is applied (draft proposals)."""
        penalties = None
        if token_ids is not None and num_prompt_tokens is not None:
            penalties = PenaltyTensors.build(params, token_ids, num_prompt_tokens, device)

        def t(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperature=t([0.0 if p.is_greedy else p.temperature for p in params], torch.float32),
            top_k=t([p.top_k for p in params], torch.int64),
            top_p=t([p.top_p for p in params], torch.float32),
            min_p=t([p.min_p for p in params], torch.float32),
            seeds=t(seeds, torch.int64),
            positions=t(positions, torch.int64),
            all_greedy=all(p.is_greedy for p in params),
            uses_top_k=any(p.top_k > 0 for p in params),
            uses_top_p=any(p.top_p < 1.0 for p in params),
            uses_min_p=any(p.min_p > 0.0 for p in params),
            penalties=penalties,
        )

    @property
    def needs_filter(self) -> bool:
        return self.uses_top_k or self.uses_top_p or self.uses_min_p


# Radix levels over the bit pattern of a non-negative fp32 (sign bit always 0): 31 bits,
# from the top. The pattern orders non-negative floats as their values.
_RADIX_LEVELS = ((20, 11), (10, 10), (0, 10))  # (shift, width)
# Probability mass in fixed point for ``threshold``: integer sums are exact, so a row's
# filter does not depend on the order of additions (CUDA's scatter_add_ has none).
_MASS_ONE = 1 << 40


def threshold(bits: torch.Tensor, weights: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row, the largest value v among ``bits`` whose tokens at or above v weigh at
    least ``target``: [N, V] int32 bit patterns of non-negative floats, [N, V] int64
    weights, [N] int64 targets (each at most its row's total weight) -> [N] int32 pattern.

    With unit weights and target k, v is the k-th largest value (top-k); with
    probabilities and target p, the smallest set of most likely tokens holding mass p is
    every token at or above v (top-p). An exact radix select instead of a sort of the
    vocabulary: each level narrows v's bit pattern by 10-11 bits with a histogram of
    weight, in three passes and without host synchronisation.
    """
    rows = bits.shape[0]
    keys = bits.long()
    bins = torch.empty_like(keys)  # one buffer for every level: fresh ones cost page faults
    prefix = torch.zeros(rows, dtype=torch.int64, device=bits.device)  # v's bits so far
    for shift, width in _RADIX_LEVELS:
        # Bin 1 + (the next ``width`` bits) inside the bucket that ``prefix`` names; bin 0
        # collects everything below the bucket, bin 2**width + 1 everything above it.
        torch.bitwise_right_shift(keys, shift, out=bins)
        bins.sub_((prefix << width)[:, None]).clamp_(-1, 1 << width).add_(1)
        hist = torch.zeros(rows, (1 << width) + 2, dtype=torch.int64, device=bits.device)
        hist.scatter_add_(1, bins, weights)
        at_or_above = hist.flip(-1).cumsum(-1).flip(-1)[:, 1:-1]  # per bin in the bucket
        chosen = ((at_or_above >= target[:, None]).sum(-1) - 1).clamp(min=0)
        prefix = (prefix << width) | chosen
    return prefix.int()


# Rows filtered together: the radix passes read [rows, V] int64 tensors several times, and
# 8 rows of a 49k vocabulary (3 MB) stay in cache where 64 (25 MB) do not.
_FILTER_ROWS = 8


def filtered_probs(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The distribution each row samples from: temperature, then top-k, top-p, min-p. [B, V]

    Each filter keeps the tokens at or above a threshold (so tokens tied with the last one
    kept are kept too): top-k the k-th largest probability; top-p, on the top-k
    renormalised distribution, the least probability of the smallest set of most likely
    tokens whose mass reaches top_p; min-p, min_p times the top token's probability.
    """
    temp = torch.where(t.temperature > 0, t.temperature, torch.ones_like(t.temperature))
    scaled = logits.float() / temp[:, None]
    if not t.needs_filter:
        return torch.softmax(scaled, dim=-1)
    rows = range(0, scaled.shape[0], _FILTER_ROWS)
    return torch.cat([_filtered(scaled, t, slice(r, r + _FILTER_ROWS)) for r in rows])


def _filtered(scaled: torch.Tensor, t: SamplingTensors, rows: slice) -> torch.Tensor:
    """``filtered_probs`` for some rows of temperature-scaled logits."""
    scaled, top_k, top_p = scaled[rows], t.top_k[rows], t.top_p[rows]
    probs = torch.softmax(scaled, dim=-1)
    bits = probs.view(torch.int32)  # non-negative floats: their patterns order as values
    floor = torch.zeros_like(top_p, dtype=torch.int32)  # keep tokens with bits >= floor
    mass = (probs * _MASS_ONE).long() if t.uses_top_p else None
    if t.uses_top_k:
        vocab = probs.shape[-1]
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
        ones = torch.ones(1, dtype=torch.int64, device=bits.device).expand_as(bits)
        floor = threshold(bits, ones, k)
    if mass is not None:
        kept_mass = torch.full_like(top_k, _MASS_ONE)  # the top-k set's
        if t.uses_top_k:
            in_top_k = torch.where(bits >= floor[:, None], mass, 0).sum(-1)
            kept_mass = torch.where(top_k > 0, in_top_k, kept_mass)
        # At least one unit of mass: a top_p so small that its target rounds to 0 would
        # put the threshold above every token. Each threshold is then at most the top
        # token's probability, so the most likely token is always kept.
        target = (top_p.double() * kept_mass).long().clamp(min=1)
        nucleus = threshold(bits, mass, target)
        floor = torch.where(top_p < 1.0, torch.maximum(floor, nucleus), floor)
    if t.uses_min_p:
        floor = torch.maximum(floor, (t.min_p[rows] * probs.amax(-1)).view(torch.int32))
    # The softmax again, not a division by the kept mass: a row that keeps everything gets
    # exactly the unfiltered distribution, whatever the other rows in its batch ask for.
    return torch.softmax(scaled.masked_fill(bits < floor[:, None], float("-inf")), dim=-1)


def draw(weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Index i with probability weights_i / sum(weights) per row, keyed on ``keys``:
    [N, V] non-negative weights (any positive total), [N] keys -> [N] int64.

    The first i whose cumulative weight exceeds u * total, for one keyed uniform u in
    (0, 1). A zero-weight index is never drawn: its cumulative weight equals the one
    before it, and u * total > 0 rules out leading zeros. u * total stays below a normal
    total, but rounds up to a subnormal one; the draw is then the last index with weight.
    """
    cdf = weights.cumsum(dim=-1)  # [N, V]
    total = cdf[:, -1:].contiguous()  # [N, 1]
    point = uniform(keys, 1) * total  # [N, 1]
    drawn = torch.searchsorted(cdf, point, right=True)
    last = torch.searchsorted(cdf, total)  # where the cumulative weight tops out
    # NaN weights (a model's overflow) compare false everywhere: never an id past the end.
    return torch.minimum(drawn, last).clamp_(max=weights.shape[-1] - 1).squeeze(-1)


class SamplingKernels(Protocol):
    """Where filters, draws and rejection sampling run (``engine.sampling_kernels``)."""

    name: str

    def row_keys(self, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[N] seeds and positions -> [N] int64 keys: ``row_keys``'s."""
        ...

    def uniform(self, keys: torch.Tensor, num: int) -> torch.Tensor:
        """[N] keys -> [N, num] fp32 in (0, 1): ``uniform``'s bits."""
        ...

    def filtered_probs(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """[B, V] logits -> [B, V] the distribution each row samples from."""
        ...

    def draw(self, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """[N, V] weights, [N] keys -> [N] int64 (``engine.sampler.draw``'s rule)."""
        ...

    def accept_sampled(
        self,
        probs: torch.Tensor,  # [B, K+1, V] p
        draft_tokens: torch.Tensor,  # [B, K]
        keys: torch.Tensor,  # [B*(K+1)] each position's key
        draft_probs: torch.Tensor | None,  # [B, K, V] q; None: argmax drafts
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Lossless rejection sampling: ``num_accepted`` [B], ``next_tokens`` [B]."""
        ...


class GreedyMasks(Protocol):
    """Structured output's greedy rows (``engine.structured.rows.SamplingMasks``), masked
    after their argmax is known, only where their grammar refuses it."""

    def greedy(self, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """[N, V] logits (masked in place where refused), [N] their argmax -> [N]."""
        ...


FAULT = -1  # the token id of a row whose logits were not finite (see ``is_faulty``)


def is_faulty(logits: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """Rows whose logits hold a NaN or +inf, or are all -inf, from their argmax ``greedy``
    (argmax picks a NaN where there is one): [..., V], [...] -> [...] bool. Such a row has
    no distribution to sample from; it gets ``FAULT`` and fails alone, in O(rows)."""
    return ~torch.isfinite(logits.gather(-1, greedy[..., None]).squeeze(-1))


def sample(
    logits: torch.Tensor,
    t: SamplingTensors,
    kernels: SamplingKernels | None = None,
    masks: GreedyMasks | None = None,
) -> torch.Tensor:
    """Next token per row: argmax for greedy rows, a seeded draw otherwise, both after the
    rows' penalties and logit bias; ``FAULT`` for a row whose logits were not finite.
    ``kernels``: where the filters and the draw run (None: the torch ops here); ``masks``:
    greedy rows' grammars, checked against their argmax. [B] int64"""
    if t.penalties is not None:
        logits = penalized(logits[:, None], t.penalties)[:, 0]
    # max, not argmax: the same first maximum (a NaN where there is one), and its value,
    # which is_faulty would otherwise gather (half argmax's cost alone, on CPU).
    best, argmax = logits.max(dim=-1)
    greedy = argmax
    if masks is not None:  # a masked logit is -inf whether masked before penalties or after
        greedy = masks.greedy(logits, greedy)
    faulty = ~torch.isfinite(best) if greedy is argmax else is_faulty(logits, greedy)
    if not t.all_greedy:
        if kernels is None:
            drawn = draw(filtered_probs(logits, t), row_keys(t.seeds, t.positions))
        else:
            keys = kernels.row_keys(t.seeds, t.positions)
            drawn = kernels.draw(kernels.filtered_probs(logits, t), keys)
        greedy = torch.where(t.temperature > 0, drawn, greedy)
    return greedy.masked_fill(faulty, FAULT)


def top_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of the raw model distribution: chosen [B], top-n ids and values [B, n]."""
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(-1, tokens.clamp(min=0)[:, None]).squeeze(-1)  # FAULT rows: unused
    values, ids = logp.topk(n, dim=-1)
    return chosen, ids, values
