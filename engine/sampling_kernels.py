"""Where a batch's keyed uniforms, filters, draws and rejection sampling run: torch ops
(``TorchSampling``, the CPU path) or the Triton kernels (``TritonSampling``, the GPU path).
An engine picks one at start-up (``sampling_kernels``); the sampler and the speculative
acceptance call it.

Both make the same keyed uniforms, bit for bit (``row_keys`` of each row's (seed,
position), salted for the accept/reject coin, then ``uniform``), and apply the same rules, so a
seeded request samples the same tokens on either: thresholds keep ties, top-p mass is fixed
point, a draw is the first index whose cumulative weight exceeds u * total. Only fp32
rounding of the softmax and cumulative sums differs (as between torch on CPU and on CUDA):
a uniform that lands within rounding of a token's boundary may pick its neighbour.
"""

from __future__ import annotations

import torch

from engine.sampler import (
    SamplingKernels,
    SamplingTensors,
    draw,
    filtered_probs,
    row_keys,
    uniform,
)

__all__ = ["SamplingKernels", "TorchSampling", "TritonSampling", "sampling_kernels"]

ACCEPT_SALT = 0x2545F491  # keys the accept/reject coin apart from the token draw


def first_rejection(accepted: torch.Tensor) -> torch.Tensor:
    """Number of leading accepted drafts per row: [B, K] bool -> [B] int64."""
    return accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)


class TorchSampling:
    """torch ops: the CPU path, and the reference of ``TritonSampling``."""

    name = "torch"

    def row_keys(self, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return row_keys(seeds, positions)

    def uniform(self, keys: torch.Tensor, num: int) -> torch.Tensor:
        return uniform(keys, num)

    def filtered_probs(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        return filtered_probs(logits, t)

    def draw(self, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        return draw(weights, keys)

    def accept_sampled(
        self,
        probs: torch.Tensor,
        draft_tokens: torch.Tensor,
        keys: torch.Tensor,
        draft_probs: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, v = probs.shape
        k = s - 1
        if draft_probs is None:
            # Argmax drafts: q is one-hot at the draft x, so min(1, p(x)/q(x)) = p(x), and
            # the residual norm(max(0, p - q)) is p without x. Draw s ~ p with the position's
            # keyed uniform and accept iff s == x: P(accept) = p(x), and after a rejection s
            # is a draw from p restricted to tokens != x, i.e. from the residual. If every
            # draft is accepted the draw at position K is the bonus token, a draw from p.
            # Each emitted token is the very draw sampling without speculation makes there.
            drawn = draw(probs.reshape(b * s, v), keys).view(b, s)
            accepted = draft_tokens == drawn[:, :k]
            nxt = drawn
        else:
            # Sampled drafts x ~ q: accept x with probability min(1, p(x)/q(x)), i.e. when a
            # keyed uniform r satisfies r * q(x) < p(x). At the first rejection emit a draw
            # from norm(max(0, p - q)); if all K drafts are accepted, the bonus is from p.
            # A draft of -1 is padding (acceptance.accept's draft_lengths): never accepted.
            x = draft_tokens.clamp(min=0)[..., None]
            p_x = probs[:, :k].gather(-1, x).squeeze(-1)  # [B, K]
            q_x = draft_probs.gather(-1, x).squeeze(-1)
            r = uniform(keys.view(b, s)[:, :k].reshape(-1) ^ ACCEPT_SALT, 1).view(b, k)
            accepted = (r * q_x < p_x) & (draft_tokens >= 0)
            residual = (probs[:, :k] - draft_probs).clamp(min=0)  # [B, K, V]
            # A zero residual means p == q, where a rejection cannot happen: fall back to p.
            has_mass = residual.sum(dim=-1, keepdim=True) > 0
            residual = torch.where(has_mass, residual, probs[:, :k])
            weights = torch.cat([residual, probs[:, k:]], dim=1)  # [B, K+1, V]
            nxt = draw(weights.reshape(b * s, v), keys).view(b, s)
        num = first_rejection(accepted)
        return num, nxt.gather(1, num[:, None]).squeeze(1)


class TritonSampling:
    """``kernels.triton.sampling``: one program per row, no host synchronisation. Imports
    triton (on CPU the kernels run only under its interpreter)."""

    name = "triton"

    def __init__(self) -> None:
        from kernels.triton import sampling

        self._kernels = sampling

    def row_keys(self, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One kernel for the ~66 int64 ops of the torch version (a launch each on a GPU)."""
        out: torch.Tensor = self._kernels.row_keys(seeds, positions)
        return out

    def uniform(self, keys: torch.Tensor, num: int) -> torch.Tensor:
        out: torch.Tensor = self._kernels.uniform(keys, num)
        return out

    def filtered_probs(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        out: torch.Tensor = self._kernels.filtered_probs(
            logits.contiguous(), t.temperature, t.top_k, t.top_p, t.min_p
        )
        return out

    def draw(self, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._kernels.draw(weights, self.uniform(keys, 1)[:, 0])
        return out

    def accept_sampled(
        self,
        probs: torch.Tensor,
        draft_tokens: torch.Tensor,
        keys: torch.Tensor,
        draft_probs: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, _ = probs.shape
        draw_u = self.uniform(keys, 1).view(b, s)  # what ``draw`` takes for each position
        accept_u = None
        if draft_probs is not None:
            accept_u = self.uniform(keys.view(b, s)[:, :-1].reshape(-1) ^ ACCEPT_SALT, 1)
            accept_u = accept_u.view(b, s - 1)
        out: tuple[torch.Tensor, torch.Tensor] = self._kernels.rejection_sample(
            probs, draft_tokens, draw_u, draft_probs, accept_u
        )
        return out


TORCH_SAMPLING = TorchSampling()


def sampling_kernels(name: str) -> SamplingKernels:
    """The implementation called ``name`` ("torch" or "triton")."""
    if name == "torch":
        return TORCH_SAMPLING
    if name == "triton":
        return TritonSampling()
    raise ValueError(f"kernels: {name!r} is not one of torch, triton")
