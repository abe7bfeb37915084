"""A split engine whose ranks share no memory, as CUDA ranks each on its own GPU
(``TANDEM_TP_SHARED_KV=0`` makes CPU ranks so): each rank's KV pools are its own, and a KV
transfer reads and writes rank 0's copy of every head (engine.executor.gathered_kv). With
an EAGLE-3 draft split as its target is, at TP 2 over 2 KV heads (one each) and at TP 4
(each head on two ranks):

- a prefill-only request's KV, target and draft, is in the copy as one device computes it
  once the layer listener hears of it, and only then: every target layer, then every draft
  layer;
- a request reserved here whose prompt KV (one device's) is written into the copy, as a
  transfer writes it, is in every rank's heads once it starts decoding (gathered back,
  it is what was written), past the prefix cached here, and decodes the tokens and
  logprobs one device decodes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.kv_cache import PagedKVCache
from engine.llm_engine import EngineConfig, LLMEngine
from engine.model_runner import StepKv
from engine.outputs import RequestDelta
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from tests.engine.tiny_drafts import build_random_draft
from tests.engine.tiny_models import build_tiny_llama

VOCAB = 67
PROMPT = [7, 31, 5, 60, 12, 12, 44, 9, 3, 27, 50, 18, 61, 33, 8, 20, 41]  # 17: 5 blocks of 4
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("tp_gathered")
    build_tiny_llama(out / "target", "gqa4_llama3rope_hd72_mlpbias", num_layers=2, vocab_size=VOCAB)
    draft = build_random_draft(out / "target", out / "eagle3", "eagle3", std=0.3)
    return out / "target", draft


def engine_for(dirs: tuple[Path, Path], size: int, *, prefix_caching: bool = False) -> LLMEngine:
    target, draft = dirs
    config = EngineConfig(
        model=str(target),
        dtype="float32",
        block_size=4,
        kv_cache_memory=8 << 20,
        enable_prefix_caching=prefix_caching,
        speculative=SpeculativeConfig(str(draft), num_draft_tokens=3),
        tensor_parallel_size=size,
        num_threads=2,
    )
    return LLMEngine(config)


def prompt_kv(pools: dict[str, PagedKVCache], table: list[int]) -> dict[str, torch.Tensor]:
    """Each pool's ``[layers, K and V, tokens, KV heads, head_dim]`` at PROMPT's slots."""
    assert pools["target"].params.block_size == 4
    return {
        name: torch.stack(
            [torch.stack([t.flatten(0, 1)[slots(table)] for t in layer]) for layer in cache.layers]
        )
        for name, cache in pools.items()
    }


def prefill(engine: LLMEngine, request_id: str) -> tuple[int, list[int], list[int]]:
    """PROMPT prefilled only: its first token, drafts and block table."""
    engine.add_request(request_id, PROMPT, GREEDY, is_prefill_only=True)
    while (done := engine.take_prefilled(request_id)) is None:
        engine.step()
    return done.first_token, done.draft_token_ids, done.block_table


def decode(
    engine: LLMEngine, request_id: str, first: RequestDelta | None = None
) -> tuple[list[int], torch.Tensor]:
    """The request's output tokens (``first``: its delta from ``start_decoding``), and the
    logprobs of those this engine sampled (all but a reserved request's first)."""
    deltas = [] if first is None else [first]
    while engine.has_unfinished_requests():
        deltas += [d for d in engine.step_deltas() if d.request_id == request_id]
    tokens = [t for d in deltas for t in d.new_token_ids]
    return tokens, torch.tensor([lp.logprob for d in deltas for lp in d.new_logprobs])


@pytest.mark.parametrize(("size", "prefix_caching"), [(2, False), (4, False), (2, True)])
def test_kv_gathered_to_rank_0_and_scattered_from_it(
    dirs: tuple[Path, Path], size: int, prefix_caching: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the prefix cache on, the received request's first 4 blocks are the prefilled
    one's, cached here: only its last block is received."""
    one = engine_for(dirs, 1)
    first, drafts, table = prefill(one, "one")
    expected_kv = prompt_kv(one.kv_pools, table)
    one.drop_request("one")
    one.add_request("whole", PROMPT, GREEDY)
    expected, expected_logprobs = decode(one, "whole")

    monkeypatch.setenv("TANDEM_TP_SHARED_KV", "0")
    engine = engine_for(dirs, size, prefix_caching=prefix_caching)
    try:
        pools = engine.kv_pools
        executor = engine.runner.executor
        assert executor.gathers("target") and executor.gathers("draft")
        # Rank 0's own heads (1 of 2) apart from its copy of both, which lies in memory a
        # decode worker may move into a shared segment for same-host senders.
        assert engine.kv_cache.layers[0][0].shape[2] == 1
        assert pools["target"].layers[0][0].shape[2] == 2 and pools["target"].is_placeable
        assert pools["draft"].layers[0][0].shape[2] == 2
        heard: list[tuple[str, int, dict[str, torch.Tensor]]] = []

        def listener(pool: str, layer: int, step: StepKv) -> None:
            (row,) = step.rows
            heard.append((pool, layer, prompt_kv(pools, list(row.block_table))))

        engine.set_layer_listener(listener)
        got_first, got_drafts, _ = prefill(engine, "split")
        engine.set_layer_listener(None)
        assert (got_first, got_drafts) == (first, drafts)
        assert [(pool, layer) for pool, layer, _ in heard] == [
            ("target", 0),
            ("target", 1),
            ("draft", 0),
        ]
        # Told of the target's layers once every rank's heads were in the copy: the
        # sums of the layers' all-reduces in another order, fp32 rounding apart.
        for name, at in (("target", 0), ("draft", 2)):
            torch.testing.assert_close(heard[at][2][name], expected_kv[name], rtol=1e-5, atol=1e-5)

        # A transfer's KV written into rank 0's copy alone (the prefilled request keeps
        # its blocks: the ranks' pools hold nothing of this prompt in the new ones) ...
        table, num_cached = engine.reserve("received", PROMPT, GREEDY)
        assert num_cached == (16 if prefix_caching else 0)
        for name, cache in pools.items():
            for layer, kv in enumerate(cache.layers):
                for t, values in zip(kv, expected_kv[name][layer], strict=True):
                    t.flatten(0, 1)[slots(table)] = values
        started = engine.start_decoding("received", first, drafts)
        # ... is in every rank's pools once it starts decoding: gathered back into a
        # cleared copy, every rank's heads of it are what was written (the cached blocks
        # what this engine computed).
        for name, cache in pools.items():
            for kv in cache.layers:
                for t in kv:
                    t.zero_()
            executor.gather_kv(name, slots(table))
        tolerance = 1e-5 if prefix_caching else 0.0
        got_kv = prompt_kv(pools, table)
        for name in ("target", "draft"):
            torch.testing.assert_close(got_kv[name], expected_kv[name], rtol=0, atol=tolerance)
        tokens, logprobs = decode(engine, "received", started)
        assert tokens == expected
        torch.testing.assert_close(logprobs, expected_logprobs[1:], rtol=1e-4, atol=1e-4)
        engine.drop_request("split")
    finally:
        engine.close()


def slots(table: list[int]) -> torch.Tensor:
    return torch.tensor([table[i // 4] * 4 + i % 4 for i in range(len(PROMPT))])
