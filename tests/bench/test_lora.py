"""``bench/lora.py``: the adapters it makes load on their base, every projection of every
layer, and its timed copies of ``lora_delta`` and ``DenseLora.deltas`` (shrink and expand
timed apart) compute what the engine's do."""

import json
from pathlib import Path

import pytest
import torch

from bench.lora import TARGETS, make_adapters, split_dense_deltas, split_lora_delta
from engine.lora.adapter import LoraWeights, load_adapter
from engine.lora.ops import DenseLora, lora_delta, token_mask
from kernels.cpu import bf16_gemm


def test_made_adapters_load_on_every_projection(tmp_path: Path) -> None:
    config = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=2)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    adapters = make_adapters(tmp_path, tmp_path / "adapters", count=2, rank=4, std=0.01)
    assert [name for name, _ in adapters] == ["adapter0", "adapter1"]
    q, kv = 32, 16  # head_dim 8
    widths, inputs = (q, kv, kv, 32, 48, 48, 32), (32, 32, 32, q, 32, 32, 48)
    shapes = {t: (o, i) for t, o, i in zip(TARGETS, widths, inputs, strict=True)}
    adapter = load_adapter("a", adapters[1][1], shapes, 2, max_rank=16)
    assert len(adapter.modules) == 2 * 7 and adapter.max_rank == 4
    assert all(w.scaling == 2.0 for w in adapter.modules.values())


def _attention_weights(tmp_path: Path) -> list[list[LoraWeights | None]]:
    """Two made adapters' q, k and v weights (by part, then by adapter id) on a tiny
    Llama's one layer."""
    (tmp_path / "config.json").write_text(json.dumps(dict(
        hidden_size=16, intermediate_size=24, num_attention_heads=2, num_key_value_heads=1,
        num_hidden_layers=1)))  # fmt: skip
    made = make_adapters(tmp_path, tmp_path / "adapters", count=2, rank=4, std=0.5)
    shapes = {t: (24 if "gate" in t or "up" in t else 16, 16) for t in TARGETS}
    shapes.update(k_proj=(8, 16), v_proj=(8, 16), down_proj=(16, 24))
    adapters = [load_adapter(name, path, shapes, 1, max_rank=4) for name, path in made]
    return [
        [a.modules[f"model.layers.0.self_attn.{part}"] for a in adapters]
        for part in ("q_proj", "k_proj", "v_proj")
    ]


def _spent() -> dict[str, float]:
    return {"shrink": 0.0, "expand": 0.0, "delta_copy": 0.0, "shrinks": 0.0, "expands": 0.0}


OFFSETS, IDS = [0, 2, 3, 5, 7], [1, -1, 0, 1]  # mixed groups, one without an adapter


def test_the_timed_copy_of_lora_delta_equals_the_engines(tmp_path: Path) -> None:
    weights = _attention_weights(tmp_path)[0]
    x = torch.randn(7, 16).to(torch.bfloat16)
    spent = _spent()
    got = split_lora_delta(spent)(x, OFFSETS, IDS, weights, 16)
    assert torch.equal(got, lora_delta(x, OFFSETS, IDS, weights, 16))
    assert spent["shrinks"] == spent["expands"] == 3
    assert spent["shrink"] > 0 and spent["expand"] > 0


@pytest.mark.parametrize(
    "packed",
    [False, pytest.param(True, marks=pytest.mark.skipif(
        not bf16_gemm.available(), reason="the CPU kernels are not built here"))],
)  # fmt: skip
def test_the_timed_copy_of_dense_deltas_equals_the_engines(tmp_path: Path, packed: bool) -> None:
    weights = _attention_weights(tmp_path)
    weights[1] = [None, None]  # k under neither: rank 0, zeros
    weights[2][0] = None  # v under adapter 1 only: an empty slot
    dense = DenseLora(weights, 16, [16, 8, 8], torch.device("cpu"), packed)
    x = torch.randn(7, 16).to(torch.bfloat16)
    mask = token_mask(OFFSETS, IDS, dense.num_slots, torch.device("cpu"))
    spent = _spent()
    got, want = torch.zeros(7, 32), torch.zeros(7, 32)
    split_dense_deltas(spent)(dense, got, x, dense.column_mask(mask))
    dense.add_deltas(want, x, dense.column_mask(mask))
    assert torch.equal(got, want)
    assert got[2].abs().sum() == 0 and got[:, 16:24].abs().sum() == 0  # no adapter; k
    assert got.abs().sum() > 0
    assert spent["shrinks"] == 1 and spent["expands"] == 2
    assert spent["shrink"] > 0 and spent["expand"] > 0
