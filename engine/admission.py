"""Whether the engine takes a request: the checks every new request passes first."""

from __future__ import annotations

from engine.dp_blocks import KvBlocks
from engine.kv_cache import KVCacheCapacityError
from engine.sampling_params import SamplingParams


class RequestError(ValueError):
    """A request the engine refuses; the message names what is wrong."""


def check_request(
    token_ids: list[int],
    params: SamplingParams,
    num_prompt_tokens: int,
    *,
    vocab_size: int,
    has_tokenizer: bool,
    max_model_len: int,
    block_manager: KvBlocks,
) -> None:
    """RequestError naming the field, unless the request fits the model: ``token_ids`` are
    the prompt's ``num_prompt_tokens``, then any resumed output. KVCacheCapacityError when
    it could never fit in the whole KV cache."""
    if not num_prompt_tokens:
        raise RequestError("prompt: is empty; send at least one token")
    vocab = vocab_size
    bad = [t for t in token_ids if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {vocab})")
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
    if bad:
        raise RequestError(
            f"stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab})"
        )
    bad = [t for t, _ in params.bias_pairs if not t < vocab]
    if bad:
        raise RequestError(f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {vocab})")
    if params.stop and not has_tokenizer:
        raise RequestError("stop: stop strings need a tokenizer; use stop_token_ids")
    total = num_prompt_tokens + params.max_tokens
    if total > max_model_len:
        raise RequestError(
            f"max_tokens: prompt ({num_prompt_tokens} tokens) + max_tokens "
            f"({params.max_tokens}) = {total} exceeds the context length {max_model_len}"
        )
    needed = block_manager.num_blocks_for(total + block_manager.num_lookahead_slots)
    if needed > block_manager.num_blocks:
        raise KVCacheCapacityError(
            f"kv cache: this request needs {needed} blocks but the cache has only "
            f"{block_manager.num_blocks}; raise kv_cache_memory or shorten the request"
        )
