"""A Llama-3 split over tensor-parallel ranks through the executor (``LLMEngine`` with
``tensor_parallel_size``: this process is rank 0, the others real processes of their own,
meeting in gloo's group and the shared-memory collectives). Each rank holds its query and
KV heads (replicated where there are fewer KV heads than ranks), MLP channels and
vocabulary rows, read from the checkpoint alone. Greedy output in fp32 equals one
device's and transformers', in a batch with the prefix cache cold and warm and one prompt
at a time; seeded rows draw as on one device; each drafter's output equals target-only
output, and an exact draft is accepted whole. How the ranks end: with the engine, with an
interpreter that never closed it, with rank 0 killed; a killed rank fails the engine
within the collectives' timeout. The KV pools a transfer reads hold every rank's heads,
as one device's do. What cannot be split is refused naming the numbers."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.llm_engine import EngineConfig, LLMEngine
from engine.parallel.shard import TensorParallelError
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from tests.comparator import compare_greedy
from tests.engine.spec.test_spec_greedy import markov_target
from tests.engine.tiny_drafts import build_random_draft
from tests.engine.tiny_models import build_tiny_llama
from tests.services.cluster_helpers import engine_greedy

VOCAB = 67  # not a multiple of 2
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    out = tmp_path_factory.mktemp("tp_llama")
    hf = build_tiny_llama(out, "gqa4_llama3rope_hd72_mlpbias", num_layers=2, vocab_size=VOCAB)
    return out, hf


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 9, 17, 6)]


def engine_for(model_dir: Path, size: int, **kw) -> LLMEngine:
    config = dict(model=str(model_dir), dtype="float32", block_size=4, kv_cache_memory=8 << 20)
    config.update(kw)
    return LLMEngine(EngineConfig(**config, tensor_parallel_size=size, num_threads=2))


def run(
    engine: LLMEngine, requests: dict[str, list[int]], params: SamplingParams
) -> dict[str, list[int]]:
    for rid, prompt in requests.items():
        engine.add_request(rid, prompt, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return done


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompt_kv(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """``[layers, K and V, tokens, KV heads, head_dim]``: the prompt's KV as a transfer
    reads it (``kv_pools``), right after its prefill."""
    engine.add_request("kv-probe", prompt, SamplingParams(max_tokens=2, temperature=0.0))
    engine.step()
    table = engine._seqs["kv-probe"].block_table
    block_size = engine.kv_cache.params.block_size
    slots = torch.tensor(
        [table[i // block_size] * block_size + i % block_size for i in range(len(prompt))]
    )
    kv = torch.stack(
        [
            torch.stack([t.flatten(0, 1)[slots] for t in layer])
            for layer in engine.kv_pools["target"].layers
        ]
    )
    run(engine, {}, GREEDY)
    return kv


def seeded(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=12, temperature=1.0, seed=100 + i, ignore_eos=True)


@pytest.mark.parametrize(("size", "vocab_rows"), [(2, 34), (4, 17)])
def test_greedy_split_over_ranks_equals_one_device_and_transformers(
    model, prompts, size: int, vocab_rows: int, caplog: pytest.LogCaptureFixture
) -> None:
    """8 query heads and 2 KV heads: split at TP 2, replicated on pairs of ranks at TP 4;
    67 vocabulary rows: rank 0 holds ``vocab_rows``, the last rank fewer. More ranks than
    cores run, with a warning."""
    model_dir, hf = model
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (8, 2)
    with caplog.at_level(logging.WARNING, logger="engine.executor.multiproc"):
        engine = engine_for(model_dir, size)
    cores = os.cpu_count() or 1
    warned = f"tensor_parallel_size: {size} ranks on {cores} CPU cores" in caplog.text
    assert warned == (size > cores)
    try:
        ranks = engine.runner.executor.ranks  # type: ignore[attr-defined]
        assert len(ranks.processes) == size - 1 and ranks.tp.shm is not None
        got: dict[str, list[int]] = {}
        for phase in ("cold", "warm"):
            got |= run(engine, {f"{phase}-{i}": p for i, p in enumerate(prompts)}, GREEDY)
        for i, prompt in enumerate(prompts):
            got |= run(engine, {f"alone-{i}": prompt}, GREEDY)
        assert engine.block_manager.num_prefix_hit_blocks > 0  # warm and alone hit the cache
        sampled = {}
        for i, prompt in enumerate(prompts):
            sampled |= run(engine, {f"seeded-{i}": prompt}, seeded(i))
        # What rank 0 holds: its vocabulary rows, and its KV heads in the cache's pools.
        assert engine.runner.model.lm_head.weight.shape[0] == vocab_rows
        assert engine.kv_cache.layers[0][0].shape[2] == 1  # of 2: its own, or its queries'
        # ... views of the pools every rank maps, which a transfer reads whole.
        whole = engine.kv_pools["target"]
        assert whole.layers[0][0].shape[2] == 2 and not whole.is_placeable
        assert engine.kv_cache.layers[1][1].data_ptr() == whole.layers[1][1].data_ptr()
        split_kv = prompt_kv(engine, prompts[2])
    finally:
        engine.close()
    assert all(p.poll() is not None for p in ranks.processes)  # closed: the ranks are gone
    one_device = engine_greedy(model_dir, prompts, 12)
    refs = [
        hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p) :].tolist()
        for p in prompts
    ]
    for phase in ("cold", "warm", "alone"):
        ours = [got[f"{phase}-{i}"] for i in range(len(prompts))]
        compare_greedy(hf, prompts, ours, one_device)
        compare_greedy(hf, prompts, ours, refs)
    # Sampled: a seeded row draws what it draws on one device.
    one = engine_for(model_dir, 1)
    alone = {}
    for i, prompt in enumerate(prompts):
        alone |= run(one, {f"seeded-{i}": prompt}, seeded(i))
    assert sampled == alone
    # Every rank's KV heads, as one device computes them (the sums of the layers'
    # all-reduces in another order: fp32 rounding apart).
    torch.testing.assert_close(split_kv, prompt_kv(one, prompts[2]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "dflash", "suffix"])
def test_each_drafter_at_tp_2_equals_target_only(model, prompts, tmp_path: Path, kind) -> None:
    """Greedy: the target-only tokens; seeded: what the same draft draws on one device.
    Suffix drafts verify rows of different lengths in one ragged forward."""
    model_dir, _ = model
    if kind == "suffix":
        spec = SpeculativeConfig("", num_draft_tokens=3, kind="suffix")
    else:
        draft = build_random_draft(model_dir, tmp_path / kind, kind, std=0.3)
        spec = SpeculativeConfig(str(draft), num_draft_tokens=3)
    requests = {str(i): p for i, p in enumerate(prompts)}
    target_only = engine_greedy(model_dir, prompts, 12)
    engine = engine_for(model_dir, 2, speculative=spec)
    try:
        got = run(engine, requests, GREEDY)
        assert engine.spec is not None and engine.spec.stats.num_draft_tokens > 0
        sampled = {}
        for i, prompt in enumerate(prompts):
            sampled |= run(engine, {f"seeded-{i}": prompt}, seeded(i))
    finally:
        engine.close()
    assert [got[str(i)] for i in range(len(prompts))] == target_only
    one = engine_for(model_dir, 1, speculative=spec)
    alone = {}
    for i, prompt in enumerate(prompts):
        alone |= run(one, {f"seeded-{i}": prompt}, seeded(i))
    assert sampled == alone


def test_an_exact_draft_is_accepted_whole_at_tp_2(tmp_path: Path) -> None:
    """A one-layer target whose next token follows from the current one, and an EAGLE
    draft that computes the same: every draft is accepted, the tokens are target-only's."""
    target_dir, draft_dir, _ = markov_target(tmp_path)
    prompts = [[5, 6, 7], [9] * 11, [40]]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    base = engine_greedy(target_dir, prompts, 30)
    spec = SpeculativeConfig(str(draft_dir), num_draft_tokens=4)
    engine = engine_for(target_dir, 2, speculative=spec)
    try:
        got = run(engine, {str(i): p for i, p in enumerate(prompts)}, params)
        stats = engine.spec.stats  # type: ignore[union-attr]
    finally:
        engine.close()
    assert [got[str(i)] for i in range(len(prompts))] == base
    # 29 tokens after the prefill's first one: 5 per step, so 6 steps, the last one cut.
    assert stats.num_drafts == 6 * len(prompts)
    assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_compiled_steps_at_tp_2_equal_one_device_without_graph_breaks(model, prompts) -> None:
    """Each rank compiles its shard; the collectives are ops of rank 0's graphs (as graph
    breaks, each step would run as a graph per layer half)."""
    from torch._dynamo.utils import counters

    model_dir, hf = model
    counters.clear()
    engine = engine_for(model_dir, 2, torch_compile=True)
    try:
        assert engine.runner.decode_model is not engine.runner.model
        got = run(engine, {str(i): p for i, p in enumerate(prompts)}, GREEDY)
    finally:
        engine.close()
    assert counters["stats"]["unique_graphs"] >= 1
    assert dict(counters["graph_break"]) == {}
    ours = [got[str(i)] for i in range(len(prompts))]
    compare_greedy(hf, prompts, ours, engine_greedy(model_dir, prompts, 12))


