"""The drafter seam: what the unified step asks of an EAGLE, EAGLE-3 or DFlash draft model.

A drafter is a strategy object. The step hands it the target's hidden states and the
tokens that follow them (``extend``: write draft KV for committed positions), then asks
for ``k`` draft tokens after each row's last committed position (``propose``). Shapes
are fixed by the caller; a drafter never synchronises with the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from engine.attention.base import AttentionBackend, BatchLayout, slots_for
from engine.config import Llama3Config
from engine.deepseek_v3_config import DeepseekV3Config
from engine.models.llama3 import Llama3Model, ModelOutputs, ReturnHiddenStates
from engine.parallel.group import TensorParallelGroup

KVLayers = Sequence[tuple[torch.Tensor, ...]]  # per layer its pools: (k, v)


@dataclass(frozen=True)
class DraftLogits:
    """One draft position's scores for B rows, fp32 [B, Vd]. A drafter with its own reduced
    vocabulary (EAGLE-3) scores only its Vd tokens, entry i standing for target token
    ``token_ids[i]``; the others score the whole target vocabulary (``token_ids`` None).
    Greedy drafting and the training loss work where the scores are, sparing the spread
    over the target vocabulary (``full``) that only sampled drafting needs."""

    values: torch.Tensor  # [B, Vd] fp32
    token_ids: torch.Tensor | None = None  # [Vd] int64 target ids, ascending
    vocab_size: int | None = None  # the target's, with token_ids

    def __post_init__(self) -> None:
        if (self.token_ids is None) != (self.vocab_size is None):
            raise ValueError("DraftLogits: token_ids and vocab_size go together")

    def argmax(self) -> torch.Tensor:
        """[B] target ids of the best-scored tokens."""
        best = self.values.argmax(dim=-1)
        return best if self.token_ids is None else self.token_ids[best]

    def full(self) -> torch.Tensor:
        """[B, V] over the target vocabulary, -inf for tokens the draft cannot emit."""
        if self.token_ids is None or self.vocab_size is None:
            return self.values
        out = self.values.new_full((self.values.shape[0], self.vocab_size), float("-inf"))
        return out.scatter(1, self.token_ids.expand_as(self.values), self.values)

    def index_of(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Where each target id is scored in ``values`` (same shape, int64), -1 where the
        draft cannot emit it."""
        if self.token_ids is None or self.vocab_size is None:
            return target_ids
        lookup = target_ids.new_full((self.vocab_size,), -1)
        lookup[self.token_ids] = torch.arange(self.token_ids.numel(), device=target_ids.device)
        return lookup[target_ids]


# (draft position j's logits, j) -> draft tokens [B]
SelectFn = Callable[[DraftLogits, int], torch.Tensor]


def argmax_drafts(scores: DraftLogits, j: int) -> torch.Tensor:
    """Each row's best-scored token: greedy drafts that no grammar masks. A drafter over
    rows on several ranks lets each rank choose its own rows' (engine.spec.dp_draft)."""
    return scores.argmax()


class DraftConfigError(ValueError):
    """A draft checkpoint that does not fit its target; the message names the field."""


@dataclass
class ProposeArgs:
    """Where each row's drafts start. Row b's last committed entry is ``last_index[b]``
    of the preceding ``extend`` (at position ``last_positions[b]``); the token after it,
    ``next_tokens[b]``, is known (the bonus token) and sits at ``last_positions[b] + 1``."""

    last_index: torch.Tensor  # [B] int64, flat index into the extend's tokens
    last_positions: torch.Tensor  # [B] int64
    next_tokens: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, M] int64, shared with the target
    block_size: int
    max_context_len: int  # host bound on last_positions + k + 2 for every row


@dataclass(frozen=True)
class DraftSignature:
    """What two workers sharing one drafter's KV and drafts must agree on: its kind, and
    the shape fields of that kind (zero or empty where a kind has none)."""

    kind: str
    block_size: int = 0  # DFlash: tokens drafted in parallel per block
    mask_token_id: int = 0  # DFlash: the token filling a block's unknown positions
    target_layer_ids: tuple[int, ...] = ()  # EAGLE-3, DFlash: target layers it reads


