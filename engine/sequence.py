"""A request as the engine tracks it: its tokens, its blocks and how far it has been computed."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import SamplingParams


class FinishReason(enum.StrEnum):
    """Why a request's output ended: the engine's one vocabulary for it
    (``serving.sampling.finish_reason_to_proto`` maps it to the wire)."""

    STOP = "stop"  # an EOS or stop token id, or a stop string (``stop_reason`` says which)
    LENGTH = "length"  # max_tokens, or the model's length
    ABORT = "abort"  # its caller aborted it
    PREEMPTED = "preempted"  # handed back for lack of KV blocks (``hand_back``): resumed elsewhere
    ERROR = "error"  # ended alone, its batch going on (``outputs.NON_FINITE_LOGITS``)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RESERVED = "reserved"  # decode side of disaggregation: blocks held, KV on its way
    RUNNING = "running"
    PREFILLED = "prefilled"  # prefill side: first token sampled, blocks held for the transfer
    FINISHED = "finished"


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: dict[int, float]  # the ``logprobs`` most likely token ids -> logprob


@dataclass
class SpecCounts:
    """One request's speculative decoding counters (engine.spec.stats' names): what its
    usage reports. The engine's global SpecDecodeStats is their sum over requests."""

    num_drafts: int = 0  # decode steps that verified at least one of its draft tokens
    num_draft_tokens: int = 0  # its draft tokens verified
    num_accepted_tokens: int = 0  # of those, accepted
    num_steps_without_drafts: int = 0  # decode steps that verified none (K = 0)

    def record(self, k: int, num_accepted: int) -> None:
        """One step that verified ``k`` of its drafts and accepted ``num_accepted``."""
        if k == 0:
            self.num_steps_without_drafts += 1
        else:
            self.num_drafts += 1
            self.num_draft_tokens += k
            self.num_accepted_tokens += num_accepted


@dataclass(eq=False)  # a request is itself: identity, not field-wise equality
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt followed by generated tokens: the known tokens
    num_prompt_tokens: int
    params: SamplingParams
    seed: int  # params.seed, or one drawn for this request
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # of those, how many came from the prefix cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    # Data-parallel attention: the rank whose pool holds its blocks, chosen when it first
    # gets some (engine.dp_blocks); its block ids are that rank's.
    dp_rank: int = 0
    lora_id: int = -1  # the LoRA adapter it runs under (engine.lora), -1: none
    arrival: int = -1  # its place in the scheduler's order of arrival (-1: not yet added)
    cache_salt: int | None = None  # its adapter's digest, which its block hashes chain on
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the stop token id that ended it (stop strings: not here)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # params.prompt_logprobs: entry i scores prompt token i + 1, filled chunk by chunk.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # What the engine's deltas handed out: tokens up to here (from the start: the prompt
    # and output an earlier attempt sent), logprobs up to here. The first delta also
    # carries the request's start.
    num_tokens_handed_out: int = 0
    num_logprobs_handed_out: int = 0
    has_handed_out: bool = False
    is_prefill_only: bool = False  # stop after the first token and keep the blocks (prefill worker)
    # Speculative decoding: drafts proposed after the last token, verified next step.
    draft_token_ids: list[int] | None = None
    draft_probs: Any = None  # [K, V] tensor when drafts were sampled, else None
    # Target features [n, F] of the last positions whose draft KV is not written yet:
    # steps that drafted nothing left the drafter idle (oldest first). Changed through
    # ``defer_drafting`` and ``clear_undrafted``, which keep their count.
    undrafted_features: list[Any] = field(default_factory=list)
    num_undrafted_tokens: int = 0
    spec_counts: SpecCounts = field(default_factory=SpecCounts)
    suffix_index: Any = None  # suffix decoding: its tokens indexed (engine.spec.suffix)
    # Structured output: an engine.structured.rows.RowGrammar committed through the last
    # token. A row in a thinking phase (the seeds' flag) is neither masked nor advanced.
    grammar: Any = None
    in_thinking_phase: bool = False

    @property
    def reads_prefix_cache(self) -> bool:
        """Prompt logprobs need every prompt position computed: no cached prefix."""
        return self.params.prompt_logprobs is None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_drafted_tokens(self) -> int:
        """Computed tokens whose draft KV is written too."""
        return self.num_computed_tokens - self.num_undrafted_tokens

    def defer_drafting(self, features: Any) -> None:
        """The drafter skipped the positions of ``features`` [n, F]; a catch-up writes them."""
        self.undrafted_features.append(features)
        self.num_undrafted_tokens += len(features)

    def clear_undrafted(self) -> None:
        """The draft KV is written up to the computed tokens (or is rebuilt from scratch)."""
        self.undrafted_features = []
        self.num_undrafted_tokens = 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
