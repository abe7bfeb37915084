"""A plain reference of logit bias and the penalties, one token at a time in fp32, for the
tests of ``engine.sampler.penalized`` and of what the engine samples with them."""

from __future__ import annotations

from collections import Counter

import torch

from engine.sampling_params import SamplingParams


def reference_penalized(
    logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams
) -> torch.Tensor:
    """``logits`` [V] of the token after ``prompt + output``, as sampling sees them: bias
    added, then repetition over the prompt and output, then the OpenAI penalties over the
    output. [V] fp32"""

    def f32(x: float) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.float32)

    x = logits.float().clone()
    for token, bias in params.bias_pairs:
        x[token] = x[token] + f32(bias)
    counts = Counter(output)
    rep = f32(params.repetition_penalty)
    if params.repetition_penalty != 1.0:
        for token in set(prompt) | set(output):
            x[token] = x[token] / rep if x[token] > 0 else x[token] * rep
    for token, n in counts.items():
        penalty = f32(params.frequency_penalty) * f32(n) + f32(params.presence_penalty)
        x[token] = x[token] - penalty
    return x
