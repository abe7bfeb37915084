"""Architectures Tandem serves, declared once each: HF name -> config, model, weight adapter."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.config import ConfigError, Llama3Config, read_hf_config
from engine.deepseek_v3_config import DeepseekV3Config
from engine.deepseek_v3_weights import deepseek_v3_weight_rules
from engine.fp8 import fill_fp8, quantized_rules, swap_fp8
from engine.gguf_weights import ROPE_FREQS, GgufCheckpoint, fill_gguf, gguf_file, swap_gguf
from engine.gguf_weights import quantized_rules as gguf_rules
from engine.models.layers import Linear
from engine.parallel.group import TensorParallelGroup
from engine.parallel.shard import Shard, TensorParallelError, check_divisible, data_parallel_shards
from engine.weights import (
    CheckpointReader,
    Source,
    TensorRule,
    WeightError,
    load_weights,
    one_rule,
    run_part,
)

logger = logging.getLogger(__name__)

# What ``load_model`` returns beside the model: the config of one of the architectures.
ModelConfig = Llama3Config | DeepseekV3Config


@dataclass(frozen=True)
class Architecture:
    name: str  # the HF ``architectures`` entry
    config_from_hf: Callable[..., Any]  # (hf dict, dtype=, max_length=) -> its config
    # (its config, this rank's group) -> a model on the current device
    model_class: Callable[[Any, TensorParallelGroup], nn.Module]
    # (its config, this rank's shard) -> the weight adapter, reading the rank's parts
    weight_rules: Callable[[Any, Shard], list[TensorRule]]


def decoder_layer_rules(
    config: Llama3Config,
    hf: str,
    ours: str,
    *,
    in_features: int | None = None,
    norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm"),
    shard: Shard | None = None,
) -> list[TensorRule]:
    """One HF Llama decoder layer (prefix ``hf``) -> Tandem's fused layer (prefix ``ours``).

    ``in_features``: attention input width when it is not ``hidden_size`` (EAGLE-3);
    ``norms``: the layer's RMSNorm weights (EAGLE-1 drafts have no input_layernorm);
    ``shard``: a tensor-parallel rank's parts (q/k/v, gate/up rows; o, down columns; the
    row-parallel biases on rank 0), else all of each tensor.
    """
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    inp = in_features or h
    attn, mlp = f"{hf}.self_attn", f"{hf}.mlp"
    qs = ks = cs = None  # rows of q, of k and v, of the intermediate channels
    qc = dc = None  # columns of o, of down
    is_first = shard is None or shard.rank == 0
    if shard is not None and shard.size > 1:
        d = config.head_dim
        heads = shard.even(config.num_attention_heads, "num_attention_heads")
        qs, ks = run_part(0, heads, d), run_part(0, shard.kv_heads(config.num_key_value_heads), d)
        channels = shard.even(inter, "intermediate_size")
        cs, qc, dc = run_part(0, channels), run_part(1, heads, d), run_part(1, channels)
    rules = [
        TensorRule(
            f"{ours}.self_attn.qkv_proj.weight",
            (
                Source(f"{attn}.q_proj.weight", (q, inp), qs),
                Source(f"{attn}.k_proj.weight", (kv, inp), ks),
                Source(f"{attn}.v_proj.weight", (kv, inp), ks),
            ),
        ),
        one_rule(f"{ours}.self_attn.o_proj.weight", f"{attn}.o_proj.weight", (h, q), qc),
        TensorRule(
            f"{ours}.mlp.gate_up_proj.weight",
            (
                Source(f"{mlp}.gate_proj.weight", (inter, h), cs),
                Source(f"{mlp}.up_proj.weight", (inter, h), cs),
            ),
        ),
        one_rule(f"{ours}.mlp.down_proj.weight", f"{mlp}.down_proj.weight", (h, inter), dc),
    ]
    if config.attention_bias:
        rules.append(
            TensorRule(
                f"{ours}.self_attn.qkv_proj.bias",
                (
                    Source(f"{attn}.q_proj.bias", (q,), qs),
                    Source(f"{attn}.k_proj.bias", (kv,), ks),
                    Source(f"{attn}.v_proj.bias", (kv,), ks),
                ),
            )
        )
        if is_first:
            rules.append(one_rule(f"{ours}.self_attn.o_proj.bias", f"{attn}.o_proj.bias", (h,)))
    if config.mlp_bias:
        rules.append(
            TensorRule(
                f"{ours}.mlp.gate_up_proj.bias",
                (
                    Source(f"{mlp}.gate_proj.bias", (inter,), cs),
                    Source(f"{mlp}.up_proj.bias", (inter,), cs),
                ),
            )
        )
        if is_first:
            rules.append(one_rule(f"{ours}.mlp.down_proj.bias", f"{mlp}.down_proj.bias", (h,)))
    rules.extend(one_rule(f"{ours}.{norm}.weight", f"{hf}.{norm}.weight", (h,)) for norm in norms)
    return rules


def llama_weight_rules(config: Llama3Config, shard: Shard | None = None) -> list[TensorRule]:
    """HF Llama tensors -> Tandem's fused qkv and gate_up parameters (a tensor-parallel
    rank's parts of them with ``shard``; the embedding and LM head by vocabulary)."""
    h, v = config.hidden_size, config.vocab_size
    vocab = None
    if shard is not None and shard.size > 1:
        vocab = run_part(0, shard.vocab(v))
    rules = [one_rule("embed_tokens.weight", "model.embed_tokens.weight", (v, h), vocab)]
    for i in range(config.num_hidden_layers):
        rules.extend(decoder_layer_rules(config, f"model.layers.{i}", f"layers.{i}", shard=shard))
    rules.append(one_rule("norm.weight", "model.norm.weight", (h,)))
    if not config.tie_word_embeddings:
        rules.append(one_rule("lm_head.weight", "lm_head.weight", (v, h), vocab))
    return rules


