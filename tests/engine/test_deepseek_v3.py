"""Tandem's DeepSeek-V3 against transformers' DeepseekV3ForCausalLM in fp32, through the
paged MLA cache: logits at every prefill and decode position, greedy generation, and the
hidden states EAGLE-3 drafts read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.config import ConfigError
from engine.deepseek_v3_config import DeepseekV3Config
from engine.llm_engine import EngineConfig, LLMEngine
from engine.models.deepseek_v3 import DeepseekV3Model, concat_hidden_states
from engine.models.llama3 import ReturnHiddenStates
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from kv_transfer import Handshake, KvLayout, KvPool, KvReceiver, KvReservation, LoopbackTransport
from kv_transfer.base import LATENT_LAYOUT
from tests.comparator import compare_greedy
from tests.engine.joined import drain_joined
from tests.engine.test_llama3_logits import hf_logits, run_teacher_forced
from tests.engine.tiny_deepseek import SHAPES, build_tiny_deepseek

TOL = 1e-4
NUM_DECODE_STEPS = 32


@pytest.fixture(scope="module", params=sorted(SHAPES))
def tiny_deepseek(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(directory, transformers model) for each tiny shape."""
    out: Path = tmp_path_factory.mktemp(request.param)
    return out, build_tiny_deepseek(out, request.param)


def make_engine(model_dir: Path, **kwargs: object) -> LLMEngine:
    config: dict[str, object] = dict(
        model=str(model_dir), dtype="float32", kv_cache_memory=1 << 22, block_size=4
    )
    config.update(kwargs)
    return LLMEngine(EngineConfig(**config))  # type: ignore[arg-type]


def test_prefill_and_decode_logits_match_transformers(tiny_deepseek):
    """Prompts chunked next to decode rows (budget 20), then 32 decode steps each."""
    model_dir, hf = tiny_deepseek
    vocab = hf.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (1, 9, 30)]
    continuations = [
        torch.randint(3, vocab, (NUM_DECODE_STEPS,), generator=gen).tolist() for _ in prompts
    ]
    engine = make_engine(model_dir, max_num_batched_tokens=20)
    got, num_chunked_steps, _ = run_teacher_forced(engine, prompts, continuations)
    assert num_chunked_steps > 0
    for i, (prompt, cont) in enumerate(zip(prompts, continuations, strict=True)):
        ref = hf_logits(hf, prompt + cont)  # [L, V]
        assert len(got[i]) == NUM_DECODE_STEPS + 1
        for step, logits in enumerate(got[i]):
            err = (logits - ref[len(prompt) - 1 + step]).abs().max().item()
            assert err < TOL, f"row {i} (prompt {len(prompt)}), step {step}: max |diff| {err:.2e}"


def test_engine_greedy_matches_transformers_generate(tiny_deepseek):
    model_dir, hf = tiny_deepseek
    engine = make_engine(model_dir, max_num_batched_tokens=16)
    prompts = [[5, 9, 4], list(range(3, 40)), [7] * 11]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
    refs = []
    for p in prompts:
        t = torch.tensor([p])
        ref = hf.generate(
            t,
            attention_mask=torch.ones_like(t),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=None,
        )
        refs.append(ref[0, len(p) :].tolist())
    ours = [outs[str(i)] for i in range(len(prompts))]
    assert compare_greedy(hf, prompts, ours, refs).num_ties <= 1


def test_mla_cache_holds_one_latent_and_rope_vector_per_token(tiny_deepseek):
    """The model declares its layout; the engine sizes the pools from it: one pool per
    layer, one head of kv_lora_rank + qk_rope_head_dim, no per-head keys or values."""
    model_dir, hf = tiny_deepseek
    engine = make_engine(model_dir)
    c = hf.config
    width = c.kv_lora_rank + c.qk_rope_head_dim
    params = engine.kv_cache.params
    assert (params.num_tensors, params.num_kv_heads, params.head_dim) == (1, 1, width)
    assert params.bytes_per_block == c.num_hidden_layers * 4 * width * 4  # block 4, fp32
    assert engine.kv_cache.num_blocks == (1 << 22) // params.bytes_per_block
    for pools in engine.kv_cache.layers:
        assert len(pools) == 1 and tuple(pools[0].shape[1:]) == (4, 1, width)


