"""A product per row bucket, chosen from injected timings, and run per call (also compiled)."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import bf16_gemm, onednn_linear
from kernels.cpu.gemm_plan import (
    ATEN,
    BUCKETS,
    KERNEL,
    ONEDNN,
    PRODUCTS,
    GemmPlan,
    choose,
    planned_linear,
    run_product,
)
from tests.kernels.compile_count import CountingCompiler


def timings_of(costs: dict[str, list[float]]) -> dict[int, dict[str, float]]:
    """{product: a time per bucket} -> {bucket: {product: time}}; None: not timed."""
    return {
        bucket: {p: t[i] for p, t in costs.items() if t[i] is not None}
        for i, bucket in enumerate(BUCKETS)
        if any(t[i] is not None for t in costs.values())
    }


def test_each_bucket_takes_its_fastest_product() -> None:
    """As the issue measured on an AMX Xeon: the kernel wins at few rows, oneDNN at many,
    and aten in the middle (made up)."""
    timings = timings_of(
        {
            KERNEL: [30, 60, 100, 136, 260, 521, 1000, 2008, 4000],
            ATEN: [153, 150, 130, 100, 140, 200, 330, 600, 1200],
            ONEDNN: [160, 150, 140, 119, 110, 187, 300, 411, 800],
        }
    )
    plan = choose(timings, PRODUCTS)
    assert plan.products == (KERNEL,) * 3 + (ATEN,) + (ONEDNN,) * 5
    assert plan.describe() == "kernel 1-7, aten 8-15, onednn 16+"
    assert plan.product(1) == KERNEL and plan.product(7) == KERNEL
    assert plan.product(8) == ATEN and plan.product(1000) == ONEDNN
    assert plan.from_two is None


def test_another_product_takes_over_only_when_a_fifth_faster() -> None:
    """Noise must not flip plans, nor make a copy of the weight for a few percent."""
    timings = timings_of({KERNEL: [10.0] * 9, ONEDNN: [11.0, 9.5, 8.7, 8.0, 9.5] + [5.0] * 4})
    plan = choose(timings, PRODUCTS)
    # 9.5 and 8.7 gain less than a fifth on 10; 8.0 does; then 10 does not win back
    assert plan.products == (KERNEL,) * 3 + (ONEDNN,) * 6


def test_only_candidates_are_chosen() -> None:
    """A kernel timed in the cache but not built now (or an fp32 weight) is not chosen."""
    timings = timings_of({KERNEL: [1.0] * 9, ATEN: [5.0] * 9, ONEDNN: [3.0] + [4.0] * 8})
    assert choose(timings, (ATEN, ONEDNN)) == GemmPlan.uniform(ONEDNN)
    assert choose(timings, (ATEN,)) == GemmPlan.uniform(ATEN)


def test_buckets_past_the_timed_ones_keep_the_last_choice() -> None:
    timings = timings_of(
        {KERNEL: [1, 2, 5, None, None, None, None, None, None], ATEN: [2, 3, 4] + [None] * 6}
    )
    plan = choose(timings, PRODUCTS)
    assert plan.products == (KERNEL, KERNEL) + (ATEN,) * 7
    assert plan.from_two is None
    with pytest.raises(ValueError, match="at 1 row"):
        choose({2: {KERNEL: 1.0}}, PRODUCTS)


def test_a_plan_names_one_known_product_per_bucket() -> None:
    assert GemmPlan.uniform(ATEN).describe() == "aten 1+"
    assert GemmPlan((ATEN,) + (ONEDNN,) * 8).from_two == ONEDNN
    assert GemmPlan((ATEN, KERNEL) + (ONEDNN,) * 7).segments() == ([1, 2, 4], [1, 0, 2])
    with pytest.raises(ValueError):
        GemmPlan((KERNEL,) * 3)
    with pytest.raises(ValueError):
        GemmPlan(("amx",) * len(BUCKETS))


needs_products = pytest.mark.skipif(
    not bf16_gemm.available() or not onednn_linear.available(),
    reason="needs the CPU kernels built and oneDNN",
)
MIXED = GemmPlan((KERNEL, KERNEL, ONEDNN, ONEDNN, ATEN, ATEN, ATEN, KERNEL, KERNEL))


def layouts(n: int, k: int) -> tuple:
    g = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    return weight, bias, bf16_gemm.pack(weight), onednn_linear.pack(weight, bias), n


@needs_products
@pytest.mark.parametrize("rows", [1, 3, 4, 15, 16, 100, 128, 300])
def test_a_mixed_plan_runs_each_bucket_on_its_product(rows: int) -> None:
    weight, bias, panels, onednn, n = layouts(48, 40)
    x = torch.randn(rows, 40, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = planned_linear(x, MIXED, weight, bias, panels, onednn, n)
    want = run_product(MIXED.product(rows), x, weight, bias, panels, onednn, n)
    assert torch.equal(got, want)
    reference = x.double() @ weight.double().T + bias.double()
    # fp32 sums in any order, then one bf16 rounding (half a unit in the 8th bit)
    assert ((got.double() - reference).abs() <= reference.abs() * 2**-8 + 1e-3).all()


@needs_products
def test_compiled_callers_of_a_mixed_plan_see_one_graph_for_every_row_count() -> None:
    """The product is chosen when the op runs: row counts from 2 add no graphs."""
    weight, bias, panels, onednn, n = layouts(64, 32)
    compiler = CountingCompiler()

    @compiler.compile
    def f(x: torch.Tensor) -> torch.Tensor:
        return planned_linear(x * 2, MIXED, weight, bias, panels, onednn, n).relu()

    for rows in (3, 2, 7, 30, 200):
        x = torch.randn(rows, 32).bfloat16()
        want = run_product(MIXED.product(rows), x * 2, weight, bias, panels, onednn, n).relu()
        assert torch.equal(f(x), want)
    assert compiler.count == 1
