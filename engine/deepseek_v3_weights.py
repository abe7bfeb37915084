"""HF DeepSeek-V3 tensors -> Tandem's parameters, whole or one tensor-parallel rank's part.

Split over ranks (``engine.parallel.shard``), a rank reads:

- **Latent attention.** Its heads' rows of the query projection (``q_proj`` or
  ``q_b_proj``) and of ``kv_b_proj``, and their columns of ``o_proj`` (whose bias is rank
  0's). The low-rank projections into the query and the latent (``q_a_proj``,
  ``kv_a_proj_with_mqa``) and their norms are every rank's: each caches the whole latent.
- **MLPs.** A dense layer's and the shared experts' intermediate channels, as Llama's.
- **Routed experts.** Every expert's channels; or, with ``config.expert_parallel``, its
  own experts whole (``DeepseekV3MoE.expert_ids``), renumbered from 0. The router is every
  rank's.
- **Vocabulary.** Its rows of the embedding and the LM head.

Under data-parallel attention (``config.data_parallel_size``) the experts split as above
over every rank of the worker, the shared ones by channels; the rest splits as above over
the ranks of the rank's data-parallel rank (``data_parallel_shards``), whole where each
data-parallel rank has one.
"""

from __future__ import annotations

from engine.deepseek_v3_config import DeepseekV3Config
from engine.parallel.shard import Shard, data_parallel_shards
from engine.weights import Part, Source, TensorRule, one_rule, run_part


