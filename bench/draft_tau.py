"""How well drafts guess SmolLM2-135M: tau (tokens emitted per verifying step) at a fixed K
on the whole committed held-out sets, several drafts side by side, no timing.

``spec_decode.py --quick`` times 4 prompts per set at batch 1, too few to tell drafts
apart reliably. This runs all 64 chat and 64 code prompts (or ``--limit``) in
batches (greedy, bf16, as served; EOS ignored), so drafts can be compared, e.g. before
and after training on new data. The outputs are the target's own greedy tokens whatever
the draft, so every draft is scored on the same text. ``looping`` counts outputs that end
in a loop (a period of 8 tokens or less over the last 32); any drafter predicts those.

``--reference`` also reads the target's probability of each token it chose (its top-1
probability: the outputs are greedy) and reports the tau that a draft would reach if it
agreed with the target with exactly that probability at every token, as a draft sampling
from the target's own distribution does. It says how sure the target is of its own
choices: a yardstick, not a bound (an argmax draft may beat it), for what a small draft
can be expected to learn. Where the target's top two tokens are close, its argmax turns
on details that a draft with a few percent of its compute does not see.

    python bench/draft_tau.py drafts/smollm2/eagle3 /path/to/new/eagle3 --k 5
    python bench/draft_tau.py drafts/smollm2/eagle3 --k 5 --reference
"""

from __future__ import annotations

import argparse
import json
import math
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
from training.corpus import load_heldout


def reference_tau(confidences: list[list[float]], k: int) -> float:
    """Expected tau of a draft that agrees with the target's token i with probability
    ``confidences[row][i]``, independently, over steps as decoding runs them: the first
    token comes from prefill, then each step from token a drafts a..a+k-1, emits the
    accepted run and one more token, and the next step starts after them."""
    tokens, steps = 0, 0.0
    for q in confidences:
        n = len(q)
        expected = [0.0] * (n + k + 2)  # expected[a]: steps still to come from token a
        for a in range(n - 1, 0, -1):
            run, total = 1.0, 0.0  # run: P(drafts a..a+j-1 all accepted)
            for j in range(k + 1):  # j drafts accepted, then draft j rejected or none left
                is_last = j == k or a + j >= n
                stop = 1.0 if is_last else 1.0 - q[a + j]
                total += run * stop * expected[a + j + 1]
                if is_last:
                    break
                run *= q[a + j]
            expected[a] = 1.0 + total
        tokens += n - 1
        steps += expected[1] if n > 1 else 0.0
    return tokens / steps if steps else float("nan")


def score(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, batch: int, k: int
) -> dict[str, Any]:
    """tau over ``prompts``, the number of looping outputs, and with logprobs asked for,
    the target's confidence in its outputs and ``reference_tau`` of it."""
    stats = llm.engine.spec.stats  # type: ignore[union-attr]
    before = (stats.num_drafts, stats.num_accepted_tokens)
    looping = 0
    confidences: list[list[float]] = []
    for i in range(0, len(prompts), batch):
        outs = llm.generate(prompts[i : i + batch], params, use_tqdm=False)
        looping += sum(is_looping(o.token_ids) for o in outs)
        confidences += [[math.exp(t.logprob) for t in o.logprobs] for o in outs if o.logprobs]
    drafts = stats.num_drafts - before[0]
    accepted = stats.num_accepted_tokens - before[1]
    result = {"tau": _tau([(drafts, accepted)]), "num_steps": drafts, "looping": looping}
    if confidences:
        top1 = [p for q in confidences for p in q]
        result["target_top1_mean"] = sum(top1) / len(top1)
        result["target_top1_below_half"] = sum(p < 0.5 for p in top1) / len(top1)
        result["reference_tau"] = reference_tau(confidences, k)
    return result


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
    parser.add_argument(
        "--reference",
        action="store_true",
        help="also the tau of a draft that agrees with the target as often as the target "
        "is sure of its own tokens (its top-1 probability, read as logprobs)",
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
    params = SamplingParams(
        max_tokens=args.new_tokens,
        temperature=0.0,
        ignore_eos=True,
        logprobs=0 if args.reference else None,
    )
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
        results[str(draft)] = {
            name: score(llm, p, params, args.batch, args.k) for name, p in sets.items()
        }
        row = results[str(draft)]
        print(
            f"{draft}: tau chat {row['chat']['tau']:.3f}, code {row['code']['tau']:.3f} "
            f"(K={args.k}; looping outputs {row['chat']['looping']} and "
            f"{row['code']['looping']} of {len(sets['chat'])} and {len(sets['code'])})",
            flush=True,
        )
        if args.reference:
            print(
                "  the target's confidence in its outputs: mean top-1 probability "
                + ", ".join(
                    f"{name} {row[name]['target_top1_mean']:.3f} (below 0.5 at "
                    f"{row[name]['target_top1_below_half']:.0%} of tokens)"
                    for name in sets
                )
                + "; a draft agreeing that often: tau "
                + ", ".join(f"{name} {row[name]['reference_tau']:.3f}" for name in sets),
                flush=True,
            )
    print(json.dumps({"k": args.k, "new_tokens": args.new_tokens, "drafts": results}))


if __name__ == "__main__":
    main()
