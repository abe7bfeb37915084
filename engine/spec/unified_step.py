"""The unified speculative decode step: verify, accept, shift and propose in fixed shapes.

One call computes a whole decode step for a batch of B rows with K drafts each:

1. merge    rows ``[x_n, d_1..d_K]`` at positions n..n+K                 -> [B, K+1]
2. verify   target forward writing target KV; logits and drafter features
3. mask     optional structured-output bitmask                            [B, K+1, ceil(V/32)]
4. accept   ``num_accepted`` [B] and ``next_tokens`` [B]
5. shift    pair each target feature at n+j with the token at n+j+1
6. propose  the drafter writes draft KV and drafts ``k_next`` tokens per row
7. pack     ``emitted`` [B, K+1] (accepted drafts, then the next token, then -1)

A step that proposes nothing (``k_next == 0``, adaptive speculation's plain step) may
defer the drafter: it skips 5 and 6 and returns the target features instead, which the
caller keeps and hands the drafter in one batched ``extend`` when drafting resumes. Such
a step costs what a plain decode step costs.

KV lengths advance by ``num_accepted + 1``; KV written for rejected positions is
overwritten by later steps. Nothing here reads a tensor on the host, so the step can
be captured in a CUDA graph per batch bucket; the only host values are shapes and
``max_context_len``, a bound fixed when the step is built. Steps with grammar rows are
the exception (``SpecStepInputs.grammar``): they read those rows' accepted tokens and each
draft on the host to advance and mask them, so they run eagerly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.attention.base import AttentionBackend, BatchLayout
from engine.executor.inputs import ForwardInputs, TargetForward
from engine.kv_cache import PagedKVCache
from engine.models.llama3 import NO_HIDDEN_STATES, ModelOutputs
from engine.sampler import SamplingTensors, is_faulty
from engine.sampling_kernels import TORCH_SAMPLING, SamplingKernels
from engine.spec.acceptance import DRAFT_SALT, accept, accept_argmax, accept_synthetic
from engine.spec.drafters import Drafter, DraftLogits, ProposeArgs
from engine.spec.drafters.base import argmax_drafts
from engine.structured.bitmask import apply_bitmask, apply_bitmask_rows


class StepGrammar(Protocol):
    """Rows with a grammar (engine.spec.grammar): the step takes their verification masks
    (and the flat positions b * (K+1) + i they mask) for its target logits, hands it the
    accepted tokens (a host sync of those rows), then each draft's scores to mask and the
    chosen draft."""

    def verify_mask(self, logits: torch.Tensor) -> tuple[torch.Tensor, list[int]]: ...
    def argmax(self, scores: DraftLogits) -> torch.Tensor: ...
    def accept(self, num_accepted: torch.Tensor, emitted: torch.Tensor) -> None: ...
    def mask(self, scores: DraftLogits) -> DraftLogits: ...
    def advance(self, drafts: torch.Tensor) -> None: ...
    def end_drafts(self) -> None: ...


@dataclass
class SpecStepInputs:
    tokens: torch.Tensor  # [B] int64: x_n, each row's pending token (its KV is not written yet)
    draft_tokens: torch.Tensor  # [B, K] int64: drafts from the previous step
    kv_lens: torch.Tensor  # [B] int64: n, committed target KV length = the pending position
    block_tables: torch.Tensor  # [B, M] int64: target and draft KV share them
    sampling: SamplingTensors  # [B] per-row parameters (``positions`` is not used)
    max_context_len: int  # host bound >= n + 2K + 3 for every row
    draft_probs: torch.Tensor | None = None  # [B, K, V] when drafts were sampled
    # [B] int64: rows with fewer drafts than K (a request that does not speculate has 0)
    # verify only theirs, the rest of their row being padding; None: every row has K.
    draft_lengths: torch.Tensor | None = None
    bitmask: torch.Tensor | None = None  # [B, K+1, ceil(V/32)] int32, bit set = allowed
    # [B] bool: rows in a thinking phase are not masked; acceptance is the same for them.
    in_thinking_phase: torch.Tensor | None = None
    # Rows with a grammar; their bitmask comes from it (not ``bitmask``): the step runs eagerly.
    grammar: StepGrammar | None = None
    # Host copy of ``draft_lengths``, for a step without a drafter that verifies each row's
    # own drafts only (``1 + draft_lengths[b]`` tokens in a ragged batch, no padding);
    # None: every row verifies K+1 tokens (the fixed shapes a CUDA graph captures).
    packed_lengths: list[int] | None = None
    # False: no row reads the step's logits (no logprobs); a packed verify of greedy rows
    # then decides from its unpadded logits' argmax and returns logits of shape [B, 0, V].
    return_logits: bool = True
    # [B] int64 under data-parallel attention: each row's rank, which runs its verify
    # (engine.executor.data_parallel); None: one device's rows.
    dp_ranks: torch.Tensor | None = None


@dataclass
class SpecStepOutputs:
    num_accepted: torch.Tensor  # [B] int64
    next_tokens: torch.Tensor  # [B] int64: the bonus or recovered token, the new pending one
    emitted: torch.Tensor  # [B, K+1] int64: accepted drafts, the next token, then -1
    next_draft_tokens: torch.Tensor  # [B, k_next] int64
    next_draft_probs: torch.Tensor | None  # [B, k_next, V] when drafts are sampled
    logits: torch.Tensor  # [B, K+1, V] fp32, for logprobs
    features: torch.Tensor | None = None  # [B, K+1, F] when the drafter was deferred


class UnifiedStep:
    """Target + drafter in one step; ``acceptance`` is "lossless" or "synthetic". Without a
    drafter (``drafter`` None: drafts that cost no forward, as suffix decoding's) the step
    verifies and accepts, then ends: steps 5 and 6 are the drafter's."""

    def __init__(
        self,
        target: TargetForward,
        drafter: Drafter | None,
        target_kv: PagedKVCache,
        draft_kv: PagedKVCache | None,
        backend: AttentionBackend,
        *,
        acceptance: str = "lossless",
        synthetic_rates: tuple[float, ...] = (),
        sample_drafts: bool = False,
        sampling_kernels: SamplingKernels = TORCH_SAMPLING,
    ) -> None:
        self.target, self.drafter = target, drafter
        self.target_kv, self.draft_kv = target_kv, draft_kv
        self.backend = backend
        self.block_size = target_kv.params.block_size
        self.acceptance = acceptance
        self.synthetic_rates = synthetic_rates
        # Made once per device and K: a host-to-device copy cannot sit in a CUDA graph.
        self._rates: dict[tuple[torch.device, int], torch.Tensor] = {}
        self.sample_drafts = sample_drafts
        self.sampling_kernels = sampling_kernels  # filters, draws, rejection sampling

    @torch.inference_mode()
    def __call__(
        self, inputs: SpecStepInputs, k_next: int, *, defer_drafter: bool = False
    ) -> SpecStepOutputs:
        """One step; ``defer_drafter`` (only with ``k_next == 0``) leaves the drafter idle
        and returns the target features of every verified position."""
        if defer_drafter and k_next != 0:
            raise ValueError(f"defer_drafter: needs k_next == 0, got {k_next}")
        b, k = inputs.draft_tokens.shape
        s = k + 1
        device = inputs.tokens.device
        steps = torch.arange(s, device=device)

        # 1. merge: [x_n, d_1..d_K] per row, at positions n..n+K.
        tokens = torch.cat([inputs.tokens[:, None], inputs.draft_tokens], dim=1)  # [B, K+1]
        positions = inputs.kv_lens[:, None] + steps  # [B, K+1]
        layout = BatchLayout.uniform(
            positions, inputs.block_tables, self.block_size, inputs.max_context_len
        )
        decided: tuple[torch.Tensor, torch.Tensor] | None = None  # accepted, next tokens
        if inputs.packed_lengths is not None:
            if self.drafter is not None:
                raise ValueError("packed_lengths: only for a step without a drafter")
            packed, out, at = self._verify_packed(inputs, tokens, positions, inputs.packed_lengths)
            if self._decides_from_argmax(inputs):
                decided = self._accept_packed(packed, at, inputs)
                logits = packed.new_empty((b, 0, packed.shape[-1]))
            else:
                logits = packed.new_zeros((b, s, packed.shape[-1]))  # padding: never read
                logits[at] = packed
        else:
            metadata = self.backend.build_metadata(layout)

            # 2. verify: every row's K+1 tokens, target KV written for all of them.
            out = self.target(
                ForwardInputs(
                    tokens.reshape(-1),
                    layout,
                    torch.arange(b * s, device=device),
                    NO_HIDDEN_STATES if self.drafter is None else self.drafter.target_hidden,
                    metadata,
                    dp_ranks=inputs.dp_ranks,
                )
            )
            logits = out.logits.view(b, s, -1)  # [B, K+1, V]

        # 3. mask: only the positions whose mask forbids anything, in place (grammar rows'
        # masks were filled on a worker thread while the forward ran; greedy rows' are
        # filled now, where the grammar refuses the argmax).
        bitmask, masked = inputs.bitmask, None
        if inputs.grammar is not None:
            bitmask, masked = inputs.grammar.verify_mask(logits)
        if bitmask is not None:
            if inputs.in_thinking_phase is not None:
                bitmask = bitmask.masked_fill(inputs.in_thinking_phase[:, None, None], -1)
            if masked is None:
                logits = apply_bitmask(logits, bitmask)
            else:
                apply_bitmask_rows(logits.view(b * s, -1), bitmask.view(b * s, -1), masked)

        # 4. accept
        first_positions = inputs.kv_lens + 1
        if decided is not None:
            num_accepted, next_tokens = decided
        elif self.acceptance == "synthetic":
            rates = self._rates.get((device, k))
            if rates is None:
                rates = torch.tensor(self.synthetic_rates[:k], device=device)
                self._rates[(device, k)] = rates
            num_accepted, next_tokens = accept_synthetic(
                logits,
                inputs.sampling,
                first_positions,
                rates,
                self.sampling_kernels,
                inputs.draft_lengths,
            )
        else:
            num_accepted, next_tokens = accept(
                logits,
                inputs.draft_tokens,
                inputs.sampling,
                first_positions,
                inputs.draft_probs,
                self.sampling_kernels,
                inputs.draft_lengths,
            )

        # Accepted drafts, then the next token: what the row emits, and (shifted by one)
        # the token after each verified position; entries past num_accepted are never read.
        padded = torch.cat([inputs.draft_tokens, next_tokens[:, None]], dim=1)  # [B, K+1]
        is_accepted = steps[None, :] < num_accepted[:, None]
        emitted = torch.where(
            is_accepted,
            padded,
            torch.where(steps[None, :] == num_accepted[:, None], next_tokens[:, None], -1),
        )
        if inputs.grammar is not None:
            inputs.grammar.accept(num_accepted, emitted)
        if self.drafter is None or defer_drafter:  # no drafts to propose
            return SpecStepOutputs(
                num_accepted=num_accepted,
                next_tokens=next_tokens,
                emitted=emitted,
                next_draft_tokens=next_tokens.new_zeros((b, 0)),
                next_draft_probs=None,
                logits=logits,
                features=None
                if self.drafter is None
                else self.drafter.features(out).view(b, s, -1),
            )

        # 5. shift: feature j (position n+j) pairs with the token at n+j+1: draft j+1 while
        # accepted, then the next token (a FAULT row's drafts are never used: any id will do).
        next_tokens = next_tokens.clamp(min=0)
        shifted = torch.where(is_accepted, padded, next_tokens[:, None])

        # 6. propose
        assert self.draft_kv is not None  # with a drafter
        state = self.drafter.extend(
            shifted.reshape(-1),
            self.drafter.features(out),
            layout,
            metadata,
            self.draft_kv.layers,
            self.backend,
        )
        args = ProposeArgs(
            last_index=torch.arange(b, device=device) * s + num_accepted,
            last_positions=inputs.kv_lens + num_accepted,
            next_tokens=next_tokens,
            block_tables=inputs.block_tables,
            block_size=self.block_size,
            max_context_len=inputs.max_context_len,
        )
        drafts, probs = self.propose(state, args, inputs.sampling, k_next, inputs.grammar)

        # 7. pack
        return SpecStepOutputs(
            num_accepted=num_accepted,
            next_tokens=next_tokens,
            emitted=emitted,
            next_draft_tokens=drafts,
            next_draft_probs=probs,
            logits=logits,
        )

    def _verify_packed(
        self,
        inputs: SpecStepInputs,
        tokens: torch.Tensor,  # [B, K+1]: the pending token, then the drafts (padded)
        positions: torch.Tensor,  # [B, K+1]
        lengths: list[int],  # drafts per row
    ) -> tuple[torch.Tensor, ModelOutputs, tuple[torch.Tensor, torch.Tensor]]:
        """Step 2 for rows of different draft lengths: each row's pending token and its own
        drafts only, as one ragged batch (what a prompt chunk's rows are), so a step costs
        the tokens proposed, not the longest proposal times the rows. Returns the logits
        [T, V] of the T tokens, the outputs, and where each token sits in [B, K+1] (row,
        step)."""
        b = tokens.shape[0]
        device = tokens.device
        counts = torch.tensor(lengths, dtype=torch.int64, device=device) + 1  # [B]
        total = sum(lengths) + b
        row = torch.repeat_interleave(torch.arange(b, device=device), counts, output_size=total)
        offsets = torch.zeros(b + 1, dtype=torch.int64, device=device)
        offsets[1:] = counts.cumsum(0)
        local = torch.arange(total, device=device) - offsets[row]  # [T] index within its row
        flat_positions = positions[row, local]
        tables = inputs.block_tables
        bs = self.block_size
        layout = BatchLayout(
            input_row_offsets=offsets,
            positions=flat_positions,
            slot_mapping=tables[row, flat_positions // bs] * bs + flat_positions % bs,
            context_lens=inputs.kv_lens + counts,
            block_tables=tables,
            block_size=bs,
            max_query_len=max(lengths) + 1,
            max_context_len=inputs.max_context_len,
            is_max_context_exact=False,
        )
        out = self.target(
            ForwardInputs(
                tokens[row, local],
                layout,
                torch.arange(total, device=device),
                dp_ranks=inputs.dp_ranks,
            )
        )
        return out.logits, out, (row, local)

    def _decides_from_argmax(self, inputs: SpecStepInputs) -> bool:
        """Whether a packed step's acceptance needs nothing but each position's argmax:
        greedy rows, nothing that changes their logits, and no row reading them."""
        return (
            inputs.sampling.all_greedy
            and inputs.sampling.penalties is None
            and inputs.bitmask is None
            and inputs.grammar is None
            and self.acceptance == "lossless"
            and not inputs.return_logits
        )

    def _accept_packed(
        self,
        packed: torch.Tensor,  # [T, V] the packed verify's logits
        at: tuple[torch.Tensor, torch.Tensor],  # [T] row and step of each
        inputs: SpecStepInputs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy acceptance from the argmax of the tokens verified, without padding their
        logits to [B, K+1, V] (a copy of B x (K+1) x V that the step's cost model does not
        see). Padding positions hold -2, which neither a draft nor its -1 equals."""
        b, k = inputs.draft_tokens.shape
        argmax = packed.argmax(dim=-1)  # [T]
        greedy = argmax.new_full((b, k + 1), -2)
        greedy[at] = argmax
        faulty = torch.zeros((b, k + 1), dtype=torch.bool, device=packed.device)
        faulty[at] = is_faulty(packed, argmax)
        return accept_argmax(greedy, faulty, inputs.draft_tokens, inputs.draft_lengths)

    def propose(
        self,
        state: torch.Tensor | None,
        args: ProposeArgs,
        sampling: SamplingTensors,
        k: int,
        grammar: StepGrammar | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``k`` drafts per row after ``args``; argmax drafts unless ``sample_drafts``;
        ``grammar`` masks each draft with its rows' state after the drafts before it."""
        if k == 0:
            return args.next_tokens.new_zeros((args.next_tokens.shape[0], 0)), None
        if self.drafter is None or self.draft_kv is None:
            raise ValueError("propose: this step has no drafter")
        sample = self.sample_drafts and not sampling.all_greedy
        probs: list[torch.Tensor] = []

        def select(scores: DraftLogits, j: int) -> torch.Tensor:
            if grammar is None:
                return choose(scores, j)
            # Greedy drafts need a mask only where the argmax is refused; sampled ones, their
            # masked distribution (acceptance reads it).
            chosen = choose(grammar.mask(scores), j) if sample else grammar.argmax(scores)
            grammar.advance(chosen)
            return chosen

        def choose(scores: DraftLogits, j: int) -> torch.Tensor:
            greedy = scores.argmax()
            if not sample:
                return greedy
            # Draft j is the token at position p + 2 + j (p: last committed, p+1: bonus).
            rows = dataclasses.replace(sampling, positions=args.last_positions + 2 + j)
            q = self.sampling_kernels.filtered_probs(scores.full(), rows)  # [B, V]
            keys = self.sampling_kernels.row_keys(rows.seeds, rows.positions) ^ DRAFT_SALT
            drawn = self.sampling_kernels.draw(q, keys)
            is_sampled = sampling.temperature > 0
            # Greedy rows draft the argmax: their q is one-hot there.
            one_hot = torch.zeros_like(q).scatter_(1, greedy[:, None], 1.0)
            probs.append(torch.where(is_sampled[:, None], q, one_hot))
            return torch.where(is_sampled, drawn, greedy)

        # Greedy drafts without a grammar: what ``select`` does then, said so to the drafter.
        by = argmax_drafts if not sample and grammar is None else select
        drafts = self.drafter.propose(state, args, k, by, self.draft_kv.layers, self.backend)
        if grammar is not None:
            grammar.end_drafts()
        return drafts, torch.stack(probs, dim=1) if sample else None