def mla_attention_rules(
    config: DeepseekV3Config,
    hf: str,
    ours: str,
    in_features: int | None = None,
    shard: Shard | None = None,
) -> list[TensorRule]:
    """One HF MLA attention (prefix ``hf``) -> Tandem's (prefix ``ours``), names unchanged.
    ``in_features``: the input width when it is not ``hidden_size`` (EAGLE-3 drafts).
    ``shard``: a tensor-parallel rank's heads."""
    c, h = config, config.hidden_size
    inp = in_features or h
    shard = shard or Shard(0, 1)
    heads = shard.even(c.num_attention_heads, "num_attention_heads")
    q_rows = run_part(0, heads, c.qk_head_dim) if shard.size > 1 else None
    kv_b_rows = run_part(0, heads, c.qk_nope_head_dim + c.v_head_dim) if shard.size > 1 else None
    o_columns = run_part(1, heads, c.v_head_dim) if shard.size > 1 else None
    q_out = c.num_attention_heads * c.qk_head_dim
    pairs: list[tuple[str, tuple[int, ...], Part | None]] = [
        ("kv_a_proj_with_mqa.weight", (c.kv_lora_rank + c.qk_rope_head_dim, inp), None),
        ("kv_a_layernorm.weight", (c.kv_lora_rank,), None),
        (
            "kv_b_proj.weight",
            (c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
            kv_b_rows,
        ),
        ("o_proj.weight", (h, c.num_attention_heads * c.v_head_dim), o_columns),
    ]
    if c.q_lora_rank is None:
        pairs.append(("q_proj.weight", (q_out, inp), q_rows))
    else:
        pairs += [
            ("q_a_proj.weight", (c.q_lora_rank, inp), None),
            ("q_a_layernorm.weight", (c.q_lora_rank,), None),
            ("q_b_proj.weight", (q_out, c.q_lora_rank), q_rows),
        ]
    if c.attention_bias:
        pairs.append(("kv_a_proj_with_mqa.bias", (c.kv_lora_rank + c.qk_rope_head_dim,), None))
        if shard.rank == 0:
            pairs.append(("o_proj.bias", (h,), None))
        if c.q_lora_rank is not None:
            pairs.append(("q_a_proj.bias", (c.q_lora_rank,), None))
    return [one_rule(f"{ours}.{name}", f"{hf}.{name}", shape, part) for name, shape, part in pairs]


def _mlp_rules(hf: str, ours: str, h: int, inter: int, shard: Shard, what: str) -> list[TensorRule]:
    """A gated MLP's fused gate/up rows and down columns: ``shard``'s channels of ``inter``."""
    channels = shard.even(inter, what)
    rows = run_part(0, channels) if shard.size > 1 else None
    columns = run_part(1, channels) if shard.size > 1 else None
    gate_up = (
        Source(f"{hf}.gate_proj.weight", (inter, h), rows),
        Source(f"{hf}.up_proj.weight", (inter, h), rows),
    )
    return [
        TensorRule(f"{ours}.gate_up_proj.weight", gate_up),
        one_rule(f"{ours}.down_proj.weight", f"{hf}.down_proj.weight", (h, inter), columns),
    ]


def decoder_layer_rules(
    config: DeepseekV3Config, layer_id: int, hf: str, ours: str, shard: Shard
) -> list[TensorRule]:
    """One HF decoder layer (prefix ``hf``): its attention, norms and MLP (dense before
    ``first_k_dense_replace``, else experts) -> Tandem's (prefix ``ours``), ``shard``'s.
    Under data-parallel attention the experts split over every rank, the rest over the
    ranks of this rank's data-parallel rank."""
    c, h = config, config.hidden_size
    moe_shard = shard
    if c.data_parallel_size > 1:
        shard = data_parallel_shards(shard, c.data_parallel_size)[0]
    rules = mla_attention_rules(c, f"{hf}.self_attn", f"{ours}.self_attn", shard=shard)
    rules += [
        one_rule(f"{ours}.{n}.weight", f"{hf}.{n}.weight", (h,))
        for n in ("input_layernorm", "post_attention_layernorm")
    ]
    if layer_id < c.first_k_dense_replace:
        inter = c.intermediate_size
        return rules + _mlp_rules(f"{hf}.mlp", f"{ours}.mlp", h, inter, shard, "intermediate_size")
    e, inter = c.n_routed_experts, c.moe_intermediate_size
    rules.append(one_rule(f"{ours}.mlp.gate.weight", f"{hf}.mlp.gate.weight", (e, h)))
    bias = "mlp.gate.e_score_correction_bias"
    rules.append(one_rule(f"{ours}.{bias}", f"{hf}.{bias}", (e,)))
    held = moe_shard.even(e, "n_routed_experts") if c.expert_parallel else range(e)
    split = Shard(0, 1) if c.expert_parallel else moe_shard
    for j in held:
        rules += _mlp_rules(
            f"{hf}.mlp.experts.{j}",
            f"{ours}.mlp.experts.{j - held.start}",
            h,
            inter,
            split,
            "moe_intermediate_size",
        )
    if c.n_shared_experts:
        shared = inter * c.n_shared_experts
        rules += _mlp_rules(
            f"{hf}.mlp.shared_experts",
            f"{ours}.mlp.shared_experts",
            h,
            shared,
            moe_shard,
            "shared experts' size",
        )
    return rules


def deepseek_v3_weight_rules(
    config: DeepseekV3Config, shard: Shard | None = None
) -> list[TensorRule]:
    """HF DeepSeek-V3 tensors (experts one by one, as DeepSeek and transformers save them)
    -> Tandem's fused gate_up parameters, ``shard``'s parts of them; the MTP layers past
    the last one are not read."""
    c, h = config, config.hidden_size
    shard = shard or Shard(0, 1)
    vocab_shard = shard  # data-parallel: over the ranks of this rank's data-parallel rank
    if c.data_parallel_size > 1:
        vocab_shard = data_parallel_shards(shard, c.data_parallel_size)[0]
    split = vocab_shard.size > 1
    vocab = run_part(0, vocab_shard.vocab(c.vocab_size)) if split else None
    rules = [one_rule("embed_tokens.weight", "model.embed_tokens.weight", (c.vocab_size, h), vocab)]
    for i in range(c.num_hidden_layers):
        rules += decoder_layer_rules(c, i, f"model.layers.{i}", f"layers.{i}", shard)
    rules.append(one_rule("norm.weight", "model.norm.weight", (h,)))
    if not c.tie_word_embeddings:
        rules.append(one_rule("lm_head.weight", "lm_head.weight", (c.vocab_size, h), vocab))
    return rules
