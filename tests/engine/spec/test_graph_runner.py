"""The CUDA-graph runner's path on CPU (no capture): buckets, padding and the dispatcher.
Padded rows leave every real block untouched, and a padded batch gives what the same rows
give unpadded, for every drafter, greedy and sampled rows; an engine on that path gives
target-only greedy output."""

from __future__ import annotations

import pytest
import torch

from engine.attention import AttentionBackend, TorchAttentionBackend
from engine.executor.uniproc import UniprocExecutor
from engine.kv_cache import KVCacheParams, PagedKVCache
from engine.models.llama3 import Llama3Model
from engine.sampler import SamplingTensors
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from engine.spec.drafters import new_drafter
from engine.spec.drafters.loading import init_random
from engine.spec.graph_runner import (
    GraphKey,
    PersistentInputBuffers,
    StepGraphRunner,
    StepShape,
    batch_buckets,
)
from engine.spec.unified_step import SpecStepInputs, UnifiedStep
from tests.comparator import compare_greedy
from tests.engine.spec.test_spec_greedy import PROMPTS, engine_for, greedy, markov_target, run
from tests.engine.spec.test_unified_step_meta import META, draft_hf, target_config

CPU = torch.device("cpu")
BLOCK_SIZE = 4
NUM_BLOCKS = 64
SCRATCH = NUM_BLOCKS - 1  # no request's: the padded rows write here
WIDTH = 10  # block-table width of the buffers: contexts up to 40 slots
K = 3
ROW_BLOCKS = 7  # a row's KV length (up to 17) and the 2K + 3 slots a step may write


def own_blocks(row: int) -> list[int]:
    return list(range(ROW_BLOCKS * row, ROW_BLOCKS * (row + 1)))


def make_step(
    kind: str, device: torch.device = CPU, backend: AttentionBackend | None = None
) -> UnifiedStep:
    """A tiny random fp32 target and drafter of ``kind`` with KV pools of random content."""
    config = target_config()
    with device:
        target = Llama3Model(config)
    init_random(target, seed=1, std=0.08)
    drafter = new_drafter(kind, draft_hf(kind), target, device, seed=2)
    target_kv = PagedKVCache(KVCacheParams.from_config(config, BLOCK_SIZE), NUM_BLOCKS, device)
    params = KVCacheParams.from_config(drafter.config, BLOCK_SIZE)
    draft_kv = PagedKVCache(params, NUM_BLOCKS, device)
    if device.type != "meta":
        gen = torch.Generator().manual_seed(3)
        for pool in (*target_kv.layers, *draft_kv.layers):
            for t in pool:
                t.copy_(torch.randn(t.shape, generator=gen))
    backend = backend or TorchAttentionBackend()
    forward = UniprocExecutor(target, target_kv, backend).forward
    return UnifiedStep(forward, drafter, target_kv, draft_kv, backend)


def kv_snapshot(step: UnifiedStep) -> list[torch.Tensor]:
    return [t.clone() for pool in (*step.target_kv.layers, *step.draft_kv.layers) for t in pool]


def restore(step: UnifiedStep, snapshot: list[torch.Tensor]) -> None:
    pools = [t for pool in (*step.target_kv.layers, *step.draft_kv.layers) for t in pool]
    for t, saved in zip(pools, snapshot, strict=True):
        t.copy_(saved)


ROW_PARAMS = [
    SamplingParams(max_tokens=8, temperature=0.0),
    SamplingParams(max_tokens=8, temperature=0.8, top_k=5, seed=7),
    SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, min_p=0.05, seed=8),
]


@pytest.fixture(scope="module")
def markov(tmp_path_factory: pytest.TempPathFactory):
    """test_spec_greedy's one-layer target and the EAGLE draft that reproduces it."""
    return markov_target(tmp_path_factory.mktemp("markov"))


def batch_inputs(b: int, k: int, *, greedy: bool, device: torch.device = CPU) -> SpecStepInputs:
    """Rows i = 0..b-1 with KV lengths 5 + 3i, each in its own ``ROW_BLOCKS`` blocks (a table
    narrower than the buffers', padded with 0 as the engine pads it)."""
    gen = torch.Generator().manual_seed(b * 10 + k)
    kv_lens = [5 + 3 * i for i in range(b)]
    tables = [[*own_blocks(i), 0] for i in range(b)]
    params = [ROW_PARAMS[0 if greedy else i % 3] for i in range(b)]
    return SpecStepInputs(
        tokens=torch.randint(0, 128, (b,), generator=gen).to(device),
        draft_tokens=torch.randint(0, 128, (b, k), generator=gen).to(device),
        kv_lens=torch.tensor(kv_lens, device=device),
        block_tables=torch.tensor(tables, device=device),
        sampling=SamplingTensors.build(params, list(range(b)), [n + 1 for n in kv_lens], device),
        max_context_len=max(kv_lens) + 2 * k + 3,
    )


