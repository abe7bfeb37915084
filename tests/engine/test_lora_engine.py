"""LoRA adapters served by the engine, in mixed batches: three PEFT adapters (ranks,
targets and scalings of their own) and the base model in one batch, each request's
greedy output in fp32 equal to transformers running its adapter merged into the base
(the tie-aware comparator); the prefix cache never hands KV made under one adapter to
another or to the base. Speculating (an EAGLE-3 draft, suffix decoding), a mixed batch
gives what it gives without drafts. Prefilled on one engine and decoded on another, and
loaded or unloaded at run time, adapters give the same tokens. Unknown adapters, what
cannot be served and what adapters do not run with yet are refused, naming the field."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from peft import PeftModel
from torch._dynamo.utils import counters
from transformers import LlamaForCausalLM

from engine.llm_engine import EngineConfig, LLMEngine, RequestError
from engine.lora.adapter import LoraError
from engine.lora.layers import LoraLinear
from engine.lora.ops import CpuSgmv
from engine.lora.registry import LoraMemoryFull, LoraMismatch
from engine.output_processor import OutputProcessor
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from tests.comparator import compare_greedy
from tests.engine.test_lora_adapter import save_adapter
from tests.engine.tiny_drafts import build_random_draft
from tests.engine.tiny_models import build_tiny_llama

VOCAB = 61


@pytest.fixture(scope="module")
def base_and_adapters(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("lora")
    build_tiny_llama(out / "base", "gqa4_llama3rope_hd72_mlpbias", num_layers=2, vocab_size=VOCAB)
    load = lambda: LlamaForCausalLM.from_pretrained(out / "base", dtype=torch.float32).eval()  # noqa: E731
    save_adapter(out / "a", load(), std=0.5, r=8, lora_alpha=16,
                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])  # fmt: skip
    save_adapter(out / "b", load(), std=0.5, r=4, lora_alpha=8, use_rslora=True,
                 target_modules=["gate_proj", "up_proj", "down_proj", "v_proj"])  # fmt: skip
    save_adapter(out / "c", load(), std=0.5, r=2, lora_alpha=4, rank_pattern={"o_proj": 6},
                 target_modules=["o_proj", "up_proj", "down_proj"])  # fmt: skip
    merged = {
        name: PeftModel.from_pretrained(load(), out / name).merge_and_unload().eval()
        for name in ("a", "b", "c")
    }
    return out, load(), merged


def run(engine: LLMEngine, requests: list[tuple[list[int], str | None]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for i, (prompt, lora) in enumerate(requests):
        engine.add_request(str(i), prompt, params, lora=lora)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [done[str(i)] for i in range(len(requests))]


@pytest.mark.parametrize("kernel", [True, False], ids=["cpu-sgmv", "aten"])
def test_a_mixed_batch_equals_each_adapter_merged(base_and_adapters, monkeypatch, kernel) -> None:
    """Through the CPU SGMV kernel, and through the aten paths that run where it is not
    built (dense for few tokens, per group for more)."""
    if not kernel:
        monkeypatch.setattr(CpuSgmv, "applies", staticmethod(lambda x: False))
    elif not CpuSgmv.applies(torch.zeros(1)):
        pytest.skip("the CPU kernels are not built here")
    out, base, merged = base_and_adapters
    adapters = tuple((name, str(out / name)) for name in ("a", "b", "c"))
    engine = LLMEngine(
        EngineConfig(model=str(out / "base"), dtype="float32", block_size=4,
                     kv_cache_memory=4 << 20, lora_modules=adapters,
                     max_num_batched_tokens=7)  # prompt chunks beside decode rows
    )  # fmt: skip
    assert sum(isinstance(m, LoraLinear) for m in engine.runner.model.modules()) == 2 * 4
    rng = random.Random(0)
    shared = [rng.randrange(3, VOCAB) for _ in range(9)]  # a prefix every request starts with
    prompts = [shared + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (2, 5, 1, 7, 3)]
    loras = ["a", None, "b", "a", "c"]

    def greedy(model: LlamaForCausalLM, prompt: list[int]) -> list[int]:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                             eos_token_id=None, pad_token_id=0)  # fmt: skip
        return out[0, len(prompt) :].tolist()

    for name in ("a", "b", "c"):  # each adapter changes the output: applied or not shows
        assert any(greedy(merged[name], p) != greedy(base, p) for p in prompts), name
    for _ in range(2):  # the second round: every prefix is cached, per adapter
        ours = run(engine, list(zip(prompts, loras, strict=True)))
        for prompt, lora, got in zip(prompts, loras, ours, strict=True):
            reference = base if lora is None else merged[lora]
            compare_greedy(reference, [prompt], [got], [greedy(reference, prompt)])
    assert engine.block_manager.num_prefix_hit_blocks > 0
    # Prefills of more than DENSE_MAX_TOKENS tokens: several of the kernel's chunks of one
    # group, or aten's per-group products.
    whole = LLMEngine(EngineConfig(model=str(out / "base"), dtype="float32", block_size=4,
                                   kv_cache_memory=4 << 20, lora_modules=adapters))  # fmt: skip
    long_prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (70, 66)]
    ours = run(whole, list(zip(long_prompts, ["c", "a"], strict=True)))
    for prompt, lora, got in zip(long_prompts, ["c", "a"], ours, strict=True):
        compare_greedy(merged[lora], [prompt], [got], [greedy(merged[lora], prompt)])
    with pytest.raises(RequestError, match=r"lora: 'd' is not an adapter of this engine"):
        engine.add_request("x", prompts[0], SamplingParams(max_tokens=2), lora="d")


def test_prefill_here_decode_there_under_adapters(base_and_adapters) -> None:
    """A prefill-only engine runs each request under its adapter, its KV is copied into
    blocks a second engine reserved under the same adapter, and the second decodes on:
    the tokens are one engine's. The decode engine's prefix cache keeps each adapter's
    KV apart: the same prompt reserved again finds its blocks under its own adapter only."""
    out, _, _ = base_and_adapters
    adapters = (("a", str(out / "a")), ("b", str(out / "b")))
    config = dict(model=str(out / "base"), dtype="float32", block_size=4,
                  kv_cache_memory=4 << 20, lora_modules=adapters)  # fmt: skip
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (9, 6, 11)]
    loras = ["a", None, "b"]
    expected = run(LLMEngine(EngineConfig(**config)), list(zip(prompts, loras, strict=True)))  # type: ignore[arg-type]
    prefill, decode = LLMEngine(EngineConfig(**config)), LLMEngine(EngineConfig(**config))  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        prefill.add_request(str(i), prompt, params, is_prefill_only=True, lora=lora)
    while prefill.has_unfinished_requests():
        prefill.step()
    firsts = []
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        done = prefill.take_prefilled(str(i))
        assert done is not None
        table, num_cached = decode.reserve(str(i), prompt, params, lora=lora)
        assert num_cached == 0
        for name, pool in prefill.kv_pools.items():  # what a KV transport does
            dst = decode.kv_pools[name]
            for (k_src, v_src), (k_dst, v_dst) in zip(pool.layers, dst.layers, strict=True):
                k_dst[table], v_dst[table] = k_src[done.block_table], v_src[done.block_table]
        prefill.drop_request(str(i))
        firsts.append(decode.start_decoding(str(i), done.first_token, done.draft_token_ids))
    outputs = OutputProcessor(decode.tokenizer)
    outputs.process(firsts)
    got: dict[str, list[int]] = {}
    while decode.has_unfinished_requests():
        got.update({o.request_id: o.token_ids for o in outputs.process(decode.step_deltas())
                    if o.finished})  # fmt: skip
    assert [got[str(i)] for i in range(len(prompts))] == expected
    # prompts[0]'s first two blocks are cached under "a": not for "b" or the base
    cached = {lora: decode.reserve(f"again-{lora}", prompts[0], params, lora=lora)[1]
              for lora in ("a", "b", None)}  # fmt: skip
    assert cached == {"a": 8, "b": 0, None: 0}


def test_what_adapters_do_not_run_with_yet_is_refused(base_and_adapters) -> None:
    out, _, _ = base_and_adapters
    with pytest.raises(ValueError, match="lora_modules: adapters do not run with CUDA graphs"):
        EngineConfig(model=str(out / "base"), cuda_graphs=True,
                     speculative=SpeculativeConfig(str(out / "draft"), num_draft_tokens=2),
                     lora_modules=(("a", str(out / "a")),))  # fmt: skip
    with pytest.raises(ValueError, match="lora_modules: names repeat"):
        EngineConfig(model=str(out / "base"),
                     lora_modules=(("a", str(out / "a")), ("a", str(out / "b"))))  # fmt: skip


@pytest.mark.parametrize("kind", ["eagle3", "suffix"])
def test_a_mixed_batch_speculating_equals_it_without_drafts(
    base_and_adapters, tmp_path, kind: str
) -> None:
    """Drafts stay the base model's (an EAGLE-3 draft, or suffix decoding's); each row
    verifies them under its own adapter, so the output is what the mixed batch gives
    without drafts."""
    out, _, _ = base_and_adapters
    adapters = (("a", str(out / "a")), ("b", str(out / "b")))
    config = dict(model=str(out / "base"), dtype="float32", block_size=4,
                  kv_cache_memory=4 << 20, lora_modules=adapters)  # fmt: skip
    if kind == "suffix":
        spec = SpeculativeConfig("", num_draft_tokens=3, kind="suffix")
    else:
        draft = build_random_draft(out / "base", tmp_path / "eagle3", "eagle3", std=0.3)
        spec = SpeculativeConfig(str(draft), num_draft_tokens=3)
    rng = random.Random(1)
    motif = [rng.randrange(3, VOCAB) for _ in range(4)]  # repeats: suffix drafts find it
    prompts = [motif * 3 + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (2, 5, 1, 7)]
    requests = list(zip(prompts, ["a", None, "b", "a"], strict=True))
    plain = run(LLMEngine(EngineConfig(**config)), requests)  # type: ignore[arg-type]
    engine = LLMEngine(EngineConfig(**config, speculative=spec))  # type: ignore[arg-type]
    assert run(engine, requests) == plain
    assert engine.spec is not None and engine.spec.stats.num_draft_tokens > 0


def test_one_adapter_a_step_gives_what_a_mixed_batch_gives(base_and_adapters) -> None:
    """``max_loras=1``: requests under the other adapter sit steps out; each request's
    tokens are what the unbounded mixed batch gives, and no step ran two adapters."""
    out, _, _ = base_and_adapters
    adapters = (("a", str(out / "a")), ("b", str(out / "b")))
    config = dict(model=str(out / "base"), dtype="float32", block_size=4,
                  kv_cache_memory=4 << 20, lora_modules=adapters)  # fmt: skip
    rng = random.Random(2)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (4, 6, 3, 5, 2)]
    requests = list(zip(prompts, ["a", "b", None, "b", "a"], strict=True))
    mixed = run(LLMEngine(EngineConfig(**config, max_loras=None)), requests)  # type: ignore[arg-type]
    engine = LLMEngine(EngineConfig(**config, max_loras=1))  # type: ignore[arg-type]
    lora_step = engine.runner.model.lora_step
    seen: list[set[int]] = []
    forward = engine.runner.executor.forward

    def recorded(*args: object, **kwargs: object) -> object:
        seen.append({i for i in lora_step.lora_ids if i >= 0})
        return forward(*args, **kwargs)  # type: ignore[arg-type]

    engine.runner.executor.forward = recorded  # type: ignore[method-assign]
    assert run(engine, requests) == mixed
    assert max(len(ids) for ids in seen) == 1 and {0, 1} <= set().union(*seen)


def test_adapters_loaded_and_unloaded_at_run_time(base_and_adapters, tmp_path) -> None:
    """``enable_lora`` without adapters: one loaded at run time gives what it gives loaded
    at start; one in use is not unloaded; what cannot be served is refused, naming the
    field, and the engine serves on."""
    out, _, _ = base_and_adapters
    config = dict(model=str(out / "base"), dtype="float32", block_size=4,
                  kv_cache_memory=4 << 20)  # fmt: skip
    rng = random.Random(4)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (6, 9)]
    static = LLMEngine(EngineConfig(**config, lora_modules=(("a", str(out / "a")),  # type: ignore[arg-type]
                                                             ("b", str(out / "b")))))  # fmt: skip
    expected = run(static, [(prompts[0], "a"), (prompts[1], "b"), (prompts[0], None)])
    engine = LLMEngine(EngineConfig(**config, enable_lora=True, max_lora_rank=8))  # type: ignore[arg-type]
    assert engine.lora_names == {}
    engine.load_lora("b", str(out / "b"))
    engine.load_lora("a", str(out / "a"))
    assert engine.lora_names["a"][1] == static.lora_names["a"][1]  # the same files' digest
    assert run(engine, [(prompts[0], "a"), (prompts[1], "b"), (prompts[0], None)]) == expected
    with pytest.raises(LoraError, match="lora_name: 'a' is already loaded"):
        engine.load_lora("a", str(out / "b"))
    engine.add_request("busy", prompts[0], SamplingParams(max_tokens=3), lora="a")
    with pytest.raises(LoraError, match="'a' has 1 requests in flight"):
        engine.unload_lora("a")
    while engine.has_unfinished_requests():
        engine.step()
    engine.unload_lora("a")
    with pytest.raises(RequestError, match="lora: 'a' is not an adapter of this engine"):
        engine.add_request("x", prompts[0], SamplingParams(max_tokens=2), lora="a")
    with pytest.raises(LoraError, match="lora_name: 'a' is not loaded"):
        engine.unload_lora("a")
    engine.load_lora("a2", str(out / "a"))  # a's slot again; the same tokens
    assert engine.lora_names["a2"][0] == 1  # b kept slot 0 (loaded first)
    assert run(engine, [(prompts[0], "a2"), (prompts[1], "b")]) == expected[:2]
    for _ in range(3):  # unloads free their slots: the stacked weights stay two wide
        engine.unload_lora("a2")
        engine.load_lora("a2", str(out / "a"))
    assert sorted(slot for slot, _ in engine.lora_names.values()) == [0, 1]
    # A worker's request names the digest its router saw: another is refused
    digest = engine.lora_names["b"][1]
    with pytest.raises(LoraMismatch, match="not the one the router routed to"):
        engine.add_request("old", prompts[0], SamplingParams(max_tokens=2), lora="b",
                           lora_digest=digest + 1)  # fmt: skip
    with pytest.raises(LoraMismatch, match="this worker has no adapter 'gone'"):
        engine.add_request("gone", prompts[0], SamplingParams(max_tokens=2), lora="gone",
                           lora_digest=digest)  # fmt: skip
    # What cannot be served: refused, naming the field; the engine runs on.
    corrupt = tmp_path / "corrupt"
    shutil.copytree(out / "a", corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    wide = tmp_path / "wide"  # rank 16 over the bound of 8
    other = tmp_path / "other"  # made for a base of another width
    load = lambda path: LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)  # noqa: E731
    save_adapter(wide, load(out / "base"), r=16, target_modules=["q_proj"])
    build_tiny_llama(tmp_path / "base2", "mha_plain", num_layers=2, vocab_size=VOCAB)
    save_adapter(other, load(tmp_path / "base2"), r=4, target_modules=["q_proj"])
    for path, error in (
        (corrupt, "adapter_model.safetensors: unreadable"),
        (wide, "r: 16 exceeds the largest rank served, 8"),
        (other, "an adapter for another base model"),
        (tmp_path / "nothing", "holds no adapter_config.json"),
    ):
        with pytest.raises(LoraError, match=error):
            engine.load_lora("bad", str(path))
        assert "bad" not in engine.lora_names
    assert run(engine, [(prompts[0], "a2"), (prompts[1], "b")]) == expected[:2]
    plain = LLMEngine(EngineConfig(**config))  # type: ignore[arg-type]
    with pytest.raises(LoraError, match="this engine runs no LoRA adapters"):
        plain.load_lora("a", str(out / "a"))


def test_adapters_beyond_max_cpu_loras_are_read_again_when_named(base_and_adapters) -> None:
    """``max_cpu_loras=1``: one adapter's weights in memory at a time. One after another,
    each request's adapter is read again in place of the last (no request runs under
    it): the tokens are those of every adapter in memory. While a request runs under the
    one in memory, another adapter cannot come in (LoraMemoryFull), and the same one can."""
    out, _, _ = base_and_adapters
    adapters = tuple((name, str(out / name)) for name in ("a", "b", "c"))
    config = dict(model=str(out / "base"), dtype="float32", block_size=4,
                  kv_cache_memory=4 << 20, lora_modules=adapters)  # fmt: skip
    rng = random.Random(5)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (6, 9, 4, 7)]
    loras = ["b", "a", "c", "b"]
    every = LLMEngine(EngineConfig(**config))  # type: ignore[arg-type]
    expected = [run(every, [(p, lora)])[0] for p, lora in zip(prompts, loras, strict=True)]
    engine = LLMEngine(EngineConfig(**config, max_cpu_loras=1))  # type: ignore[arg-type]
    loras_registry = engine.loras
    assert loras_registry is not None and loras_registry.num_reads == 3  # checked at start
    assert dict(loras_registry.resident) == {"a": 0}  # the first given
    got = [run(engine, [(p, lora)])[0] for p, lora in zip(prompts, loras, strict=True)]
    assert got == expected
    assert loras_registry.num_reads == 3 + 4  # b, a, c, b: each read again
    assert dict(loras_registry.resident) == {"b": 0}  # in the one slot
    engine.add_request("busy", prompts[0], SamplingParams(max_tokens=3), lora="b")
    with pytest.raises(LoraMemoryFull, match=r"adapter 'c' is not in memory.*retry later"):
        engine.add_request("full", prompts[0], SamplingParams(max_tokens=3), lora="c")
    engine.add_request("same", prompts[1], SamplingParams(max_tokens=3), lora="b")
    while engine.has_unfinished_requests():
        engine.step()
    assert run(engine, [(prompts[2], "c")])[0] == expected[2]


def test_compiled_steps_under_adapters_equal_each_adapter_merged(base_and_adapters) -> None:
    """``torch_compile``: decode steps run the compiled graph, each projection's deltas one
    opaque op in it (``tandem::lora_deltas``), so that a step's groups, and an adapter
    loaded after compiling, give each request its adapter's tokens."""
    out, base, merged = base_and_adapters
    engine = LLMEngine(
        EngineConfig(model=str(out / "base"), dtype="float32", block_size=4,
                     kv_cache_memory=4 << 20, torch_compile=True, enable_lora=True,
                     lora_modules=(("a", str(out / "a")), ("b", str(out / "b"))))
    )  # fmt: skip
    linears = [m for m in engine.runner.model.modules() if isinstance(m, LoraLinear)]
    assert len(linears) == 2 * 4  # every projection, adapters or not
    engine.load_lora("c", str(out / "c"))  # after compiling: no module changes
    rng = random.Random(6)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 8, 3, 6)]
    loras = ["c", None, "a", "b"]
    calls = counters["stats"]["calls_captured"]
    ours = run(engine, list(zip(prompts, loras, strict=True)))
    assert counters["stats"]["calls_captured"] == calls  # no graph compiled again
    for prompt, lora, got in zip(prompts, loras, ours, strict=True):
        reference = base if lora is None else merged[lora]
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(prompt):]  # fmt: skip
        compare_greedy(reference, [prompt], [got], [want.tolist()])