def test_the_triton_path_at_tp_2_equals_one_device(model, prompts) -> None:
    """Every rank swaps in the Triton layers (through Triton's interpreter here), which
    all-reduce as the torch layers do; rank 0 gathers the LM head's vocabulary shards. The
    attention kernel reads each rank's heads of the shared KV pools (strided slots)."""
    model_dir, hf = model
    engine = engine_for(model_dir, 2, attention_backend="triton")
    try:
        assert engine.kernels == "triton" and engine.runner.model.fused_decoder is not None
        got = run(engine, {str(i): p for i, p in enumerate(prompts)}, GREEDY)
    finally:
        engine.close()
    ours = [got[str(i)] for i in range(len(prompts))]
    compare_greedy(hf, prompts, ours, engine_greedy(model_dir, prompts, 12))


def test_what_cannot_be_split_is_refused_naming_the_numbers(model) -> None:
    model_dir, _ = model
    config = json.loads((model_dir / "config.json").read_text())
    heads = config["num_attention_heads"]
    with pytest.raises(TensorParallelError, match=f"does not divide num_attention_heads {heads}"):
        from engine.parallel.shard import check_divisible

        check_divisible(heads, config["num_key_value_heads"], heads + 1)
    with pytest.raises(TensorParallelError, match="3 does not divide num_attention_heads 8"):
        engine_for(model_dir, 3)
    on_cuda = EngineConfig(
        model=str(model_dir),
        device="cuda",
        attention_backend="torch",
        kernels="torch",
        tensor_parallel_size=2,
    )
    visible = torch.cuda.device_count()
    if visible < 2:  # refused before any rank starts
        with pytest.raises(ValueError, match=f"2 ranks from cuda, but only {visible} CUDA"):
            LLMEngine(on_cuda)


