"""Drafter kinds as the trainer sees them, declared once each: the draft's HF config for a
target, its start from the target's weights, and its objective."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from engine.models.llama3 import Llama3DecoderLayer, Llama3Model
from engine.spec.drafters import new_drafter
from engine.spec.drafters.base import Drafter
from engine.spec.drafters.dflash import DflashDrafter
from engine.spec.drafters.eagle import EagleDrafter
from engine.spec.drafters.eagle3 import Eagle3Drafter, default_eagle3_layers
from training.data import SequenceSet
from training.objectives import EagleObjective, Objective, block_objective, chain_objective


@dataclass(frozen=True)
class DraftOptions:
    intermediate_size: int
    num_layers: int  # draft decoder layers (EAGLE kinds: 1)
    block_size: int  # DFlash
    num_drafts: int  # chain steps trained (EAGLE kinds); DFlash: block_size - 1
    draft_vocab_size: int  # EAGLE-3
    max_anchors: int  # per sequence and batch; 0: every continuation position
    attention: str | None = None  # EAGLE-3: "mha" | "mla"; None: the target's own


@dataclass(frozen=True)
class Recipe:
    kind: str
    architecture: str
    hf_fields: Callable[[dict[str, Any], DraftOptions, SequenceSet], dict[str, Any]]
    init_from_target: Callable[[Any, Llama3Model, SequenceSet], None]  # (drafter, ...)
    objective: Callable[[Drafter, int, int], Objective]
    default_num_drafts: int
    default_max_anchors: int
    default_num_layers: int  # draft decoder layers when not given
    max_num_layers: int | None  # the drafter kind's own limit (``Drafter.max_num_layers``)
    # Fine-tuning (--init-from): the trained draft made to fit the new training data, as
    # (drafter, hf config); None keeps it as it is.
    refit: (
        Callable[[Any, dict[str, Any], Llama3Model, SequenceSet, DraftOptions], tuple[Any, dict]]
        | None
    ) = None


def draft_hf_config(
    recipe: Recipe, target_hf: dict[str, Any], opts: DraftOptions, data: SequenceSet
) -> dict[str, Any]:
    """The target's config.json with the draft's depth, width and kind fields."""
    if target_attention(target_hf) == "mla" and recipe.kind != "eagle3":
        raise ValueError(
            f"kind: a target with MLA (DeepSeek-V3) takes eagle3 drafts, not {recipe.kind}"
        )
    hf = copy.deepcopy(target_hf)
    for key in ("auto_map", "quantization_config"):
        hf.pop(key, None)
    hf.update(
        architectures=[recipe.architecture],
        num_hidden_layers=opts.num_layers,
        intermediate_size=opts.intermediate_size,
        tie_word_embeddings=False,
        tandem_draft_kind=recipe.kind,
    )
    hf.update(recipe.hf_fields(target_hf, opts, data))
    return hf


MLA_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def target_attention(target_hf: dict[str, Any]) -> str:
    """How a target attends: with multi-head latent attention, "mla" (DeepSeek-V3), or
    with multi-head attention, "mha" (Llama)."""
    return "mla" if target_hf.get("kv_lora_rank") else "mha"


def mha_fields(target_hf: dict[str, Any]) -> dict[str, Any]:
    """What turns an MLA target's config into its MHA draft's: Llama's attention with one
    K/V head per query head of hidden_size / heads, plain RoPE at the target's theta (the
    draft's paged K/V is its own, so its shape need not follow the target's cache)."""
    heads, hidden = target_hf["num_attention_heads"], target_hf["hidden_size"]
    rope = target_hf.get("rope_parameters") or target_hf.get("rope_scaling") or {}
    theta = rope.get("rope_theta", target_hf.get("rope_theta", 10000.0))
    return {
        **{name: None for name in MLA_FIELDS},
        "head_dim": 2 * (hidden // heads // 2),
        "num_key_value_heads": heads,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
    }


def copy_matching(dst: nn.Module, src: nn.Module) -> None:
    """Copies every parameter of ``src`` into the one of the same name and shape in ``dst``."""
    params = dict(src.named_parameters())
    with torch.no_grad():
        for name, p in dst.named_parameters():
            if name in params and params[name].shape == p.shape:
                p.copy_(params[name])


def copy_widened(dst: nn.Module, src: nn.Module) -> None:
    """EAGLE-3's input projections read ``concat(embed, hidden)`` (2H): each [out, 2H]
    weight of ``dst`` whose namesake in ``src`` is [out, H] becomes ``[w, w]``, the token
    and the state seen alike (Llama's qkv_proj; MLA's q_a_proj or q_proj and
    kv_a_proj_with_mqa). A draft whose attention differs from the target's (the MHA draft
    of a DeepSeek-V3 target) has no such namesakes and keeps its random start."""
    params = dict(src.named_parameters())
    with torch.no_grad():
        for name, p in dst.named_parameters():
            w = params.get(name)
            if w is not None and p.dim() == 2 and p.shape == (w.shape[0], 2 * w.shape[1]):
                p.copy_(torch.cat([w, w], dim=1))


def target_layers(target: Llama3Model) -> list[Llama3DecoderLayer]:
    return [cast(Llama3DecoderLayer, layer) for layer in target.layers]


def stacked_identity(hidden: int, copies: int, scale: float) -> torch.Tensor:
    """[H, copies*H]: ``scale`` times the sum of the inputs' copies."""
    return torch.cat([torch.eye(hidden)] * copies, dim=1) * scale


