"""A Llama-3 split over tensor-parallel ranks (real processes, gloo): each rank's engine
holds its query and KV heads (replicated where there are fewer KV heads than ranks), MLP
channels and vocabulary rows, read from the checkpoint alone, and the ranks' greedy output
in fp32 equals one device's and transformers', in a batch with the prefix cache cold and
warm and one prompt at a time; seeded rows draw as on one device. A tiny model at TP 2
and TP 4, SmolLM2 at TP 3. What cannot be split is refused naming the numbers."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from engine.llm_engine import EngineConfig, LLMEngine
from engine.parallel.group import TensorParallelGroup
from engine.parallel.shard import TensorParallelError
from engine.sampling_params import SamplingParams
from tests.comparator import compare_greedy
from tests.engine.parallel import ranks
from tests.engine.tiny_models import build_tiny_llama
from tests.services.cluster_helpers import engine_greedy

VOCAB = 67  # not a multiple of 2


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    out = tmp_path_factory.mktemp("tp_llama")
    hf = build_tiny_llama(out, "gqa4_llama3rope_hd72_mlpbias", num_layers=2, vocab_size=VOCAB)
    return out, hf


@pytest.mark.parametrize(("size", "vocab_rows"), [(2, 34), (4, 17)])
def test_greedy_split_over_ranks_equals_one_device_and_transformers(
    model, tmp_path: Path, size: int, vocab_rows: int
) -> None:
    """8 query heads and 2 KV heads: split at TP 2, replicated on pairs of ranks at TP 4;
    67 vocabulary rows: rank 0 holds ``vocab_rows``, the last rank fewer."""
    model_dir, hf = model
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (8, 2)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 9, 17, 6)]
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.start_processes(
        ranks.lockstep_engines,
        args=(size, str(model_dir), init, prompts),
        nprocs=size,
        start_method="spawn",
    )
    got, *others = (load_file(str(model_dir / f"engine{rank}.out")) for rank in range(size))
    one_device = engine_greedy(model_dir, prompts, 12)
    refs = [
        hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p) :].tolist()
        for p in prompts
    ]
    for phase in ("cold", "warm", "alone"):
        ours = [got[f"{phase}-{i}"].tolist() for i in range(len(prompts))]
        compare_greedy(hf, prompts, ours, one_device)
        compare_greedy(hf, prompts, ours, refs)
    assert got["num_cached"].item() > 0  # the warm batch and the lone prompts hit the cache
    assert got["lm_head_rows"].item() == vocab_rows
    assert got["kv_heads"].item() == 1  # of 2: its own at TP 2, the one its queries read at 4
    assert got["through_shm"].item()  # the collectives went through shared memory

    # Sampled: a seeded row draws what it draws on one device; one that set no seed draws
    # alike on both ranks (rank 0 picked the seeds they draw from).
    one = LLMEngine(
        EngineConfig(model=str(model_dir), dtype="float32", block_size=4, kv_cache_memory=8 << 20)
    )
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=100 + i, ignore_eos=True)
        one.add_request(f"seeded-{i}", prompt, params)
    alone = {}
    while one.has_unfinished_requests():
        alone.update({o.request_id: o.token_ids for o in one.step() if o.finished})
    for i in range(len(prompts)):
        assert got[f"seeded-{i}"].tolist() == alone[f"seeded-{i}"]
    assert {k for k in got if k.startswith("unseeded")} == {f"unseeded-{i}" for i in range(4)}
    tokens = [k for k in got if k.split("-")[0] in ("cold", "warm", "alone", "seeded", "unseeded")]
    assert len(tokens) == 5 * len(prompts)
    for other in others:  # every rank saw the same tokens
        assert [k for k in tokens if not torch.equal(got[k], other[k])] == []


def test_what_cannot_be_split_is_refused_naming_the_numbers(model) -> None:
    model_dir, _ = model
    config = json.loads((model_dir / "config.json").read_text())
    heads = config["num_attention_heads"]
    with pytest.raises(TensorParallelError, match=f"does not divide num_attention_heads {heads}"):
        from engine.parallel.shard import check_divisible

        check_divisible(heads, config["num_key_value_heads"], heads + 1)
    with pytest.raises(ValueError, match="tensor_parallel_size: 2, but this rank's group has 1"):
        LLMEngine(
            EngineConfig(model=str(model_dir), dtype="float32", tensor_parallel_size=2),
            tp=TensorParallelGroup.single(),
        )
    for refused in ({"kernels": "triton"}, {"torch_compile": True}):
        with pytest.raises(ValueError, match="runs without a draft, on the torch kernels and"):
            EngineConfig(model=str(model_dir), tensor_parallel_size=2, **refused)


def test_smollm2_at_tp_3_equals_one_device_and_transformers(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    """9 query heads, 3 KV heads, 1536 MLP channels and 49152 vocabulary rows over 3 ranks."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small"]
    prompts = [tokenizer.encode(t) for t in texts]
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.start_processes(
        ranks.lockstep_engines,
        args=(3, str(smollm2_dir), init, prompts, True, str(out_dir)),
        nprocs=3,
        start_method="spawn",
    )
    got = load_file(str(out_dir / "engine0.out"))
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, torch_dtype=torch.float32)
    refs = [
        hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p) :].tolist()
        for p in prompts
    ]
    ours = [got[f"cold-{i}"].tolist() for i in range(len(prompts))]
    compare_greedy(hf, prompts, ours, engine_greedy(smollm2_dir, prompts, 12))
    compare_greedy(hf, prompts, ours, refs)
    assert got["kv_heads"].item() == 1 and got["lm_head_rows"].item() == 49152 // 3
