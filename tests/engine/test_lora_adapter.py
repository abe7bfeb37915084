"""LoRA adapters in PEFT's format, against PEFT itself: adapters made and saved by peft
on a tiny Llama, read back by ``engine.lora``, give peft's deltas (its ``lora_B(lora_A(x))
* scaling``) module by module, with rank_pattern, alpha_pattern and rslora, over a batch
of token groups each with its adapter or none. What Tandem cannot serve is refused,
naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from engine.lora.adapter import TARGETS, LoraError, LoraWeights, load_adapter
from engine.lora.layers import LoraStep
from engine.lora.ops import CpuSgmv, DenseLora, lora_delta, token_mask
from kernels.cpu import extension


def tiny_llama(hidden: int = 64) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=hidden,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config).eval()


def shapes_of(model: LlamaForCausalLM) -> dict[str, tuple[int, int]]:
    layer = model.model.layers[0]
    mods = {**dict(layer.self_attn.named_children()), **dict(layer.mlp.named_children())}
    return {t: tuple(mods[t].weight.shape) for t in TARGETS}  # type: ignore[misc]


def save_adapter(out: Path, model: LlamaForCausalLM, std: float = 0.1, **config: object):
    """``model`` wrapped by peft with ``config``, its A and B matrices random of ``std``
    (peft starts B at zero), saved to ``out``; returns the peft model."""
    peft_model = get_peft_model(model, LoraConfig(**config))  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    peft_model.save_pretrained(out)
    return peft_model


@pytest.mark.parametrize("rslora", [False, True])
def test_deltas_equal_peft_module_by_module(tmp_path, rslora: bool) -> None:
    peft_model = save_adapter(
        tmp_path / "a", tiny_llama(), r=8, lora_alpha=16, use_rslora=rslora,
        target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
        rank_pattern={"down_proj": 4}, alpha_pattern={"layers.1.self_attn.o_proj": 5},
    )  # fmt: skip
    adapter = load_adapter("a", tmp_path / "a", shapes_of(tiny_llama()), 2, max_rank=64)
    assert len(adapter.modules) == 2 * 4 and adapter.max_rank == 8
    down = adapter.modules["model.layers.0.mlp.down_proj"]
    assert down.rank == 4 and down.scaling == pytest.approx(16 / (2.0 if rslora else 4))
    o_proj = adapter.modules["model.layers.1.self_attn.o_proj"]
    assert o_proj.scaling == pytest.approx(5 / (8**0.5 if rslora else 8))
    offsets, ids = [0, 3, 5, 9], [0, -1, 0]  # the adapter, none, the adapter again
    for module, weights in adapter.modules.items():
        peft_layer = peft_model.base_model.model.get_submodule(module)
        x = torch.randn(9, weights.a.shape[1])
        got = lora_delta(x, offsets, ids, [weights], weights.b.shape[0])
        expected = peft_layer.lora_B["default"](peft_layer.lora_A["default"](x))
        expected = expected * peft_layer.scaling["default"]
        assert torch.allclose(got[:3], expected[:3], atol=1e-6), module
        assert torch.allclose(got[5:], expected[5:], atol=1e-6), module
        assert not got[3:5].any()  # no adapter: no delta


def test_dense_deltas_equal_the_per_group_products() -> None:
    """``DenseLora`` (every adapter stacked, each token's others masked out) gives each
    token what ``lora_delta`` gives its group: adapters of different ranks and scalings,
    an unloaded one (None), a part no adapter targets, rows without one, ids past the
    slots."""
    gen = torch.Generator().manual_seed(0)

    def weights(r: int, out: int, scaling: float) -> LoraWeights:
        a, b = torch.randn(r, 24, generator=gen), torch.randn(out, r, generator=gen)
        return LoraWeights(a, b, scaling)

    parts = [
        [weights(4, 16, 2.0), None, weights(8, 16, 0.5)],  # ids 0 and 2; 1 unloaded
        [None, None, None],  # no adapter targets this part
        [weights(2, 8, 1.0), weights(6, 8, 3.0), None],
    ]
    dense = DenseLora(parts, 24, [16, 4, 8], torch.device("cpu"))
    offsets, ids = [0, 2, 3, 6, 7, 9, 10], [2, -1, 0, 1, 2, 5]  # 5: past the slots
    x = torch.randn(10, 24, generator=gen)
    got = dense.deltas(x, token_mask(offsets, ids, dense.num_slots, x.device))
    widths = [16, 4, 8]
    per_part = [lora_delta(x, offsets, ids, p, w) for p, w in zip(parts, widths, strict=True)]
    expected = torch.cat(per_part, dim=-1)
    assert got.shape == (10, 28)
    assert torch.allclose(got, expected, atol=1e-4)
    assert not got[2].any() and not got[9].any() and not got[:, 16:20].any()


@pytest.mark.skipif(not extension.available(), reason="the CPU kernels are not built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_sgmv_adds_what_the_per_group_products_give(dtype: torch.dtype) -> None:
    """The CPU SGMV kernel (``CpuSgmv``) adds into the base product what ``lora_delta``
    gives each group: ranks that are no multiple of 16, widths that are no multiple of 8,
    an unloaded slot, a part no adapter targets, a group without one, an id past the
    slots, and a group of 70 tokens. fp32 to summation order; bf16 to its rounding, and
    rows without an adapter untouched."""
    gen = torch.Generator().manual_seed(2)

    def weights(r: int, out: int, scaling: float) -> LoraWeights:
        a, b = torch.randn(r, 40, generator=gen), torch.randn(out, r, generator=gen) * 0.1
        return LoraWeights(a.to(dtype).float(), b.to(dtype).float(), scaling)

    parts = [
        [weights(4, 20, 2.0), None, weights(12, 20, 0.5), None],  # 3: unloaded
        [None, None, None, None],  # no adapter targets this part
        [weights(3, 13, 1.0), weights(18, 13, 3.0), None, None],
    ]
    widths = [20, 4, 13]
    sgmv = CpuSgmv(parts, 40, widths, dtype)
    offsets, ids = [0, 70, 73, 76, 77, 80, 81], [2, -1, 0, 1, 3, 5]  # 5: past the slots
    x = torch.randn(81, 40, generator=gen).to(dtype)
    base = torch.randn(81, sum(widths), generator=gen).to(dtype)
    y = base.clone()
    sgmv.add_deltas(y, x, offsets, ids)
    per_part = [
        lora_delta(x.float(), offsets, ids, p, w) for p, w in zip(parts, widths, strict=True)
    ]
    want = base.float() + torch.cat(per_part, dim=-1)
    if dtype == torch.float32:
        assert torch.allclose(y, want, atol=1e-4, rtol=1e-5)
    else:
        assert torch.allclose(y.float(), want, atol=0.02, rtol=0.01)
    for start, end in [(70, 73), (77, 80), (80, 81)]:  # none, unloaded, past the slots
        assert torch.equal(y[start:end], base[start:end])
    assert torch.equal(y[:, 20:24], base[:, 20:24])  # the part no adapter targets


def test_what_cannot_be_served_is_refused_naming_the_field(tmp_path) -> None:
    shapes = shapes_of(tiny_llama())
    save_adapter(tmp_path / "big", tiny_llama(), r=128, target_modules=["q_proj"])
    with pytest.raises(LoraError, match="r: 128 exceeds the largest rank served, 64"):
        load_adapter("big", tmp_path / "big", shapes, 2, max_rank=64)
    save_adapter(tmp_path / "head", tiny_llama(), r=4, target_modules=["q_proj", "lm_head"])
    with pytest.raises(LoraError, match=r"target_modules: \['lm_head'\] not supported"):
        load_adapter("head", tmp_path / "head", shapes, 2, max_rank=64)
    save_adapter(tmp_path / "other", tiny_llama(hidden=48), r=4, target_modules=["q_proj"])
    with pytest.raises(LoraError, match="an adapter for another base model"):
        load_adapter("other", tmp_path / "other", shapes, 2, max_rank=64)
    save_adapter(tmp_path / "bias", tiny_llama(), r=4, target_modules=["q_proj"], bias="all")
    with pytest.raises(LoraError, match="bias: 'all' is not supported"):
        load_adapter("bias", tmp_path / "bias", shapes, 2, max_rank=64)
    with pytest.raises(LoraError, match=r"holds no adapter_config\.json"):
        load_adapter("none", tmp_path, shapes, 2, max_rank=64)


def test_target_modules_as_peft_reads_them(tmp_path) -> None:
    """A regex over full module names, dotted names, and layers_to_transform: the same
    modules adapted as peft adapts, each with peft's delta."""
    shapes = shapes_of(tiny_llama())
    cases = {
        "regex": dict(target_modules=r".*\.layers\.1\.self_attn\.(q|v)_proj"),
        "dotted": dict(target_modules=["self_attn.o_proj", "mlp.up_proj"]),
        "layers": dict(target_modules=["k_proj"], layers_to_transform=[0]),
    }
    dotted = ("self_attn.o_proj", "mlp.up_proj")
    expected = {
        "regex": {"model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"},
        "dotted": {f"model.layers.{i}.{m}" for i in (0, 1) for m in dotted},
        "layers": {"model.layers.0.self_attn.k_proj"},
    }
    for case, config in cases.items():
        peft_model = save_adapter(tmp_path / case, tiny_llama(), r=4, **config)
        adapter = load_adapter(case, tmp_path / case, shapes, 2, max_rank=64)
        assert set(adapter.modules) == expected[case], case
        for module, weights in adapter.modules.items():
            peft_layer = peft_model.base_model.model.get_submodule(module)
            x = torch.randn(3, weights.a.shape[1])
            want = peft_layer.lora_B["default"](peft_layer.lora_A["default"](x))
            got = lora_delta(x, [0, 3], [0], [weights], weights.b.shape[0])
            assert torch.allclose(got, want * peft_layer.scaling["default"], atol=1e-6)


def test_fields_and_tensors_it_would_misread_are_refused(tmp_path) -> None:
    shapes = shapes_of(tiny_llama())
    save_adapter(tmp_path / "a", tiny_llama(), r=4, target_modules=["q_proj"])
    config_file = tmp_path / "a" / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "alora_invocation_tokens": [5, 6]}))
    with pytest.raises(LoraError, match=r"alora_invocation_tokens: \[5, 6\] is not supported"):
        load_adapter("a", tmp_path / "a", shapes, 2, max_rank=64)
    config_file.write_text(json.dumps(config))
    tensors = load_file(tmp_path / "a" / "adapter_model.safetensors")
    extra = "base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight"
    save_file({**tensors, extra: torch.zeros(4, 64)}, tmp_path / "a" / "adapter_model.safetensors")
    with pytest.raises(LoraError, match=r"o_proj\.lora_A\.weight: a tensor no target of this"):
        load_adapter("a", tmp_path / "a", shapes, 2, max_rank=64)


def test_a_steps_masks_are_made_again_for_each_steps_groups() -> None:
    """``LoraStep.set`` drops what the last step's projections shared: the same number of
    tokens under other adapters gets its own mask (lists of a finished step may be freed
    and their addresses reused: nothing is keyed on them)."""
    step = LoraStep()
    step.set([0, 2, 4], [0, 1])
    first = step.mask(2, torch.device("cpu")).clone()
    for _ in range(3):
        step.set([0, 70], [-1])  # steps that never ask for a mask
    step.set([0, 2, 4], [1, 0])
    again = step.mask(2, torch.device("cpu"))
    assert torch.equal(first, torch.tensor([[1.0, 0.0], [1, 0], [0, 1], [0, 1]]))
    assert torch.equal(again, torch.tensor([[0.0, 1.0], [0, 1], [1, 0], [1, 0]]))
