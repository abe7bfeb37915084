"""What each rank of the tensor-parallel tests runs, in a process of its own (spawned):
it joins the group, reads its parts of a checkpoint, computes its shard of each layer,
runs the collectives, and saves what it got (safetensors: nothing pickled)."""

from __future__ import annotations

import contextlib
import importlib
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
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
        os._exit(0)  # gone, as a killed rank is: no clean-up
    started = time.monotonic()
    try:
        tp.all_reduce(torch.ones(4))
    except RuntimeError:
        waited = time.monotonic() - started
        save_file({"waited_s": torch.tensor([waited])}, str(Path(model_dir) / "rank0.out"))
        return
    raise AssertionError("the all-reduce with a rank gone did not fail")


def many_all_reduces(rank: int, size: int, out_dir: str, init_method: str) -> None:
    """60 all-reduces, all-gathers and broadcasts of varied sizes and dtypes through the
    shared segment (one larger than its slots goes through gloo): each must be, on every
    rank, the rank-order sum (or concatenation) of every rank's tensor, or rank 0's,
    computed here from the same seeds."""
    from engine.parallel import group as group_module

    torch.set_num_threads(1)
    group_module.SHM_SLOT_BYTES = 4096  # small slots: the largest tensors go through gloo
    tp = TensorParallelGroup.join(rank, size, init_method, timeout_s=30)
    assert tp.shm is not None
    num_via_gloo = 0
    for call in range(60):
        dtype = (torch.float32, torch.bfloat16)[call % 2]
        shape = (1 + call % 7, 3 + 5 * (call % 11)) if call != 30 else (64, 64)
        inputs = [
            torch.randn(shape, generator=torch.Generator().manual_seed(1000 * call + r)).to(dtype)
            for r in range(size)
        ]
        expected = inputs[0].clone()
        for other in inputs[1:]:
            expected += other
        num_via_gloo += not tp.shm.fits(inputs[rank])
        got = tp.all_reduce(inputs[rank].clone())
        tolerance = 0 if tp.shm.fits(got) else 1e-2  # gloo may add in another order
        assert (got.float() - expected.float()).abs().max().item() <= tolerance, call
        gathered = tp.all_gather(inputs[rank].clone(), dim=call % 2)
        assert torch.equal(gathered, torch.cat(inputs, dim=call % 2)), call
        sent = inputs[rank].clone()
        assert tp.broadcast(sent) is sent and torch.equal(sent, inputs[0]), call  # in place
    save_file({"via_gloo": torch.tensor([num_via_gloo])}, str(Path(out_dir) / f"rank{rank}.out"))
    tp.close()


def out_of_step(rank: int, size: int, out_dir: str, init_method: str) -> None:
    """Rank 0 all-reduces 4 values, rank 1 8: both must refuse, naming the byte counts."""
    torch.set_num_threads(1)
    tp = TensorParallelGroup.join(rank, size, init_method, timeout_s=10)
    try:
        tp.all_reduce(torch.ones(4 * (1 + rank)))
    except RuntimeError as e:
        assert "out of step" in str(e) and "[16, 32]" in str(e), str(e)
        save_file({"refused": torch.tensor([1])}, str(Path(out_dir) / f"rank{rank}.out"))
        return
    finally:  # the group's threads end before the interpreter does (else, at times, abort)
        tp.close()
    raise AssertionError("collectives of different sizes were not refused")


def waits_for_a_compiling_rank(rank: int, size: int, out_dir: str, init_method: str) -> None:
    """Rank 1 compiles a function (torch.compile, from a cold cache: seconds) before its
    all-reduce; rank 0 waits for it past the group's 1 s timeout. Then rank 1 sleeps 3 s
    before the next one, compiling nothing: rank 0's fails after about 1 s."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(out_dir) / f"inductor{rank}")
    torch.set_num_threads(1)
    tp = TensorParallelGroup.join(rank, size, init_method, timeout_s=1.0)
    assert tp.shm is not None
    if rank == 1:  # dynamo and inductor imported first: the compile says so at once
        importlib.import_module("torch._inductor.compile_fx")
        compiled = torch.compile(lambda x: torch.sin(x) * 2 + x.cos(), dynamic=False)
    dist.barrier()  # gloo's, under the group's long timeout: both ranks ready
    if rank == 1:
        compiled(torch.ones(4))
        tp.all_reduce(torch.ones(4))
        time.sleep(3.0)
        with contextlib.suppress(RuntimeError):  # rank 0 gave up on it
            tp.all_reduce(torch.ones(4))
        return
    started = time.monotonic()
    total = tp.all_reduce(torch.ones(4))
    waited_for_compile = time.monotonic() - started
    started = time.monotonic()
    refused = 0
    try:
        tp.all_reduce(torch.ones(4))
    except RuntimeError:
        refused = 1
    out = {
        "sum": total,
        "waited_for_compile_s": torch.tensor([waited_for_compile]),
        "refused": torch.tensor([refused]),
        "waited_s": torch.tensor([time.monotonic() - started]),
    }
    save_file(out, str(Path(out_dir) / "rank0.out"))


def data_parallel_subgroups(rank: int, size: int, out_dir: str, init_method: str) -> None:
    """Four ranks as two data-parallel ranks of two tensor-parallel ranks each: an
    all-reduce within each data-parallel rank's ranks, an all-gather across them, and a
    broadcast from rank 0 over every rank, each through a shared-memory segment of its
    own. Then a compile seen across segments: rank 2 says it compiles and arrives 2.5 s
    late (the timeout is 1 s); rank 3 waits for it in their attention group, and rank 1
    waits for rank 3 in their rows group. Rank 1 must wait too, not give up on rank 3."""
    torch.set_num_threads(1)
    world = TensorParallelGroup.join(rank, size, init_method, timeout_s=1.0)
    layout = world.split_data_parallel(2)
    attention, rows = layout.attention, layout.rows
    assert world.shm is not None and attention.shm is not None and rows.shm is not None
    dp_rank, tp_rank = divmod(rank, 2)
    assert (attention.shard.rank, attention.size) == (tp_rank, 2)
    assert (rows.shard.rank, rows.size) == (dp_rank, 2)
    assert world.heads_shard == attention.shard
    summed = attention.all_reduce(torch.full((3,), float(rank + 1)))
    gathered = rows.all_gather(torch.full((2,), float(rank)), dim=0)
    sent = world.broadcast(torch.full((2,), 7.0 if rank == 0 else -1.0))
    dist.barrier()  # gloo's, under the group's long timeout
    if rank == 2:
        world.shm.set_compiling(True)
        time.sleep(2.5)
        world.shm.set_compiling(False)
    started = time.monotonic()
    if rank in (2, 3):
        attention.all_reduce(torch.ones(1))
    if rank in (1, 3):
        rows.all_reduce(torch.ones(1))
    waited = time.monotonic() - started
    out = {"summed": summed, "gathered": gathered, "sent": sent,
           "waited_s": torch.tensor([waited])}  # fmt: skip
    save_file(out, str(Path(out_dir) / f"rank{rank}.out"))
    dist.barrier()
    world.close()
