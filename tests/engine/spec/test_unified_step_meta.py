"""The unified step never synchronises with the host: it runs whole on the meta device,
where ``.item()``, ``.tolist()``, ``nonzero``, boolean-mask indexing and data-dependent
branches raise."""

from __future__ import annotations

import pytest
import torch

from engine.attention import TorchAttentionBackend
from engine.config import Llama3Config
from engine.executor.uniproc import UniprocExecutor
from engine.kv_cache import KVCacheParams, PagedKVCache
from engine.models.llama3 import Llama3Model
from engine.sampler import SamplingTensors
from engine.sampling_params import SamplingParams
from engine.spec.drafters import new_drafter
from engine.spec.unified_step import SpecStepInputs, UnifiedStep

META = torch.device("meta")


def target_config() -> Llama3Config:
    return Llama3Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        head_dim=16,
        intermediate_size=96,
        vocab_size=128,
        rope_theta=10000.0,
        rope_scaling=None,
        max_seq_len=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        dtype=torch.float32,
    )


def draft_hf(kind: str) -> dict:
    hf = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        head_dim=16,
        intermediate_size=48,
        vocab_size=128,
        max_position_embeddings=256,
    )
    if kind == "eagle3":
        hf.update(draft_vocab_size=96, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 4]})
    if kind == "dflash":
        hf.update(
            num_hidden_layers=2,
            block_size=4,
            dflash_config={"mask_token_id": 127, "target_layer_ids": [0, 3]},
        )
    return hf


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "dflash"])
@pytest.mark.parametrize("sample_drafts", [False, True])
def test_whole_step_runs_on_meta(kind, sample_drafts):
    config = target_config()
    with META:
        target = Llama3Model(config)
    drafter = new_drafter(kind, draft_hf(kind), target, META)
    params = KVCacheParams.from_config(config, 4)
    target_kv = PagedKVCache(params, 64, META)
    draft_kv = PagedKVCache(KVCacheParams.from_config(drafter.config, 4), 64, META)
    backend = TorchAttentionBackend()
    forward = UniprocExecutor(target, target_kv, backend).forward
    step = UnifiedStep(forward, drafter, target_kv, draft_kv, backend, sample_drafts=sample_drafts)
    b, k = 3, 3
    rows = [
        SamplingParams(max_tokens=8),
        SamplingParams(max_tokens=8, temperature=0.7, top_k=5),
        SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, min_p=0.05),
    ]
    sampling = SamplingTensors.build(rows, [1, 2, 3], [0, 0, 0], META)
    inputs = SpecStepInputs(
        tokens=torch.zeros(b, dtype=torch.int64, device=META),
        draft_tokens=torch.zeros(b, k, dtype=torch.int64, device=META),
        kv_lens=torch.zeros(b, dtype=torch.int64, device=META),
        block_tables=torch.zeros(b, 8, dtype=torch.int64, device=META),
        sampling=sampling,
        max_context_len=32,
        draft_probs=torch.zeros(b, k, 128, device=META) if sample_drafts else None,
        bitmask=torch.zeros(b, k + 1, 4, dtype=torch.int32, device=META),
    )
    out = step(inputs, k_next=k)
    assert out.num_accepted.shape == (b,) and out.num_accepted.device == META
    assert out.next_tokens.shape == (b,)
    assert out.emitted.shape == (b, k + 1)
    assert out.next_draft_tokens.shape == (b, k)
    assert out.logits.shape == (b, k + 1, 128)
    assert (out.next_draft_probs is not None) == sample_drafts
    assert out.features is None
    # A step that drafts nothing may leave the drafter idle and hand back its features.
    idle = step(inputs, k_next=0, defer_drafter=True)
    assert idle.emitted.shape == (b, k + 1) and idle.next_draft_tokens.shape == (b, 0)
    assert idle.features is not None and idle.features.shape[:2] == (b, k + 1)
    assert idle.features.device == META
    with pytest.raises(ValueError, match="defer_drafter: needs k_next == 0, got 3"):
        step(inputs, k_next=k, defer_drafter=True)


def test_meta_catches_a_host_sync():
    """The guard itself: a host read on the meta device raises."""
    with pytest.raises(Exception):  # noqa: B017
        torch.zeros(3, device=META).sum().item()
