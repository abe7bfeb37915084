"""The seed's Eagle3DeepseekV3Inputs / Eagle3MHADeepseekV3Inputs: built at each extend of a
DeepSeek-V3 target's EAGLE-3 draft, they dispatch the draft's forwards by width (the
extend's, 1+K when verifying, and the chain's 1), on the draft's own pools."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.attention.base import BatchLayout
from engine.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from engine.spec.drafters.eagle3_deepseek_v3 import Eagle3DeepseekV3, Eagle3MHADeepseekV3
from engine.spec.drafters.eagle3_deepseek_v3_inputs import (
    Eagle3DeepseekV3Inputs,
    Eagle3MHADeepseekV3Inputs,
    KVCacheInputs,
)
from tests.engine.tiny_deepseek import build_tiny_deepseek
from tests.engine.tiny_drafts import build_random_draft
from training.recipes import mha_fields

K = 3


def uniform(num_rows: int, width: int, start: int = 5) -> BatchLayout:
    positions = start + torch.arange(width).repeat(num_rows, 1)  # [B, S]
    tables = torch.arange(num_rows * 4).view(num_rows, 4)
    return BatchLayout.uniform(positions, tables, block_size=4, max_context_len=16)


def test_the_mha_inputs_dispatch_the_verify_and_the_decode_width() -> None:
    backend = TorchAttentionBackend()
    verify = uniform(2, 1 + K)
    metadata = backend.build_metadata(verify)
    pools = [(torch.zeros(8, 4, 2, 16), torch.zeros(8, 4, 2, 16))]  # the draft's K and V
    tokens, features = torch.arange(8), torch.zeros(8, 96)
    inputs = Eagle3MHADeepseekV3Inputs.for_extend(tokens, features, verify, metadata, pools)

    cache = inputs.kv_cache_inputs
    assert isinstance(cache, KVCacheInputs)
    assert cache.max_lengths.tolist() == [[1 + K, 16], [1, 16]]
    assert cache.widths == [1 + K, 1]
    assert cache.kv_blocks is pools and inputs.draft_kv_blocks == [pools]
    assert cache.lookup_table is verify.block_tables  # one block id: target and draft
    assert torch.equal(cache.cache_lengths, torch.tensor([9, 9]))
    assert cache.dispatch(verify, backend) is metadata  # the target's, borrowed
    chain = cache.dispatch(uniform(2, 1, start=9), backend)
    assert isinstance(chain, TorchAttentionMetadata) and chain.max_query_len == 1
    with pytest.raises(ValueError, match=r"q_max_seq_len: 2, .* dispatch widths \[4, 1\]"):
        cache.dispatch(uniform(2, 2), backend)

    assert inputs.host_input_row_offsets.tolist() == [0, 4, 8]
    assert inputs.host_input_row_offsets.device.type == "cpu"
    assert [int(t) for t in inputs.batch_context_lengths] == [18]
    assert inputs.data_parallel_splits.tolist() == [0, 2]
    assert (inputs.signal_buffers, inputs.ep_inputs, inputs.lora) == ([], (), None)
    assert inputs.hidden_states is features
    assert inputs.buffers[:3] == (tokens, verify.input_row_offsets, inputs.host_input_row_offsets)
    # The seed's fields, in its order.
    names = [f.name for f in dataclasses.fields(Eagle3DeepseekV3Inputs)]
    assert names[:5] == [
        "tokens",
        "input_row_offsets",
        "signal_buffers",
        "host_input_row_offsets",
        "batch_context_lengths",
    ]
    assert names[-6:] == [  # keyword-only
        "kv_cache_inputs",
        "lora",
        "hidden_states",
        "return_n_logits",
        "data_parallel_splits",
        "ep_inputs",
    ]


def test_a_prefill_extend_dispatches_its_chunk_width_then_one() -> None:
    lens = [3, 5]
    offsets = torch.tensor([0, 3, 8])
    layout = BatchLayout(
        input_row_offsets=offsets,
        positions=torch.cat([torch.arange(n) for n in lens]),
        slot_mapping=torch.arange(8),
        context_lens=torch.tensor(lens),
        block_tables=torch.tensor([[0, 0], [1, 2]]),
        block_size=4,
        max_query_len=5,
        max_context_len=5,
        is_causal_prefill=True,
        query_lens=lens,
        context_lens_host=lens,
    )
    inputs = Eagle3DeepseekV3Inputs.for_extend(
        torch.arange(8), torch.zeros(8, 6), layout, "target metadata", [(torch.zeros(3, 4, 1, 8),)]
    )
    assert inputs.host_input_row_offsets.tolist() == [0, 3, 8]
    assert inputs.kv_cache_inputs is not None
    assert inputs.kv_cache_inputs.max_lengths.tolist() == [[5, 5], [1, 5]]


def test_an_extend_of_width_one_lends_the_chain_no_metadata() -> None:
    """Every row one token (prompts' last chunks of one): the chain's forwards share the
    width but not the positions, so neither borrows the extend's metadata."""
    backend = TorchAttentionBackend()
    extend = uniform(2, 1, start=12)
    inputs = Eagle3DeepseekV3Inputs.for_extend(
        torch.arange(2), torch.zeros(2, 6), extend, backend.build_metadata(extend),
        [(torch.zeros(8, 4, 1, 8),)],
    )  # fmt: skip
    cache = inputs.kv_cache_inputs
    assert cache is not None and cache.widths == [1]
    chain = cache.dispatch(uniform(2, 1, start=13), backend)
    assert isinstance(chain, TorchAttentionMetadata)
    assert torch.equal(chain.slot_mapping, uniform(2, 1, start=13).slot_mapping)


@pytest.mark.parametrize("variant", ["mha", "mla"])
def test_the_engines_draft_forwards_go_through_the_inputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variant: str
) -> None:
    """Greedy decoding with K=3: after the prefill, each step's extend is dispatched at
    width 1+K on the draft's own pools and its chain at width 1."""
    build_tiny_deepseek(tmp_path / "t", "groups8_yarn_two_dense", vocab_size=64, num_layers=2)
    hf = json.loads((tmp_path / "t" / "config.json").read_text())
    extra = mha_fields(hf) if variant == "mha" else {}
    draft = build_random_draft(tmp_path / "t", tmp_path / "d", "eagle3", **extra)
    kind = "Eagle3MHADeepseekV3Inputs" if variant == "mha" else "Eagle3DeepseekV3Inputs"
    seen: list[tuple[str, int, int]] = []  # (inputs class, number of pools, width)
    real_dispatch = KVCacheInputs.dispatch

    def dispatch(self: KVCacheInputs, layout: BatchLayout, backend: Any) -> Any:
        seen.append(
            (type(drafter.step_inputs).__name__, len(self.kv_blocks[0]), layout.max_query_len)
        )
        return real_dispatch(self, layout, backend)

    monkeypatch.setattr(KVCacheInputs, "dispatch", dispatch)
    engine = LLMEngine(
        EngineConfig(
            model=str(tmp_path / "t"),
            dtype="float32",
            kv_cache_memory=1 << 20,
            block_size=4,
            speculative=SpeculativeConfig(str(draft), num_draft_tokens=K),
        )
    )
    assert engine.spec is not None
    drafter = engine.spec.drafter
    assert type(drafter) is (Eagle3MHADeepseekV3 if variant == "mha" else Eagle3DeepseekV3)
    engine.add_request("r", [5, 6, 7, 8, 9], SamplingParams(max_tokens=9, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    inputs = drafter.step_inputs  # type: ignore[attr-defined]
    assert type(inputs).__name__ == kind
    assert inputs.kv_cache_inputs.kv_blocks is engine.kv_pools["draft"].layers
    pools = 2 if variant == "mha" else 1  # K and V, or the latent one
    assert seen[:K] == [(kind, pools, 5)] + [(kind, pools, 1)] * (K - 1)  # prefill, chain
    steps = seen[K:]
    assert steps and len(steps) % K == 0
    one_step = [(kind, pools, 1 + K)] + [(kind, pools, 1)] * (K - 1)  # extend, then chain
    assert steps == one_step * (len(steps) // K)
