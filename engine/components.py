"""What an engine is built from: the model and its draft, on their kernels, the paged KV
cache sized for both, the block manager, the scheduler and the runners."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.attention import get_backend, select_backend
from engine.block_manager import BlockManager
from engine.config import Llama3Config, read_hf_config
from engine.dp_blocks import DataParallelBlocks, KvBlocks
from engine.engine_config import EngineConfig
from engine.executor.gathered_kv import GatheredKv
from engine.executor.multiproc import MultiprocExecutor, RankGroup, rank_threads
from engine.executor.shared_kv import DRAFT_LABEL, SharedKv
from engine.executor.worker import RankConfig, load_shard
from engine.fp8 import BlockFp8, QuantizationError
from engine.kv_cache import KVCacheParams, PagedKVCache, plan_num_blocks
from engine.lora.registry import LoraRegistry, lora_registry
from engine.model_runner import ModelRunner
from engine.models.layers import dequantize_fp8, release_packed_weights, use_packed_gemm
from engine.models.triton_layers import use_triton_kernels
from engine.parallel.group import TensorParallelGroup
from engine.registry import (
    ModelConfig,
    check_split,
    eos_token_ids,
    load_whole_vocabulary,
)
from engine.sampling_kernels import sampling_kernels
from engine.scheduler import Scheduler, SchedulerConfig
from engine.spec.dp_draft import DataParallelDrafter
from engine.spec.spec_runner import (
    SpecRunner,
    load_speculator,
    num_draft_tokens,
    num_lookahead_slots,
)
from engine.spec.split_draft import SplitDrafter
from engine.spec.suffix_runner import SuffixSpecRunner
from engine.structured.grammars import Grammars
from kernels.cpu import extension as cpu_kernels

logger = logging.getLogger(__name__)


def kernels_for(kernels: str, attention_backend: str) -> str:
    """What ``EngineConfig.kernels`` means: "auto" follows the attention backend (Triton's
    element-wise and sampling kernels beside the triton and flash_attn backends)."""
    if kernels != "auto":
        return kernels
    return "triton" if attention_backend in ("triton", "flash_attn") else "torch"


def fp8_weights_for(config: EngineConfig, kernels: str) -> str:
    """What ``config.fp8_weights`` means for its block-FP8 checkpoint: "auto" keeps the
    projections FP8 where the Triton kernels run them (W8A8 products, half of bf16's bytes:
    blocks the kernel runs, on a GPU with FP8 arithmetic, sm_89 on) and dequantizes them
    once at load time elsewhere (the packed bf16 products ran 2-3x faster than kept FP8 on
    CPU, bench/RESULTS.md). Raises QuantizationError for "keep" on the Triton kernels with
    blocks the kernel cannot run, before anything loads."""
    if kernels != "triton" or config.fp8_weights == "dequantize":
        return "dequantize" if config.fp8_weights == "auto" else config.fp8_weights
    block = BlockFp8.from_hf(read_hf_config(config.model).get("quantization_config"))
    if block is None:
        return "dequantize" if config.fp8_weights == "auto" else config.fp8_weights
    from kernels.triton.fp8_gemm import supports  # imports triton: on the Triton path only

    device = torch.device(config.device)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    why = ""
    if not supports(block.block_k):
        why = (
            f"quantization_config.weight_block_size: blocks of {block.block_k} columns; the "
            "GPU's W8A8 kernel runs a power of two from 32 to 256"
        )
    elif capability is not None and capability < (8, 9):
        why = f"{device} (sm_{capability[0]}{capability[1]}) has no FP8 arithmetic (sm_89 on)"
    if why and config.fp8_weights == "keep":
        raise QuantizationError(f"{why}. Use --fp8-weights dequantize")
    return "dequantize" if why else "keep"


def resolved_kernels(config: EngineConfig) -> tuple[str, str]:
    """(attention backend, kernels) that ``config``'s "auto"s resolve to on its device."""
    attention = config.attention_backend
    if attention == "auto":
        attention = select_backend(config.device, config.block_size)
    return attention, kernels_for(config.kernels, attention)