def start_script(model_dir: Path, mode: str) -> tuple[subprocess.Popen[str], list[int]]:
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.engine.parallel.tp_script", str(model_dir), mode],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    first = process.stdout.readline().split()
    assert first[:1] == ["ranks"], (first, process.stderr.read() if process.stderr else "")
    return process, [int(pid) for pid in first[1:]]


def is_gone(pid: int) -> bool:
    """The process has ended (a zombie waiting to be reaped counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pids: list[int], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(is_gone(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return False


def test_an_engine_never_closed_exits_with_its_ranks_and_prints_nothing_after(model) -> None:
    model_dir, _ = model
    process, pids = start_script(model_dir, "exit")
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    assert out.splitlines() == ["done"] and err == ""
    assert wait_gone(pids, 5)


def test_ranks_leave_when_rank_0_is_killed(model) -> None:
    model_dir, _ = model
    process, pids = start_script(model_dir, "wait")
    assert process.stdout is not None and process.stdout.readline().strip() == "waiting"
    process.kill()
    process.wait()
    assert wait_gone(pids, 5)


def test_a_killed_rank_fails_the_engine_within_the_timeout(model) -> None:
    model_dir, _ = model
    process, pids = start_script(model_dir, "kill-rank")
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    words = out.split()
    assert words[0] == "failed", out
    # At once: rank 0's waits ask whether the ranks' processes still run (else within the
    # collectives' timeout, 10 s).
    assert float(words[1]) < 2.0, out
    assert f"rank 1 (pid {pids[0]}) exited with code -9" in out, out
    assert wait_gone(pids, 1)


def test_smollm2_at_tp_3_equals_one_device_and_transformers(smollm2_dir: Path) -> None:
    """9 query heads, 3 KV heads, 1536 MLP channels and 49152 vocabulary rows over 3 ranks."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small"]
    prompts = [tokenizer.encode(t) for t in texts]
    engine = engine_for(smollm2_dir, 3, kv_cache_memory=32 << 20)
    try:
        got = run(engine, {str(i): p for i, p in enumerate(prompts)}, GREEDY)
        assert engine.kv_cache.layers[0][0].shape[2] == 1
        assert engine.runner.model.lm_head.weight.shape[0] == 49152 // 3
    finally:
        engine.close()
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, torch_dtype=torch.float32)
    refs = [
        hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p) :].tolist()
        for p in prompts
    ]
    ours = [got[str(i)] for i in range(len(prompts))]
    compare_greedy(hf, prompts, ours, engine_greedy(smollm2_dir, prompts, 12))
    compare_greedy(hf, prompts, ours, refs)


def test_one_split_engine_per_process(model) -> None:
    model_dir, _ = model
    engine = engine_for(model_dir, 2)
    try:
        with pytest.raises(RuntimeError, match="one tensor-parallel engine per process"):
            engine_for(model_dir, 2)
    finally:
        engine.close()


@pytest.mark.slow
def test_sampled_speculation_at_tp_2_draws_as_target_only(tmp_path: Path) -> None:
    """The chi-square test of tests/engine/spec/test_spec_sampled.py (the joint of the
    first three tokens against the exact target-only distribution), at TP 2."""
    from tests.engine.spec import test_spec_sampled as sampled

    hf = build_tiny_llama(tmp_path / "target", "mha_plain", num_layers=2, vocab_size=sampled.VOCAB)
    draft = build_random_draft(tmp_path / "target", tmp_path / "eagle", "eagle", std=0.3)
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=1.0)
    spec = SpeculativeConfig(str(draft), num_draft_tokens=2, sample_drafts=True)
    engine = engine_for(
        tmp_path / "target",
        2,
        kv_cache_memory=64 << 20,
        max_num_seqs=1024,
        max_num_batched_tokens=8192,
        enable_prefix_caching=False,
        speculative=spec,
    )
    try:
        counts = sampled.sample_joint(engine, params)
        stats = engine.spec.stats  # type: ignore[union-attr]
    finally:
        engine.close()
    assert 0 < stats.acceptance_rate < 1
    assert sampled.chi_square_p(counts, sampled.exact_joint(hf, params)) > 1e-3
