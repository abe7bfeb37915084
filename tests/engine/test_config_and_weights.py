"""Bad configs and bad checkpoints fail at load, naming the field or tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import ConfigError, Llama3Config
from engine.registry import load_model
from engine.weights import WeightError
from tests.engine.tiny_models import build_tiny_llama

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "intermediate_size": 96,
    "vocab_size": 128,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ckpt")
    build_tiny_llama(out, "mha_plain", num_layers=2)
    return out


def copy_with(src: Path, dst: Path, edit_config=None, edit_tensors=None) -> Path:
    shutil.copytree(src, dst)
    if edit_config:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if edit_tensors:
        tensors = load_file(dst / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, dst / "model.safetensors")
    return dst


def test_transformers4_and_5_key_names_give_the_same_config():
    v5 = dict(
        BASE,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        dtype="bfloat16",
    )
    v4 = dict(
        BASE,
        rope_theta=5e5,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        torch_dtype="bfloat16",
    )
    a, b = Llama3Config.from_hf(v5), Llama3Config.from_hf(v4)
    assert a == b
    assert a.rope_theta == 5e5 and a.rope_scaling is not None and a.rope_scaling.factor == 8.0
    assert a.head_dim == 16 and a.dtype == torch.bfloat16 and a.max_seq_len == 256


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq_factor"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config.quant_method"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"max_position_embeddings": None}, "max_position_embeddings"),
        ({"head_dim": 15}, "head_dim"),
    ],
)
def test_bad_config_names_the_field(edit, field):
    with pytest.raises(ConfigError, match=f"^{field.replace('.', '[.]')}:"):
        Llama3Config.from_hf(dict(BASE, **edit))


def test_max_length_over_the_model_limit_is_refused():
    assert Llama3Config.from_hf(BASE, max_length=100).max_seq_len == 100
    with pytest.raises(ConfigError, match=r"max_length: 300 .* allowed: 1\.\.256"):
        Llama3Config.from_hf(BASE, max_length=300)


def test_bad_dtype_and_architecture(checkpoint, tmp_path):
    with pytest.raises(ConfigError, match=r"dtype: 'int8' is not supported; allowed"):
        Llama3Config.from_hf(BASE, dtype="int8")
    bad = copy_with(
        checkpoint, tmp_path / "m", lambda c: c.update(architectures=["GPT2LMHeadModel"])
    )
    with pytest.raises(ConfigError, match=r"architectures: \['GPT2LMHeadModel'\] is not supported"):
        load_model(bad)


def test_missing_tensor_is_named(checkpoint, tmp_path):
    bad = copy_with(
        checkpoint,
        tmp_path / "m",
        edit_tensors=lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
    )
    with pytest.raises(WeightError, match=r"^model\.layers\.1\.mlp\.up_proj\.weight: missing"):
        load_model(bad, dtype="float32")


def test_misshapen_tensor_is_named(checkpoint, tmp_path):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)

    bad = copy_with(checkpoint, tmp_path / "m", edit_tensors=shrink)
    with pytest.raises(
        WeightError,
        match=r"^model\.layers\.0\.self_attn\.k_proj\.weight: shape \[8, 64\] .* \[64, 64\]",
    ):
        load_model(bad, dtype="float32")


def test_no_checkpoint_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    with pytest.raises(WeightError, match=r"no \*\.safetensors files"):
        load_model(tmp_path)


def test_sharded_checkpoint_loads_identically(tmp_path):
    single = build_tiny_llama(tmp_path / "single", "gqa4_llama3rope_hd72_mlpbias", num_layers=2)
    build_tiny_llama(
        tmp_path / "sharded",
        "gqa4_llama3rope_hd72_mlpbias",
        num_layers=2,
        max_shard_size="100KB",
        legacy_keys=True,
    )
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert "rope_theta" in json.loads((tmp_path / "sharded" / "config.json").read_text())
    a, _ = load_model(tmp_path / "single", dtype="float32")
    b, _ = load_model(tmp_path / "sharded", dtype="float32")
    for (name, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(p, q), name
    assert torch.equal(
        a.state_dict()["layers.1.mlp.gate_up_proj.weight"][:128],
        single.state_dict()["model.layers.1.mlp.gate_proj.weight"],
    )
