"""Block-FP8 checkpoints (DeepSeek-V3's format) on a Llama-3: a random model whose
projections are quantized to float8_e4m3fn in 128x128 blocks with their float32
``weight_scale_inv``, beside the same model with those weights dequantized (the
reference: transformers runs it). Greedy output in fp32 equals transformers' on the
dequantized weights, with the FP8 weights kept in memory (half of bf16's bytes) and
dequantized once at load time; TP 2 splits them where their blocks allow. What cannot
load is refused, naming the tensor or the field."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from engine.config import ConfigError
from engine.fp8 import FP8, BlockFp8, Fp8Linear, quantize_blocks
from engine.llm_engine import EngineConfig, LLMEngine
from engine.models.layers import Linear
from engine.parallel.shard import TensorParallelError
from engine.sampling_params import SamplingParams
from engine.weights import WeightError
from tests.comparator import compare_greedy

BLOCK = BlockFp8(128, 128)
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
VOCAB = 67


def spread(weight: torch.Tensor, block: BlockFp8, generator: torch.Generator) -> torch.Tensor:
    """``weight`` with each block scaled by its own factor, from 0.1 to 10: scales a
    hundred times apart, so that a scale applied to the wrong rows or columns shows."""
    rows, cols = weight.shape
    nb, kb = -(-rows // block.block_n), -(-cols // block.block_k)
    factors = 10 ** (torch.rand(nb, kb, generator=generator) * 2 - 1)
    grid = factors.repeat_interleave(block.block_n, 0).repeat_interleave(block.block_k, 1)
    return weight * grid[:rows, :cols]


def write_fp8(
    plain: Path, out: Path, block: BlockFp8, quantized: tuple[str, ...], *, seed: int
) -> None:
    """From ``plain``'s checkpoint, ``out/fp8`` (the ``quantized`` projections in block
    FP8, each block spread, with its ``weight_scale_inv`` and quantization_config) and
    ``out/dequantized`` (those weights dequantized, in fp32: the reference)."""
    tensors = load_file(plain / "model.safetensors")
    fp8, dequantized = dict(tensors), dict(tensors)
    generator = torch.Generator().manual_seed(seed)
    for name, weight in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in quantized:
            q, scale_inv = quantize_blocks(spread(weight, block, generator), block)
            fp8[name], fp8[name + "_scale_inv"] = q, scale_inv
            expanded = scale_inv.repeat_interleave(block.block_n, 0)
            expanded = expanded.repeat_interleave(block.block_k, 1)
            dequantized[name] = q.float() * expanded[: weight.shape[0], : weight.shape[1]]
    for name, chosen in (("fp8", fp8), ("dequantized", dequantized)):
        (out / name).mkdir()
        save_file(chosen, out / name / "model.safetensors")
        hf = json.loads((plain / "config.json").read_text())
        if name == "fp8":
            size = [block.block_n, block.block_k]
            hf["quantization_config"] = {**FP8_CONFIG, "weight_block_size": size}
        (out / name / "config.json").write_text(json.dumps(hf))


def build_fp8(out: Path, intermediate_size: int) -> tuple[Path, Path, LlamaForCausalLM]:
    """(the FP8 checkpoint, its weights dequantized, transformers on the latter): hidden
    256, 4 heads of 64, 2 KV heads, 2 layers."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        mlp_bias=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08)
    plain = out / "plain"
    model.save_pretrained(plain)
    write_fp8(plain, out, BLOCK, QUANTIZED, seed=1)
    reference = LlamaForCausalLM.from_pretrained(out / "dequantized", dtype=torch.float32).eval()
    return out / "fp8", out / "dequantized", reference


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, LlamaForCausalLM]:
    """MLP 320 wide: two whole blocks and a part block."""
    return build_fp8(tmp_path_factory.mktemp("fp8"), 320)


def greedy(model_dir: Path, prompts: list[list[int]], **config: object) -> tuple[list, LLMEngine]:
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir), dtype="float32", block_size=4, kv_cache_memory=8 << 20, **config
        )
    )
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [done[str(i)] for i in range(len(prompts))], engine


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (4, 11, 19)]


def references(reference: LlamaForCausalLM, prompts: list[list[int]]) -> list[list[int]]:
    return [
        reference.generate(
            torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(p) :].tolist()
        for p in prompts
    ]


