"""DeepSeek-V3 with tensor parallelism inside data-parallel ranks (real processes, gloo):
four ranks as two data-parallel ranks of two tensor-parallel ranks each. Each pair splits
its attention by heads, its dense layer by channels and its vocabulary, and attends its
own requests' rows over its own latent cache; the experts split over all four ranks. Rank
w is tensor-parallel rank w % 2 of data-parallel rank w // 2. Greedy output in fp32
equals transformers' (the tie-aware comparator), with expert parallelism and without,
with one data-parallel rank idle and with every token sent to one pair's experts; with
the MLA EAGLE-3 draft beside each pair's rows, speculative output equals the target alone
and every draft offered is one device's, also sampled with rank 0 holding no rows; so with
an EAGLE draft (a whole LM head on every rank) and with MTP; compiled
steps from a cold compile cache equal eager ones."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.dp_blocks import DataParallelBlocks
from engine.models.moe import DeepseekV3MoE
from engine.parallel.shard import TensorParallelError
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from tests.comparator import compare_greedy
from tests.engine.parallel.test_dp_deepseek_v3 import model as model  # the fixture
from tests.engine.parallel.test_dp_deepseek_v3 import prompts as prompts  # the fixture
from tests.engine.parallel.test_dp_drafts import CHUNKED, offered_drafts
from tests.engine.parallel.test_tp_deepseek_v3 import SHAPE, VOCAB, greedy, references
from tests.engine.spec.test_eagle3_deepseek_v3 import MHA_OVERRIDES
from tests.engine.tiny_deepseek import (
    build_tiny_deepseek_with_mtp,
    make_mtp_know_the_target,
    write_biased_router,
)
from tests.engine.tiny_drafts import build_random_draft

DP2_TP2 = {"data_parallel_size": 2}  # with greedy's tensor_parallel_size 2: four ranks


@pytest.mark.parametrize("expert_parallel", [True, False])
def test_two_data_parallel_ranks_of_two_equal_transformers(model, prompts, expert_parallel):
    model_dir, hf = model
    ours, engine = greedy(model_dir, prompts, 2, enable_expert_parallel=expert_parallel,
                          **DP2_TP2)  # fmt: skip
    compare_greedy(hf, prompts, ours, references(hf, prompts))
    blocks = engine.block_manager
    assert isinstance(blocks, DataParallelBlocks) and blocks.num_placed == [3, 1]
    model_ = engine.runner.model
    assert model_.layers[0].self_attn.num_heads == 2  # 4 heads over the pair
    assert model_.layers[0].mlp.gate_up_proj.weight.shape[0] == 2 * 96 // 2  # dense: split
    assert model_.lm_head.weight.shape[0] == 49  # ceil(97 / 2): the pair's vocabulary
    moe = model_.layers[1].mlp
    assert isinstance(moe, DeepseekV3MoE)
    assert moe.tp.size == 4 and model_.dp.group.size == 2
    assert len(moe.experts) == (2 if expert_parallel else 8)  # 8 experts over 4 ranks
    # Two data-parallel ranks' blocks in the shared pool.
    whole = engine.kv_pools["target"]
    assert whole.layers[0][0].shape[0] == 2 * engine.runner.kv_cache.num_blocks


def test_an_idle_pair_and_one_pairs_experts_give_the_same_tokens(model, prompts, tmp_path):
    """One request: data-parallel rank 1's two ranks have no rows in any step and join
    the experts' collectives alone. Then a correction bias that sends every token to
    experts 0-3, held by ranks 0 and 1 (data-parallel rank 0's pair)."""
    model_dir, hf = model
    ours, engine = greedy(model_dir, prompts[1:2], 2, enable_expert_parallel=True, **DP2_TP2)
    compare_greedy(hf, prompts[1:2], ours, references(hf, prompts[1:2]))
    assert engine.block_manager.num_placed == [1, 0]
    biased = tmp_path / "biased"
    write_biased_router(model_dir, biased, [5.0] * 4 + [0.0] * 4)
    hf_biased = type(hf).from_pretrained(biased, dtype=torch.float32).eval()
    ours, _ = greedy(biased, prompts, 2, enable_expert_parallel=True, **DP2_TP2)
    compare_greedy(hf_biased, prompts, ours, references(hf_biased, prompts))


def test_mla_eagle3_drafts_beside_each_pairs_rows(model, prompts, tmp_path, monkeypatch):
    """Greedy drafts, chunked prefill: output equals the target alone, and every draft
    offered equals one device's. Then seeded sampled drafts with every request on
    data-parallel rank 1: rank 0, holding no rows, chooses them for all four ranks."""
    model_dir, _ = model
    alone, _ = greedy(model_dir, prompts, 1)
    draft = build_random_draft(model_dir, tmp_path / "draft", "eagle3", draft_vocab_size=48,
                               d2t=torch.arange(48))  # fmt: skip
    spec = SpeculativeConfig(str(draft), num_draft_tokens=3)
    one, _, offered_one = offered_drafts(model_dir, prompts, spec, **CHUNKED)
    ours, engine, offered = offered_drafts(model_dir, prompts, spec, tensor_parallel_size=2,
                                           enable_expert_parallel=True, **DP2_TP2,
                                           **CHUNKED)  # fmt: skip
    assert one == alone and ours == alone
    assert engine.block_manager.num_placed == [2, 2]  # type: ignore[union-attr]
    assert offered == offered_one
    assert sum(len(steps) for steps in offered.values()) >= 4 * 9  # every step drafted

    sampled_spec = SpeculativeConfig(str(draft), num_draft_tokens=3, sample_drafts=True)
    sampled = SamplingParams(max_tokens=10, temperature=0.9, seed=11, ignore_eos=True)
    one, _, offered_one = offered_drafts(model_dir, prompts[:2], sampled_spec, sampled,
                                         **CHUNKED)  # fmt: skip

    def rank_1(blocks: DataParallelBlocks, seq: Any) -> int | None:
        return 1 if blocks.ranks[1].can_allocate(seq) else None

    monkeypatch.setattr(DataParallelBlocks, "_place", rank_1)
    ours, engine, offered = offered_drafts(model_dir, prompts[:2], sampled_spec, sampled,
                                           tensor_parallel_size=2, **DP2_TP2,
                                           **CHUNKED)  # fmt: skip
    assert engine.block_manager.num_placed == [0, 2]  # type: ignore[union-attr]
    assert ours == one and offered == offered_one and len(offered) == 2


def test_eagle_and_mtp_drafts_beside_each_pairs_rows(model, prompts, tmp_path) -> None:
    """An EAGLE draft scores with its target's LM head: each rank borrows a whole copy (the
    pair's is split by vocabulary), so its drafts are one device's. DeepSeek-V3's MTP
    layer made to predict the target: every draft is accepted, as on one device."""
    model_dir, _ = model
    alone, _ = greedy(model_dir, prompts, 1)
    llama_shape = {k: v for k, v in MHA_OVERRIDES.items() if k != "eagle_config"}
    draft = build_random_draft(model_dir, tmp_path / "eagle", "eagle", rope_scaling=None,
                               **llama_shape)  # fmt: skip
    spec = SpeculativeConfig(str(draft), num_draft_tokens=3)
    one, _, offered_one = offered_drafts(model_dir, prompts, spec, **CHUNKED)
    ours, _, offered = offered_drafts(model_dir, prompts, spec, tensor_parallel_size=2,
                                      **DP2_TP2, **CHUNKED)  # fmt: skip
    assert one == alone and ours == alone
    assert offered == offered_one and max(t for o in offered.values() for d in o for t in d) > 49

    mtp_dir = tmp_path / "mtp"
    build_tiny_deepseek_with_mtp(mtp_dir, SHAPE, vocab_size=VOCAB)
    make_mtp_know_the_target(mtp_dir)
    alone, _ = greedy(mtp_dir, prompts, 1)
    mtp = SpeculativeConfig("", kind="mtp", num_draft_tokens=3)
    ours, engine = greedy(mtp_dir, prompts, 2, speculative=mtp, enable_expert_parallel=True,
                          **DP2_TP2, **CHUNKED)  # fmt: skip
    assert ours == alone
    stats = engine.spec.stats  # type: ignore[union-attr]
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


def test_what_does_not_split_is_refused_naming_the_numbers(model) -> None:
    """Three data-parallel ranks of two: 8 experts do not split over six ranks."""
    model_dir, _ = model
    with pytest.raises(TensorParallelError, match="6 does not divide n_routed_experts 8"):
        greedy(model_dir, [], 2, data_parallel_size=3, enable_expert_parallel=True)


def test_compiled_steps_from_a_cold_compile_cache_equal_eager(
    model, prompts, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode workers' default: each rank's rows through its compiled forward, the
    pair's all-reduces ops of the graph, every inductor cache empty. The warm-up puts rows
    on both pairs; then one request alone, the other pair idle. Ranks compile seconds
    apart while others wait in three segments' collectives."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model_dir, _ = model
    eager, _ = greedy(model_dir, prompts[1:2], 2, enable_expert_parallel=True, **DP2_TP2)
    ours, engine = greedy(model_dir, prompts[1:2], 2, enable_expert_parallel=True,
                          torch_compile=True, **DP2_TP2)  # fmt: skip
    assert ours == eager
    assert min(engine.block_manager.num_placed) > 0  # the warm-up's rows on both pairs