def _llama_model(config: Llama3Config, tp: TensorParallelGroup) -> nn.Module:
    from engine.models.llama3 import Llama3Model

    check_divisible(config.num_attention_heads, config.num_key_value_heads, tp.size)
    if tp.size > 1 and not tp.shard.vocab(config.vocab_size):
        raise TensorParallelError(
            f"tensor_parallel_size: {tp.size} leaves a rank no row of vocab_size "
            f"{config.vocab_size}"
        )
    return Llama3Model(config, tp)


def _deepseek_v3_model(config: DeepseekV3Config, tp: TensorParallelGroup) -> nn.Module:
    from engine.models.deepseek_v3 import DeepseekV3Model

    shard = tp.shard  # data-parallel: the vocabulary splits within each data-parallel rank
    if config.data_parallel_size > 1:
        shard = data_parallel_shards(shard, config.data_parallel_size)[0]
    if shard.size > 1 and not shard.vocab(config.vocab_size):
        raise TensorParallelError(
            f"tensor_parallel_size: {shard.size} leaves a rank no row of vocab_size "
            f"{config.vocab_size}"
        )
    return DeepseekV3Model(config, tp)  # what does not divide raises, naming the numbers


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(
        name="LlamaForCausalLM",
        config_from_hf=Llama3Config.from_hf,
        model_class=_llama_model,
        weight_rules=llama_weight_rules,
    ),
    "DeepseekV3ForCausalLM": Architecture(
        name="DeepseekV3ForCausalLM",
        config_from_hf=DeepseekV3Config.from_hf,
        model_class=_deepseek_v3_model,
        weight_rules=deepseek_v3_weight_rules,
    ),
}


def get_architecture(hf_config: dict[str, Any]) -> Architecture:
    names = hf_config.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise ConfigError(f"architectures: {names} is not supported; allowed: {sorted(ARCHITECTURES)}")


