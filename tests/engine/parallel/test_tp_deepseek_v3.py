"""DeepSeek-V3 split over two ranks through the executor (real processes, gloo and the
shared-memory collectives): each rank holds its heads of the latent attention, the whole
latent, its MLP channels, and either every routed expert's channels or, with expert
parallelism, half the experts whole. Greedy output in fp32 equals transformers' (the
tie-aware comparator) in both layouts, also when every token picks experts of one rank,
and with an MLA EAGLE-3 draft on rank 0 it equals target-only output; a block-FP8
checkpoint split either way equals one device. What cannot be split is refused before any rank
starts, naming the numbers."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import DeepseekV3ForCausalLM

from engine.config import ConfigError
from engine.fp8 import BlockFp8, Fp8Linear
from engine.llm_engine import EngineConfig, LLMEngine
from engine.models.moe import DeepseekV3MoE
from engine.parallel.shard import TensorParallelError
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from tests.comparator import compare_greedy
from tests.engine.tiny_deepseek import build_tiny_deepseek, write_biased_router
from tests.engine.tiny_drafts import build_random_draft
from tests.engine.tiny_models import build_tiny_llama

SHAPE = "qlora_yarn_mscale_interleaved"  # 4 heads; 8 experts in 4 groups, 1 shared; 1 dense
VOCAB = 97  # not a multiple of 2
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("tp_deepseek")
    return out, build_tiny_deepseek(out, SHAPE, vocab_size=VOCAB, num_layers=3)


@pytest.fixture(scope="module")
def tied_bias_model(tmp_path_factory: pytest.TempPathFactory):
    """No q-LoRA (q_proj split by heads), attention biases (o_proj's on rank 0 alone),
    tied embeddings, 6 experts with 2 shared, no dense layer; 4 heads."""
    out = tmp_path_factory.mktemp("tp_deepseek_tied")
    shape = "q_proj_plain_rope_split_tied_bias"
    return out, build_tiny_deepseek(out, shape, vocab_size=VOCAB, num_layers=2,
                                    num_attention_heads=4)  # fmt: skip


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (4, 13, 7)]


def greedy(
    model_dir: Path, prompts: list[list[int]], size: int, **kw: object
) -> tuple[list[list[int]], LLMEngine]:
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), dtype="float32", block_size=4,
                     kv_cache_memory=4 << 20, tensor_parallel_size=size, num_threads=2, **kw)
    )  # fmt: skip
    try:
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, GREEDY)
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    finally:
        engine.close()
    return [done[str(i)] for i in range(len(prompts))], engine


def references(hf: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    return [
        hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                    pad_token_id=0)[0, len(p):].tolist()
        for p in prompts
    ]  # fmt: skip


@pytest.mark.parametrize("which", ["model", "tied_bias_model"])
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_tp_2_equals_transformers(request, prompts, which: str, expert_parallel: bool) -> None:
    model_dir, hf = request.getfixturevalue(which)
    c = hf.config
    ours, engine = greedy(model_dir, prompts, 2, enable_expert_parallel=expert_parallel)
    compare_greedy(hf, prompts, ours, references(hf, prompts))
    layer = c.first_k_dense_replace  # the first MoE layer
    moe = engine.runner.model.layers[layer].mlp
    assert isinstance(moe, DeepseekV3MoE)
    attn = engine.runner.model.layers[0].self_attn
    heads = c.num_attention_heads // 2
    assert attn.num_heads == heads
    assert attn.kv_b_proj.weight.shape[0] == heads * (c.qk_nope_head_dim + c.v_head_dim)
    latent = engine.kv_cache.layers[0][0].shape[-1]
    assert latent == c.kv_lora_rank + c.qk_rope_head_dim  # the whole latent and rope
    experts, inter = c.n_routed_experts, c.moe_intermediate_size
    if expert_parallel:  # rank 0: the first half of the experts, whole
        assert moe.expert_ids == range(0, experts // 2) and len(moe.experts) == experts // 2
        assert moe.experts[0].gate_up_proj.weight.shape == (2 * inter, c.hidden_size)
    else:  # rank 0: every expert's first half of the channels
        assert moe.expert_ids == range(experts) and len(moe.experts) == experts
        assert moe.experts[0].gate_up_proj.weight.shape == (inter, c.hidden_size)
    assert engine.runner.model.lm_head.weight.shape[0] == 49  # of 97 rows


def test_every_token_on_one_ranks_experts_and_an_mla_draft(model, prompts, tmp_path) -> None:
    """The correction bias sends every token to experts 0-3 (rank 0's): rank 1 adds only
    its share of the shared expert. Then an MLA EAGLE-3 draft, run on rank 0 over a whole
    vocabulary: speculative output equals target-only output."""
    model_dir, hf = model
    biased = tmp_path / "biased"
    write_biased_router(model_dir, biased, [5.0] * 4 + [0.0] * 4)
    hf_biased = type(hf).from_pretrained(biased, dtype=torch.float32).eval()
    refs = references(hf_biased, prompts)
    ours, _ = greedy(biased, prompts, 2, enable_expert_parallel=True)
    compare_greedy(hf_biased, prompts, ours, refs)

    draft = build_random_draft(model_dir, tmp_path / "draft", "eagle3")
    target_only, _ = greedy(model_dir, prompts, 2, enable_expert_parallel=True)
    spec = SpeculativeConfig(str(draft), num_draft_tokens=3)
    ours, engine = greedy(model_dir, prompts, 2, enable_expert_parallel=True, speculative=spec)
    assert ours == target_only
    assert engine.spec is not None and engine.spec.stats.num_draft_tokens > 0


@pytest.mark.parametrize("size", [1, 2])
def test_compiled_steps_equal_eager(model, prompts, size: int) -> None:
    """Compiled, the experts chosen per step break the graph, and the modules they call
    compile one frame each: each keeps its own graph (at TP 1 too)."""
    model_dir, _ = model
    eager, _ = greedy(model_dir, prompts, size, enable_expert_parallel=size > 1)
    compiled, engine = greedy(model_dir, prompts, size, enable_expert_parallel=size > 1,
                              torch_compile=True)  # fmt: skip
    assert engine.runner.decode_model is not engine.runner.model
    assert compiled == eager


def test_what_cannot_be_split_is_refused_naming_the_numbers(model, tmp_path) -> None:
    model_dir, _ = model
    with pytest.raises(TensorParallelError, match="3 does not divide num_attention_heads 4"):
        greedy(model_dir, [], 3)
    llama = tmp_path / "llama"
    build_tiny_llama(llama, "gqa4_llama3rope_hd72_mlpbias", num_layers=1, vocab_size=VOCAB)
    no_experts = "enable_expert_parallel: LlamaForCausalLM has no experts"
    with pytest.raises(ConfigError, match=no_experts):
        greedy(llama, [], 2, enable_expert_parallel=True)


def test_block_fp8_split_over_2_ranks_equals_one_device(tmp_path, prompts) -> None:
    """Its released format, blocks of 16x16: every rank keeps its heads' and channels'
    FP8 blocks with their scales, and with expert parallelism its experts' whole. Blocks
    a split would cut are refused before any rank starts."""
    from tests.engine.test_fp8 import DEEPSEEK_QUANTIZED, write_fp8

    plain = tmp_path / "plain"
    # o_proj's 64 and the MLPs' columns split into whole 16-column blocks per rank.
    build_tiny_deepseek(plain, SHAPE, vocab_size=VOCAB, num_layers=3, v_head_dim=16,
                        intermediate_size=64, moe_intermediate_size=32)  # fmt: skip
    write_fp8(plain, tmp_path, BlockFp8(16, 16), DEEPSEEK_QUANTIZED, seed=3)
    reference = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "dequantized", dtype=torch.float32)
    refs = references(reference.eval(), prompts)
    one, _ = greedy(tmp_path / "fp8", prompts, 1, fp8_weights="keep")
    compare_greedy(reference, prompts, one, refs)
    for expert_parallel in (True, False):
        split, engine = greedy(tmp_path / "fp8", prompts, 2, fp8_weights="keep",
                               enable_expert_parallel=expert_parallel)  # fmt: skip
        if split != one:  # only where a near-tie flips, judged by the reference
            compare_greedy(reference, prompts, split, one)
        expert = engine.runner.model.layers[1].mlp.experts[0]
        assert isinstance(expert.down_proj, Fp8Linear)
        assert expert.down_proj.weight.shape == (64, 32 if expert_parallel else 16)
    assert engine.runner.model.layers[0].self_attn.o_proj.weight.shape == (64, 32)

    (tmp_path / "wide").mkdir()
    write_fp8(plain, tmp_path / "wide", BlockFp8(16, 64), DEEPSEEK_QUANTIZED, seed=3)
    refused = "splits num_attention_heads x v_head_dim 64 into runs of 32 columns, not whole 64"
    with pytest.raises(TensorParallelError, match=refused):
        greedy(tmp_path / "wide" / "fp8", prompts, 2, fp8_weights="keep")
