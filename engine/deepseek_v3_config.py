"""DeepSeek-V3 configuration read from an HF ``config.json``, validated once at load."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import (
    DEFAULT_DTYPE,
    ConfigError,
    KVCacheLayout,
    context_limit,
    hf_eos_ids,
    parse_dtype,
    require_fields,
)
from engine.fp8 import BlockFp8, QuantizationError


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context ``scale`` times the pretrained one."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN RoPE scaling as DeepSeek-V3 uses it (``rope_type: yarn``)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # None: derived from factor and the mscales
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ConfigError(f"rope_scaling.factor: must be > 0, got {self.factor}")
        if self.original_max_position_embeddings <= 0:
            raise ConfigError(
                "rope_scaling.original_max_position_embeddings: must be positive, got "
                f"{self.original_max_position_embeddings}"
            )

    @property
    def cos_sin_factor(self) -> float:
        """What cos and sin are multiplied by (the paper's attention factor)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_mscale(self.factor)

    def inv_freq(self, dim: int, theta: float) -> torch.Tensor:
        """Inverse frequencies [dim // 2]: interpolated below the correction range,
        extrapolated above it, blended linearly inside."""

        def correction_dim(num_rotations: float) -> float:
            ratio = self.original_max_position_embeddings / (num_rotations * 2 * math.pi)
            return dim * math.log(ratio) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # no singular ramp
        pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        return (1.0 / (self.factor * pos_freqs)) * (1 - extrapolation) + (
            1.0 / pos_freqs
        ) * extrapolation


@dataclass(frozen=True)
class DeepseekV3Config:
    """Shapes and numerics of a DeepSeek-V3 model (MLA attention, routed and shared experts)."""

    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    intermediate_size: int  # the first dense layers' MLP
    moe_intermediate_size: int  # one routed expert's MLP (shared experts: times their number)
    num_attention_heads: int
    q_lora_rank: int | None  # None: one q_proj, no low-rank query
    kv_lora_rank: int  # the compressed latent cached for every token
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # the rotary part of queries and of the one shared key
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int  # layers before this one have a dense MLP, the rest experts
    rope_theta: float
    rope_scaling: YarnRopeScaling | None
    rope_interleave: bool  # rotary dims stored as interleaved pairs (DeepSeek's checkpoints)
    max_seq_len: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    quantization: BlockFp8 | None = None  # its released checkpoint's block FP8 (engine.fp8)
    # Multi-token-prediction layers stored after the last (layers L..L+n-1): the MTP draft's
    # (engine.spec.drafters.mtp); the target never reads them.
    num_nextn_predict_layers: int = 0
    # Split over ranks: the routed experts split whole, not by channels (engine.models.moe);
    # EngineConfig.enable_expert_parallel.
    expert_parallel: bool = False
    # Data-parallel attention over the ranks (EngineConfig.data_parallel_size): each
    # data-parallel rank attends its own rows, its attention split over its ranks (whole
    # where it has one); the experts split over every rank.
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "num_hidden_layers",
            "vocab_size",
            "intermediate_size",
            "moe_intermediate_size",
            "num_attention_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "n_routed_experts",
            "num_experts_per_tok",
            "n_group",
            "topk_group",
            "max_seq_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}: must be a positive integer, got {value!r}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ConfigError(f"q_lora_rank: must be positive or null, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim: must be even, got {self.qk_rope_head_dim}")
        if self.n_routed_experts % self.n_group:
            raise ConfigError(
                f"n_group: {self.n_group} must divide n_routed_experts ({self.n_routed_experts})"
            )
        if self.n_routed_experts // self.n_group < 2:
            raise ConfigError("n_group: each group needs at least 2 experts (scored by its top 2)")
        if self.topk_group > self.n_group:
            raise ConfigError(f"topk_group: {self.topk_group} exceeds n_group ({self.n_group})")
        allowed = self.topk_group * (self.n_routed_experts // self.n_group)
        if self.num_experts_per_tok > allowed:
            raise ConfigError(
                f"num_experts_per_tok: {self.num_experts_per_tok} exceeds the {allowed} experts "
                "of topk_group groups"
            )
        if self.n_shared_experts < 0 or self.first_k_dense_replace < 0:
            raise ConfigError("n_shared_experts and first_k_dense_replace: must be >= 0")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ConfigError("rope_theta and rms_norm_eps: must be > 0")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times YaRN's mscale(factor, mscale_all_dim) squared."""
        scale = self.qk_head_dim**-0.5
        yarn = self.rope_scaling
        if yarn is not None and yarn.mscale_all_dim:
            scale *= yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2
        return scale

    @property
    def kv_cache_layout(self) -> KVCacheLayout:
        """MLA caches one vector per token and layer, shared by every head: the latent
        (``kv_lora_rank``) followed by the rotated key part (``qk_rope_head_dim``)."""
        return KVCacheLayout(
            num_layers=self.num_hidden_layers,
            num_kv_heads=1,
            head_dim=self.kv_lora_rank + self.qk_rope_head_dim,
            num_tensors=1,
        )

    def with_dtype(self, dtype: str | torch.dtype) -> DeepseekV3Config:
        return dataclasses.replace(self, dtype=parse_dtype(dtype))

    @classmethod
    def from_hf(
        cls,
        hf: dict[str, Any],
        *,
        dtype: str | torch.dtype = DEFAULT_DTYPE,
        max_length: int | None = None,
    ) -> DeepseekV3Config:
        """Builds the config from an HF config dict (transformers 4 or 5 key names)."""
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act: {act!r} is not supported; allowed: ['silu']")
        try:
            quantization = BlockFp8.from_hf(hf.get("quantization_config"))
        except QuantizationError as e:
            raise ConfigError(str(e)) from None
        for key, allowed in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if hf.get(key, allowed) != allowed:
                raise ConfigError(f"{key}: {hf[key]!r} is not supported; allowed: [{allowed!r}]")
        require_fields(hf)
        limit = context_limit(hf, max_length)
        rope_theta, rope_scaling = _parse_rope(hf, hf["max_position_embeddings"])
        eos_ids = hf_eos_ids(hf)
        get = hf.get
        return cls(
            hidden_size=hf["hidden_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            vocab_size=hf["vocab_size"],
            intermediate_size=get("intermediate_size", 18432),
            moe_intermediate_size=get("moe_intermediate_size", 2048),
            num_attention_heads=hf["num_attention_heads"],
            q_lora_rank=get("q_lora_rank", 1536),
            kv_lora_rank=get("kv_lora_rank", 512),
            qk_nope_head_dim=get("qk_nope_head_dim", 128),
            qk_rope_head_dim=get("qk_rope_head_dim", 64),
            v_head_dim=get("v_head_dim") or 128,
            n_routed_experts=get("n_routed_experts", 256),
            n_shared_experts=get("n_shared_experts") or 0,
            num_experts_per_tok=get("num_experts_per_tok", 8),
            n_group=get("n_group") or 1,
            topk_group=get("topk_group") or 1,
            norm_topk_prob=bool(get("norm_topk_prob", True)),
            routed_scaling_factor=float(get("routed_scaling_factor", 2.5)),
            first_k_dense_replace=get("first_k_dense_replace") or 0,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rope_interleave=bool(get("rope_interleave", True)),
            max_seq_len=limit,
            rms_norm_eps=get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            attention_bias=bool(get("attention_bias", False)),
            dtype=parse_dtype(dtype),
            eos_token_ids=eos_ids,
            bos_token_id=get("bos_token_id"),
            quantization=quantization,
            num_nextn_predict_layers=get("num_nextn_predict_layers") or 0,
        )


def _parse_rope(
    hf: dict[str, Any], max_position_embeddings: int
) -> tuple[float, YarnRopeScaling | None]:
    """RoPE from ``rope_parameters`` (v5) or ``rope_theta``/``rope_scaling`` (v4)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"rope_parameters: expected an object, got {type(params).__name__}")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise ConfigError(
            f"rope_scaling.rope_type: {rope_type!r} is not supported; allowed: ['default', 'yarn']"
        )
    original = int(params.get("original_max_position_embeddings", max_position_embeddings))
    factor = params.get("factor")
    if factor is None:
        factor = max_position_embeddings / original

    def optional(key: str) -> float | None:
        value = params.get(key)
        return None if value is None else float(value)

    return theta, YarnRopeScaling(
        factor=float(factor),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=optional("mscale"),
        mscale_all_dim=optional("mscale_all_dim"),
        attention_factor=optional("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )
