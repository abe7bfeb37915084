"""Sampling and speculative acceptance in plain torch, with the random uniforms passed in:
the reference of ``kernels.triton.sampling``. The rules are ``engine.sampler``'s and
``engine.spec.acceptance``'s (thresholds keep ties; top-p mass in fixed point).

The uniforms themselves are keyed: ``row_keys`` hashes each row's (seed, position) into a
32-bit key and ``uniform`` each (key, column) into a number in (0, 1), with lowbias32 in
int64 tensor ops (about 110 of them for a row's keys and its uniform, which the Triton
versions do in one kernel each). The engine's CPU path runs these."""

from __future__ import annotations

import torch

MASS_ONE = 1 << 40  # probability mass in fixed point: integer sums are exact in any order
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


def filtered_probs(
    logits: torch.Tensor,  # [B, V]
    temperature: torch.Tensor,  # [B] fp32; <= 0: greedy (scaled by 1 here)
    top_k: torch.Tensor,  # [B] int64, 0 = off
    top_p: torch.Tensor,  # [B] fp32, 1 = off
    min_p: torch.Tensor,  # [B] fp32, 0 = off
) -> torch.Tensor:  # [B, V] fp32
    """The distribution each row samples from: temperature, then top-k (probabilities at or
    above the k-th largest), top-p (on the top-k set: at or above the least probability of
    the smallest most-likely set whose mass reaches top_p of the set's), min-p (at or above
    min_p times the top probability); the kept tokens' softmax."""
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = logits.float() / temp[:, None]
    probs = torch.softmax(scaled, dim=-1)
    vocab = probs.shape[-1]
    ordered = probs.sort(dim=-1, descending=True).values  # [B, V]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    floor = torch.where(top_k > 0, ordered.gather(1, (k - 1)[:, None]).squeeze(1), 0.0)
    mass = (probs * MASS_ONE).long()
    in_top_k = torch.where(probs >= floor[:, None], mass, 0).sum(-1)
    kept_mass = torch.where(top_k > 0, in_top_k, MASS_ONE)
    target = (top_p.double() * kept_mass).long().clamp(min=1)
    cum = (ordered * MASS_ONE).long().cumsum(-1)  # mass at or above each sorted probability
    first = (cum < target[:, None]).sum(-1)  # the first index whose cumulative mass reaches
    nucleus = torch.where(
        first < vocab, ordered.gather(1, first.clamp(max=vocab - 1)[:, None])[:, 0], 0.0
    )
    floor = torch.where(top_p < 1.0, torch.maximum(floor, nucleus), floor)
    floor = torch.maximum(floor, min_p * probs.amax(-1))
    return torch.softmax(scaled.masked_fill(probs < floor[:, None], float("-inf")), dim=-1)


def draw(
    weights: torch.Tensor,  # [N, V] non-negative, any positive total
    uniforms: torch.Tensor,  # [N] in (0, 1)
) -> torch.Tensor:  # [N] int64
    """The first index whose cumulative weight exceeds u * total; never a zero-weight one."""
    cdf = weights.float().cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    drawn = torch.searchsorted(cdf, uniforms[:, None].float() * total, right=True)
    last = torch.searchsorted(cdf, total)
    return torch.minimum(drawn, last).clamp_(max=weights.shape[-1] - 1).squeeze(-1)


def sample(
    logits: torch.Tensor,  # [B, V]
    temperature: torch.Tensor,  # [B]; <= 0: greedy
    top_k: torch.Tensor,  # [B]
    top_p: torch.Tensor,  # [B]
    min_p: torch.Tensor,  # [B]
    uniforms: torch.Tensor,  # [B]
) -> torch.Tensor:  # [B] int64
    """Argmax for greedy rows, else a draw from the filtered distribution."""
    drawn = draw(filtered_probs(logits, temperature, top_k, top_p, min_p), uniforms)
    return torch.where(temperature > 0, drawn, logits.argmax(dim=-1))


def rejection_sample(
    target_probs: torch.Tensor,  # [B, K+1, V] p: the target's filtered distributions
    draft_tokens: torch.Tensor,  # [B, K]
    draw_uniforms: torch.Tensor,  # [B, K+1]: one per position's draw
    draft_probs: torch.Tensor | None = None,  # [B, K, V] q; None: argmax (one-hot) drafts
    accept_uniforms: torch.Tensor | None = None,  # [B, K]: with draft_probs
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [B], next_tokens [B]
    """Lossless acceptance of sampled rows. Sampled drafts x ~ q: accept x when
    r * q(x) < p(x) (probability min(1, p/q)); at the first rejection emit a draw from
    norm(max(0, p - q)) (p where that is empty); after K acceptances the bonus is a draw
    from p. Argmax drafts: draw s ~ p at each position, accept while s == x, emit the
    first s that differs (the residual of a one-hot q), or the bonus."""
    b, s, v = target_probs.shape
    k = s - 1
    if draft_probs is None:
        drawn = draw(target_probs.reshape(b * s, v), draw_uniforms.reshape(-1)).view(b, s)
        accepted = draft_tokens == drawn[:, :k]
        nxt = drawn
    else:
        assert accept_uniforms is not None
        p_x = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
        q_x = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
        accepted = accept_uniforms * q_x < p_x
        residual = (target_probs[:, :k] - draft_probs).clamp(min=0)
        has_mass = residual.sum(dim=-1, keepdim=True) > 0
        residual = torch.where(has_mass, residual, target_probs[:, :k])
        weights = torch.cat([residual, target_probs[:, k:]], dim=1)
        nxt = draw(weights.reshape(b * s, v), draw_uniforms.reshape(-1)).view(b, s)
    num = accepted.long().cumprod(dim=1).sum(dim=1)
    return num, nxt.gather(1, num[:, None]).squeeze(1)
