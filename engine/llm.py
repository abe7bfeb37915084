"""Offline generation: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from typing import Any

from tqdm import tqdm

from engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
from engine.sampling_params import SamplingParams


class LLM:
    """Loads a model once and generates for batches of prompts (text or token ids).
    ``model``: a model directory, a prepared model's name, or a GGUF file (``x.gguf``).
    ``engine_kwargs`` are EngineConfig's: ``tensor_parallel_size=N`` splits the model over N
    ranks, each a process of its own."""

    def __init__(
        self,
        model: str,
        dtype: str = "bfloat16",
        max_model_len: int | None = None,
        **engine_kwargs: Any,
    ) -> None:
        from transformers import AutoTokenizer

        from engine.model_store import resolve_model

        model = str(resolve_model(model))  # a prepared name, or a GGUF file's own directory
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        config = EngineConfig(
            model=str(model), dtype=dtype, max_model_len=max_model_len, **engine_kwargs
        )
        self.engine = LLMEngine(config, tokenizer=self.tokenizer)
        self._next_id = 0

    def generate(
        self,
        prompts: Seq[str | list[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion as one continuous batch; outputs in prompt order."""
        params = params or SamplingParams()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"params: got {len(per_prompt)} for {len(prompts)} prompts")
        ids = []
        for prompt, p in zip(prompts, per_prompt, strict=True):
            token_ids = self._encode(prompt)
            request_id = f"offline-{self._next_id}"
            self._next_id += 1
            self.engine.add_request(request_id, token_ids, p)
            ids.append(request_id)
        finished: dict[str, RequestOutput] = {}
        start, num_tokens = time.perf_counter(), 0
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    num_tokens += 1
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
                bar.set_postfix(tok_s=f"{num_tokens / (time.perf_counter() - start):.1f}")
        return [finished[i] for i in ids]

    def close(self) -> None:
        """Stops the engine's other tensor-parallel ranks, if any (also done when the
        interpreter exits)."""
        self.engine.close()

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return [int(t) for t in self.tokenizer.encode(prompt)]
        return list(prompt)

    def chat_prompt(self, message: str) -> str:
        """The tokenizer's chat template around one user message (text, with generation prompt)."""
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
        )
        return str(text)


__all__ = ["LLM", "RequestOutput", "SamplingParams"]
