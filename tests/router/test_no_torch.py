"""The router runs without torch: in a fresh interpreter, its modules load, build a validator
over the real SmolLM2 tokenizer and validate a chat, leaving torch, transformers and the
engine unimported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import json, sys
import router.service, router.validation, router.tokenizer, router.routing, router.models
import router.http_api.app, router.http_api.server
from router.models import resolve_model_dir
from router.tokenizer import load_tokenizer
from router.validation import ModelInfo, RequestValidator
from tandem.v1 import generation_pb2 as gen

model_dir = resolve_model_dir(sys.argv[1])
validator = RequestValidator(ModelInfo.from_dir(model_dir, "smollm2"), load_tokenizer(model_dir))
chat = gen.ChatMessages(messages=[gen.ChatMessage(role="user", content="What is 2+2?")])
valid = validator.validate(gen.GenerateRequest(chat=chat, sampling=gen.SamplingParams(top_p=0.5)))
loaded = sorted(m for m in ("torch", "transformers", "engine") if m in sys.modules)
print(json.dumps({"ids": valid.prompt_token_ids, "loaded": loaded}))
"""


def test_the_router_imports_neither_torch_nor_the_engine(smollm2_dir: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(smollm2_dir)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["loaded"] == []
    from transformers import AutoTokenizer  # here, in the test's own interpreter

    reference = AutoTokenizer.from_pretrained(str(smollm2_dir))
    chat = [{"role": "user", "content": "What is 2+2?"}]
    want = reference.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    assert result["ids"] == list(want if isinstance(want, list) else want["input_ids"])