def draft_vocab(
    data: SequenceSet, vocab_size: int, size: int, preferred: torch.Tensor | None = None
) -> torch.Tensor:
    """The ``size`` target ids most frequent in the continuations (then in the prompts;
    then ``preferred`` ids), ascending: [size] int64."""
    cont = data.token_counts(vocab_size, continuations_only=True)
    total = data.token_counts(vocab_size)
    score = (cont * (int(total.sum()) + 1) + total) * 2
    if preferred is not None:
        score[preferred.cpu()] += 1
    return torch.argsort(-score, stable=True)[:size].sort().values


def mask_token(data: SequenceSet, vocab_size: int) -> int:
    """A token the data never uses, preferring the tokenizer's special tokens."""
    counts = data.token_counts(vocab_size).tolist()
    candidates = [*data.special_token_ids, *range(vocab_size - 1, -1, -1)]
    unused = (t for t in candidates if 0 <= t < vocab_size and counts[t] == 0)
    return next(unused, min(range(vocab_size), key=counts.__getitem__))


def dflash_layer_ids(num_layers: int, count: int = 5) -> list[int]:
    """``count`` target layers spread from layer 1 to L-2 (every layer of a shallow target)."""
    if num_layers <= count:
        return list(range(num_layers))
    return sorted({round(1 + i * (num_layers - 3) / (count - 1)) for i in range(count)})


# -- EAGLE ---------------------------------------------------------------------------------


def _eagle_init(drafter: EagleDrafter, target: Llama3Model, data: SequenceSet) -> None:
    """Keeps the random start. EAGLE-1 has no input norm and no norm before the lm_head,
    so a start from the target's last layer (massive activations in SmolLM2) makes the
    logits explode: its loss starts far above a random start's and stays there for long."""


# -- EAGLE-3 -------------------------------------------------------------------------------


def _eagle3_fields(hf: dict[str, Any], opts: DraftOptions, data: SequenceSet) -> dict[str, Any]:
    """Reduced vocabulary and taps; the draft's layer attends like the target (MLA in its
    cache layout for a DeepSeek-V3 target) unless ``opts.attention`` says "mha"."""
    taps = default_eagle3_layers(hf["num_hidden_layers"])
    own = target_attention(hf)
    if opts.attention == "mla" and own != "mla":
        raise ValueError(
            "draft_attention: 'mla' needs a target with MLA (kv_lora_rank in its config.json)"
        )
    fields = mha_fields(hf) if opts.attention == "mha" and own == "mla" else {}
    return {
        **fields,
        "draft_vocab_size": min(opts.draft_vocab_size, hf["vocab_size"]),
        # The public config names the layers whose input is tapped: ours + 1.
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i + 1 for i in taps]},
    }


def _eagle3_init(drafter: Eagle3Drafter, target: Llama3Model, data: SequenceSet) -> None:
    last = target_layers(target)[-1]
    mid = drafter.midlayer
    copy_matching(mid, last)  # MoE experts (DeepSeek-V3) match no draft MLP: they stay random
    copy_widened(mid.self_attn, last.self_attn)  # an attention of the target's own kind
    ids = draft_vocab(data, target.config.vocab_size, drafter.lm_head.weight.shape[0])
    with torch.no_grad():
        mid.hidden_norm.weight.copy_(last.input_layernorm.weight)
        n = len(drafter.layer_ids)
        drafter.fc.weight.copy_(stacked_identity(target.config.hidden_size, n, 1.0 / n))
        drafter.norm.weight.copy_(target.norm.weight)
        drafter.lm_head.weight.copy_(target.lm_head.weight[ids])
        drafter.d2t.copy_(ids - torch.arange(ids.numel()))  # target id = draft id + d2t


