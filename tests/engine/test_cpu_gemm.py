"""Every product plan (``EngineConfig.cpu_gemm``) gives today's tokens: the same in fp32
(tie-aware), the same agreement with fp32 in bf16. Mixed plans come from injected timings."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from engine.models.layers import Linear, release_packed_weights, use_packed_gemm
from kernels.cpu import bf16_gemm, gemm_timings, onednn_linear
from kernels.cpu.gemm_plan import ATEN, BUCKETS, KERNEL, ONEDNN, GemmPlan
from tests.comparator import compare_greedy
from tests.engine.spec.test_spec_greedy import PROMPTS, engine_for, greedy, run
from tests.engine.test_llama3_logits import hf_logits, make_engine, run_teacher_forced
from tests.engine.tiny_models import build_tiny_llama
from tests.kernels.compile_count import CountingCompiler

pytestmark = pytest.mark.skipif(
    not bf16_gemm.available() or not onednn_linear.available(),
    reason="needs the CPU kernels built and oneDNN",
)

NUM_TOKENS = 16
# Injected: the kernel to 3 rows, oneDNN to 15, aten past (1 row: aten where the kernel
# cannot run the weight), so that one engine's steps use every product.
MIXED_COSTS = [
    {KERNEL: 1.0, ATEN: 5.0, ONEDNN: 6.0},
    {KERNEL: 1.0, ATEN: 5.0, ONEDNN: 6.0},
    {KERNEL: 9.0, ATEN: 5.0, ONEDNN: 1.0},
    {KERNEL: 9.0, ATEN: 5.0, ONEDNN: 1.0},
] + [{KERNEL: 9.0, ATEN: 1.0, ONEDNN: 5.0}] * 5


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("gemm_target")
    model = build_tiny_llama(out, "gqa4_llama3rope_hd72_mlpbias", num_layers=2, vocab_size=96)
    return out, model


@pytest.fixture
def mixed_timings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``cpu_gemm="measured"`` reads these timings, in a cache of this test's own."""

    def measure(n: int, k: int, dtype: torch.dtype, products: Sequence[str]):
        return {
            rows: {p: c[p] for p in products} for rows, c in zip(BUCKETS, MIXED_COSTS, strict=True)
        }

    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gemm_timings, "measure", measure)
    monkeypatch.setattr(gemm_timings, "is_busy", lambda: False)


def plans_of(engine) -> set[GemmPlan | None]:
    return {m._plan for m in engine.runner.model.modules() if isinstance(m, Linear)}


REQUESTS = {str(i): (p, greedy(NUM_TOKENS)) for i, p in enumerate(PROMPTS)}


@pytest.mark.parametrize("products", [ATEN, ONEDNN, "measured"])
def test_every_fp32_plan_gives_the_same_tokens(target, products, mixed_timings) -> None:
    """fp32 weights run on aten or oneDNN's fp32 copy (no kernel): all six prompts in one
    batch, then decode steps of 6 rows down to 1, so a mixed plan switches products."""
    model_dir, hf_model = target
    base = run(engine_for(model_dir, cpu_gemm=ATEN), REQUESTS)
    engine = engine_for(model_dir, cpu_gemm=products)
    if products == "measured":
        assert plans_of(engine) == {GemmPlan((ATEN, ATEN) + (ONEDNN,) * 2 + (ATEN,) * 5)}
    out = run(engine, REQUESTS)
    ours, refs = [out[r].token_ids for r in REQUESTS], [base[r].token_ids for r in REQUESTS]
    assert ours == refs or compare_greedy(hf_model, PROMPTS, ours, refs).num_ties <= 1


def agreement(tokens: dict, reference: dict) -> int:
    return sum(tokens[r].token_ids == reference[r].token_ids for r in REQUESTS)


def test_every_bf16_plan_agrees_with_fp32_as_the_kernel_does(target, mixed_timings) -> None:
    """Rows identical to the fp32 tokens: no plan loses more than one row to today's (the
    kernel everywhere); and teacher-forced logits (prompt chunks of up to 12 rows, then
    single rows) err from transformers' fp32 no more than aten's bf16 products do."""
    model_dir, hf_model = target
    fp32 = run(engine_for(model_dir, cpu_gemm=ATEN), REQUESTS)
    gen = torch.Generator().manual_seed(2)
    vocab = hf_model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 23)]
    continuations = [torch.randint(3, vocab, (8,), generator=gen).tolist() for _ in prompts]
    counts, errors = {}, {}
    for products in (KERNEL, ONEDNN, ATEN, "measured"):
        engine = engine_for(model_dir, dtype="bfloat16", cpu_gemm=products)
        if products == "measured":
            assert plans_of(engine) == {GemmPlan((KERNEL, KERNEL) + (ONEDNN,) * 2 + (ATEN,) * 5)}
        counts[products] = agreement(run(engine, REQUESTS), fp32)
        engine = make_engine(
            model_dir, dtype="bfloat16", max_num_batched_tokens=12, cpu_gemm=products
        )
        got, _, _ = run_teacher_forced(engine, prompts, continuations)
        errors[products] = max(
            (logits.float() - hf_logits(hf_model, p + c)[len(p) - 1 + step]).abs().max().item()
            for i, (p, c) in enumerate(zip(prompts, continuations, strict=True))
            for step, logits in enumerate(got[i])
        )
    assert min(counts.values()) >= counts[KERNEL] - 1, counts
    assert 0 < max(errors.values()) <= 1.5 * errors[ATEN] + 1e-3, errors


def test_native_weights_are_released_only_where_no_bucket_uses_aten() -> None:
    torch.manual_seed(0)
    linears = [Linear(64, 48, bias=True).bfloat16() for _ in range(3)]
    plans = [
        GemmPlan.uniform(KERNEL),
        GemmPlan((KERNEL,) * 4 + (ONEDNN,) * 5),  # panels and a oneDNN copy: the weight goes
        GemmPlan((KERNEL,) * 4 + (ATEN,) * 5),
    ]
    x = {rows: torch.randn(rows, 64).bfloat16() for rows in (1, 5, 40)}
    before = []
    for linear, plan in zip(linears, plans, strict=True):
        linear.prepare(plan)
        before.append({rows: linear(v) for rows, v in x.items()})
    assert linears[1]._panels is not None and linears[1]._onednn is not None
    assert linears[2]._onednn is None
    model = torch.nn.Sequential(*linears)
    assert release_packed_weights(model) == 2 * 48 * 64 * 2
    assert [m.weight.numel() for m in linears] == [0, 0, 48 * 64]
    for linear, want in zip(linears, before, strict=True):
        assert all(torch.equal(linear(v), want[rows]) for rows, v in x.items())


def test_forcing_a_product_the_weight_cannot_take_keeps_aten() -> None:
    """The kernel takes bf16 weights only: an fp32 Linear stays as it was."""
    linear = Linear(32, 16)
    use_packed_gemm(linear, KERNEL)
    assert linear._plan is None and linear._panels is None
    with pytest.raises(ValueError, match="products: one of"):
        use_packed_gemm(linear, "amx")


@pytest.mark.parametrize(
    "plan",
    [GemmPlan((KERNEL,) * 2 + (ONEDNN,) * 2 + (ATEN,) * 5), GemmPlan((ATEN,) + (KERNEL,) * 8)],
    ids=["mixed", "one-from-two"],
)
def test_a_compiled_linear_makes_a_graph_for_one_row_and_one_for_more(plan: GemmPlan) -> None:
    """One row is fixed by the compiler and takes its bucket's product in Python; more rows
    are a symbol: one product called directly, or a mixed plan's op choosing per call."""
    torch.manual_seed(0)
    linear = Linear(32, 64, bias=True).bfloat16()
    linear.prepare(plan)
    compiler = CountingCompiler()
    f = compiler.compile(lambda x: linear(x * 2).relu())
    for rows in (1, 3, 2, 7, 30, 200):
        x = torch.randn(rows, 32).bfloat16()
        assert torch.equal(f(x), linear(x * 2).relu()), rows
    assert compiler.count == 2