def load_model(
    model_dir: str | Path,
    *,
    dtype: str | torch.dtype = "bfloat16",
    max_length: int | None = None,
    device: str | torch.device = "cpu",
    tp: TensorParallelGroup | None = None,
    expert_parallel: bool = False,
    data_parallel_size: int = 1,
) -> tuple[nn.Module, ModelConfig]:
    """Reads config.json, builds the declared model and fills it from safetensors; with
    ``tp``, this rank's part of it, read from the files alone (``expert_parallel``: a
    mixture of experts' routed experts split whole, not by channels; ``data_parallel_size``
    over 1: data-parallel attention, the experts split over every rank, the rest within
    each data-parallel rank's ranks)."""
    arch, config = _model_config(model_dir, dtype, max_length, expert_parallel, data_parallel_size)
    tp = tp or TensorParallelGroup.single()
    with torch.device("meta"):
        model = arch.model_class(config, tp)
    model = model.to(config.dtype)  # on the meta device: nothing is allocated yet
    gguf = gguf_file(model_dir)
    if gguf is not None:
        return _load_gguf(model, config, gguf, arch.weight_rules(config, tp.shard), device)
    reader = CheckpointReader(model_dir)
    try:
        rules = arch.weight_rules(config, tp.shard)
        block = getattr(config, "quantization", None)
        fp8 = quantized_rules(reader, rules) if block is not None else []
        if block is not None:  # FP8 projections stay FP8 (engine.fp8), never bf16 first
            swap_fp8(model, fp8, block)
        model = model.to_empty(device=device)
        model.finalize()  # type: ignore[operator]  # re-tie shared weights and recompute buffers lost on the meta device
        preloaded = fill_fp8(model, reader, fp8, block) if block is not None else set()
        load_weights(model, reader, [r for r in rules if r not in fp8], preloaded)
    finally:
        reader.close()
    return model.eval(), config


def _load_gguf(
    model: nn.Module,
    config: ModelConfig,
    path: Path,
    rules: list[TensorRule],
    device: str | torch.device,
) -> tuple[nn.Module, ModelConfig]:
    """A model directory's GGUF file (engine.gguf_weights): in bf16, Q4_0, Q4_1 and Q8_0
    projections kept quantized; in float32 (the reference) and float16, all dequantized."""
    reader = GgufCheckpoint(path)  # a file it cannot open is refused naming it
    try:
        kept = {}
        if config.dtype == torch.bfloat16:  # float32 (the reference) and float16: dequantized
            kept = gguf_rules(reader, model, rules)
            swap_gguf(model, kept, config.tie_word_embeddings)
        model = model.to_empty(device=device)
        model.finalize()  # type: ignore[operator]
        fill_gguf(model, reader, rules, kept)
        load_weights(model, reader, [r for r in rules if r.dst not in kept])  # type: ignore[arg-type]
        scaling = reader.rope_scaling()  # made config.json's rope_parameters
        if scaling is not None and scaling != getattr(config, "rope_scaling", None):
            raise WeightError(
                f"{ROPE_FREQS}: the file's rope scaling is {scaling}, but config.json's is "
                f"{getattr(config, 'rope_scaling', None)}; prepare the model directory again"
            )
        if unused := reader.unused():
            raise WeightError(
                f"{len(unused)} tensor(s) the model has no place for, e.g. {unused[:3]}: it "
                "would run without them"
            )
        dequantized = sorted(
            {reader.dtype(s.name) for r in rules for s in r.sources if r.dst not in kept}
            - {"F32", "F16", "BF16"}
        )
        if dequantized and kept:
            logger.warning(
                "%s: %s tensors dequantized at load time (only Q4_0, Q4_1 and Q8_0 stay in "
                "their blocks), with bf16's memory",
                path.name,
                ", ".join(dequantized),
            )
    except WeightError as exc:
        raise WeightError(f"{path}: {exc}") from None
    finally:
        reader.close()
    return model.eval(), config