@dataclass
class EngineComponents:
    model_config: ModelConfig  # the target's
    eos_token_ids: frozenset[int]
    grammars: Grammars
    kv_cache: PagedKVCache  # the target's (split: this rank's heads); the draft's is spec.draft_kv
    # Split over ranks that share memory: every rank's heads of kv_cache (kv_cache's pools
    # are views of it), what a KV transfer reads and writes; else None.
    whole_kv_cache: PagedKVCache | None
    block_manager: KvBlocks
    scheduler: Scheduler
    kernels: str  # "torch" or "triton"
    runner: ModelRunner
    spec: SpecRunner | None  # with speculation (config.speculative): a draft model, or suffix
    num_blocks: int  # in each KV pool, the CUDA graphs' padding block included
    # LoRA adapters by name, with their ids and digests; None: the engine runs none
    loras: LoraRegistry | None = None
    # A split draft's KV, every rank's heads, as whole_kv_cache is the target's (shared,
    # or rank 0's copy); None where the draft is not split.
    whole_draft_kv: PagedKVCache | None = None


def build_components(config: EngineConfig, tokenizer: Any | None) -> EngineComponents:
    """Loads the target (and draft), prepares their kernels, and sizes one block pool for
    both: a block id holds a target block and a draft block. With tensor parallelism
    (``config.tensor_parallel_size``), first starts the other ranks (``RankGroup``): this
    process is rank 0, with its part of the target and of the KV cache (its KV heads)."""
    device = torch.device(config.device)
    if device.type == "cpu":  # loaded (or built) now: before packing, not in the first step
        cpu_kernels.load(build=config.build_cpu_kernels)  # and before other ranks load it
    # What rank 0 runs, resolved here: every rank's layers swap in the same kernels; and
    # block-FP8 weights that cannot run as told are refused before anything loads.
    attention, kernels = resolved_kernels(config)
    fp8_weights = fp8_weights_for(config, kernels)
    ranks, split_draft = None, False
    if config.world_size > 1:
        model_config = check_split(
            config.model,
            config.world_size,
            dtype=config.dtype,
            max_length=config.max_model_len,
            expert_parallel=config.enable_expert_parallel,
            data_parallel_size=config.data_parallel_size,
        )
        rank_config = dataclasses.replace(
            RankConfig.of(config),
            attention_backend=attention,
            kernels=kernels,
            fp8_weights=fp8_weights,
        )
        split_draft = draft_splits(config, model_config)
        if split_draft or draft_beside_rows(config):
            assert config.speculative is not None
            spec = config.speculative
            rank_config = dataclasses.replace(
                rank_config,
                draft_model=spec.draft_model,
                draft_kind=spec.kind,
                draft_layer_ids=None if spec.target_layer_ids is None else [*spec.target_layer_ids],
            )
        ranks = RankGroup.start(rank_config)
        torch.set_num_threads(rank_threads(rank_config))
    try:
        return _build(config, tokenizer, device, ranks, fp8_weights, split_draft)
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise


def draft_splits(config: EngineConfig, model_config: ModelConfig) -> bool:
    """Whether the draft splits over the target's ranks as the target does
    (``engine.spec.split_draft``): a draft model beside a split Llama-3 target, unless
    ``draft_tensor_parallel_size`` is 1. Elsewhere a draft runs on rank 0 alone."""
    spec = config.speculative
    return (
        config.tensor_parallel_size > 1
        and config.data_parallel_size == 1
        and spec is not None
        and not spec.is_model_free
        and not spec.reads_target_files
        and spec.draft_tensor_parallel_size != 1
        and isinstance(model_config, Llama3Config)
    )


def draft_beside_rows(config: EngineConfig) -> bool:
    """Whether each data-parallel rank holds the whole draft, for its own rows
    (``engine.spec.dp_draft``)."""
    spec = config.speculative
    return config.data_parallel_size > 1 and spec is not None and not spec.is_model_free


