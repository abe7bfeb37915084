"""The CPU SGMV kernel (kernels/cpu/lora_sgmv.cpp, through ``engine.lora.ops.CpuSgmv``):
a token's delta is the same, bit for bit, whatever other tokens and groups share its call
and however many threads run it; what it is given wrongly is refused naming the
argument. (Its sums against ``lora_delta``'s: tests/engine/test_lora_adapter.py.)"""

from __future__ import annotations

import pytest
import torch

from engine.lora.adapter import LoraWeights
from engine.lora.ops import CpuSgmv
from kernels.cpu import extension

pytestmark = pytest.mark.skipif(
    not extension.available(), reason="the CPU kernels are not built here"
)

IN, WIDTHS = 96, [80, 24, 13]  # q, k, v: a full block and part of one, vector and scalar tails


def adapters(dtype: torch.dtype, slots: int = 4) -> CpuSgmv:
    gen = torch.Generator().manual_seed(3)
    parts = [
        [LoraWeights(torch.randn(r, IN, generator=gen), torch.randn(w, r, generator=gen), 0.5)
         for r in (8, 16, 4, 12)[:slots]]
        for w in WIDTHS
    ]  # fmt: skip
    return CpuSgmv(parts, IN, WIDTHS, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_delta_does_not_depend_on_its_batch(dtype: torch.dtype) -> None:
    """Token 5 of a group of 37 (chunked and tiled among the threads) under slot 2, next
    to groups under other slots and none, gets what it gets alone, at 1 and 2 threads."""
    sgmv = adapters(dtype)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(45, IN, generator=gen).to(dtype)
    base = torch.randn(45, sum(WIDTHS), generator=gen).to(dtype)
    offsets, ids = [0, 3, 40, 41, 45], [1, 2, -1, 3]
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            y = base.clone()
            sgmv.add_deltas(y, x, offsets, ids)
            alone = base[8:9].clone()
            sgmv.add_deltas(alone, x[8:9], [0, 1], [2])
            assert torch.equal(y[8:9], alone)
            results.append(y)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])
    assert torch.equal(results[0][40], base[40])  # no adapter
    assert not torch.equal(results[0][:40], base[:40])


def test_wrong_arguments_are_refused_naming_them() -> None:
    sgmv = adapters(torch.float32)
    x, y = torch.randn(4, IN), torch.zeros(4, sum(WIDTHS))
    op = torch.ops.tandem_cpu.sgmv_add
    args = (sgmv.a, sgmv.b, sgmv.rank_offsets, sgmv.column_offsets)
    with pytest.raises(RuntimeError, match="groups cover 3 tokens, x has 4"):
        op(y, x, *args, [0, 3], [0])
    with pytest.raises(RuntimeError, match="lora_grouped_offsets needs one more entry"):
        op(y, x, *args, [0, 4], [0, 1])
    with pytest.raises(RuntimeError, match="must not decrease"):
        op(y, x, *args, [0, 3, 2, 4], [0, 1, 2])
    with pytest.raises(RuntimeError, match="y, x and a must share one dtype"):
        op(y.bfloat16(), x, *args, [0, 4], [0])
    with pytest.raises(RuntimeError, match=r"a must be contiguous \[S, R/16, in, 16\]"):
        op(y, torch.randn(4, IN + 2), *args, [0, 4], [0])
    with pytest.raises(
        RuntimeError, match=r"b\[1\] must be contiguous \[S, ceil\(24/64\), 16, 64\]"
    ):
        op(y, x, sgmv.a, [sgmv.b[0], sgmv.b[1][:, :, :8], sgmv.b[2]], *args[2:], [0, 4], [0])
    with pytest.raises(RuntimeError, match="column_offsets fall outside y's 109 columns"):
        op(y[:, :-8], x, *args, [0, 4], [0])
    assert not y.any()  # nothing written by a refused call
