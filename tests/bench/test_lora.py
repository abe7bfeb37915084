"""``bench/lora.py``: the adapters it makes load on their base, every projection of every
layer, and its shrink-only kernel calls (what its shrink time is of) add nothing and
count their calls."""

import json
from pathlib import Path

import pytest
import torch

from bench.lora import TARGETS, make_adapters, shrink_only
from engine.lora.adapter import LoraWeights, load_adapter
from engine.lora.ops import CpuSgmv
from kernels.cpu import extension


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


@pytest.mark.skipif(not extension.available(), reason="the CPU kernels are not built here")
def test_the_shrink_only_calls_add_nothing(tmp_path: Path) -> None:
    """The shrink-only copy runs the kernel with no part to expand: ``y`` keeps the base
    product, where the engine's call adds the deltas; each call is counted and timed."""
    weights = _attention_weights(tmp_path)
    weights[2][0] = None  # v under adapter 1 only
    sgmv = CpuSgmv(weights, 16, [16, 8, 8], torch.bfloat16)
    offsets, ids = [0, 2, 3, 5, 7], [1, -1, 0, 1]  # mixed groups, one without an adapter
    x = torch.randn(7, 16).to(torch.bfloat16)
    base = torch.randn(7, 32).to(torch.bfloat16)
    spent = {"shrink": 0.0, "calls": 0.0}
    got, want = base.clone(), base.clone()
    for _ in range(2):
        shrink_only(spent)(sgmv, got, x, offsets, ids)
    sgmv.add_deltas(want, x, offsets, ids)
    assert torch.equal(got, base)
    assert not torch.equal(want[:2], base[:2]) and torch.equal(want[2], base[2])
    assert spent["calls"] == 2 and spent["shrink"] > 0