class WholeVocabulary(nn.Module):
    """A split target's embedding and LM head, whole: what a draft on rank 0
    borrows from its target (``embed_tokens``, ``lm_head``, ``config``), so that it looks
    tokens up and scores them without the other ranks."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.finalize()

    def finalize(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight


def load_whole_vocabulary(
    model_dir: str | Path, config: ModelConfig, device: torch.device
) -> WholeVocabulary:
    with torch.device("meta"):
        vocab = WholeVocabulary(config)
    vocab = vocab.to_empty(device=device).to(config.dtype)
    vocab.finalize()
    h, v = config.hidden_size, config.vocab_size
    rules = [one_rule("embed_tokens.weight", "model.embed_tokens.weight", (v, h))]
    if not config.tie_word_embeddings:
        rules.append(one_rule("lm_head.weight", "lm_head.weight", (v, h)))
    gguf = gguf_file(model_dir)
    reader = GgufCheckpoint(gguf) if gguf is not None else CheckpointReader(model_dir)
    try:
        load_weights(vocab, reader, rules)  # type: ignore[arg-type]  # GGUF: dequantized
    finally:
        reader.close()
    return vocab.eval()


def _model_config(
    model_dir: str | Path,
    dtype: str | torch.dtype,
    max_length: int | None,
    expert_parallel: bool,
    data_parallel_size: int = 1,
) -> tuple[Architecture, ModelConfig]:
    hf = read_hf_config(model_dir)
    arch = get_architecture(hf)
    config = arch.config_from_hf(hf, dtype=dtype, max_length=max_length)
    if not isinstance(config, DeepseekV3Config):
        if expert_parallel:
            raise ConfigError(
                f"enable_expert_parallel: {arch.name} has no experts to split; leave it off"
            )
        if data_parallel_size > 1:
            raise ConfigError(
                f"data_parallel_size: {data_parallel_size}; data-parallel attention is built "
                f"for DeepSeek-V3's latent cache, not {arch.name} (use tensor_parallel_size)"
            )
    if isinstance(config, DeepseekV3Config):
        config = dataclasses.replace(
            config, expert_parallel=expert_parallel, data_parallel_size=data_parallel_size
        )
    return arch, config


def check_split(
    model_dir: str | Path,
    size: int,
    *,
    dtype: str = "bfloat16",
    max_length: int | None = None,
    expert_parallel: bool = False,
    data_parallel_size: int = 1,
) -> ModelConfig:
    """Raises TensorParallelError (naming the numbers) where the model in ``model_dir``
    cannot be split over ``size`` ranks: built on the meta device as rank 0's part, before
    any rank starts or reads a weight. Returns the model's config."""
    arch, config = _model_config(model_dir, dtype, max_length, expert_parallel, data_parallel_size)
    with torch.device("meta"):
        arch.model_class(config, TensorParallelGroup(Shard(0, size), None))
    block = getattr(config, "quantization", None)
    if block is not None and size > 1:
        # Row-parallel projections split their columns: FP8 blocks must not straddle ranks.
        for name, columns, ranks in _row_parallel_columns(config, size):
            if ranks > 1 and (columns // ranks) % block.block_k:
                raise TensorParallelError(
                    f"tensor_parallel_size: {ranks} splits {name} {columns} into runs of "
                    f"{columns // ranks} columns, not whole {block.block_k}-column FP8 "
                    "blocks (weight_block_size)"
                )
    return config


def _row_parallel_columns(config: ModelConfig, size: int) -> list[tuple[str, int, int]]:
    """(what, columns, over how many ranks) of each row-parallel projection of a worker of
    ``size`` ranks: what its ranks split by columns."""
    if isinstance(config, Llama3Config):
        return [
            ("num_attention_heads x head_dim", config.q_size, size),
            ("intermediate_size", config.intermediate_size, size),
        ]
    c = config
    # Data-parallel attention: attention and dense MLPs split within a data-parallel rank.
    within = size // c.data_parallel_size
    found = [("num_attention_heads x v_head_dim", c.num_attention_heads * c.v_head_dim, within)]
    if c.first_k_dense_replace:
        found.append(("intermediate_size", c.intermediate_size, within))
    if c.first_k_dense_replace < c.num_hidden_layers:
        if not c.expert_parallel:
            found.append(("moe_intermediate_size", c.moe_intermediate_size, size))
        if c.n_shared_experts:
            shared = c.moe_intermediate_size * c.n_shared_experts
            found.append(("shared experts' size", shared, size))
    return found


def eos_token_ids(model_dir: Path, config: ModelConfig) -> frozenset[int]:
    """EOS ids from config.json and generation_config.json together."""
    ids = set(config.eos_token_ids)
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(ids)
