"""What prefill and decode workers share about their engine: command-line options, building
the engine (and tokenizer), the draft's DraftConfig with its fingerprint, the KV layout.

Two workers can hand KV to each other only if their layouts match, draft fingerprint
included: the fingerprint hashes the drafter's settings and its weights (an MTP draft's,
which are the model's own: the model's config and its files' names and sizes).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.engine_config import FP8_WEIGHTS
from serving.lora_setup import add_lora_arguments, check_lora_arguments, parse_lora_modules
from tandem.v1 import worker_pb2

if TYPE_CHECKING:  # torch: imported by the functions that need it, so `--help` stays light
    from engine.engine_figures import EngineStats
    from engine.llm_engine import LLMEngine
    from kv_transfer import KvLayout

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
MODEL_DRAFT_KINDS = ("eagle", "eagle3", "dflash")  # engine.spec.drafters.DRAFTERS
# suffix: engine.spec.config.MODEL_FREE_KINDS; mtp: TARGET_FILE_KINDS (the target's own layer)
DRAFT_METHODS = (*MODEL_DRAFT_KINDS, "suffix", "mtp")
SUFFIX_CACHE_TOKENS = 1 << 18  # engine.spec.suffix.SuffixConfig.shared_tokens


def add_model_arguments(parser: Any) -> None:
    """--model, --served-model-name and --tokenizer: the workers' and `tandem serve`'s."""
    parser.add_argument(
        "--model", required=True, help="HF model directory, a prepared name, or a .gguf file"
    )
    parser.add_argument(
        "--served-model-name",
        help="name clients use (default: the directory's; a .gguf file's stem)",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="with --model FILE.gguf: a HF tokenizer directory instead of the file's metadata",
    )


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `tandem prefill`, `tandem decode` and `tandem serve` that shape the engine."""
    group = parser.add_argument_group("model and engine")
    add_model_arguments(group)
    group.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        default="bfloat16",
        help="activations and weights; a GGUF file's Q4_0/Q4_1/Q8_0 projections stay "
        "quantized, except in float32 (dequantized at load time)",
    )
    group.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    group.add_argument("--max-num-seqs", type=int, default=64, help="rows per engine step")
    group.add_argument(
        "--kv-cache-memory",
        type=int,
        help="KV cache bytes (default: 10%% of total memory); a split model's ranks each "
        "take this much for their KV heads",
    )
    group.add_argument("--threads", type=int, help="torch CPU threads of this process")
    group.add_argument(
        "--fp8-weights",
        choices=FP8_WEIGHTS,
        default="auto",
        help="a block-FP8 checkpoint's projections: dequantize them once at load time (as "
        "fast as bf16 on CPU) or keep them FP8 (half of bf16's weight bytes; W8A8 Triton "
        "products on the GPU path, 0.35-0.55x bf16's speed on CPU). auto: keep where the "
        "Triton kernels run, else dequantize (default: auto)",
    )
    group.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="split the model over N ranks, each a process of its own started by this one, "
        "one worker in the ledger (a Llama-3 or DeepSeek-V3 model whose heads divide by N); "
        "on CPU each "
        "rank gets its share of --threads and compiles its shard. KV travels between "
        "workers as whole heads, so prefill and decode workers may differ in N (default: 1)",
    )
    group.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="DeepSeek-V3's data-parallel attention over N ranks (processes): each caches "
        "and attends its own requests, the experts split over all of them. Requests go to "
        "the rank with most free blocks, and the router balances by each rank's room. "
        "With --tensor-parallel-size T each is T ranks splitting its attention by heads "
        "(N x T in all). Ranks on one host's CPU (default: 1)",
    )
    group.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="a mixture of experts (DeepSeek-V3) split over the ranks: each holds a share of the "
        "routed experts whole, rather than every expert's share of channels",
    )
    group.add_argument(
        "--attention-backend",
        choices=("auto", "torch", "triton", "flash_attn"),  # engine.attention.BACKENDS
        default="auto",
        help="auto: flash-attn or the Triton kernels on CUDA, the torch backend (C++ kernels) "
        "on CPU (default: auto)",
    )
    group.add_argument(
        "--kernels",
        choices=("auto", "torch", "triton"),  # engine.engine_config.KERNELS
        default="auto",
        help="RMSNorm, RoPE, SiLU-and-mul and sampling: auto: the Triton kernels beside the "
        "triton or flash_attn attention backend, torch ops otherwise (default: auto)",
    )
    add_speculation_arguments(group)
    add_lora_arguments(group)
    group.add_argument(
        "--grammar-compile-timeout-s",
        type=float,
        default=10.0,
        help="structured output: refuse a schema, regex or grammar that takes longer to "
        "compile (INVALID_ARGUMENT) (default: 10)",
    )
    group.add_argument(
        "--eager",
        action="store_true",
        help="run eagerly, without torch.compile. By default decode workers (co-located ones "
        "included) compile their decode steps before they report SERVING (CPU: about 1.8x "
        "the tokens per second at batch 1; the first start takes minutes, a restart with the "
        "compile cache warm far less); prefill workers run prefill eagerly either way",
    )
    group.add_argument(
        "--torch-compile",
        action="store_true",
        help="accepted for old command lines and changes nothing: compiling is the default "
        "(--eager turns it off)",
    )


