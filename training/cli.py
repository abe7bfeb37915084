"""`tandem train-draft`: self-distil an EAGLE, EAGLE-3 or DFlash draft for a target model;
`tandem draft-data`: the target's self-distillation data in shards, for sets larger than
one sitting.

Registered through the ``tandem.commands`` entry points; torch and the trainer are
imported inside the handler, so `tandem --help` stays fast.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

Subparsers = Any  # argparse._SubParsersAction; private in argparse


def register_train_draft(subparsers: Subparsers) -> None:
    """Add `tandem train-draft`."""
    parser = subparsers.add_parser(
        "train-draft",
        help="train a draft model for speculative decoding",
        description="Generate training data with the target itself (greedy continuations of "
        "corpus prompts, cached in OUT/data) or read it (--data), compute the target's hidden "
        "states of the training sequences once (cached in fp16 in OUT/data), train a draft of "
        "the given kind on them, report held-out acceptance after each epoch, and save the "
        "draft in HF layout (fp16) with manifest.json in OUT. --resume continues from "
        "OUT/checkpoint; --init-from fine-tunes an existing draft.",
    )
    _add_target(parser)
    parser.add_argument("--kind", required=True, choices=["eagle", "eagle3", "dflash"])
    parser.add_argument("--out", required=True, help="directory of the trained draft")
    _add_data_recipe(parser, num_prompts=2000, what="training prompts")
    parser.add_argument(
        "--data",
        nargs="+",
        type=Path,
        metavar="PATH",
        help="train on sequences saved earlier instead of generating them: files such as "
        "OUT/data/sequences.safetensors, or directories of *.safetensors shards; all files "
        "are concatenated in sorted path order",
    )
    parser.add_argument(
        "--max-sequences",
        type=int,
        default=None,
        metavar="N",
        help="use only the first N sequences, training and held-out (quick runs)",
    )
    parser.add_argument(
        "--no-feature-cache",
        dest="feature_cache",
        action="store_false",
        help="compute the target's hidden states for every batch of every epoch instead of "
        "once into OUT/data/features-KIND-*.safetensors (fp16; 2 bytes x tokens x features)",
    )
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW)")
    parser.add_argument("--intermediate-size", type=int, default=1536, help="draft MLP width")
    parser.add_argument(
        "--num-layers", type=int, default=None, help="draft layers (DFlash; default 2)"
    )
    parser.add_argument("--block-size", type=int, default=8, help="DFlash block size")
    parser.add_argument(
        "--num-draft-steps",
        type=int,
        default=None,
        help="chain steps trained per anchor (training-time test; EAGLE 2, EAGLE-3 4)",
    )
    parser.add_argument(
        "--draft-vocab-size", type=int, default=16384, help="EAGLE-3 reduced vocabulary"
    )
    parser.add_argument(
        "--draft-attention",
        choices=["mha", "mla"],
        default=None,
        help="EAGLE-3's layer: multi-head attention with its own paged K/V, or MLA in the "
        "target's cache layout (default: the target's own; mla needs a DeepSeek-V3 target)",
    )
    parser.add_argument(
        "--anchors-per-seq",
        type=int,
        default=None,
        help="anchor positions per sequence and step (0: all; default all, DFlash 16)",
    )
    parser.add_argument(
        "--soft-labels",
        type=int,
        default=0,
        metavar="K",
        help="train on the target's distribution over each next token, cut to its K most "
        "likely tokens (computed with the features, cached beside them), instead of on its "
        "greedy token (0, the default)",
    )
    parser.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    parser.add_argument(
        "--init-from",
        metavar="DRAFT_DIR",
        default=None,
        help="fine-tune a trained draft of the same kind (e.g. on new data) instead of "
        "starting from a fresh one; its shape is kept, so --intermediate-size does not "
        "apply; an EAGLE-3 draft's vocabulary is chosen again from the new data at "
        "--draft-vocab-size (tokens it had keep their trained rows)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the target and the draft run for training, e.g. cuda (default: cpu); "
        "the continuations are generated on CPU",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=_train_draft)


def _train_draft(args: argparse.Namespace) -> int:
    def train(target: Path) -> int:
        from training.data import load_sequence_files
        from training.train_draft import TrainConfig, train_draft

        config = TrainConfig(
            target=str(target),
            kind=args.kind,
            out=args.out,
            num_prompts=args.num_prompts,
            max_new_tokens=args.max_new_tokens,
            max_prompt_len=args.max_prompt_len,
            epochs=args.epochs,
            batch_size=args.batch_size,
            lr=args.lr,
            intermediate_size=args.intermediate_size,
            num_layers=args.num_layers,
            block_size=args.block_size,
            num_draft_steps=args.num_draft_steps,
            draft_vocab_size=args.draft_vocab_size,
            draft_attention=args.draft_attention,
            anchors_per_seq=args.anchors_per_seq,
            soft_labels=args.soft_labels,
            max_sequences=args.max_sequences,
            feature_cache=args.feature_cache,
            resume=args.resume,
            init_from=args.init_from,
            threads=args.threads,
            device=args.device,
            seed=args.seed,
            command=shlex.join(["tandem", *sys.argv[1:]]),
        )
        data, data_meta = load_sequence_files(args.data) if args.data else (None, None)
        manifest = train_draft(config, data, data_meta)
        print(
            f"{args.kind} draft in {args.out}: {manifest['epochs']} epoch(s), final loss "
            f"{manifest['final_loss']:.4f}, held-out tau {manifest['heldout_tau']:.3f} "
            f"(decoding: {manifest['heldout_decoding_tau']:.3f})"
        )
        return 0

    return _run("train-draft", args.target, train)


def register_draft_data(subparsers: Subparsers) -> None:
    """Add `tandem draft-data`."""
    parser = subparsers.add_parser(
        "draft-data",
        help="generate self-distillation data for train-draft, in resumable shards",
        description="Build the training corpus's prompts (held-out prompts excluded), cut them "
        "into shards of --shard-size, and generate the target's greedy bf16 continuations "
        "shard by shard into OUT/shardNNN.safetensors. A shard already there with the same "
        "recipe is kept: a stopped run resumes, and a larger --num-shards adds to the set. "
        "Train on it with `tandem train-draft --data OUT`.",
    )
    _add_target(parser)
    parser.add_argument("--out", required=True, type=Path, help="directory of the shards")
    _add_data_recipe(parser, num_prompts=6000, what="prompts in the whole set")
    parser.add_argument("--shard-size", type=int, default=250, help="sequences per shard")
    parser.add_argument(
        "--num-shards", type=int, default=None, help="make the first N shards only (default all)"
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=64, help="continuations generated at once"
    )
    parser.add_argument(
        "--self-instruct",
        type=int,
        default=0,
        metavar="N",
        help="add N chat messages that the target writes itself when shown its chat template "
        "up to a user turn (sampled; kept in OUT/self_instruct.jsonl): prompts like those "
        "people send a chat model, which the corpus lacks",
    )
    parser.add_argument(
        "--self-instruct-openers",
        action="store_true",
        help="begin each self-instruct message with the next of a fixed list of openers "
        "('Write', 'Explain', 'How do I', ...; training.self_instruct.DEFAULT_OPENERS), "
        "the target writing the rest: many kinds of request, where unsteered a small "
        "target writes a few kinds again and again",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=1, help="corpus order")
    parser.set_defaults(func=_draft_data)


def _draft_data(args: argparse.Namespace) -> int:
    def make(target: Path) -> int:
        from training.data import prepare_shards
        from training.self_instruct import DEFAULT_OPENERS

        paths = prepare_shards(
            target,
            args.out,
            num_prompts=args.num_prompts,
            shard_size=args.shard_size,
            num_shards=args.num_shards,
            max_new_tokens=args.max_new_tokens,
            max_prompt_len=args.max_prompt_len,
            seed=args.seed,
            num_threads=args.threads,
            max_num_seqs=args.max_num_seqs,
            self_instruct=args.self_instruct,
            self_instruct_openers=DEFAULT_OPENERS if args.self_instruct_openers else (),
        )
        print(f"{len(paths)} shard(s) in {args.out}")
        return 0

    return _run("draft-data", args.target, make)


def _add_target(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target", required=True, help="a prepared model name (e.g. smollm2) or a HF model dir"
    )


def _add_data_recipe(parser: argparse.ArgumentParser, *, num_prompts: int, what: str) -> None:
    """The self-distillation data's recipe, as train-draft and draft-data both take it."""
    parser.add_argument("--num-prompts", type=int, default=num_prompts, help=what)
    parser.add_argument("--max-new-tokens", type=int, default=128, help="continuation length")
    parser.add_argument("--max-prompt-len", type=int, default=192, help="prompt tokens at most")


def _run(command: str, target_name: str, body: Callable[[Path], int]) -> int:
    """``body`` on the resolved target; an unknown target, or a config, data or weight error
    (each names the problem), is one line on stderr and exit status 2."""
    from engine.model_store import ModelNotFoundError, resolve_model

    try:
        return body(Path(resolve_model(target_name)))
    except (ModelNotFoundError, ValueError, OSError) as exc:
        print(f"tandem {command}: error: {exc}", file=sys.stderr)
        return 2
