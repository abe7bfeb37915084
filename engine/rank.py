"""What a tensor-parallel rank other than rank 0 runs, in a process of its own
(``python -m engine.rank``, started by ``RankGroup``): it joins the group, loads its shard
of the target and its KV heads' pools (and of a split draft and its KV), and then runs
each forward rank 0 sends it (``engine.executor.inputs``), or each graph rank 0 defines
or names (the graph runner's steps and a split draft's forwards,
``engine.executor.graph_steps``), until told to stop or until rank 0 is gone. It samples
nothing and returns nothing: its part of each forward is its share of the layers'
all-reduces, of the logits' gather and of the broadcasts from rank 0."""

from __future__ import annotations

import argparse
import json
import logging
import signal
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from engine.attention import get_backend
from engine.executor.channel import RankGone, StepChannel
from engine.executor.gathered_kv import GatheredKv
from engine.executor.graph_steps import FollowerGraphs, OpRunner, target_runner
from engine.executor.graph_wire import GraphDefine, GraphSignature, decode_message
from engine.executor.inputs import ForwardStep, KvMove
from engine.executor.shared_kv import DRAFT_LABEL, SharedKv
from engine.executor.uniproc import UniprocExecutor, compile_decode_model
from engine.executor.worker import RankConfig, load_shard
from engine.kv_cache import KVCacheParams, PagedKVCache, plan_num_blocks
from engine.lora.registry import LoraRegistry, lora_registry
from engine.models.layers import dequantize_fp8, release_packed_weights, use_packed_gemm
from engine.models.llama3 import Llama3Model
from engine.models.triton_layers import use_triton_kernels
from engine.parallel.group import TensorParallelGroup
from engine.registry import load_whole_vocabulary
from engine.spec.config import SpeculativeConfig
from engine.spec.dp_draft import DATA_PARALLEL_DRAFT_KINDS, DataParallelDraftMirror, DraftRows
from engine.spec.drafters import load_drafter
from engine.spec.spec_runner import load_speculator
from engine.spec.split_draft import SPLIT_DRAFT_KINDS, DraftMirror
from kernels.cpu import extension as cpu_kernels

# What a rank other than 0 reads: the target's forwards and a draft's, split or by rows.
DRAFT_KINDS = {**SPLIT_DRAFT_KINDS, **DATA_PARALLEL_DRAFT_KINDS}


@dataclass
class LoadedRank:
    executor: UniprocExecutor  # the target's shard and KV pools
    # A split draft's shard and KV pools, or a data-parallel rank's whole draft and pool.
    draft: DraftMirror | DataParallelDraftMirror | None
    loras: LoraRegistry | None = None  # this rank's part of each adapter
    # Pools not shared with rank 0 (engine.executor.gathered_kv), by name: rank 0 moves
    # their heads to and from its copy with this rank's help.
    gathered: dict[str, GatheredKv] = field(default_factory=dict)


def load_rank(config: RankConfig, tp: TensorParallelGroup, device: torch.device) -> LoadedRank:
    """This rank's shards, packed for the CPU's products, and its KV heads' pools, with as
    many blocks as every rank holds (the collectives rank 0's ``build_components`` runs,
    in its order)."""
    if device.type == "cpu":
        cpu_kernels.load(build=config.build_cpu_kernels)
    model, model_config = load_shard(config, tp, device)
    if config.fp8_weights == "dequantize":  # as rank 0's build_components does
        dequantize_fp8(model, model_config.dtype)
    loras = lora_registry(config, model, model_config, tp.shard)  # its part of each adapter
    drafter = None
    modules: list[nn.Module] = [model]
    has_draft = bool(config.draft_model or config.draft_kind)  # MTP: no directory, a kind
    beside_rows = config.data_parallel_size > 1 and has_draft
    if beside_rows:  # a data-parallel rank's: the whole draft, for its own rows
        layer_ids = None if config.draft_layer_ids is None else tuple(config.draft_layer_ids)
        spec = SpeculativeConfig(config.draft_model, kind=config.draft_kind,
                                 target_layer_ids=layer_ids)  # fmt: skip
        borrowed: nn.Module = model  # as rank 0's: a whole copy where the target's is split
        if tp.heads_shard.size > 1:
            borrowed = load_whole_vocabulary(config.model, model_config, device)
            modules.append(borrowed)  # its products packed as rank 0 packs them
        drafter = load_speculator(spec, borrowed, device, config.model)
        modules.append(cast(nn.Module, drafter))
    elif config.draft_model:  # split as the target is: a Llama-3 target's draft
        assert isinstance(model, Llama3Model)
        layer_ids = None if config.draft_layer_ids is None else tuple(config.draft_layer_ids)
        drafter = load_drafter(config.draft_model, model, device, config.draft_kind, layer_ids)
        modules.append(cast(nn.Module, drafter))
    if device.type == "cpu" and config.cpu_gemm != "aten":
        for module in modules:
            use_packed_gemm(module, config.cpu_gemm)
        release_packed_weights(*modules)
    if config.kernels == "triton":  # as rank 0's build_components swaps them in
        for module in modules:
            use_triton_kernels(module, rope=config.attention_backend != "torch")
    whole_params = KVCacheParams.from_config(model_config, config.block_size)
    plan = [whole_params.for_rank(tp.heads_shard)]
    if drafter is not None:
        whole_draft = KVCacheParams.from_config(drafter.config, config.block_size)
        plan.append(whole_draft if beside_rows else whole_draft.for_rank(tp.shard))
    num_blocks = plan_num_blocks(
        plan,
        device,
        memory_bytes=config.kv_cache_memory,
        memory_fraction=config.kv_cache_memory_fraction,
    )
    num_blocks = tp.agree_min(num_blocks)
    backend = get_backend(
        config.attention_backend, device=config.device, block_size=config.block_size
    )
    # As rank 0 opens it (data-parallel ranks' pools hold different requests: their own).
    is_split = config.data_parallel_size == 1
    shared = SharedKv.open(tp, whole_params, num_blocks, by_blocks=not is_split)
    kv_cache = PagedKVCache(plan[0], num_blocks, device) if shared is None else shared.rank
    gathered: dict[str, GatheredKv] = {}  # rank 0's copy of unshared pools: this rank helps
    if is_split and shared is None:
        gathered["target"] = GatheredKv(tp, whole_params, kv_cache)
    decode_model = None
    if config.torch_compile:
        decode_model = compile_decode_model(model, kv_cache, cpp_wrapper=config.compile_cpp_wrapper)
    executor = UniprocExecutor(model, kv_cache, backend, decode_model)
    mirror: DraftMirror | DataParallelDraftMirror | None = None
    if drafter is not None and beside_rows:
        shared = SharedKv.open(tp, whole_draft, num_blocks, DRAFT_LABEL, by_blocks=True,
                               split_heads=False)  # fmt: skip
        draft_kv = PagedKVCache(plan[1], num_blocks, device) if shared is None else shared.rank
        mirror = DataParallelDraftMirror(DraftRows(drafter, draft_kv, backend, tp))
    elif drafter is not None:
        shared = SharedKv.open(tp, whole_draft, num_blocks, DRAFT_LABEL)
        draft_kv = PagedKVCache(plan[1], num_blocks, device) if shared is None else shared.rank
        if shared is None:
            gathered["draft"] = GatheredKv(tp, whole_draft, draft_kv)
        mirror = DraftMirror(drafter, draft_kv, backend, tp)
    return LoadedRank(executor, mirror, loras, gathered)


