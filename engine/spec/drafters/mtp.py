"""DeepSeek-V3's own multi-token-prediction (MTP) module as its draft: SGLang's NextN,
vLLM's ``deepseek_mtp``. The released checkpoint stores it as the layer after the last
(``model.layers.{L}``, ``num_nextn_predict_layers: 1``), so the draft needs no directory of
its own: its weights come from the target's files, which the target never reads.

One step, as those servers run the released weights: ``x = eh_proj(concat(enorm(embed(
t_{i+1})), hnorm(h_i)))``, then the MTP decoder layer (latent attention over its own
cache, in the target's MLA layout, and a mixture of experts), whose output, normed by
``shared_head.norm``, the shared head scores. ``h_i`` is the target's last hidden state
after its final norm. The chain feeds the normed output back as the next step's ``h``,
the one MTP layer run again, as they do for more than one draft token. The embedding is
the target's (the checkpoint's copy in the layer is the same tensor). In a block-FP8
checkpoint (as released) the layer's FP8 projections are dequantized at load time.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.attention.base import AttentionBackend, BatchLayout
from engine.deepseek_v3_config import DeepseekV3Config
from engine.deepseek_v3_weights import decoder_layer_rules
from engine.fp8 import fill_fp8, quantized_rules
from engine.models.deepseek_v3 import DeepseekV3DecoderLayer, yarn_rotary
from engine.models.layers import Linear, RMSNorm
from engine.models.llama3 import ReturnHiddenStates
from engine.models.moe import DeepseekV3MoE
from engine.parallel.shard import Shard
from engine.spec.drafters.base import DraftConfigError, DraftLogits, KVLayers
from engine.spec.drafters.eagle import EagleDrafter
from engine.spec.drafters.loading import build_draft
from engine.weights import CheckpointReader, one_rule


class MtpDrafter(EagleDrafter):
    """EAGLE's chain (``extend``, ``propose``, the target's final-normed hidden state as
    features) over the MTP layer, scored by its own shared head."""

    kind = "mtp"

    def __init__(self, config: DeepseekV3Config, target: nn.Module) -> None:
        """``config``: the target's, one layer (the MTP layer's cache); ``target``: a
        DeepSeek-V3 model (or a split one's ``WholeVocabulary``), its embedding borrowed."""
        nn.Module.__init__(self)  # EAGLE's wiring, none of its layers
        h = config.hidden_size
        self.config = config  # type: ignore[assignment]
        # The target's last hidden state after its final norm, as vLLM and SGLang feed it.
        self.target_hidden = ReturnHiddenStates(final=True)
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = Linear(2 * h, h, bias=False)
        # Experts, as the layers past first_k_dense_replace have.
        self.block: DeepseekV3DecoderLayer = DeepseekV3DecoderLayer(
            config, config.first_k_dense_replace
        )
        self.head_norm = RMSNorm(h, config.rms_norm_eps)
        self.head = Linear(h, config.vocab_size, bias=False)
        self.rotary = yarn_rotary(config)
        embed = target.embed_tokens
        assert isinstance(embed, nn.Module)
        self._embed: tuple[nn.Module] = (embed,)  # borrowed, not registered

    def finalize(self) -> None:
        """The router back in fp32 after the cast to the model's dtype (``build_draft``
        calls it before the weights load)."""
        moe = self.block.mlp
        assert isinstance(moe, DeepseekV3MoE)
        moe.gate.keep_fp32()

    def _forward(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        layout: BatchLayout,
        metadata: Any,
        kv: KVLayers,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        embed = self.enorm(self._embed[0](tokens))  # [T, H]
        x = self.eh_proj(torch.cat([embed, self.hnorm(hidden)], dim=-1))
        g = self.block(x, self.rotary.lookup(layout.positions), kv[0], backend, metadata)
        out: torch.Tensor = self.head_norm(g)  # what the head scores and the chain feeds back
        return out

    def logits(self, g: torch.Tensor) -> DraftLogits:
        return DraftLogits(self.head(g).float())


def load_mtp(target_dir: str | Path, target: nn.Module, device: torch.device) -> MtpDrafter:
    """The MTP draft of the DeepSeek-V3 target in ``target_dir`` (its first MTP layer, from
    the target's own files); refused, naming the field, for a target without one."""
    tc = getattr(target, "config", None)
    if not isinstance(tc, DeepseekV3Config):
        raise DraftConfigError("draft_method: mtp needs a DeepSeek-V3 target (its MTP layer)")
    if tc.num_nextn_predict_layers < 1:
        raise DraftConfigError(
            "num_nextn_predict_layers: the target's config declares no MTP layer "
            f"({tc.num_nextn_predict_layers}); its checkpoint has none to draft with"
        )
    # Whole on every rank, beside its rows under data-parallel attention.
    config = dataclasses.replace(
        tc, num_hidden_layers=1, expert_parallel=False, data_parallel_size=1
    )
    h, mtp = tc.hidden_size, f"model.layers.{tc.num_hidden_layers}"
    reader = CheckpointReader(target_dir)
    try:
        has_layer = f"{mtp}.eh_proj.weight" in reader.names()
    finally:
        reader.close()
    if not has_layer:
        raise DraftConfigError(
            f"num_nextn_predict_layers: {tc.num_nextn_predict_layers} in the target's config, "
            f"but its checkpoint has no MTP layer ({mtp}.eh_proj.weight and the rest)"
        )
    rules = decoder_layer_rules(config, config.first_k_dense_replace, mtp, "block", Shard(0, 1))
    rules += [
        one_rule("enorm.weight", f"{mtp}.enorm.weight", (h,)),
        one_rule("hnorm.weight", f"{mtp}.hnorm.weight", (h,)),
        one_rule("eh_proj.weight", f"{mtp}.eh_proj.weight", (h, 2 * h)),
        one_rule("head_norm.weight", f"{mtp}.shared_head.norm.weight", (h,)),
        one_rule("head.weight", f"{mtp}.shared_head.head.weight", (tc.vocab_size, h)),
    ]

    def factory() -> MtpDrafter:
        return MtpDrafter(config, target)

    block = tc.quantization
    if block is None:
        return build_draft(factory, target_dir, rules, device, config.dtype)
    reader = CheckpointReader(target_dir)
    try:
        fp8 = quantized_rules(reader, rules)  # the layer's FP8 projections: dequantized
    finally:
        reader.close()

    def dequantized(module: MtpDrafter, reader: CheckpointReader) -> set[str]:
        return fill_fp8(module, reader, fp8, block)

    plain = [rule for rule in rules if rule not in fp8]
    return build_draft(factory, target_dir, plain, device, config.dtype, preload=dequantized)