def make_runner(step: UnifiedStep, max_batch: int = 8, **kw: object) -> StepGraphRunner:
    device = step.target_kv.layers[0][0].device
    buffers = PersistentInputBuffers.alloc(
        max_batch, max_batch * (K + 1), device, max_blocks_per_seq=WIDTH
    )
    runner = StepGraphRunner(step, buffers, SCRATCH, **kw)  # type: ignore[arg-type]
    runner.capture([StepShape(K, K, False, greedy, False) for greedy in (True, False)])
    return runner


def test_buckets_and_buffers():
    assert batch_buckets(64) == [1, 2, 4, 8, *range(16, 65, 8)]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(1) == [1]
    buffers = PersistentInputBuffers.alloc(4, 4 * 6, torch.device("cpu"), max_blocks_per_seq=3)
    assert buffers.max_batch_size == 4 and buffers.max_k == 5
    assert buffers.block_tables.shape == (4, 3) and buffers.bitmask is None
    with_mask = PersistentInputBuffers.alloc(4, 8, torch.device("cpu"), bitmask_words=3)
    assert with_mask.bitmask is not None and with_mask.bitmask.shape == (4, 2, 3)
    with pytest.raises(ValueError, match="not a multiple of max_batch_size 4"):
        PersistentInputBuffers.alloc(4, 10, torch.device("cpu"))