@pytest.mark.parametrize("fp8_weights", ["keep", "dequantize"])
def test_fp8_checkpoint_greedy_equals_transformers_on_its_dequantized_weights(
    checkpoints, prompts, fp8_weights: str
) -> None:
    fp8_dir, _, reference = checkpoints
    ours, engine = greedy(fp8_dir, prompts, fp8_weights=fp8_weights)
    compare_greedy(reference, prompts, ours, references(reference, prompts))
    layer = engine.runner.model.layers[0]
    projections = [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
    projections += [layer.mlp.gate_up_proj, layer.mlp.down_proj]
    if fp8_weights == "keep":  # FP8 in memory: one byte a weight, and its block scales
        assert all(isinstance(p, Fp8Linear) and p.weight.dtype == FP8 for p in projections)
        # Each part of a fused projection with its own scales: the reference's weights.
        dequantized = load_file(checkpoints[1] / "model.safetensors")
        attn = "model.layers.0.self_attn"
        want = torch.cat([dequantized[f"{attn}.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(layer.self_attn.qkv_proj.dequantized(torch.float32), want)
        mlp = "model.layers.0.mlp"
        want = torch.cat([dequantized[f"{mlp}.{p}_proj.weight"] for p in ("gate", "up")])
        assert torch.equal(layer.mlp.gate_up_proj.dequantized(torch.float32), want)
        want = dequantized[f"{mlp}.down_proj.weight"]
        assert torch.equal(layer.mlp.down_proj.dequantized(torch.float32), want)
        qkv = layer.self_attn.qkv_proj
        assert qkv.weight.shape == (256 + 2 * 128, 256) and qkv.scale.shape == (512, 2)
        down = layer.mlp.down_proj
        assert down.scale.shape == (256, 3)  # 320 columns: two blocks and a part block
        assert layer.mlp.gate_up_proj.bias is not None  # biases stay as they are
    else:
        assert all(type(p) is Linear and p.weight.dtype == torch.float32 for p in projections)
    assert isinstance(engine.runner.model.lm_head, Linear)  # the LM head is not quantized


def test_fp8_weights_take_half_of_bf16s_memory(checkpoints) -> None:
    """Kept FP8, the projections' bytes (scales included) against the same in bf16."""
    fp8_dir, dequantized_dir, _ = checkpoints
    _, kept = greedy(fp8_dir, [], fp8_weights="keep", cpu_gemm="aten")
    fp8_bytes = sum(
        m.weight.numel() * m.weight.element_size() + m.scale.numel() * m.scale.element_size()
        for m in kept.runner.model.modules()
        if isinstance(m, Fp8Linear)
    )
    bf16_bytes = sum(
        t.numel() * 2
        for name, t in load_file(dequantized_dir / "model.safetensors").items()
        if name.split(".")[-2] in QUANTIZED and name.endswith(".weight")
    )
    assert 0.5 < fp8_bytes / bf16_bytes < 0.52  # 1 byte a weight, 4 more a 128 weights


def test_tp_2_splits_fp8_weights_with_their_scales(checkpoints, prompts, tmp_path) -> None:
    """Column-parallel rows carry their scales; row-parallel columns split on block edges:
    an MLP 512 wide splits at 256, one 320 wide would split at 160, which is refused."""
    fp8_dir, _, _ = checkpoints
    with pytest.raises(TensorParallelError, match="splits intermediate_size 320 into runs of 160"):
        greedy(fp8_dir, prompts, fp8_weights="keep", tensor_parallel_size=2)  # before any rank
    aligned_dir, dequantized_dir, reference = build_fp8(tmp_path, 512)
    ours, engine = greedy(aligned_dir, prompts, fp8_weights="keep", tensor_parallel_size=2)
    try:  # rank 0's parts, with their own scales: the reference's rows and columns
        dequantized = load_file(dequantized_dir / "model.safetensors")
        layer, name = engine.runner.model.layers[1], "model.layers.1"
        down = layer.mlp.down_proj
        assert isinstance(down, Fp8Linear) and down.scale.shape == (256, 2)
        want = dequantized[f"{name}.mlp.down_proj.weight"][:, :256]
        assert torch.equal(down.dequantized(torch.float32), want)
        attn = f"{name}.self_attn"
        want = torch.cat(
            [
                dequantized[f"{attn}.q_proj.weight"][:128],  # heads 0 and 1 of 4
                dequantized[f"{attn}.k_proj.weight"][:64],  # KV head 0 of 2
                dequantized[f"{attn}.v_proj.weight"][:64],
            ]
        )
        assert torch.equal(layer.self_attn.qkv_proj.dequantized(torch.float32), want)
        want = dequantized[f"{attn}.o_proj.weight"][:, :128]
        assert torch.equal(layer.self_attn.o_proj.dequantized(torch.float32), want)
    finally:
        engine.close()
    compare_greedy(reference, prompts, ours, references(reference, prompts))


def write_variant(src: Path, dst: Path, edit) -> Path:
    """A copy of the FP8 checkpoint with ``edit(tensors, config)`` applied."""
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    edit(tensors, config)
    save_file(tensors, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_what_cannot_load_is_refused_naming_the_tensor_or_field(checkpoints, tmp_path) -> None:
    fp8_dir, _, _ = checkpoints
    q = "model.layers.1.self_attn.k_proj.weight"

    def no_scale(tensors, config):
        del tensors[q + "_scale_inv"]

    def bad_scale(tensors, config):
        tensors[q + "_scale_inv"] = torch.ones(2, 2)

    cases = [
        (no_scale, WeightError, f"{q}: float8_e4m3fn without its {q}_scale_inv"),
        (bad_scale, WeightError, f"{q}_scale_inv: shape [2, 2], but [128, 256] in blocks"),
    ]
    for i, (edit, error, message) in enumerate(cases):
        broken = write_variant(fp8_dir, tmp_path / f"w{i}", edit)
        with pytest.raises(error, match=message.replace("[", "\\[").replace("]", "\\]")):
            greedy(broken, [])

    def no_config(tensors, config):
        del config["quantization_config"]

    broken = write_variant(fp8_dir, tmp_path / "no_config", no_config)
    with pytest.raises(WeightError, match=r"float8_e4m3fn, but .* is no block-FP8 projection"):
        greedy(broken, [])
    fields = [
        ({"quant_method": "gptq"}, "quantization_config.quant_method: 'gptq' is not supported"),
        ({**FP8_CONFIG, "weight_block_size": None}, "per-tensor FP8 is not supported"),
        ({**FP8_CONFIG, "weight_block_size": [128, 100]}, "weight_block_size: [128, 100]"),
        ({**FP8_CONFIG, "fmt": "e5m2"}, "quantization_config.fmt: 'e5m2' is not supported"),
        ({**FP8_CONFIG, "activation_scheme": "static"}, "activation_scheme: 'static'"),
    ]
    for i, (quantization, message) in enumerate(fields):

        def set_config(tensors, config, quantization=quantization):
            config["quantization_config"] = quantization

        broken = write_variant(fp8_dir, tmp_path / f"c{i}", set_config)
        with pytest.raises(ConfigError, match=message.replace("[", "\\[").replace("]", "\\]")):
            greedy(broken, [])


DEEPSEEK_QUANTIZED = (
    "q_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


def test_deepseek_v3_in_block_fp8_equals_transformers_on_its_dequantized_weights(
    tmp_path: Path,
) -> None:
    """Its released format: every projection FP8 (the experts', the shared expert's, the
    latent attention's), the router, norms, embedding and LM head not; blocks of 16x32
    here, so that the tiny shapes hold several. ``kv_b_proj``, which latent attention
    absorbs, is dequantized at load time; the rest stay FP8."""
    from transformers import DeepseekV3ForCausalLM

    from tests.engine.tiny_deepseek import build_tiny_deepseek

    block = BlockFp8(16, 32)
    plain = tmp_path / "plain"
    build_tiny_deepseek(plain, "qlora_yarn_mscale_interleaved", vocab_size=VOCAB, num_layers=3)
    write_fp8(plain, tmp_path, block, DEEPSEEK_QUANTIZED, seed=2)
    reference = DeepseekV3ForCausalLM.from_pretrained(
        tmp_path / "dequantized", dtype=torch.float32
    ).eval()
    prompts = [[5, 9, 4], list(range(3, 30)), [7] * 11]
    ours, engine = greedy(tmp_path / "fp8", prompts, fp8_weights="keep")
    compare_greedy(reference, prompts, ours, references(reference, prompts))
    moe = engine.runner.model.layers[1].mlp
    assert isinstance(moe.experts[0].gate_up_proj, Fp8Linear)
    assert isinstance(moe.shared_experts.down_proj, Fp8Linear)
    attn = engine.runner.model.layers[0].self_attn
    assert isinstance(attn.q_b_proj, Fp8Linear)
    assert type(attn.kv_b_proj) is torch.nn.Linear
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    assert torch.equal(
        attn.kv_b_proj.weight, load_file(tmp_path / "dequantized" / "model.safetensors")[name]
    )
    expert = "model.layers.1.mlp.experts.3"
    deq = load_file(tmp_path / "dequantized" / "model.safetensors")
    want = torch.cat([deq[f"{expert}.gate_proj.weight"], deq[f"{expert}.up_proj.weight"]])
    assert torch.equal(moe.experts[3].gate_up_proj.dequantized(torch.float32), want)
    assert not isinstance(engine.runner.model.lm_head, Fp8Linear)
