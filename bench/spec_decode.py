"""Speculative decoding on SmolLM2-135M, bf16, on this machine: Tandem without speculation,
with EAGLE, EAGLE-3 and DFlash drafts, transformers' ``generate`` and (batch 1 only, the
only batch it supports) transformers' prompt-lookup decoding, side by side in one run.

Prompts are the committed held-out sets (``training/heldout/{chat,code}.jsonl``), never
used for training. Every row produces exactly ``--new-tokens`` tokens (EOS ignored).
tau is the mean accepted length (tokens emitted per verifying step); ``tau_no_loops``
leaves out outputs that end in a loop (a period of 8 tokens or less over the last 32),
which the Q4_1 SmolLM2 falls into easily and which any drafter predicts trivially.
Adaptive speculation (K chosen per step from measured costs and acceptance, down to 0)
runs beside fixed-K EAGLE-3 at batch 1, and against plain decoding at batch 8 and 32:
there both engines warm up on one full batch, then run ``--repeats`` times in
alternation; the run of median speed is reported, and the ratio of each repeat's pair.
At batch 8 each drafter also runs once at its fixed K, after a warm-up batch. The last
line is one JSON object (batch 1, chat).

    python bench/spec_decode.py            # 16 prompts per set at batch 1, 32 at batch 8/32
    python bench/spec_decode.py --quick    # 4 prompts per set at batch 1, 8 at batch 8
    python bench/spec_decode.py --quick --skip-batch1   # adaptive at batch 8 and 32 only
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import AutoTokenizer, LlamaForCausalLM

from engine.llm import LLM
from engine.model_store import prepare
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from engine.spec.stats import SpecDecodeStats
from training.corpus import load_heldout

DRAFTS = Path(__file__).resolve().parents[1] / "drafts" / "smollm2"
KINDS = ("eagle", "eagle3", "dflash")


def is_looping(tokens: list[int], window: int = 32, max_period: int = 8) -> bool:
    tail = tokens[-window:]
    return len(tail) == window and any(
        all(tail[i] == tail[i + p] for i in range(window - p)) for p in range(1, max_period + 1)
    )


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def run_tandem_bs1(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
    """One prompt at a time; per-request tau from the counters' deltas."""
    spec = llm.engine.spec
    taus, looping, elapsed, tokens = [], [], 0.0, 0
    for prompt in prompts:
        before = (spec.stats.num_drafts, spec.stats.num_accepted_tokens) if spec else (0, 0)
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        elapsed += time.perf_counter() - start
        tokens += len(out.token_ids)
        looping.append(is_looping(out.token_ids))
        if spec:
            drafts = spec.stats.num_drafts - before[0]
            taus.append((drafts, spec.stats.num_accepted_tokens - before[1]))
    result: dict[str, Any] = {"tok_s": tokens / elapsed, "num_looping": sum(looping)}
    if spec:
        result["tau"] = _tau(taus)
        result["tau_no_loops"] = _tau(
            [t for t, loop in zip(taus, looping, strict=True) if not loop]
        )
    return result


def _tau(parts: list[tuple[int, int]]) -> float | None:
    """Mean accepted length, or None (JSON null) where no step drafted anything."""
    drafts = sum(d for d, _ in parts)
    return 1.0 + sum(a for _, a in parts) / drafts if drafts else None