async def test_mla_blocks_pushed_to_a_decode_engine_give_the_same_tokens(tmp_path: Path):
    """Prefill on one engine, push its MLA blocks layer by layer through the KV transfer
    (loopback, checked against the layout both engines declare), decode on another: the
    output equals one engine doing everything."""
    model_dir = tmp_path
    build_tiny_deepseek(model_dir, "q_proj_plain_rope_split_tied_bias", num_layers=3)
    prompts = [[5, 6, 7], [9] * 11, list(range(10, 27))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    whole = make_engine(model_dir)
    for i, p in enumerate(prompts):
        whole.add_request(str(i), p, params)
    expected = _drain(whole)

    prefill, decode = make_engine(model_dir), make_engine(model_dir)
    layout = KvLayout.of_pools("tiny-deepseek", prefill.kv_cache)
    assert layout == KvLayout.of_pools("tiny-deepseek", decode.kv_cache)
    assert layout.target.num_tensors == 1 and layout.layout == LATENT_LAYOUT
    receiver = KvReceiver()
    for i, p in enumerate(prompts):
        prefill.add_request(str(i), p, params, is_prefill_only=True)
    while prefill.has_unfinished_requests():
        prefill.step()
    firsts = []
    for i, p in enumerate(prompts):
        rid = str(i)
        done = prefill.take_prefilled(rid)
        assert done is not None
        table, _ = decode.reserve(rid, p, params)
        receiver.reserve(KvReservation(rid, table, {"target": decode.kv_cache}, layout))
        sender = LoopbackTransport(receiver).sender()
        await sender.begin(Handshake(rid, layout))
        for layer, pools in enumerate(prefill.kv_cache.layers):
            await sender.send_layer(KvPool.TARGET, layer, pools, done.block_table, table)
        await sender.finish({})
        await receiver.wait_done(rid, timeout=5)
        prefill.drop_request(rid)
        firsts.append(decode.start_decoding(rid, done.first_token, done.draft_token_ids))
    assert {rid: out.token_ids for rid, out in drain_joined(decode, firsts).items()} == expected


def _drain(engine: LLMEngine) -> dict[str, list[int]]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return done


def test_eagle3_hidden_states_match_transformers(tmp_path: Path):
    """The low, middle and high layers' residual streams, concatenated as EAGLE-3's fc takes
    them (8 layers: the first 5 would collapse EAGLE-3's taps into one)."""
    hf = build_tiny_deepseek(tmp_path, "qlora_yarn_mscale_interleaved", num_layers=8)
    engine = make_engine(tmp_path)
    model = engine.runner.model
    assert isinstance(model, DeepseekV3Model)
    layer_ids = model.eagle3_layer_ids
    assert layer_ids == (1, 3, 4)  # outputs of layers 1, 8 // 2 - 1 and 8 - 4
    prompt = list(range(3, 20))
    engine.scheduler.add(Sequence("h", list(prompt), len(prompt), SamplingParams(), 0))
    inputs = engine.runner.prepare(engine.scheduler.schedule())
    out = engine.runner.forward(inputs, ReturnHiddenStates(layer_ids=layer_ids))
    features = concat_hidden_states(out, layer_ids)
    with torch.inference_mode():
        t = torch.tensor([prompt])
        ref = hf(t, attention_mask=torch.ones_like(t), output_hidden_states=True).hidden_states
    # transformers: hidden_states[i + 1] is the output of layer i.
    expected = torch.cat([ref[i + 1][0] for i in layer_ids], dim=-1)
    assert features.shape == (len(prompt), 3 * hf.config.hidden_size)
    assert (features - expected).abs().max().item() < TOL


def test_bf16_keeps_routers_in_fp32_and_the_latent_up_projection(tmp_path: Path):
    """Routing decides in fp32 whatever the dtype (as transformers keeps gate.weight and
    the correction bias); kv_b_proj is read as W_UK and W_UV, so releasing packed weights
    must not take it. The rest runs in bf16 on the CPU kernel where it is built."""
    hf = build_tiny_deepseek(tmp_path, "qlora_yarn_mscale_interleaved", num_layers=2)
    engine = make_engine(tmp_path, dtype="bfloat16", cpu_gemm="kernel")
    model = engine.runner.model
    assert isinstance(model, DeepseekV3Model)
    moe = model.layers[1].mlp
    assert moe.gate.weight.dtype == moe.gate.e_score_correction_bias.dtype == torch.float32
    ref = hf.model.layers[1].mlp.gate
    assert torch.equal(moe.gate.weight, ref.weight)
    assert torch.equal(moe.gate.e_score_correction_bias, ref.e_score_correction_bias)
    kv_b = model.layers[1].self_attn.kv_b_proj.weight
    assert kv_b.dtype == torch.bfloat16 and kv_b.shape == ref_shape(hf)
    engine.add_request("a", [5, 9, 4, 7], SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(_drain(engine)["a"]) == 8


def ref_shape(hf) -> tuple[int, int]:
    c = hf.config
    return (c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)


def _hf_config(**overrides: object) -> dict[str, object]:
    hf: dict[str, object] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "hidden_size": 32,
        "num_attention_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": 64,
        "max_position_embeddings": 128,
        "n_routed_experts": 8,
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 2,
    }
    hf.update(overrides)
    return hf


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.rope_type: 'linear'"),
        ({"quantization_config": {"quant_method": "fp8"}}, "per-tensor FP8 is not supported"),
        ({"quantization_config": {"quant_method": "awq"}}, "quant_method: 'awq' is not"),
        ({"scoring_func": "softmax"}, "scoring_func: 'softmax' is not supported"),
        ({"n_group": 3}, "n_group: 3 must divide n_routed_experts (8)"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok: 5 exceeds the 4 experts"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim: must be even"),
    ],
)
def test_configs_tandem_cannot_serve_are_refused_naming_the_field(overrides, message):
    with pytest.raises(ConfigError) as refused:
        DeepseekV3Config.from_hf(_hf_config(**overrides))
    assert message in str(refused.value)


def test_yarn_from_a_transformers_4_config(tmp_path: Path):
    """DeepSeek-V3's own config.json spelling: rope_theta beside rope_scaling with "type"."""
    hf = _hf_config(
        rope_theta=10000,
        rope_scaling={
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
    )
    (tmp_path / "config.json").write_text(json.dumps(hf))
    config = DeepseekV3Config.from_hf(hf, max_length=64)
    yarn = config.rope_scaling
    assert yarn is not None and (yarn.factor, yarn.original_max_position_embeddings) == (40, 4096)
    assert config.max_seq_len == 64
    assert yarn.cos_sin_factor == 1.0  # mscale and mscale_all_dim cancel
    mscale = 0.1 * torch.log(torch.tensor(40.0)).item() + 1.0
    assert config.softmax_scale == pytest.approx(192**-0.5 * mscale**2)
