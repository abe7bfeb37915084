"""The engine's seam to disaggregation: a prefill worker's requests leave with their blocks
(``take_prefilled``, the KV pools a transfer reads: ``kv_pools``, each layer's KV as it is
written: ``set_layer_listener``); a decode worker ``reserve``s blocks for a pushed KV and
``start_decoding`` joins the request to its batch; a co-located worker prefills a
reservation in place (``prefill_reserved``) and decodes it on."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.admission import RequestError
from engine.dp_blocks import DataParallelBlocks, whole_table
from engine.kv_cache import KVCacheCapacityError, PagedKVCache
from engine.model_runner import LayerListener
from engine.outputs import PrefilledRequest, RequestDelta, hand_out
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason, Sequence, SequenceStatus

if TYPE_CHECKING:
    from engine.config import Llama3Config
    from engine.deepseek_v3_config import DeepseekV3Config
    from engine.dp_blocks import KvBlocks
    from engine.engine_config import EngineConfig
    from engine.model_runner import ModelRunner
    from engine.scheduler import Scheduler
    from engine.spec.spec_runner import SpecRunner
    from engine.stop_checker import StopChecker


class Disaggregation:
    """``LLMEngine``'s disaggregation methods (see the module's docstring)."""

    _seqs: dict[str, Sequence]
    config: EngineConfig
    kv_cache: PagedKVCache
    whole_kv_cache: PagedKVCache | None
    whole_draft_kv: PagedKVCache | None
    block_manager: KvBlocks
    scheduler: Scheduler
    runner: ModelRunner
    spec: SpecRunner | None
    stops: StopChecker
    model_config: Llama3Config | DeepseekV3Config
    # LLMEngine's methods these call: a new sequence (request id, token ids, params,
    # output tokens sent), and ending one.
    _new_sequence: Callable[[str, list[int], SamplingParams, int, str | None, int | None], Sequence]
    drop_request: Callable[[str], None]

    @property
    def kv_pools(self) -> dict[str, PagedKVCache]:
        """The KV pools a transfer reads or writes, by name; one block id indexes each.
        Split over ranks, the target's (and a split draft's) is every rank's heads: the
        ranks' shared pools (engine.executor.shared_kv), or rank 0's copy of them
        (engine.executor.gathered_kv). Whole heads, whatever the ranks, so that workers of
        any tensor-parallel sizes map onto each other. Under data-parallel attention, every
        rank's blocks one after the other (engine.dp_blocks.whole_table numbers them)."""
        target = self.kv_cache
        if self.whole_kv_cache is not None:
            target = self.whole_kv_cache
        elif self.config.data_parallel_size > 1:
            raise RuntimeError(
                f"data_parallel_size: {self.config.data_parallel_size} ranks whose KV pools "
                "share no memory (CUDA devices, or TANDEM_TP_SHARED_KV=0): KV transfers into "
                "them are not built; serve with ranks on one host's CPU"
            )
        pools = {"target": target}
        if self.spec is not None and self.spec.draft_kv is not None:
            pools["draft"] = self.spec.draft_kv
            if self.whole_draft_kv is not None:  # a split draft: every rank's heads of it
                pools["draft"] = self.whole_draft_kv
        return pools

    def set_layer_listener(self, listener: LayerListener | None) -> None:
        """Calls ``listener`` in this engine's thread as each layer of a step (target
        layers during the forward, draft layers at the end) has its KV written."""
        self.runner.layer_listener = listener

    def take_prefilled(self, request_id: str) -> PrefilledRequest | None:
        """A prefill-only request whose first token (and drafts) are ready, or None (also
        when the first token ended it: nothing to hand on, ``drop_request`` it all the same)."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.status is not SequenceStatus.PREFILLED:
            return None
        if seq.finish_reason is not None:
            return None
        return PrefilledRequest(
            request_id=request_id,
            block_table=whole_table(self.block_manager, seq),
            num_prompt_tokens=seq.num_prompt_tokens,
            first_token=seq.token_ids[-1],  # prefill-only: the one token it sampled
            draft_token_ids=list(seq.draft_token_ids or []),
            seed=seq.seed,
        )

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        num_output_tokens_sent: int = 0,
        lora: str | None = None,
        lora_digest: int | None = None,
    ) -> tuple[list[int], int]:
        """Decode worker: holds blocks for a request whose KV another worker computes
        (under LoRA adapter ``lora``, which the prefill worker ran too; ``lora_digest`` as
        ``add_request``'s).

        Returns the block table (as ``kv_pools`` numbers blocks: ``whole_table``) and how
        many leading prompt tokens are already cached here
        (prefix reuse: their blocks need no transfer). Raises ``KVCacheCapacityError`` when
        the cache cannot hold it now.
        """
        seq = self._new_sequence(
            request_id, prompt_token_ids, params, num_output_tokens_sent, lora, lora_digest
        )
        if not self.block_manager.can_allocate(seq):
            del self._seqs[request_id]
            blocks = self.block_manager
            where = f"{blocks.num_free_blocks}"
            if isinstance(blocks, DataParallelBlocks):  # one rank must hold it
                where = f"{blocks.free_blocks_per_rank} per rank"
            raise KVCacheCapacityError(
                f"kv cache: {where} blocks free, not enough for "
                f"{len(prompt_token_ids)} prompt tokens; retry later or on another worker"
            )
        self.block_manager.allocate(seq)
        seq.status = SequenceStatus.RESERVED
        return whole_table(self.block_manager, seq), seq.num_cached_tokens

    def start_decoding(
        self,
        request_id: str,
        first_token: int,
        draft_token_ids: list[int] | None = None,
        *,
        has_kv: bool = True,
    ) -> RequestDelta:
        """Joins a reserved request to the running batch once its prompt's KV is in its
        blocks; ``first_token`` was sampled by the prefill worker. Returns the request's
        first delta. ``has_kv`` False: the first token ended the request there, so its KV
        was not (or only partly) sent; it ends here whatever the delta says (a stop
        string that ended it is for the caller to find, and to refuse the request if none
        did).

        Only a request that goes on decoding has its blocks cached: one that ends here
        frees them at once, and its KV may never have arrived (a prefill worker pushes
        none for a request its first token ends). Cached, such blocks would serve every
        later request with the same prefix KV that is not its own."""
        seq = self._seqs.get(request_id)
        if seq is not None and seq.status is SequenceStatus.PREFILLED:
            return self._decode_in_place(seq, first_token, has_kv=has_kv)
        if seq is None or seq.status is not SequenceStatus.RESERVED:
            raise RequestError(f"request_id: {request_id!r} is not reserved on this worker")
        vocab = self.model_config.vocab_size
        if not 0 <= first_token < vocab:
            raise RequestError(f"first_token: {first_token} is outside the vocabulary")
        seq.num_computed_tokens = seq.num_tokens  # the prompt (and resumed output) arrived
        if seq.params.max_tokens == 0:  # the prefill worker only scored the prompt
            seq.finish_reason = FinishReason.LENGTH
        else:
            seq.token_ids.append(first_token)
            seq.grammar and seq.grammar.commit([first_token])  # rebuilt from the tokens
            if self.spec is not None and (
                draft_token_ids or not seq.params.speculative or self.spec.drafter is None
            ):
                # One that does not speculate came with none, as do all without a draft
                # model: a decode row from its first step (a prefill worker's drafter wrote
                # its draft KV all the same).
                seq.draft_token_ids = list(draft_token_ids or [])
            self.stops.check(seq, first_token)
        delta = hand_out(seq, has_spec=self.spec is not None)
        if seq.finish_reason is not None or not has_kv:
            self.drop_request(request_id)
        else:
            self._spread_received(seq)
            self.block_manager.cache_computed_blocks(seq)
            self.scheduler.join(seq)
        return delta

    def _spread_received(self, seq: Sequence) -> None:
        """Split over ranks that share no memory, the KV a transfer wrote into rank 0's
        copy (its blocks past the prefix cached here) goes to each rank's heads before the
        request's first step (engine.executor.gathered_kv)."""
        executor = self.runner.executor
        pools = [pool for pool in ("target", "draft") if executor.gathers(pool)]
        if not pools:  # one device, or ranks that share their pools
            return
        block_size = self.config.block_size
        first = seq.num_cached_tokens // block_size
        end = -(-seq.num_computed_tokens // block_size)
        blocks = torch.tensor(seq.block_table[first:end], dtype=torch.int64)
        for pool in pools:
            if len(blocks):
                executor.scatter_kv(pool, blocks)

    def prefill_reserved(self, request_id: str, prompt_token_ids: list[int]) -> None:
        """A co-located worker's prefill: a reserved request (with this prompt) joins the
        batch prefill-only. The next steps compute its prompt into the reserved blocks (past
        the prefix already cached here) and sample its first token and drafts; it is then
        PREFILLED (``take_prefilled``), and ``start_decoding`` decodes it on in place."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.status is not SequenceStatus.RESERVED:
            raise RequestError(f"request_id: {request_id!r} is not reserved on this worker")
        if seq.token_ids != prompt_token_ids:
            raise RequestError(
                f"prompt_token_ids: not the {seq.num_tokens} ids reserved for {request_id!r}"
            )
        seq.is_prefill_only = True
        self.scheduler.join(seq)

    def _decode_in_place(self, seq: Sequence, first_token: int, *, has_kv: bool) -> RequestDelta:
        """``start_decoding`` of a request this engine prefilled in its reserved blocks
        (``prefill_reserved``): it decodes on from its first token, already appended. Its
        first delta is handed out again, for the decode side: the token, without the
        logprobs the prefill side reported."""
        has_first = seq.params.max_tokens > 0  # else the prefill only scored the prompt
        if has_first and seq.token_ids[-1] != first_token:
            raise RequestError(
                f"first_token: {first_token} is not the token {seq.request_id!r} was prefilled "
                "with here"
            )
        seq.is_prefill_only = False
        seq.has_handed_out = False
        seq.num_tokens_handed_out = seq.num_tokens - has_first
        seq.num_logprobs_handed_out = len(seq.logprobs)
        delta = hand_out(seq, has_spec=self.spec is not None)
        if seq.finish_reason is not None or not has_kv:
            self.drop_request(seq.request_id)
        else:
            self.scheduler.join(seq)
        return delta
