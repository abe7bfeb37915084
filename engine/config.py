"""Model configuration read from an HF ``config.json``, validated once at load."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.fp8 import BlockFp8, QuantizationError

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
DEFAULT_DTYPE = "bfloat16"


class ConfigError(ValueError):
    """A model config that Tandem cannot serve; the message names the field."""


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype):
        if value not in DTYPES.values():
            raise ConfigError(f"dtype: {value} is not supported; allowed: {sorted(DTYPES)}")
        return value
    name = value.removeprefix("torch.")
    if name not in DTYPES:
        raise ConfigError(f"dtype: {value!r} is not supported; allowed: {sorted(DTYPES)}")
    return DTYPES[name]


@dataclass(frozen=True)
class Llama3RopeScaling:
    """The llama3 frequency-dependent RoPE scaling (Llama 3.1+)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ConfigError(f"rope_scaling.factor: must be > 0, got {self.factor}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(
                "rope_scaling.high_freq_factor: must be greater than low_freq_factor "
                f"({self.high_freq_factor} <= {self.low_freq_factor})"
            )


SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class KVCacheLayout:
    """What a model caches per token, as its config declares it: per layer ``num_tensors``
    paged pools (2: K and V; 1: MLA's latent and rope vector), each entry ``[num_kv_heads,
    head_dim]``. The engine, the block planner and KV transfer size pools from it."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tensors: int = 2


@dataclass(frozen=True)
class Llama3Config:
    """Shapes and numerics of a Llama-3 family model, as served."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rope_scaling: Llama3RopeScaling | None
    max_seq_len: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    quantization: BlockFp8 | None = None  # a block-FP8 checkpoint's projections (engine.fp8)

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "num_hidden_layers",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_seq_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}: must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_key_value_heads: {self.num_key_value_heads} must divide "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim: must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_theta <= 0:
            raise ConfigError(f"rope_theta: must be > 0, got {self.rope_theta}")
        if self.rms_norm_eps <= 0:
            raise ConfigError(f"rms_norm_eps: must be > 0, got {self.rms_norm_eps}")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def kv_cache_layout(self) -> KVCacheLayout:
        """K and V of ``num_key_value_heads`` heads per token and layer."""
        return KVCacheLayout(self.num_hidden_layers, self.num_key_value_heads, self.head_dim)

    def with_dtype(self, dtype: str | torch.dtype) -> Llama3Config:
        return dataclasses.replace(self, dtype=parse_dtype(dtype))

    @classmethod
    def from_hf(
        cls,
        hf: dict[str, Any],
        *,
        dtype: str | torch.dtype = DEFAULT_DTYPE,
        max_length: int | None = None,
    ) -> Llama3Config:
        """Builds the config from an HF config dict (transformers 4 or 5 key names)."""
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act: {act!r} is not supported; allowed: ['silu']")
        if hf.get("pretraining_tp", 1) not in (1, None):
            raise ConfigError(
                f"pretraining_tp: {hf['pretraining_tp']} is not supported; allowed: [1]"
            )
        try:
            quantization = BlockFp8.from_hf(hf.get("quantization_config"))
        except QuantizationError as e:
            raise ConfigError(str(e)) from None
        require_fields(hf)
        heads = hf["num_attention_heads"]
        rope_theta, rope_scaling = _parse_rope(hf)
        limit = context_limit(hf, max_length)
        eos_ids = hf_eos_ids(hf)
        return cls(
            hidden_size=hf["hidden_size"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            num_hidden_layers=hf["num_hidden_layers"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            intermediate_size=hf.get("intermediate_size", 0),
            vocab_size=hf["vocab_size"],
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_seq_len=limit,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            dtype=parse_dtype(dtype),
            eos_token_ids=eos_ids,
            bos_token_id=hf.get("bos_token_id"),
            quantization=quantization,
        )


def _parse_rope(hf: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """Reads RoPE from ``rope_theta``/``rope_scaling`` (v4) or ``rope_parameters`` (v5)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"rope_parameters: expected an object, got {type(params).__name__}")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"rope_scaling.rope_type: {rope_type!r} is not supported; "
            f"allowed: {list(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return float(theta), None
    missing = [
        k
        for k in (
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        )
        if k not in params
    ]
    if missing:
        raise ConfigError(f"rope_scaling.{missing[0]}: required for rope_type 'llama3'")
    return float(theta), Llama3RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"config.json: not found in {model_dir}; is this an HF model directory?")
    with path.open() as f:
        data: dict[str, Any] = json.load(f)
    return data


def require_fields(hf: dict[str, Any]) -> None:
    """ConfigError naming the first field a decoder config cannot do without."""
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
        if key not in hf:
            raise ConfigError(f"{key}: missing from config.json")
    if hf.get("max_position_embeddings") is None:
        raise ConfigError("max_position_embeddings: missing from config.json")


def context_limit(hf: dict[str, Any], max_length: int | None) -> int:
    """The context length served: ``max_length`` if given (within the model's limit)."""
    limit = int(hf["max_position_embeddings"])
    if max_length is None:
        return limit
    if max_length <= 0 or max_length > limit:
        raise ConfigError(
            f"max_length: {max_length} is outside the model's limit; allowed: "
            f"1..{limit} (max_position_embeddings)"
        )
    return max_length


def hf_eos_ids(hf: dict[str, Any]) -> tuple[int, ...]:
    """``eos_token_id`` (one id, a list, or none) as a tuple."""
    eos = hf.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