def run_tandem_batch(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, batch: int
) -> dict[str, Any]:
    spec = llm.engine.spec
    stats = spec.stats if spec else SpecDecodeStats()
    before = (stats.num_drafts, stats.num_accepted_tokens, stats.num_steps_without_drafts)
    elapsed, tokens = 0.0, 0
    for i in range(0, len(prompts), batch):
        start = time.perf_counter()
        outs = llm.generate(prompts[i : i + batch], params, use_tqdm=False)
        elapsed += time.perf_counter() - start
        tokens += sum(len(o.token_ids) for o in outs)
    result: dict[str, Any] = {"tok_s": tokens / elapsed}
    if spec:
        drafts = stats.num_drafts - before[0]
        result["tau"] = _tau([(drafts, stats.num_accepted_tokens - before[1])])
        plain = stats.num_steps_without_drafts - before[2]
        result["k0_fraction"] = plain / max(1, plain + drafts)  # row-steps that drafted nothing
    return result


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median speed, with every run's tok/s beside it."""
    ordered = sorted(runs, key=lambda r: r["tok_s"])
    return {**ordered[len(ordered) // 2], "tok_s_runs": [r["tok_s"] for r in runs]}


def run_hf(
    model: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    new_tokens: int,
    batch: int,
    prompt_lookup: bool = False,
) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    if prompt_lookup:
        kwargs["prompt_lookup_num_tokens"] = 10
    elapsed, tokens = 0.0, 0
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        width = max(len(p) for p in group)
        pad = tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, **kwargs)
        elapsed += time.perf_counter() - start
        tokens += (out.shape[1] - width) * len(group)
    return {"tok_s": tokens / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer prompts (a few minutes)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--num-draft-tokens", type=int, default=5, help="K for EAGLE/EAGLE-3")
    parser.add_argument(
        "--drafts", type=Path, default=DRAFTS, help="dir with eagle/, eagle3/, dflash/"
    )
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--skip-batched", action="store_true", help="batch 1 only")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs per engine at batch 8 and 32, alternating; the median is reported",
    )
    parser.add_argument(
        "--skip-batch1",
        action="store_true",
        help="batch 8 and 32 only (the last line then holds their figures)",
    )
    parser.add_argument(
        "--torch-compile",
        action="store_true",
        help="Tandem's decode steps through torch.compile (each engine compiles for a minute "
        "or two first)",
    )
    args = parser.parse_args()

    missing = [k for k in args.kinds if not (args.drafts / k / "config.json").is_file()]
    if missing:
        parser.error(
            f"no {missing} draft under {args.drafts}; train one with "
            "`tandem train-draft --target smollm2 --kind KIND --out DIR`"
        )
    model_dir = prepare("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    n1 = 4 if args.quick else 16
    nb = 8 if args.quick else 32
    sets = {name: [chat_ids(tokenizer, p) for p in load_heldout(name)] for name in ("chat", "code")}
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    common = dict(dtype="bfloat16", kv_cache_memory=512 << 20, torch_compile=args.torch_compile)

    def spec(kind: str, adaptive: bool = False) -> SpeculativeConfig:
        return SpeculativeConfig(
            str(args.drafts / kind), num_draft_tokens=args.num_draft_tokens, adaptive=adaptive
        )

    results: dict[str, Any] = {"batch1": {}, "batched": {}}
    configs = [("nospec", None)] + [(k, spec(k)) for k in args.kinds]
    if "eagle3" in args.kinds:  # what a deployment runs: K per step, down to 0
        configs.append(("eagle3_adaptive", spec("eagle3", adaptive=True)))
    batch1_sets = {} if args.skip_batch1 else sets
    bar = tqdm(total=len(batch1_sets) * (len(configs) + 2), desc="batch 1")
    for set_name, prompts in batch1_sets.items():
        row: dict[str, Any] = {}
        for name, cfg in configs:
            llm = LLM(str(model_dir), speculative=cfg, max_num_seqs=1, **common)
            llm.generate([prompts[0]], params, use_tqdm=False)  # warm-up
            if llm.engine.spec is not None:
                llm.engine.spec.stats = SpecDecodeStats()  # count the measured runs only
            row[name] = run_tandem_bs1(llm, prompts[:n1], params)
            bar.update()
            del llm
        row["hf"] = run_hf(hf, tokenizer, prompts[:n1], args.new_tokens, 1)
        bar.update()
        row["hf_prompt_lookup"] = run_hf(hf, tokenizer, prompts[:n1], args.new_tokens, 1, True)
        bar.update()
        results["batch1"][set_name] = row
    bar.close()

    if not args.skip_batched:
        for batch in (8, 32):
            prompts = (sets["chat"] * 2)[: max(nb, batch)]
            engines = {
                name: LLM(str(model_dir), speculative=cfg, max_num_seqs=batch, **common)
                for name, cfg in [("nospec", None), ("eagle3_adaptive", spec("eagle3", True))]
            }
            # Warm-up: one full batch compiles every shape and settles the adaptive costs.
            for llm in engines.values():
                llm.generate(prompts[:batch], params, use_tqdm=False)
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
            for _ in tqdm(range(args.repeats), desc=f"batch {batch}"):
                for name, llm in engines.items():  # alternating: a slow spell hits both
                    runs[name].append(run_tandem_batch(llm, prompts, params, batch))
            row = {name: median_run(r) for name, r in runs.items()}
            del engines
            if batch == 8:  # each drafter at a fixed K too, one run after a warm-up batch
                for kind in args.kinds:
                    llm = LLM(str(model_dir), speculative=spec(kind), max_num_seqs=batch, **common)
                    llm.generate(prompts[:batch], params, use_tqdm=False)
                    row[kind] = run_tandem_batch(llm, prompts, params, batch)
                    del llm
            row["hf"] = run_hf(hf, tokenizer, prompts, args.new_tokens, batch)
            row["adaptive_over_nospec"] = row["eagle3_adaptive"]["tok_s"] / row["nospec"]["tok_s"]
            # Each repeat ran both engines back to back: their ratio cancels the slow spells
            # that move both alike.
            paired = sorted(
                a["tok_s"] / b["tok_s"]
                for a, b in zip(runs["eagle3_adaptive"], runs["nospec"], strict=True)
            )
            row["adaptive_over_nospec_paired"] = {
                "median": paired[len(paired) // 2],
                "min": paired[0],
                "max": paired[-1],
            }
            results["batched"][str(batch)] = row

    print(
        json.dumps(
            {
                "machine": platform.processor() or platform.machine(),
                "threads": torch.get_num_threads(),
                "results": results,
            },
            indent=1,
        )
    )
    if args.skip_batch1:
        ratios = {
            b: {
                "adaptive_over_nospec": row["adaptive_over_nospec"],
                "paired": row["adaptive_over_nospec_paired"],
            }
            for b, row in results["batched"].items()
        }
        print(json.dumps(ratios))
        return
    chat = results["batch1"]["chat"]
    summary = {
        "nospec_tok_s": chat["nospec"]["tok_s"],
        "hf_tok_s": chat["hf"]["tok_s"],
        "hf_prompt_lookup_tok_s": chat["hf_prompt_lookup"]["tok_s"],
        "drafters": {
            k: {
                "tau": chat[k]["tau"],
                "tau_no_loops": chat[k]["tau_no_loops"],
                "tok_s": chat[k]["tok_s"],
            }
            for k in args.kinds
        },
    }
    if "eagle3_adaptive" in chat:
        summary["eagle3_adaptive_tok_s"] = chat["eagle3_adaptive"]["tok_s"]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