def test_dispatcher_picks_the_next_bucket_or_eager():
    runner = make_runner(make_step("eagle"))
    assert runner.buckets == [1, 2, 4, 8]
    pick = runner.dispatch
    greedy = StepShape(K, K, False, True, False)
    assert pick(batch_inputs(3, K, greedy=True), K) == GraphKey(4, greedy)
    assert pick(batch_inputs(1, K, greedy=True), K) == GraphKey(1, greedy)
    sampled = pick(batch_inputs(5, K, greedy=False), K)
    assert sampled == GraphKey(8, StepShape(K, K, False, False, False))
    assert pick(batch_inputs(9, K, greedy=True), K) is None  # oversized
    assert pick(batch_inputs(3, K, greedy=True), 0, True) is None  # shape not captured
    assert pick(batch_inputs(3, 1, greedy=True), K) is None
    penalized = batch_inputs(2, K, greedy=True)
    params = [SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.2)] * 2
    penalized.sampling = SamplingTensors.build(
        params, [0, 0], [6, 9], torch.device("cpu"), [[1, 2]] * 2, [1, 1]
    )
    assert pick(penalized, K) is None
    too_long = batch_inputs(2, K, greedy=True)
    too_long.max_context_len = WIDTH * BLOCK_SIZE + 1
    assert pick(too_long, K) is None


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "dflash"])
def test_padding_leaves_real_blocks_untouched_and_matches_unpadded(kind):
    step = make_step(kind)
    runner = make_runner(step)
    before = kv_snapshot(step)
    for b, is_greedy in ((3, True), (5, False), (1, False), (2, True)):
        inputs = batch_inputs(b, K, greedy=is_greedy)
        restore(step, before)
        want = step(inputs, K)
        unpadded_kv = kv_snapshot(step)
        restore(step, before)
        got = runner(inputs, K)
        assert runner.dispatch(inputs, K) is not None
        # Tables as the graph read them: each row's blocks up to its reach (KV length + 2K
        # + 3 slots), then the scratch block, never the engine's 0 padding; padded rows
        # the scratch block alone.
        tables = runner.buffers.block_tables[: runner.dispatch(inputs, K).bucket]
        for i, n in enumerate(inputs.kv_lens.tolist()):
            used = (n + 2 * K + 2) // BLOCK_SIZE + 1
            assert tables[i].tolist() == own_blocks(i)[:used] + [SCRATCH] * (WIDTH - used)
        assert (tables[b:] == SCRATCH).all()
        for name in ("num_accepted", "next_tokens", "emitted", "next_draft_tokens"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (kind, b, name)
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
        # Every block but the rows' own and the scratch block is as it was; the rows' own
        # hold what the unpadded step wrote.
        own = [blk for i in range(b) for blk in own_blocks(i)]
        others = [blk for blk in range(NUM_BLOCKS) if blk not in own and blk != SCRATCH]
        for now, was, unpadded in zip(kv_snapshot(step), before, unpadded_kv, strict=True):
            assert torch.equal(now[others], was[others]), (kind, b)
            torch.testing.assert_close(now[own], unpadded[own], rtol=1e-5, atol=1e-5)
    assert runner.num_graph_steps == 4 and runner.num_eager_steps == 0


def test_launch_copies_tokens_to_host_slots_that_alternate():
    step = make_step("eagle3")
    runner = make_runner(step)
    first = runner.launch(batch_inputs(2, K, greedy=True), K)
    first_host = [t.clone() for t in first.host()]
    second = runner.launch(batch_inputs(3, K, greedy=True), K)
    # Step n's host tokens are still readable after step n+1 was launched.
    assert all(torch.equal(a, b) for a, b in zip(first.host(), first_host, strict=True))
    accepted, emitted, drafts = second.host()
    assert accepted.shape == (3,) and emitted.shape == (3, K + 1) and drafts.shape == (3, K)
    assert torch.equal(emitted, second.outputs.emitted)
    assert torch.equal(drafts, second.outputs.next_draft_tokens)


def test_a_runner_step_on_meta():
    """The padded path never synchronises with the host either."""
    step = make_step("eagle3", META)
    runner = make_runner(step)
    assert not runner.use_graphs
    out = runner(batch_inputs(3, K, greedy=False, device=META), K)
    assert runner.num_graph_steps == 1
    assert out.emitted.shape == (3, K + 1) and out.emitted.device == META
    assert out.next_draft_tokens.shape == (3, K) and out.logits.shape == (3, K + 1, 128)


def assert_graphs_equal_target_only(target_dir, draft_dir, hf_model, **engine_kw) -> int:
    """Greedy requests that finish at different steps (the batch shrinks step by step)
    through an engine whose decode steps run on the graph runner give target-only output;
    returns the number of steps that took the graph path."""
    requests = {str(i): (p, greedy(4 + 3 * i)) for i, p in enumerate(PROMPTS)}
    kw = dict(max_model_len=64, **engine_kw)
    base = run(engine_for(target_dir, **kw), requests)
    spec = SpeculativeConfig(str(draft_dir), num_draft_tokens=3)
    engine = engine_for(target_dir, spec, cuda_graphs=True, max_num_seqs=8, **kw)
    assert engine.spec is not None and engine.spec.graphs is not None
    assert engine.block_manager.num_blocks == engine.kv_cache.num_blocks - 1  # the scratch block
    out = run(engine, requests)
    ours = [out[r].token_ids for r in requests]
    refs = [base[r].token_ids for r in requests]
    assert ours == refs or compare_greedy(hf_model, PROMPTS, ours, refs).num_ties <= 1
    assert engine.spec.stats.num_accepted_tokens > 0
    return engine.spec.graphs.num_graph_steps


def test_engine_with_graph_runner_on_cpu_equals_target_only(markov):
    """The oracle draft accepts every draft: rows advance K+1 positions a step."""
    target_dir, draft_dir, hf_model = markov
    assert assert_graphs_equal_target_only(target_dir, draft_dir, hf_model) >= 4
    # Off by default on CPU: the engine's path is unchanged.
    engine = engine_for(target_dir, SpeculativeConfig(str(draft_dir), num_draft_tokens=3))
    assert engine.spec is not None and engine.spec.graphs is None


def test_captured_graphs_pin_their_pools_until_released_and_captured_again(monkeypatch):
    """A decode worker moves its KV pools into memory it shares (decode_worker.cli
    ``share_pools``): the graphs that address them are released first, which unpins
    them, and captured again over where they lie. (The capture itself needs CUDA: here it
    records its keys.)"""
    captured: list[GraphKey] = []

    def capture(runner: StepGraphRunner, key: GraphKey) -> None:
        captured.append(key)
        runner.graphs[key] = (None, None)  # type: ignore[assignment]

    monkeypatch.setattr(StepGraphRunner, "_capture", capture)
    step = make_step("eagle")
    runner = make_runner(step, use_graphs=True)
    pools = (step.target_kv, step.draft_kv)
    runner.hold(*pools)
    assert not any(p.is_placeable for p in pools)
    first = list(captured)
    assert len(first) == 4 * 2  # buckets 1, 2, 4, 8; greedy and sampled
    runner.release()
    assert runner.graphs == {} and all(p.is_placeable for p in pools)
    for p in pools:
        p.place(lambda shape, dtype: torch.zeros(shape, dtype=dtype))
    runner.recapture()
    assert sorted(captured[len(first) :]) == sorted(first)
    assert not any(p.is_placeable for p in pools) and len(runner.graphs) == 8
