"""The attention backends: what ``auto`` picks, and the Triton backend against the torch
backend, alone and inside the engine (greedy output token for token, fp32)."""

from __future__ import annotations

import pytest
import torch

from engine.attention import (
    BatchLayout,
    TorchAttentionBackend,
    flash_attn_backend,
    get_backend,
    select_backend,
)
from engine.attention.triton_backend import TritonAttentionBackend
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
from tests.engine.tiny_models import build_tiny_llama


def test_auto_picks_by_device_and_what_is_installed(monkeypatch) -> None:
    assert select_backend("cpu", 16) == "torch"
    monkeypatch.setattr(flash_attn_backend, "is_importable", lambda: False)
    assert select_backend("cuda", 256) == "triton"
    monkeypatch.setattr(flash_attn_backend, "is_importable", lambda: True)
    assert select_backend("cuda", 256) == "flash_attn"
    assert select_backend("cuda", 16) == "triton"  # flash-attn pages are multiples of 256
    assert isinstance(get_backend("auto"), TorchAttentionBackend)
    assert isinstance(get_backend("triton"), TritonAttentionBackend)


def test_unknown_names_and_unsupported_block_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match=r"'flash' is not available; allowed: \['auto'"):
        get_backend("flash")
    with pytest.raises(ValueError, match="block_size 16 is not a multiple of 256"):
        get_backend("flash_attn", block_size=16)


def mixed_layout(device: torch.device) -> BatchLayout:
    """A prompt chunk after a cached prefix, a fresh prompt, two verify rows of K+1 = 3."""
    bs = 4
    query_lens, context_lens = [6, 5, 3, 3], [10, 5, 9, 14]
    tables = torch.arange(16, device=device).flip(0).view(4, 4)  # descending block ids
    pairs = zip(query_lens, context_lens, strict=True)
    positions = torch.cat([torch.arange(c - n, c) for n, c in pairs])
    rows = torch.repeat_interleave(torch.arange(4), torch.tensor(query_lens))
    positions, rows = positions.to(device), rows.to(device)
    return BatchLayout(
        input_row_offsets=torch.tensor([0, *query_lens], device=device).cumsum(0),
        positions=positions,
        slot_mapping=tables[rows, positions // bs] * bs + positions % bs,
        context_lens=torch.tensor(context_lens, device=device),
        block_tables=tables,
        block_size=bs,
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
        query_lens=query_lens,
        context_lens_host=context_lens,
    )


@pytest.mark.parametrize("is_causal", [True, False])
def test_triton_backend_matches_the_torch_backend_on_a_mixed_batch(is_causal, device) -> None:
    layout = mixed_layout(device)
    layout.is_causal = is_causal
    g = torch.Generator().manual_seed(0)
    t = layout.positions.numel()
    q, k, v = (torch.randn(t, h, 40, generator=g).to(device) for h in (6, 2, 2))
    pools = torch.randn(2, 16, 4, 2, 40, generator=g).to(device)
    outs, caches = [], []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        k_cache, v_cache = pools[0].clone(), pools[1].clone()
        outs.append(backend.forward(q, k, v, k_cache, v_cache, backend.build_metadata(layout)))
        caches.append((k_cache, v_cache))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("tiny")
    build_tiny_llama(out, "gqa3_llama3rope_tied_bias_hd40", num_layers=2, vocab_size=64)
    return out


def test_the_engine_on_the_triton_backend_generates_what_the_torch_backend_does(
    tiny, device
) -> None:
    """Chunked prefill (a prompt longer than the token budget), then decode, fp32."""
    prompts = {"a": [5, 9, 3, 7, 11, 2, 8, 6, 4, 10, 12, 13], "b": [7, 1, 9]}
    outputs = []
    for name in ("torch", "triton"):
        engine = LLMEngine(
            EngineConfig(model=str(tiny), dtype="float32", kv_cache_memory=1 << 20, block_size=4,
                         max_num_batched_tokens=8, attention_backend=name, device=str(device))
        )  # fmt: skip
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, SamplingParams(max_tokens=6, temperature=0.0,
                                                           ignore_eos=True))  # fmt: skip
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
        outputs.append(done)
    assert outputs[1] == outputs[0]
    assert all(len(ids) == 6 for ids in outputs[0].values())


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_speculative_decoding_on_the_triton_backend_equals_the_torch_backend(
    tiny, tmp_path, kind, device
) -> None:
    """The unified step's verify rows (K+1 causal tokens), the chained EAGLE-3 proposals and
    DFlash's non-causal block with its context K/V writes, all through the Triton kernels:
    the same tokens as on the torch backend, which are target-only greedy's."""
    from engine.spec.config import SpeculativeConfig
    from tests.engine.tiny_drafts import build_random_draft

    draft = build_random_draft(tiny, tmp_path / kind, kind)
    prompts = {"a": [5, 9, 3, 7, 11], "b": [7, 1, 9]}
    outputs = []
    for name, spec in (("torch", None), ("torch", 3), ("triton", 3)):
        config = EngineConfig(
            model=str(tiny), dtype="float32", kv_cache_memory=1 << 20, block_size=4,
            attention_backend=name, device=str(device),
            speculative=SpeculativeConfig(str(draft), num_draft_tokens=spec) if spec else None,
        )  # fmt: skip
        engine = LLMEngine(config)
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, SamplingParams(max_tokens=6, temperature=0.0,
                                                           ignore_eos=True))  # fmt: skip
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
        outputs.append(done)
    assert outputs[2] == outputs[1] == outputs[0]