def add_speculation_arguments(group: argparse._ActionsContainer) -> None:
    """The draft and how deep it drafts: `tandem serve`'s and both workers'."""
    group.add_argument(
        "--draft",
        metavar="DIR",
        help="EAGLE / EAGLE-3 / DFlash draft directory (its kind is read from its config)",
    )
    group.add_argument(
        "--draft-method",
        choices=DRAFT_METHODS,
        help="how decode workers draft: suffix: from the request's own prompt and output and "
        "recent outputs, with no draft model (wins where text repeats: code edits, quoting, "
        "JSON); mtp: DeepSeek-V3's own multi-token-prediction layer, read from the model's "
        "files (no --draft); eagle, eagle3, dflash: the --draft model's kind, checked against "
        "its config "
        "(default: the --draft model's kind, else no speculation)",
    )
    group.add_argument(
        "--num-draft-tokens",
        type=int,
        default=5,
        metavar="K",
        help="the most draft tokens a decode step verifies (default: 5); with adaptive "
        "speculation, the default, each step drafts 0 to K",
    )
    group.add_argument(
        "--suffix-cache-tokens",
        type=int,
        default=SUFFIX_CACHE_TOKENS,
        metavar="N",
        help="suffix decoding: tokens of recent requests' outputs kept to draft from, the "
        f"least recently used dropped first; 0: each request drafts from its own tokens only "
        f"(default: {SUFFIX_CACHE_TOKENS})",
    )
    group.add_argument(
        "--no-adaptive-speculation",
        dest="adaptive_speculation",
        action="store_false",
        help="draft exactly --num-draft-tokens every step. By default a decode worker with a "
        "draft measures its step costs at start-up and chooses K per step (0 to "
        "--num-draft-tokens) from them and the acceptance it observes, so that speculating "
        "never makes a batch slower than plain decoding; prefill workers draft the most "
        "either way",
    )


def check_engine_arguments(args: argparse.Namespace, prog: str) -> bool:
    """False (with the error on stderr) for ``--eager`` with ``--torch-compile``, a
    ``--draft-method`` that does not fit ``--draft``, ``--no-adaptive-speculation``
    without any draft, or a tensor-parallel size below 1; a lone ``--torch-compile`` gets
    a note."""
    why = draft_method_error(args.draft, args.draft_method)
    if args.suffix_cache_tokens < 0:
        why = f"--suffix-cache-tokens: must be 0 or more, got {args.suffix_cache_tokens}"
    size = getattr(args, "tensor_parallel_size", 1)
    if size < 1:
        why = f"--tensor-parallel-size: must be at least 1, got {size}"
    data_parallel = getattr(args, "data_parallel_size", 1)
    if data_parallel < 1:
        why = f"--data-parallel-size: must be at least 1, got {data_parallel}"
    if args.torch_compile and args.eager:
        why = "--torch-compile, --eager: give one (compiling is the default)"
    why = why or check_lora_arguments(args, prog)
    if why:
        print(f"{prog}: error: {why}", file=sys.stderr)
        return False
    if not args.adaptive_speculation and not (args.draft or args.draft_method):
        print(
            f"{prog}: error: --no-adaptive-speculation: needs --draft or --draft-method "
            "(without a draft there is no speculation to fix)",
            file=sys.stderr,
        )
        return False
    if args.torch_compile:
        print(
            f"{prog}: note: --torch-compile is the default now and changes nothing; --eager "
            "turns compiling off",
            file=sys.stderr,
        )
    return True


