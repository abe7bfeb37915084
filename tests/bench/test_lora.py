"""``bench/lora.py``: the adapters it makes load on their base, every projection of every
layer, and its timed copy of ``lora_delta`` (shrink and expand timed apart) computes what
the engine's does."""

import json
from pathlib import Path

import torch

from bench.lora import TARGETS, make_adapters, split_lora_delta
from engine.lora.adapter import load_adapter
from engine.lora.ops import lora_delta


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


def test_the_timed_copy_of_lora_delta_equals_the_engines(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(dict(
        hidden_size=16, intermediate_size=24, num_attention_heads=2, num_key_value_heads=1,
        num_hidden_layers=1)))  # fmt: skip
    made = make_adapters(tmp_path, tmp_path / "adapters", count=2, rank=4, std=0.5)
    shapes = {t: (24 if "gate" in t or "up" in t else 16, 16) for t in TARGETS}
    shapes.update(k_proj=(8, 16), v_proj=(8, 16), down_proj=(16, 24))
    weights = [
        load_adapter(name, path, shapes, 1, max_rank=4).modules["model.layers.0.self_attn.q_proj"]
        for name, path in made
    ]
    x = torch.randn(7, 16).to(torch.bfloat16)
    offsets, ids = [0, 2, 3, 5, 7], [1, -1, 0, 1]
    spent = {"shrink": 0.0, "expand": 0.0, "delta_copy": 0.0, "products": 0.0}
    got = split_lora_delta(spent)(x, offsets, ids, weights, 16)
    assert torch.equal(got, lora_delta(x, offsets, ids, weights, 16))
    assert spent["products"] == 3 and spent["shrink"] > 0 and spent["expand"] > 0