def _build(
    config: EngineConfig,
    tokenizer: Any | None,
    device: torch.device,
    ranks: RankGroup | None,
    fp8_weights: str,  # fp8_weights_for's
    split_draft: bool = False,  # draft_splits'
) -> EngineComponents:
    tp = ranks.tp if ranks is not None else TensorParallelGroup.single()
    attention, kernels = resolved_kernels(config)
    model, model_config = load_shard(config, tp, device)
    if fp8_weights == "dequantize":  # once, at load time
        dequantize_fp8(model, model_config.dtype)
    loras = lora_registry(config, model, model_config, tp.shard)
    packed: list[torch.nn.Module] = []  # models whose products use_packed_gemm prepared
    if device.type == "cpu" and config.cpu_gemm != "aten":
        use_packed_gemm(model, config.cpu_gemm)
        packed.append(model)
    eos = eos_token_ids(Path(config.model), model_config)
    grammars = Grammars(
        config.model,
        tokenizer,
        model_config.vocab_size,
        eos,
        timeout_s=config.grammar_compile_timeout_s,
        cache_size=config.grammar_cache_size,
    )
    whole_kv_params = KVCacheParams.from_config(model_config, config.block_size)
    kv_params = whole_kv_params.for_rank(tp.heads_shard)
    plan_params = [kv_params]
    drafter, lookahead, whole_draft_params = None, 0, None
    if config.speculative is not None:
        # Split as the target is, the draft borrows the split target's embedding and LM
        # head; on rank 0 alone, or beside each data-parallel rank's rows, a whole copy of
        # them (the target's own where it is whole: data-parallel ranks of one rank each).
        borrowed = model
        if tp.heads_shard.size > 1 and not config.speculative.is_model_free and not split_draft:
            borrowed = load_whole_vocabulary(config.model, model_config, device)
        drafter = load_speculator(config.speculative, borrowed, device, config.model)
        if drafter is not None and device.type == "cpu" and config.cpu_gemm != "aten":
            assert isinstance(drafter, torch.nn.Module)
            for module in [drafter] if borrowed is model else [drafter, borrowed]:
                use_packed_gemm(module, config.cpu_gemm)
                packed.append(module)
        if drafter is not None:
            whole_draft_params = KVCacheParams.from_config(drafter.config, config.block_size)
            shard = tp.shard if split_draft else TensorParallelGroup.single().shard
            plan_params.append(whole_draft_params.for_rank(shard))
        lookahead = num_lookahead_slots(num_draft_tokens(config.speculative, drafter), drafter)
    if packed:
        freed = release_packed_weights(*packed)
        logger.info("native weights no product uses: %.0f MB freed", freed / 1e6)
    num_blocks = plan_num_blocks(
        plan_params,
        device,
        memory_bytes=config.kv_cache_memory,
        memory_fraction=config.kv_cache_memory_fraction,
    )
    num_blocks = tp.agree_min(num_blocks)  # every rank's scheduler plans the same blocks
    whole_kv = None  # split: every rank's KV heads, for transfers (engine.executor.shared_kv)
    # Data-parallel ranks' pools hold different requests: each its own blocks of the file.
    is_split = tp.size > 1 and config.data_parallel_size == 1
    is_data_parallel = config.data_parallel_size > 1
    shared = None
    if is_split or is_data_parallel:
        shared = SharedKv.open(tp, whole_kv_params, num_blocks, by_blocks=is_data_parallel)
    gathered: dict[str, GatheredKv] = {}  # split, unshared: rank 0's copy of every head
    if shared is not None:
        kv_cache, whole_kv = shared.rank, shared.whole
    else:
        kv_cache = PagedKVCache(kv_params, num_blocks, device)
        if is_split:  # CUDA ranks: engine.executor.gathered_kv
            gathered["target"] = GatheredKv(tp, whole_kv_params, kv_cache)
            whole_kv = gathered["target"].whole
            logger.info(
                "tensor_parallel_size %d: each rank's KV pools are its own; KV transfers "
                "go through rank 0's copy of every head",
                tp.size,
            )
    # With CUDA graphs the last block is no request's: padded rows write there.
    block_manager: KvBlocks = BlockManager(
        num_blocks - config.uses_cuda_graphs,
        config.block_size,
        config.enable_prefix_caching,
        lookahead,
    )
    if config.data_parallel_size > 1:  # each rank's pool, its requests' blocks
        block_manager = DataParallelBlocks(
            config.data_parallel_size,
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            lookahead,
        )
    scheduler = Scheduler(
        SchedulerConfig(
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_loras if loras else None,  # no adapters: nothing to bound
        ),
        block_manager,
    )
    if kernels == "triton":  # swapped in once: the torch path keeps its modules
        rope = attention != "torch"  # the torch backend's metadata has no positions
        use_triton_kernels(model, rope=rope)
        if drafter is not None:
            assert isinstance(drafter, torch.nn.Module)
            use_triton_kernels(drafter, rope=rope)
    runner = ModelRunner(
        model,
        kv_cache,
        get_backend(attention, device=config.device, block_size=config.block_size),
        device,
        compile_decode=config.torch_compile,
        cpp_wrapper=config.compile_cpp_wrapper,
        sampling_kernels=sampling_kernels(kernels),
        ranks=ranks,
        data_parallel_size=config.data_parallel_size,
    )
    spec: SpecRunner | None = None
    whole_draft_kv = draft_kv = None
    if split_draft:  # the draft's KV heads as the target's: shared, each rank its own
        assert drafter is not None and whole_draft_params is not None
        assert isinstance(runner.executor, MultiprocExecutor)
        shared_draft = SharedKv.open(tp, whole_draft_params, num_blocks, DRAFT_LABEL)
        if shared_draft is not None:
            draft_kv, whole_draft_kv = shared_draft.rank, shared_draft.whole
        else:  # as the target's
            draft_kv = PagedKVCache(plan_params[1], num_blocks, device)
            gathered["draft"] = GatheredKv(tp, whole_draft_params, draft_kv)
            whole_draft_kv = gathered["draft"].whole
        drafter = SplitDrafter(drafter, runner.executor)
    elif draft_beside_rows(config):  # each rank's whole draft over its rows, its own pool
        assert drafter is not None and isinstance(runner.executor, MultiprocExecutor)
        assert whole_draft_params is not None
        shared_draft = SharedKv.open(tp, whole_draft_params, num_blocks, DRAFT_LABEL,
                                     by_blocks=True, split_heads=False)  # fmt: skip
        if shared_draft is not None:
            draft_kv, whole_draft_kv = shared_draft.rank, shared_draft.whole
        else:
            draft_kv = PagedKVCache(plan_params[1], num_blocks, device)
        drafter = DataParallelDrafter(drafter, runner.executor, draft_kv)
    runner.executor.gathered.update(gathered)
    if config.speculative is not None and config.speculative.is_model_free:
        spec = SuffixSpecRunner(config.speculative, runner, num_blocks)  # eager: ragged drafts
    elif config.speculative is not None and drafter is not None:
        spec = SpecRunner(config.speculative, runner, drafter, num_blocks, draft_kv)
        # Overlap scheduling launches steps whose rows the host has not caught up on: a
        # K = 0 step runs the drafter (and its costs are measured so).
        spec.defer_drafter = not config.enable_overlap_scheduler
        if config.uses_cuda_graphs:
            spec.enable_graphs(config.max_num_seqs, model_config.max_seq_len, num_blocks - 1)
            if spec.graphs is not None:  # captured graphs hold the pools' addresses
                spec.graphs.hold(kv_cache, spec.draft_kv)
    return EngineComponents(
        model_config=model_config,
        eos_token_ids=eos,
        grammars=grammars,
        kv_cache=kv_cache,
        whole_kv_cache=whole_kv,
        block_manager=block_manager,
        scheduler=scheduler,
        kernels=kernels,
        runner=runner,
        spec=spec,
        num_blocks=num_blocks,
        loras=loras,
        whole_draft_kv=whole_draft_kv,
    )