def draft_method_error(draft: str | None, method: str | None) -> str | None:
    """Why ``--draft-method`` does not fit ``--draft``, naming both; None where it does."""
    if method == "mtp" and draft:
        return (
            "--draft-method mtp, --draft: the MTP layer comes from the model's own files; "
            "give no --draft"
        )
    if method == "suffix" and draft:
        return (
            "--draft-method suffix, --draft: combining suffix drafts with a draft model is "
            "not built yet; give one of them"
        )
    if method in MODEL_DRAFT_KINDS and not draft:
        return f"--draft-method {method}: needs --draft DIR (a {method} draft model)"
    if method in MODEL_DRAFT_KINDS and draft:
        from engine.config import read_hf_config
        from engine.spec.drafters import detect_kind

        try:
            kind = detect_kind(read_hf_config(draft))
        except (OSError, ValueError) as e:  # a DraftConfigError is a ValueError
            return f"--draft: {draft} has no readable draft config ({e})"
        if kind != method:
            return (
                f"--draft-method {method}: the draft {draft} is a {kind} draft (its "
                f"config.json says so); give --draft-method {kind} or leave it out"
            )
    return None


@dataclass(frozen=True)
class ModelSpec:
    """The served model as every component names it."""

    model_dir: Path
    served_name: str
    draft_dir: Path | None
    num_draft_tokens: int
    draft_method: str | None = None  # --draft-method: "suffix" and "mtp" without a draft_dir

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ModelSpec:
        from engine.model_store import resolve_model, served_name

        model_dir = Path(resolve_model(args.model, tokenizer=getattr(args, "tokenizer", None)))
        draft_dir = Path(args.draft) if args.draft else None
        return cls(
            model_dir=model_dir,
            served_name=args.served_model_name or served_name(model_dir),
            draft_dir=draft_dir,
            num_draft_tokens=args.num_draft_tokens,
            draft_method=args.draft_method,
        )


