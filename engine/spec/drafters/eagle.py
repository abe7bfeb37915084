"""EAGLE (EAGLE-1) for Llama-3: one decoder layer over ``fc(concat(embed(t_{i+1}), h_i))``.

``h_i`` is the target's last hidden state (after its final norm, what the lm_head sees)
at position i; the draft layer's output approximates ``h_{i+1}`` and the target's
lm_head turns it into the next draft token. Later chain steps feed the draft's own
output back through ``fc``. Public layout: ``fc.weight``/``fc.bias`` [H, 2H], ``layers.0.*``
without ``input_layernorm``; ``embed_tokens.weight``, when present, is the target's copy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from engine.attention.base import AttentionBackend, BatchLayout
from engine.config import Llama3Config
from engine.models.layers import Linear, RotaryEmbedding
from engine.models.llama3 import (
    ROPE_SLACK_POSITIONS,
    Llama3DecoderLayer,
    Llama3Model,
    ModelOutputs,
    ReturnHiddenStates,
)
from engine.parallel.layers import gather_logits
from engine.registry import decoder_layer_rules
from engine.spec.drafters.base import (
    DraftConfigError,
    DraftLogits,
    DraftSignature,
    KVLayers,
    ProposeArgs,
    SelectFn,
    draft_split,
    propose_chain,
)
from engine.spec.drafters.loading import build_draft, draft_llama_config
from engine.weights import CheckpointReader, Source, TensorRule


class EagleDrafter(nn.Module):
    kind = "eagle"
    max_num_layers: ClassVar[int | None] = 1
    fixed_num_draft_tokens: int | None = None

    def __init__(
        self, config: Llama3Config, target: Llama3Model, fc_bias: bool, has_input_norm: bool
    ) -> None:
        super().__init__()
        h = config.hidden_size
        self.config = config
        self.target_hidden = ReturnHiddenStates(final=True)
        self.tp = draft_split(target)
        self.fc = Linear(2 * h, h, bias=fc_bias)  # whole on every rank
        self.layer = Llama3DecoderLayer(config, self.tp)
        if not has_input_norm:
            self.layer.input_layernorm = nn.Identity()  # type: ignore[assignment]
        self.rotary = RotaryEmbedding(
            config.head_dim,
            config.max_seq_len + ROPE_SLACK_POSITIONS,
            config.rope_theta,
            config.rope_scaling,
            config.dtype,
        )
        self._target = (target.embed_tokens, target.lm_head)  # borrowed, not registered

    def signature(self) -> DraftSignature:
        return DraftSignature(self.kind)

    def features(self, out: ModelOutputs) -> torch.Tensor:
        assert out.final_hidden_state is not None
        return out.final_hidden_state

    def _forward(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        layout: BatchLayout,
        metadata: Any,
        kv: KVLayers,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        embed = self._target[0](tokens)  # [T, H]
        x = self.fc(torch.cat([embed, hidden], dim=-1))
        return self.layer(x, self.rotary.lookup(layout.positions), kv[0], backend, metadata)

    def extend(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        layout: BatchLayout,
        metadata: Any,
        kv: KVLayers,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        return self._forward(tokens, features, layout, metadata, kv, backend)

    def propose(
        self,
        state: torch.Tensor | None,
        args: ProposeArgs,
        k: int,
        select: SelectFn,
        kv: KVLayers,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        assert state is not None
        return propose_chain(
            state[args.last_index],
            args,
            k,
            select,
            logits=self.logits,
            step=lambda tokens, g, layout, md: self._forward(tokens, g, layout, md, kv, backend),
            backend=backend,
        )

    def logits(self, g: torch.Tensor) -> DraftLogits:
        """The next token's scores from the draft state ``g``: the target's LM head."""
        logits = self._target[1](g).float()
        return DraftLogits(gather_logits(self.tp, logits, self.config.vocab_size))


def load_eagle(
    draft_dir: str | Path | None, hf: dict[str, Any], target: Llama3Model, device: torch.device
) -> EagleDrafter:
    """Loads an EAGLE draft (``draft_dir`` None: a random one shaped by ``hf``)."""
    tc = target.config
    config = draft_llama_config(hf, tc)
    if hf.get("num_hidden_layers", 1) != 1:
        raise DraftConfigError(
            "num_hidden_layers: an EAGLE draft has one decoder layer, "
            f"got {hf['num_hidden_layers']}"
        )
    if draft_dir is None:
        fc_bias, has_input_norm = True, False
    else:
        reader = CheckpointReader(draft_dir)
        try:
            names = reader.names()
        finally:
            reader.close()
        fc_bias = "fc.bias" in names
        has_input_norm = "layers.0.input_layernorm.weight" in names
    h = config.hidden_size
    rules = [TensorRule("fc.weight", (Source("fc.weight", (h, 2 * h)),))]
    if fc_bias:
        rules.append(TensorRule("fc.bias", (Source("fc.bias", (h,)),)))
    norms = ("input_layernorm",) * has_input_norm + ("post_attention_layernorm",)
    shard = draft_split(target).shard
    rules += decoder_layer_rules(config, "layers.0", "layer", norms=norms, shard=shard)
    return build_draft(
        lambda: EagleDrafter(config, target, fc_bias, has_input_norm),
        draft_dir,
        rules,
        device,
        config.dtype,
    )
