"""LoRA adapters on a Llama-3 split over tensor-parallel ranks (this process rank 0, the
others real processes over gloo): each rank holds its part of every adapter, split as
the projection is (``B``'s output rows for q, k, v, gate and up; ``A``'s input columns
for o and down, their deltas summed by the projection's all-reduce), and each forward's
token groups travel with its step message. A mixed batch of three adapters and the base
at TP 2 and TP 4 (KV heads replicated) gives each request the tokens transformers gives
with its adapter merged, in fp32 (the tie-aware comparator). Adapters loaded and unloaded
at run time, and read again with ``max_cpu_loras``, reach every rank in the same slots:
the outputs stay each adapter's. Data-parallel ranks with adapters are refused."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import LlamaForCausalLM

from engine.llm_engine import EngineConfig, LLMEngine
from engine.lora.adapter import LoraError
from engine.sampling_params import SamplingParams
from tests.comparator import compare_greedy
from tests.engine.test_lora_adapter import save_adapter
from tests.engine.tiny_models import build_tiny_llama

VOCAB = 67
NAMES = ("qkvo", "mlp", "mixed")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object]]:
    out = tmp_path_factory.mktemp("tp_lora")
    build_tiny_llama(out / "base", "gqa4_llama3rope_hd72_mlpbias", num_layers=2, vocab_size=VOCAB)
    load = lambda: LlamaForCausalLM.from_pretrained(out / "base", dtype=torch.float32).eval()  # noqa: E731
    save_adapter(out / "qkvo", load(), std=0.5, r=8, lora_alpha=16,
                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])  # fmt: skip
    save_adapter(out / "mlp", load(), std=0.5, r=4, lora_alpha=8, use_rslora=True,
                 target_modules=["gate_proj", "up_proj", "down_proj"])  # fmt: skip
    save_adapter(out / "mixed", load(), std=0.5, r=2, rank_pattern={"o_proj": 6},
                 target_modules=["v_proj", "o_proj", "down_proj"])  # fmt: skip
    merged = {
        name: PeftModel.from_pretrained(load(), out / name).merge_and_unload().eval()
        for name in NAMES
    }
    return out, {**merged, "": load()}


@pytest.mark.parametrize("size", [2, 4])
def test_a_mixed_batch_split_over_ranks_equals_each_adapter_merged(adapters, size: int) -> None:
    out, models = adapters
    engine = LLMEngine(
        EngineConfig(model=str(out / "base"), dtype="float32", block_size=4,
                     kv_cache_memory=8 << 20, tensor_parallel_size=size, num_threads=2,
                     lora_modules=tuple((n, str(out / n)) for n in NAMES),
                     # TP 2: prompt chunks beside decode rows; TP 4: a 70-token prefill
                     # (its group in several of the CPU kernel's chunks)
                     max_num_batched_tokens=9 if size == 2 else 1024)
    )  # fmt: skip
    rng = random.Random(size)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 11, 3, 8, 70)]
    loras: list[str | None] = ["qkvo", None, "mlp", "mixed", "mixed"]
    try:
        done = run_batch(engine, prompts, loras)
    finally:
        engine.close()
    for prompt, lora, output in zip(prompts, loras, done, strict=True):
        reference = models[lora or ""]
        compare_greedy(reference, [prompt], [output], [greedy(reference, prompt)])
    for name in NAMES:  # each adapter changes the output: applied or not shows
        row = loras.index(name)
        assert greedy(models[""], prompts[row]) != done[row], name


def greedy(model: object, prompt: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,  # type: ignore[attr-defined]
                         eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def run_batch(
    engine: LLMEngine, prompts: list[list[int]], loras: list[str | None]
) -> list[list[int]]:
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(str(i), prompt, params, lora=lora)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [done[str(i)] for i in range(len(prompts))]


def test_adapters_changed_at_run_time_change_every_rank(adapters, tmp_path: Path) -> None:
    """TP 2 with room for two adapters: one given at start, two loaded at run time (the
    second taking the first's slot), the first read again for a request (taking the
    least recently used one's), one unloaded, one loaded, unloaded and loaded again from
    other files with no forward between. Every batch's requests equal their adapters
    merged, so the other rank's slots held what rank 0's did."""
    out, models = adapters
    engine = LLMEngine(
        EngineConfig(model=str(out / "base"), dtype="float32", block_size=4,
                     kv_cache_memory=8 << 20, tensor_parallel_size=2, num_threads=2,
                     lora_modules=(("qkvo", str(out / "qkvo")),), max_cpu_loras=2)
    )  # fmt: skip
    rng = random.Random(7)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (6, 9, 4)]
    batches: list[list[str | None]] = [["mixed", "qkvo", None], ["mlp", "mixed", "mlp"]]
    try:
        engine.load_lora("mlp", str(out / "mlp"))  # slot 1
        engine.load_lora("mixed", str(out / "mixed"))  # qkvo out of memory: slot 0
        registry = engine._registry()
        assert dict(registry.resident) == {"mlp": 1, "mixed": 0}
        got = [run_batch(engine, prompts, loras) for loras in batches]
        # Read again: qkvo for batch 1 (in mlp's slot), mlp and mixed for batch 2
        assert registry.num_reads == 6 and dict(registry.resident) == {"mlp": 0, "mixed": 1}
        engine.unload_lora("mlp")
        with pytest.raises(LoraError, match="'mlp' is not loaded"):
            engine.unload_lora("mlp")
        got.append(run_batch(engine, prompts, ["qkvo", None, "mixed"]))
        batches.append(["qkvo", None, "mixed"])
        # Between two forwards: loaded, unloaded, its files replaced, loaded again. The
        # other rank reads the last only (an earlier one would not match its files now).
        shutil.copytree(out / "mlp", tmp_path / "swap")
        engine.load_lora("swap", str(tmp_path / "swap"))
        engine.unload_lora("swap")
        shutil.rmtree(tmp_path / "swap")
        shutil.copytree(out / "mixed", tmp_path / "swap")
        engine.load_lora("swap", str(tmp_path / "swap"))
        got.append(run_batch(engine, prompts, ["swap", "qkvo", None]))
        batches.append(["mixed", "qkvo", None])  # what "swap" now is
    finally:
        engine.close()
    for loras, outputs in zip(batches, got, strict=True):
        for prompt, lora, output in zip(prompts, loras, outputs, strict=True):
            reference = models[lora or ""]
            compare_greedy(reference, [prompt], [output], [greedy(reference, prompt)])


def test_data_parallel_ranks_with_adapters_are_refused(adapters) -> None:
    out, _ = adapters
    with pytest.raises(ValueError, match="lora_modules: adapters do not run with data"):
        EngineConfig(model=str(out / "base"), data_parallel_size=2,
                     lora_modules=(("qkvo", str(out / "qkvo")),))  # fmt: skip