def run_rank(
    rank: int,
    size: int,
    init_method: str,
    config_json: str,
    parent_pid: int,
    channel_fd: int,
    backend: str,
    timeout_s: float,
) -> None:
    """The process of rank ``rank`` (1..size-1)."""
    # Signals to the process group (a terminal's Ctrl-C, a supervisor's SIGTERM) are rank
    # 0's to handle: it stops this rank, or this rank leaves once rank 0 is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    config = RankConfig(**json.loads(config_json))
    torch.set_num_threads(config.num_threads or 1)
    device = torch.device(config.device)
    if device.type == "cuda":  # rank r on the device r places after rank 0's
        device = torch.device("cuda", (device.index or 0) + rank)
        torch.cuda.set_device(device)
    tp = TensorParallelGroup.join(rank, size, init_method, backend=backend, timeout_s=timeout_s)
    channel = StepChannel.attach(parent_pid, channel_fd, size - 1, rank - 1, timeout_s=timeout_s)
    try:
        loaded = load_rank(config, tp, device)
        executor = loaded.executor
        runners: dict[type, OpRunner] = {GraphSignature: target_runner(executor.forward)}
        if loaded.draft is not None:
            runners.update(loaded.draft.runners())
        graphs = FollowerGraphs(runners, tp, device)
        while True:
            message = channel.receive(parent_pid).view(torch.int64)
            step = decode_message(message, device, DRAFT_KINDS)
            if step is None:
                return
            if isinstance(step, ForwardStep):
                if step.lora_groups is not None:  # rank 0's model's, for this forward
                    lora_step = getattr(executor.model, "lora_step", None)
                    if lora_step is None or loaded.loras is None:
                        raise RuntimeError("rank 0 runs LoRA adapters this rank has none of")
                    if step.lora_changes:  # then tell rank 0, which waits (multiproc.py)
                        loaded.loras.apply(step.lora_changes)
                        tp.agree_min(1)
                    lora_step.set(*step.lora_groups)
                executor.forward(step.inputs, compiled=step.compiled)
            elif isinstance(step, KvMove):  # rank 0's copy of the pool's heads
                move = loaded.gathered[step.pool]
                move.scatter(step.indices) if step.is_scatter else move.gather(step.indices)
            elif isinstance(step, GraphDefine):
                graphs.define(step)
            else:
                graphs.run(step.graph_id)
    except RankGone:
        return  # rank 0 ended without a word (killed): so does this rank
    finally:
        channel.close()
        tp.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description="One tensor-parallel rank (1..size-1) of an engine; started by the "
        "engine's rank 0 (engine.executor.multiproc), not by hand."
    )
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--init-method", required=True, help="the group's rendezvous")
    parser.add_argument("--config", required=True, help="RankConfig as JSON")
    parser.add_argument("--parent-pid", type=int, required=True, help="rank 0's process")
    parser.add_argument("--channel-fd", type=int, required=True, help="rank 0's step channel")
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--timeout-s", type=float, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format=f"rank {args.rank}: %(message)s")
    run_rank(
        args.rank,
        args.size,
        args.init_method,
        args.config,
        args.parent_pid,
        args.channel_fd,
        args.backend,
        args.timeout_s,
    )


if __name__ == "__main__":
    main()
