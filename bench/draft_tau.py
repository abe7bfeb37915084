"""How well drafts guess SmolLM2-135M: tau (tokens emitted per verifying step) at a fixed K
on the whole committed held-out sets, several drafts side by side, no timing.

``spec_decode.py --quick`` times 4 prompts per set at batch 1, too few to tell drafts
apart reliably. This runs all 64 chat and 64 code prompts (or ``--limit``) in
batches (greedy, bf16, as served; EOS ignored), so drafts can be compared, e.g. before
and after training on new data. The outputs are the target's own greedy tokens whatever
the draft, so every draft is scored on the same text. ``looping`` counts outputs that end
in a loop (a period of 8 tokens or less over the last 32); any drafter predicts those.

    python bench/draft_tau.py drafts/smollm2/eagle3 /path/to/new/eagle3 --k 5
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.spec_decode import _tau, chat_ids, is_looping
from engine.llm import LLM
from engine.model_store import prepare
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from engine.train.corpus import load_heldout


def score(llm: LLM, prompts: list[list[int]], params: SamplingParams, batch: int) -> dict[str, Any]:
    """tau over ``prompts`` and the number of looping outputs."""
    stats = llm.engine.spec.stats  # type: ignore[union-attr]
    before = (stats.num_drafts, stats.num_accepted_tokens)
    looping = 0
    for i in range(0, len(prompts), batch):
        outs = llm.generate(prompts[i : i + batch], params, use_tqdm=False)
        looping += sum(is_looping(o.token_ids) for o in outs)
    drafts = stats.num_drafts - before[0]
    accepted = stats.num_accepted_tokens - before[1]
    return {"tau": _tau([(drafts, accepted)]), "num_steps": drafts, "looping": looping}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("drafts", nargs="+", type=Path, help="draft directories to compare")
    parser.add_argument("--k", type=int, default=5, help="drafts per step (DFlash: its block)")
    parser.add_argument("--batch", type=int, default=16, help="prompts decoded together")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=None, help="first N prompts of each set")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--dtype", default="bfloat16", help="target and draft dtype (bfloat16 as served)"
    )
    args = parser.parse_args()
    for draft in args.drafts:
        if not (draft / "config.json").is_file():
            parser.error(f"{draft}: no config.json; give a draft directory (train-draft --out)")

    model_dir = prepare("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sets = {
        name: [chat_ids(tokenizer, p) for p in load_heldout(name)[: args.limit]]
        for name in ("chat", "code")
    }
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    results: dict[str, Any] = {}
    for draft in tqdm(args.drafts, desc="drafts"):
        llm = LLM(
            str(model_dir),
            dtype=args.dtype,
            kv_cache_memory=512 << 20,
            max_num_seqs=args.batch,
            num_threads=args.threads,
            speculative=SpeculativeConfig(str(draft), num_draft_tokens=args.k),
        )
        results[str(draft)] = {name: score(llm, p, params, args.batch) for name, p in sets.items()}
        row = results[str(draft)]
        print(
            f"{draft}: tau chat {row['chat']['tau']:.3f}, code {row['code']['tau']:.3f} "
            f"(K={args.k}; looping outputs {row['chat']['looping']} and "
            f"{row['code']['looping']} of {len(sets['chat'])} and {len(sets['code'])})",
            flush=True,
        )
    print(json.dumps({"k": args.k, "new_tokens": args.new_tokens, "drafts": results}))


if __name__ == "__main__":
    main()
