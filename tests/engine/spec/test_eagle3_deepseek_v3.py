"""convert_eagle3_draft_state_dict: public EAGLE-3 checkpoints for DeepSeek-V3 targets
(``fc.*``, ``layers.0.*``, ``norm.*``, ``lm_head.*``) become the draft module's parameters,
and misfits are refused naming the tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from engine.deepseek_v3_config import DeepseekV3Config
from engine.llm_engine import EngineConfig, LLMEngine
from engine.models.deepseek_v3 import MultiHeadLatentAttention
from engine.models.layers import GatedMLP
from engine.registry import load_model
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from engine.spec.drafters import load_drafter, new_drafter
from engine.spec.drafters.base import DraftConfigError
from engine.spec.drafters.eagle3_deepseek_v3 import (
    MIDLAYER_NORMS,
    Eagle3DeepseekV3,
    convert_eagle3_draft_state_dict,
    draft_rules,
)
from engine.weights import WeightError
from kv_transfer import KvLayout
from kv_transfer.base import KV_LAYOUT, LATENT_LAYOUT
from tests.comparator import compare_greedy
from tests.engine.tiny_deepseek import build_tiny_deepseek
from tests.engine.tiny_drafts import build_random_draft

# The MHA draft of a tiny DeepSeek-V3: a Llama layer with its own K/V heads.
MHA_OVERRIDES = dict(
    kv_lora_rank=None,  # no MLA
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    head_dim=16,
    num_key_value_heads=2,
    intermediate_size=80,
    eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 4]},
)


@pytest.fixture(scope="module")
def mha_draft(tmp_path_factory: pytest.TempPathFactory):
    """(public checkpoint as nvidia lays it out, draft config, the drafter it should load)."""
    out = tmp_path_factory.mktemp("eagle3_dsv3")
    build_tiny_deepseek(out / "target", "qlora_yarn_mscale_interleaved", num_layers=4)
    draft_dir = build_random_draft(out / "target", out / "draft", "eagle3", **MHA_OVERRIDES)
    hf = json.loads((draft_dir / "config.json").read_text())
    ours = load_file(str(draft_dir / "model.safetensors"))  # Tandem's layout: midlayer.*
    public = {k.replace("midlayer.", "layers.0."): v for k, v in ours.items()}
    assert {public.pop("d2t").numel(), public.pop("t2d").numel()} == {hf["vocab_size"]}
    target, _ = load_model(out / "target", dtype="float32")
    drafter = new_drafter("eagle3", hf, target, torch.device("cpu"), 0)
    return public, hf, drafter


def test_an_mha_draft_converts_to_the_drafters_parameters(mha_draft):
    public, hf, drafter = mha_draft
    assert {k.split(".")[0] for k in public} == {"fc", "layers", "norm", "lm_head"}
    # A copy of the target's embedding in the checkpoint is not the draft's to load.
    embed = torch.zeros(hf["vocab_size"], hf["hidden_size"])
    converted = convert_eagle3_draft_state_dict({**public, "embed_tokens.weight": embed}, hf)
    assert set(converted) == {name for name, _ in drafter.named_parameters()}
    head_dim, heads, kv_heads = 16, hf["num_attention_heads"], 2
    qkv = converted["midlayer.self_attn.qkv_proj.weight"]
    assert qkv.shape == ((heads + 2 * kv_heads) * head_dim, 2 * hf["hidden_size"])
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
    assert torch.equal(q, public["layers.0.self_attn.q_proj.weight"])
    assert torch.equal(k, public["layers.0.self_attn.k_proj.weight"])
    assert torch.equal(v, public["layers.0.self_attn.v_proj.weight"])
    assert torch.equal(converted["lm_head.weight"], public["lm_head.weight"])  # its own
    drafter.load_state_dict(converted, strict=False)  # every parameter, no buffer needed


def test_a_reduced_vocabulary_keeps_d2t_and_needs_it(mha_draft):
    public, hf, _ = mha_draft
    hf = {**hf, "draft_vocab_size": 100}
    h = hf["hidden_size"]
    reduced = {**public, "lm_head.weight": torch.zeros(100, h)}
    d2t = torch.arange(100) * 2
    converted = convert_eagle3_draft_state_dict({**reduced, "d2t": d2t, "t2d": d2t > 0}, hf)
    assert torch.equal(converted["d2t"], d2t) and "t2d" not in converted
    with pytest.raises(WeightError, match="d2t: required when draft_vocab_size is below"):
        convert_eagle3_draft_state_dict(reduced, hf)
    with pytest.raises(WeightError, match=r"d2t: torch.float32 \[100\], expected integers"):
        convert_eagle3_draft_state_dict({**reduced, "d2t": d2t.float()}, hf)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda sd: sd.pop("layers.0.mlp.up_proj.weight"),
            "layers.0.mlp.up_proj.weight: missing from the EAGLE-3 checkpoint",
        ),
        (
            lambda sd: sd.update({"fc.weight": torch.zeros(64, 128)}),
            "fc.weight: shape [64, 128] does not match the config's [64, 192]",
        ),
        (
            lambda sd: sd.update({"layers.1.mlp.up_proj.weight": torch.zeros(1)}),
            "layers.1.mlp.up_proj.weight: an EAGLE-3 draft has one layer (layers.0.*)",
        ),
        (
            lambda sd: sd.update({"layers.0.self_attn.q_norm.weight": torch.zeros(1)}),
            "layers.0.self_attn.q_norm.weight: not a tensor this draft has",
        ),
        (
            lambda sd: sd.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(1)}),
            "model.layers.0.mlp.up_proj.weight: not part of an EAGLE-3 draft (fc.*, layers.0.*",
        ),
    ],
    ids=["missing", "shape", "second_layer", "unknown_in_layer", "foreign"],
)
def test_misfits_are_refused_naming_the_tensor(mha_draft, edit, message):
    public, hf, _ = mha_draft
    state_dict = dict(public)
    edit(state_dict)
    with pytest.raises(WeightError) as refused:
        convert_eagle3_draft_state_dict(state_dict, hf)
    assert message in str(refused.value)


def mla_draft_config() -> dict[str, object]:
    """A DeepSeek-style config for an MLA draft of hidden size 48."""
    return {
        "hidden_size": 48,
        "num_attention_heads": 3,
        "num_hidden_layers": 1,
        "vocab_size": 96,
        "intermediate_size": 72,
        "q_lora_rank": 24,
        "kv_lora_rank": 20,
        "qk_nope_head_dim": 12,
        "qk_rope_head_dim": 8,
        "v_head_dim": 10,
        "n_routed_experts": 8,
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 2,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]},
    }


def test_an_mla_draft_converts_to_mla_parameters_of_twice_the_width():
    hf = mla_draft_config()
    gen = torch.Generator().manual_seed(0)
    public = {
        src.name: torch.randn(src.shape, generator=gen)
        for rule in draft_rules(dict(hf), is_mla=True)
        for src in rule.sources
    }
    assert "layers.0.self_attn.kv_b_proj.weight" in public
    converted = convert_eagle3_draft_state_dict(public, hf)
    # The module the MLA draft's layer is built from: MLA over concat(embed, hidden).
    config = DeepseekV3Config.from_hf({**hf, "max_position_embeddings": 64}, dtype="float32")
    midlayer = nn.Module()
    midlayer.self_attn = MultiHeadLatentAttention(config, in_features=96)
    midlayer.mlp = GatedMLP(48, 72, bias=False)
    for norm in MIDLAYER_NORMS:
        midlayer.add_module(norm, nn.LayerNorm(48, bias=False))
    expected = {f"midlayer.{k}": v.shape for k, v in midlayer.named_parameters()}
    expected.update({"fc.weight": (48, 144), "norm.weight": (48,), "lm_head.weight": (96, 48)})
    assert {k: tuple(v.shape) for k, v in converted.items()} == {
        k: tuple(s) for k, s in expected.items()
    }
    name = "layers.0.self_attn.q_a_proj.weight"
    assert torch.equal(converted["midlayer.self_attn.q_a_proj.weight"], public[name])


def test_a_config_tandem_cannot_read_is_refused():
    with pytest.raises(DraftConfigError, match="draft config: hidden_size: missing"):
        convert_eagle3_draft_state_dict({}, {"num_attention_heads": 2})


def run_greedy(
    model_dir: Path, spec: SpeculativeConfig | None
) -> tuple[list[list[int]], LLMEngine]:
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            kv_cache_memory=1 << 21,
            block_size=4,
            speculative=spec,
        )
    )
    for i, p in enumerate(GREEDY_PROMPTS):
        engine.add_request(
            str(i), p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        )
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [done[str(i)] for i in range(len(GREEDY_PROMPTS))], engine


GREEDY_PROMPTS = [[5, 6, 7], [9] * 11, [10, 11, 12, 13, 14, 15, 16]]


@pytest.mark.parametrize("variant", ["mha", "mla"])
def test_greedy_with_either_draft_equals_the_deepseek_target_alone(tmp_path, variant):
    """The MHA draft (its own paged K/V beside the target's MLA pools, one block id for
    both) and the MLA draft (pools in the target's layout), with a reduced vocabulary:
    verifying their drafts leaves the output exactly what the target alone gives."""
    hf_model = build_tiny_deepseek(tmp_path / "t", "groups8_yarn_two_dense", vocab_size=64)
    overrides = {**(MHA_OVERRIDES if variant == "mha" else {}), "draft_vocab_size": 32}
    draft = build_random_draft(
        tmp_path / "t", tmp_path / "d", "eagle3", d2t=torch.arange(32), **overrides
    )
    refs, _ = run_greedy(tmp_path / "t", None)
    for k in (1, 3):  # verify widths 2 and 4
        ours, engine = run_greedy(tmp_path / "t", SpeculativeConfig(str(draft), num_draft_tokens=k))
        assert engine.spec is not None and engine.spec.stats.num_draft_tokens > 0
        pools = engine.kv_pools
        assert isinstance(engine.spec.drafter, Eagle3DeepseekV3) == (variant == "mla")
        assert len(pools["target"].layers[0]) == 1  # MLA
        assert len(pools["draft"].layers[0]) == (2 if variant == "mha" else 1)
        layout = KvLayout.of_pools("m", pools["target"], pools["draft"], "fingerprint")
        assert layout.layout == (
            LATENT_LAYOUT if variant == "mla" else f"{LATENT_LAYOUT};draft={KV_LAYOUT}"
        )
        assert ours == refs or compare_greedy(hf_model, GREEDY_PROMPTS, ours, refs).num_ties <= 1


def test_mla_draft_is_saved_in_the_public_layout_and_loads_back(tmp_path):
    """What Tandem saves is what nvidia's drafts look like (fc, layers.0, norm, lm_head,
    d2t, t2d); loading it gives the same draft, and the converter reads it alike."""
    build_tiny_deepseek(tmp_path / "t", "qlora_yarn_mscale_interleaved", num_layers=4)
    draft_dir = build_random_draft(
        tmp_path / "t", tmp_path / "d", "eagle3", d2t=torch.arange(100), draft_vocab_size=100
    )
    public = load_file(str(draft_dir / "model.safetensors"))
    assert {k.split(".")[0] for k in public} == {"fc", "layers", "norm", "lm_head", "d2t", "t2d"}
    assert "layers.0.self_attn.kv_b_proj.weight" in public
    target, _ = load_model(tmp_path / "t", dtype="float32")
    drafter = load_drafter(draft_dir, target, torch.device("cpu"))  # type: ignore[arg-type]
    assert isinstance(drafter, Eagle3DeepseekV3)
    hf = json.loads((draft_dir / "config.json").read_text())
    converted = convert_eagle3_draft_state_dict(public, hf)
    state = drafter.state_dict()
    assert set(converted) <= set(state)
    for name, tensor in converted.items():
        assert torch.equal(state[name], tensor), name
    assert drafter.layer_ids == (0, 3)  # the config's taps [1, 4] name layer inputs


def test_an_mha_draft_in_the_public_layout_loads_like_its_midlayer_release(tmp_path, mha_draft):
    public, hf, _ = mha_draft
    build_tiny_deepseek(tmp_path / "t", "qlora_yarn_mscale_interleaved", num_layers=4)
    (tmp_path / "d").mkdir()
    save_file(public, str(tmp_path / "d" / "model.safetensors"))
    (tmp_path / "d" / "config.json").write_text(json.dumps(hf))
    target, _ = load_model(tmp_path / "t", dtype="float32")
    loaded = load_drafter(tmp_path / "d", target, torch.device("cpu"))  # type: ignore[arg-type]
    assert not isinstance(loaded, Eagle3DeepseekV3)
    expected = convert_eagle3_draft_state_dict(public, hf)
    for name, tensor in loaded.state_dict().items():  # type: ignore[attr-defined]
        if name in expected:
            assert torch.equal(tensor, expected[name]), name