class Drafter(Protocol):
    kind: str
    max_num_layers: ClassVar[int | None]  # decoder layers its kind allows; None: any number

    @property
    def config(self) -> Llama3Config | DeepseekV3Config:
        """The draft model's own shapes (its KV cache follows them)."""
        ...

    target_hidden: ReturnHiddenStates  # what the target forward must return for ``features``
    fixed_num_draft_tokens: int | None  # DFlash: block_size - 1; chain drafters: None

    def signature(self) -> DraftSignature:
        """Its kind and shape fields, as a peer checks them before sharing drafts."""
        ...

    def features(self, out: ModelOutputs) -> torch.Tensor:
        """The target features the drafter conditions on, per token: [T, F]."""
        ...

    def extend(
        self,
        tokens: torch.Tensor,  # [T] token t_{i+1} following each feature position i
        features: torch.Tensor,  # [T, F]
        layout: BatchLayout,
        metadata: Any,  # the backend's metadata for ``layout``
        kv: KVLayers,
        backend: AttentionBackend,
    ) -> torch.Tensor | None:
        """Writes draft KV for the given positions; returns per-token draft state or None."""
        ...

    def propose(
        self,
        state: torch.Tensor | None,
        args: ProposeArgs,
        k: int,
        select: SelectFn,
        kv: KVLayers,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """``k`` draft tokens per row: [B, k] int64."""
        ...


def draft_split(target: Any) -> TensorParallelGroup:
    """The ranks a draft splits over: its target's, where it borrows a split Llama-3
    target's embedding and LM head (a draft split as its target is: each rank its share of
    the draft layers' heads and channels, and of the LM head's vocabulary); one rank where
    it borrows a whole one (``WholeVocabulary``: the draft on rank 0 alone), and beside
    DeepSeek-V3."""
    if isinstance(target, Llama3Model):
        return target.tp
    return TensorParallelGroup.single()


def draft_layout(
    positions: torch.Tensor,  # [B, S] int64
    args: ProposeArgs,
    is_causal: bool = True,
) -> BatchLayout:
    """Layout of a fixed-shape draft forward of S tokens per row at ``positions``."""
    return BatchLayout.uniform(
        positions, args.block_tables, args.block_size, args.max_context_len, is_causal=is_causal
    )


def chain_layouts(args: ProposeArgs, num: int) -> list[BatchLayout]:
    """The layouts of a chain's ``num`` one-token forwards, at positions p+1 .. p+num (p:
    each row's ``last_positions``), what ``draft_layout`` gives for each, built at once: a
    few kernels for the chain, not a few per forward (each a launch in a CUDA graph)."""
    if num <= 0:
        return []
    b, device = args.last_positions.shape[0], args.last_positions.device
    steps = torch.arange(1, num + 1, device=device)
    positions = args.last_positions[None, :] + steps[:, None]  # [num, B]: rows contiguous
    slots = slots_for(args.block_tables, positions.t(), args.block_size).t().contiguous()
    context_lens = positions + 1
    offsets = torch.arange(b + 1, device=device)  # one token a row
    return [
        BatchLayout(
            input_row_offsets=offsets,
            positions=positions[j],
            slot_mapping=slots[j],
            context_lens=context_lens[j],
            block_tables=args.block_tables,
            block_size=args.block_size,
            max_query_len=1,
            max_context_len=args.max_context_len,
            is_max_context_exact=False,
        )
        for j in range(num)
    ]


def propose_chain(
    hidden: torch.Tensor,  # [B, H] draft state at each row's last committed entry
    args: ProposeArgs,
    k: int,
    select: SelectFn,
    logits: Callable[[torch.Tensor], DraftLogits],  # [B, H] state -> its next token's scores
    step: Callable[[torch.Tensor, torch.Tensor, BatchLayout, Any], torch.Tensor],
    backend: AttentionBackend,
    build_metadata: Callable[[BatchLayout], Any] | None = None,  # default: the backend's
) -> torch.Tensor:
    """EAGLE-style chain: draft j+1 comes from one more draft-layer step over (draft j, state).

    The state at position p (the last committed entry) predicts the token at p+2 (the one
    after the known bonus token); chain step j then runs at position p + j. [B, k]
    """
    drafts = []
    layouts = chain_layouts(args, k - 1)
    for j in range(k):
        token = select(logits(hidden), j)  # [B]
        drafts.append(token)
        if j + 1 == k:
            break
        layout = layouts[j]
        metadata = (build_metadata or backend.build_metadata)(layout)
        hidden = step(token, hidden, layout, metadata)
    return torch.stack(drafts, dim=1)
