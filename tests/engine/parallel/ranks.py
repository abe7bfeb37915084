"""What each rank of the tensor-parallel tests runs, in a process of its own (spawned):
it joins the group, reads its parts of a checkpoint, computes its shard of each layer,
runs the collectives, and saves what it got (safetensors: nothing pickled)."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from engine.parallel.group import TensorParallelGroup
from engine.parallel.shard import Shard
from engine.weights import CheckpointReader, Part

HIDDEN, INTER, VOCAB = 16, 24, 37  # VOCAB: not a multiple of 2


def sharded_layers(rank: int, size: int, model_dir: str, init_method: str) -> None:
    """A gated MLP (gate and up column-parallel, down row-parallel and all-reduced) and a
    vocabulary-parallel LM head (all-gathered), each from this rank's parts only."""
    torch.set_num_threads(1)
    tp = TensorParallelGroup.join(rank, size, init_method, timeout_s=30)
    shard = Shard(rank, size)
    reader = CheckpointReader(model_dir)
    x = reader.get("x")
    inter = shard.even(INTER, "intermediate_size")
    rows = Part(0, inter.start, inter.stop)
    gate, up = reader.get("gate_proj", rows), reader.get("up_proj", rows)
    down = reader.get("down_proj", Part(1, inter.start, inter.stop))
    mlp = tp.all_reduce((F.silu(x @ gate.T) * (x @ up.T)) @ down.T)
    vocab = shard.vocab(VOCAB)
    head = reader.get("lm_head", Part(0, vocab.start, vocab.stop))
    per_rank = -(-VOCAB // size)
    logits = torch.zeros(x.shape[0], per_rank)
    logits[:, : len(vocab)] = x @ head.T
    all_logits = tp.all_gather(logits, dim=-1)[:, :VOCAB]
    out = {"mlp": mlp, "logits": all_logits.contiguous()}
    save_file(out, str(Path(model_dir) / f"rank{rank}.out"))
    reader.close()
    tp.close()


def one_rank_gone(rank: int, size: int, model_dir: str, init_method: str) -> None:
    """Rank 1 joins, then exits without its all-reduce; rank 0's fails within the group's
    timeout, and says how long it waited."""
    torch.set_num_threads(1)
    tp = TensorParallelGroup.join(rank, size, init_method, timeout_s=3)
    if rank == 1:
        return  # gone: its process ends
    started = time.monotonic()
    try:
        tp.all_reduce(torch.ones(4))
    except RuntimeError:
        waited = time.monotonic() - started
        save_file({"waited_s": torch.tensor([waited])}, str(Path(model_dir) / "rank0.out"))
        return
    raise AssertionError("the all-reduce with a rank gone did not fail")
