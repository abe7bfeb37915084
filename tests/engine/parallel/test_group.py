"""Two tensor-parallel ranks, real processes (spawn) over gloo: each reads only its parts
of a checkpoint, and its collectives give what one device computes from the whole tensors;
a rank that is gone fails the others' collective within the group's timeout, not never."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.engine.parallel import ranks


def checkpoint(tmp_path: Path) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "x": torch.randn(5, ranks.HIDDEN, generator=generator),
        "gate_proj": torch.randn(ranks.INTER, ranks.HIDDEN, generator=generator),
        "up_proj": torch.randn(ranks.INTER, ranks.HIDDEN, generator=generator),
        "down_proj": torch.randn(ranks.HIDDEN, ranks.INTER, generator=generator),
        "lm_head": torch.randn(ranks.VOCAB, ranks.HIDDEN, generator=generator),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tensors


def test_sharded_layers_over_two_ranks_equal_one_device(tmp_path: Path) -> None:
    full = checkpoint(tmp_path)
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.start_processes(
        ranks.sharded_layers, args=(2, str(tmp_path), init), nprocs=2, start_method="spawn"
    )
    x = full["x"]
    mlp = (F.silu(x @ full["gate_proj"].T) * (x @ full["up_proj"].T)) @ full["down_proj"].T
    logits = x @ full["lm_head"].T
    for rank in range(2):
        got = load_file(str(tmp_path / f"rank{rank}.out"))
        torch.testing.assert_close(got["mlp"], mlp, rtol=1e-5, atol=1e-4)  # sums reordered
        torch.testing.assert_close(got["logits"], logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(
        load_file(str(tmp_path / "rank0.out"))["mlp"], load_file(str(tmp_path / "rank1.out"))["mlp"]
    )  # every rank holds the same sum


def test_a_rank_gone_ends_the_others_collective_within_seconds(tmp_path: Path) -> None:
    """Rank 1 exits without its all-reduce. Rank 0's fails within the group's timeout
    (3 s): with an error, or gloo aborts its process; either way it does not hang, and no
    process is left behind."""
    init = f"file://{tmp_path / 'rendezvous'}"
    context = mp.get_context("spawn")
    procs = [
        context.Process(target=ranks.one_rank_gone, args=(rank, 2, str(tmp_path), init))
        for rank in range(2)
    ]
    started = time.monotonic()
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=30)
    ended = time.monotonic() - started
    alive = [p.pid for p in alive_procs(procs)]
    for proc in alive_procs(procs):
        proc.kill()
    assert alive == [], f"ranks still running after {ended:.1f} s"
    assert procs[1].exitcode == 0
    if procs[0].exitcode == 0:  # it caught the error and said how long it waited
        assert load_file(str(tmp_path / "rank0.out"))["waited_s"].item() < 10.0
    else:  # gloo aborted the process when its peer went away
        assert procs[0].exitcode == -signal.SIGABRT


def alive_procs(procs: list[mp.Process]) -> list[mp.Process]:
    return [p for p in procs if p.is_alive()]


def test_collectives_through_shared_memory_give_every_rank_the_same_result(tmp_path: Path) -> None:
    """Three ranks, 60 all-reduces, all-gathers and broadcasts of varied shapes and dtypes
    in a row: each is the rank-order sum, bit for bit, the concatenation, or rank 0's; the
    one too large for the segment's slots goes through gloo."""
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.start_processes(
        ranks.many_all_reduces, args=(3, str(tmp_path), init), nprocs=3, start_method="spawn"
    )
    for rank in range(3):
        assert load_file(str(tmp_path / f"rank{rank}.out"))["via_gloo"].item() == 1


def test_ranks_out_of_step_are_refused_not_given_stale_bytes(tmp_path: Path) -> None:
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.start_processes(
        ranks.out_of_step, args=(2, str(tmp_path), init), nprocs=2, start_method="spawn"
    )
    for rank in range(2):
        assert load_file(str(tmp_path / f"rank{rank}.out"))["refused"].item() == 1


def test_a_compiling_rank_is_waited_for_and_a_silent_one_is_not(tmp_path: Path) -> None:
    """With a 1 s timeout, rank 0 waits for rank 1 through its torch.compile (a cold
    compile: seconds; rank 1 says it compiles in the shared segment), and gives up on it
    after about 1 s when it is late without compiling."""
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.start_processes(
        ranks.waits_for_a_compiling_rank,
        args=(2, str(tmp_path), init),
        nprocs=2,
        start_method="spawn",
    )
    out = load_file(str(tmp_path / "rank0.out"))
    assert torch.equal(out["sum"], torch.full((4,), 2.0))
    assert out["waited_for_compile_s"].item() > 1.0  # past the timeout: rank 1 compiled
    assert out["refused"].item() == 1 and 1.0 <= out["waited_s"].item() < 2.5


def test_data_parallel_subgroups_have_collectives_of_their_own(tmp_path: Path) -> None:
    """Four ranks split as data-parallel 2 x tensor-parallel 2: rank w is tensor-parallel
    rank w % 2 of data-parallel rank w // 2. Each subgroup's collectives reach its ranks
    only; a rank compiling in one subgroup keeps a rank two segments away waiting."""
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.start_processes(
        ranks.data_parallel_subgroups,
        args=(4, str(tmp_path), init),
        nprocs=4,
        start_method="spawn",
    )
    for rank in range(4):
        out = load_file(str(tmp_path / f"rank{rank}.out"))
        partner = rank ^ 1  # the other rank of its data-parallel rank
        assert torch.equal(out["summed"], torch.full((3,), float(rank + partner + 2)))
        tp_rank = rank % 2  # gathered from its tensor-parallel rank of each data-parallel one
        assert out["gathered"].tolist() == [tp_rank] * 2 + [tp_rank + 2] * 2
        assert out["sent"].tolist() == [7.0, 7.0]
    assert load_file(str(tmp_path / "rank1.out"))["waited_s"].item() > 2.0
