"""Token sampling for a batch whose rows each carry their own parameters.

Everything is a tensor op on per-row parameter tensors (no host synchronisation),
and random numbers are a pure function of (request seed, token position), so batching,
chunking or speculation never change what a seeded request samples.

A draw inverts the row's cumulative distribution at one keyed uniform (``draw``). An
exponential race (argmax p_i / E_i) needs a keyed uniform per vocabulary entry: hashing
[B, V] int64 took 234 ms at batch 64 with SmolLM2's vocabulary on a 2-core CPU, more than
the model's own step; the draw takes 45 ms (``bench/sampling.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x < 2**32, without leaving the int64 range."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (lowbias32) on int64 tensors holding values < 2**32."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A 32-bit key per (seed, position): [B] int64."""
    k = hash32(seeds & _MASK32)
    k = hash32(k ^ ((seeds >> 32) & _MASK32))
    return hash32(k ^ (positions & _MASK32))


def uniform(keys: torch.Tensor, num: int) -> torch.Tensor:
    """Uniform numbers in (0, 1), [B, num], a pure function of each row's key and column."""
    cols = torch.arange(num, device=keys.device, dtype=torch.int64)
    h = hash32(hash32(keys[:, None] ^ cols[None, :]) ^ 0x5BD1E995)
    # 23 bits: fp32 holds (2**23 - 1) + 0.5 exactly, so u stays strictly below 1.
    return ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))


@dataclass
class SamplingTensors:
    """Per-row sampling parameters on the logits' device; greedy rows have temperature 0."""

    temperature: torch.Tensor  # [B] fp32
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] fp32
    min_p: torch.Tensor  # [B] fp32
    seeds: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64: position the sampled token will take
    all_greedy: bool  # host-known when the batch is built: skip the sampling path
    needs_filter: bool  # some row uses top-k, top-p or min-p

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        seeds: list[int],
        positions: list[int],
        device: torch.device,
    ) -> SamplingTensors:
        def t(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperature=t([p.temperature for p in params], torch.float32),
            top_k=t([p.top_k for p in params], torch.int64),
            top_p=t([p.top_p for p in params], torch.float32),
            min_p=t([p.min_p for p in params], torch.float32),
            seeds=t(seeds, torch.int64),
            positions=t(positions, torch.int64),
            all_greedy=all(p.is_greedy for p in params),
            needs_filter=any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params),
        )


def filtered_probs(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The distribution each row samples from: temperature, then top-k, top-p, min-p. [B, V]"""
    temp = torch.where(t.temperature > 0, t.temperature, torch.ones_like(t.temperature))
    scaled = logits / temp[:, None]
    if not t.needs_filter:
        return torch.softmax(scaled, dim=-1)
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [B, V]
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(t.top_k > 0, t.top_k, torch.full_like(t.top_k, vocab))
    keep = rank < k[:, None]  # top-k
    probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    # top-p on the top-k renormalised distribution: keep the smallest prefix whose mass
    # reaches top_p (a token is kept when the mass before it is still below top_p).
    mass_before = probs.cumsum(dim=-1) - probs
    keep &= (mass_before < t.top_p[:, None]) | (t.top_p[:, None] >= 1.0)
    # min-p: drop tokens below min_p times the most likely token's probability.
    keep &= probs >= t.min_p[:, None] * probs[:, :1]
    keep[:, 0] = True
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    filtered = torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.softmax(filtered, dim=-1)


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
    return torch.minimum(drawn, last).squeeze(-1)


def sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Next token per row: argmax for greedy rows, a seeded draw otherwise. [B] int64"""
    greedy = logits.argmax(dim=-1)
    if t.all_greedy:
        return greedy
    drawn = draw(filtered_probs(logits, t), row_keys(t.seeds, t.positions))
    return torch.where(t.temperature > 0, drawn, greedy)


def top_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of the raw model distribution: chosen [B], top-n ids and values [B, n]."""
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
    values, ids = logp.topk(n, dim=-1)
    return chosen, ids, values