def has_tokenizer(model_dir: Path) -> bool:
    return any((model_dir / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(model_dir: Path) -> Any | None:
    """The model's tokenizer, or None for a directory without one (token ids only)."""
    if not has_tokenizer(model_dir):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def build_engine(
    spec: ModelSpec, args: argparse.Namespace, *, is_decoding: bool, preemption: str = "recompute"
) -> LLMEngine:
    """``is_decoding``: a decode worker (co-located or not), whose decode steps compile
    unless ``--eager``; a prefill worker's engine never compiles (it runs prefill chunks,
    eagerly). ``preemption="hand_back"`` on decode workers: a request preempted for lack
    of blocks goes back to the router, which re-prefills it on a prefill worker."""
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.model_store import use_compile_cache
    from engine.spec.config import SpeculativeConfig
    from engine.spec.suffix import SuffixConfig
    from serving.engine_loop import exit_worker

    use_compile_cache()  # before anything compiles
    lora_modules = parse_lora_modules(args.lora_modules)
    if any(name == spec.served_name for name, _ in lora_modules):
        raise ValueError(
            f"--lora-modules: {spec.served_name!r} is the served model's name; give the "
            "adapter another (a request's model field names one or the other)"
        )
    speculative = None
    if spec.draft_dir is not None:
        speculative = SpeculativeConfig(
            str(spec.draft_dir),
            num_draft_tokens=spec.num_draft_tokens,
            kind=spec.draft_method,
            # a decode worker's steps; a prefill worker's first drafts are always K deep
            adaptive=is_decoding and args.adaptive_speculation,
        )
    elif spec.draft_method == "mtp":  # both roles: a prefill worker makes the first drafts
        speculative = SpeculativeConfig(
            "",
            num_draft_tokens=spec.num_draft_tokens,
            kind="mtp",
            adaptive=is_decoding and args.adaptive_speculation,
        )
    elif spec.draft_method == "suffix" and is_decoding:  # a prefill worker has none to make
        speculative = SpeculativeConfig(
            "",
            num_draft_tokens=spec.num_draft_tokens,
            kind="suffix",
            adaptive=args.adaptive_speculation,
            suffix=SuffixConfig(shared_tokens=args.suffix_cache_tokens),
        )
    config = EngineConfig(
        model=str(spec.model_dir),
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        kv_cache_memory=args.kv_cache_memory,
        num_threads=args.threads,
        speculative=speculative,
        preemption=preemption,
        torch_compile=is_decoding and not args.eager,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        fp8_weights=args.fp8_weights,
        attention_backend=args.attention_backend,
        kernels=args.kernels,
        grammar_compile_timeout_s=args.grammar_compile_timeout_s,
        lora_modules=lora_modules,
        enable_lora=args.allow_runtime_lora,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        max_loras=args.max_loras,
        warm_up=True,  # before health turns SERVING: no request pays for lazy set-up
        build_cpu_kernels=False,  # workers only load a prebuilt CPU kernels extension
    )
    engine = LLMEngine(config, tokenizer=load_tokenizer(spec.model_dir))
    engine.runner.executor.on_rank_lost(exit_worker)  # serving.engine_loop's
    return engine


def draft_config(engine: LLMEngine, spec: ModelSpec) -> worker_pb2.DraftConfig | None:
    """The engine's draft model as the wire describes it, with its fingerprint; None
    without one (suffix decoding has none: its KV and drafts are the decode worker's own).
    An MTP draft's files are the model's: its fingerprint covers their names and sizes and
    the model's config, not their bytes (hundreds of gigabytes)."""
    if engine.spec is None or engine.spec.drafter is None:
        return None
    if spec.draft_dir is None and spec.draft_method != "mtp":
        return None
    signature = engine.spec.drafter.signature()
    message = worker_pb2.DraftConfig(
        kind=signature.kind,
        draft_model=spec.draft_dir.name if spec.draft_dir else f"{spec.served_name}:mtp",
        num_draft_tokens=engine.spec.k,
        block_size=signature.block_size,
        mask_token_id=signature.mask_token_id,
        target_layer_ids=[int(i) for i in signature.target_layer_ids],
    )
    digest = hashlib.sha256(message.SerializeToString(deterministic=True))
    if spec.draft_dir is None:  # mtp
        for path in sorted(spec.model_dir.glob("*.safetensors")):
            digest.update(f"{path.name}:{path.stat().st_size}".encode())
        digest.update((spec.model_dir / "config.json").read_bytes())
        message.fingerprint = digest.hexdigest()[:32]
        return message
    for path in [*sorted(spec.draft_dir.glob("*.safetensors")), spec.draft_dir / "config.json"]:
        digest.update(path.name.encode())
        with path.open("rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    message.fingerprint = digest.hexdigest()[:32]
    return message


def kv_layout(engine: LLMEngine, served_name: str, fingerprint: str) -> KvLayout:
    """The layout of this engine's KV pools (what a push must match)."""
    from kv_transfer import KvLayout

    pools = engine.kv_pools
    return KvLayout.of_pools(served_name, pools["target"], pools.get("draft"), fingerprint)


def rank_figures(engine: LLMEngine, stats: EngineStats) -> dict[str, str | int | float]:
    """How the engine's ranks split it, as heartbeat figures: tensor-parallel ranks split
    its KV heads; data-parallel ranks each hold their own requests' blocks (their free
    blocks, comma-separated; the load counts the emptiest rank's)."""
    figures: dict[str, str | int | float] = {
        "tensor_parallel_size": engine.config.tensor_parallel_size,
        "data_parallel_size": engine.config.data_parallel_size,
    }
    if stats.num_free_blocks_per_rank:
        figures["num_free_blocks_per_rank"] = ",".join(map(str, stats.num_free_blocks_per_rank))
    return figures


def draft_figures(draft: worker_pb2.DraftConfig | None) -> dict[str, str | int | float]:
    """The draft as heartbeat figures: the router pairs workers with equal fingerprints."""
    if draft is None:
        return {"draft_fingerprint": "", "draft_kind": "", "draft_model": ""}
    return {
        "draft_fingerprint": draft.fingerprint,
        "draft_kind": draft.kind,
        "draft_model": draft.draft_model,
    }