def _eagle3_refit(
    given: Eagle3Drafter,
    hf: dict[str, Any],
    target: Llama3Model,
    data: SequenceSet,
    opts: DraftOptions,
) -> tuple[Eagle3Drafter, dict[str, Any]]:
    """The draft vocabulary chosen again from the new data (``opts.draft_vocab_size``):
    a token the old one lacks can never be drafted. Where counts tie, tokens of the old
    vocabulary stay; they keep their trained lm_head rows, every other weight is kept too.
    New tokens start from zero rows, scoring 0 until trained: the target's own rows, on the
    draft's hidden states, outscore the trained ones often enough to cost a trained draft
    much of its acceptance, and a new sample of the same kind of data changes many of the
    rare tokens at the end of the vocabulary."""
    hf = {**hf, "draft_vocab_size": min(opts.draft_vocab_size, hf["vocab_size"])}
    device = given.d2t.device
    drafter = cast(Eagle3Drafter, new_drafter("eagle3", hf, target, device))
    copy_matching(drafter, given)  # all but a resized lm_head; rows are placed below
    old_ids = torch.arange(given.d2t.numel(), device=device) + given.d2t
    vocab_size = target.config.vocab_size
    ids = draft_vocab(data, vocab_size, hf["draft_vocab_size"], old_ids).to(device)
    old_row = torch.full((vocab_size,), -1, dtype=torch.int64, device=device)
    old_row[old_ids] = torch.arange(old_ids.numel(), device=device)
    rows = old_row[ids]
    with torch.no_grad():
        kept = given.lm_head.weight[rows.clamp(min=0)]
        drafter.lm_head.weight.copy_(kept * (rows[:, None] >= 0))
        drafter.d2t.copy_(ids - torch.arange(ids.numel(), device=device))
    return drafter, hf


# -- DFlash --------------------------------------------------------------------------------


def _dflash_fields(hf: dict[str, Any], opts: DraftOptions, data: SequenceSet) -> dict[str, Any]:
    num_target_layers = hf["num_hidden_layers"]
    return {
        "block_size": opts.block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": {
            "mask_token_id": mask_token(data, hf["vocab_size"]),
            "target_layer_ids": dflash_layer_ids(num_target_layers),
        },
    }


def _dflash_init(drafter: DflashDrafter, target: Llama3Model, data: SequenceSet) -> None:
    num_layers = len(drafter.layers)
    sources = target_layers(target)[-num_layers:]
    for dst, src in zip(drafter.layers, sources, strict=True):
        copy_matching(dst, src)
    with torch.no_grad():
        n = len(drafter.layer_ids)
        drafter.fc.weight.copy_(stacked_identity(target.config.hidden_size, n, 1.0 / n))
        drafter.hidden_norm.weight.copy_(sources[0].input_layernorm.weight)
        drafter.norm.weight.copy_(target.norm.weight)


RECIPES: dict[str, Recipe] = {
    "eagle": Recipe(
        kind="eagle",
        architecture="EagleLlamaForCausalLM",
        hf_fields=lambda hf, opts, data: {},
        init_from_target=_eagle_init,
        objective=EagleObjective,
        default_num_drafts=2,
        default_max_anchors=0,
        default_num_layers=1,
        max_num_layers=EagleDrafter.max_num_layers,
    ),
    "eagle3": Recipe(
        kind="eagle3",
        architecture="LlamaForCausalLMEagle3",
        hf_fields=_eagle3_fields,
        init_from_target=_eagle3_init,
        objective=chain_objective,
        default_num_drafts=4,
        default_max_anchors=0,
        default_num_layers=1,
        max_num_layers=Eagle3Drafter.max_num_layers,
        refit=_eagle3_refit,
    ),
    "dflash": Recipe(
        kind="dflash",
        architecture="DFlashDraftModel",
        hf_fields=_dflash_fields,
        init_from_target=_dflash_init,
        objective=block_objective,
        default_num_drafts=0,  # the block decides
        default_max_anchors=16,
        default_num_layers=2,
        max_num_layers=DflashDrafter.max_num_layers,
    ),
}
