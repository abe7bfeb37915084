"""Two tensor-parallel ranks, real processes (spawn) over gloo: each reads only its parts
of a checkpoint, and its collectives give what one device computes from the whole tensors;
a rank that is gone fails the others' collective within the group's timeout, not never."""

from __future__ import annotations

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


def test_a_rank_gone_fails_the_others_collective_within_the_timeout(tmp_path: Path) -> None:
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.start_processes(
        ranks.one_rank_gone, args=(2, str(tmp_path), init), nprocs=2, start_method="spawn"
    )
    waited = load_file(str(tmp_path / "rank0.out"))["waited_s"].item()
    assert waited < 10.0  # the group's timeout is 3 s
