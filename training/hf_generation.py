"""The target's greedy continuations through transformers' ``generate``, batched: the
self-distillation data of a run where Tandem's own engine is not used (a GPU it has never
served on: scripts/gpu_train_drafts)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from training.data import SequenceSet, chat_prompt_ids, special_token_ids


@dataclass(frozen=True)
class HfTarget:
    """The target in transformers (bf16 on a GPU, fp32 on CPU) and its tokenizer, loaded
    once for every ``hf_greedy_sequences`` call."""

    model: Any
    tokenizer: Any
    device: str

    @classmethod
    def load(cls, target_dir: str | Path, device: str) -> HfTarget:
        dtype = torch.bfloat16 if device != "cpu" else torch.float32
        model: Any = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype)
        # generate falls back on this EOS when a call names none: calls name it themselves
        model.generation_config.eos_token_id = None
        tokenizer = AutoTokenizer.from_pretrained(target_dir)
        return cls(model.to(device).eval(), tokenizer, device)


def hf_greedy_sequences(
    target: HfTarget,
    seconds: float,
    texts: Sequence[str],
    max_new_tokens: int,
    *,
    ignore_eos: bool = False,
    max_prompt_len: int = 192,
) -> SequenceSet:
    """The target's greedy continuations of ``texts`` in its chat template through
    transformers' ``generate``, batch after batch (longest prompts first) until ``seconds``
    have passed: a ``training.data.SequenceSet``.

    A continuation ends with the EOS the target chose, unless ``ignore_eos``: then every
    one is ``max_new_tokens`` long, past EOS, as a benchmark run with EOS ignored serves it.
    """
    deadline = time.monotonic() + seconds
    model, tokenizer, device = target.model, target.tokenizer, target.device
    prompts = chat_prompt_ids(tokenizer, texts, max_prompt_len)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    pad = eos if pad is None else pad
    batch_size = 512 if device != "cpu" else 8
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    sequences, prompt_lens = [], []
    for start in range(0, len(order), batch_size):
        if time.monotonic() >= deadline:
            break
        rows = [prompts[i] for i in order[start : start + batch_size]]
        width = max(map(len, rows))
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=None if ignore_eos else eos,
            )
        new_rows = out[:, width:].tolist()
        if ignore_eos and len(new_rows[0]) != max_new_tokens:
            raise RuntimeError(f"generate stopped at {len(new_rows[0])} tokens with EOS ignored")
        for row, new in zip(rows, new_rows, strict=True):
            if not ignore_eos and eos in new:  # kept, as the engine's continuations keep it
                new = new[: new.index(eos) + 1]
            sequences.append(row + new)
            prompt_lens.append(len(row))
    if not sequences:
        raise RuntimeError(f"no sequence was generated within {seconds:.0f} s")
    return SequenceSet(sequences, prompt_lens, special_token_ids(tokenizer))
