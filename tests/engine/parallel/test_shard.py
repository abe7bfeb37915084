"""Which part of each layer a tensor-parallel rank holds, and what cannot be split."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.parallel.shard import Shard, TensorParallelError, check_divisible, padded_vocab
from engine.weights import CheckpointReader, Part, Source, TensorRule, WeightError, load_weights


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size", "message"),
    [
        (9, 3, 2, "tensor_parallel_size: 2 does not divide num_attention_heads 9"),
        (8, 6, 4, "tensor_parallel_size: 4 does not divide num_key_value_heads 6"),
        (12, 2, 3, "3 is not a multiple of num_key_value_heads 2"),
        (8, 4, 0, "tensor_parallel_size: 0, must be at least 1"),
    ],
)
def test_heads_that_do_not_split_are_refused_naming_both_numbers(
    heads: int, kv_heads: int, size: int, message: str
) -> None:
    with pytest.raises(TensorParallelError, match=message):
        check_divisible(heads, kv_heads, size)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size"), [(8, 4, 2), (8, 2, 4), (9, 3, 3), (8, 1, 8)]
)
def test_heads_that_split(heads: int, kv_heads: int, size: int) -> None:
    check_divisible(heads, kv_heads, size)


def test_query_heads_and_channels_split_evenly_in_rank_order() -> None:
    assert [Shard(r, 2).even(8, "heads") for r in range(2)] == [range(0, 4), range(4, 8)]
    assert [Shard(r, 3).even(9, "heads") for r in range(3)] == [
        range(0, 3),
        range(3, 6),
        range(6, 9),
    ]
    with pytest.raises(TensorParallelError, match="does not divide intermediate_size 10"):
        Shard(0, 4).even(10, "intermediate_size")


def test_kv_heads_split_or_each_is_replicated_on_the_ranks_that_read_it() -> None:
    assert [Shard(r, 2).kv_heads(4) for r in range(2)] == [range(0, 2), range(2, 4)]
    # 2 KV heads over 4 ranks: ranks 0-1 hold head 0 (their query heads 0-1, 2-3 of 8 read
    # it: group size 4), ranks 2-3 head 1.
    assert [Shard(r, 4).kv_heads(2) for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    for rank in range(4):
        queries = Shard(rank, 4).even(8, "heads")
        assert {q // (8 // 2) for q in queries} == set(Shard(rank, 4).kv_heads(2))


def test_a_vocabulary_that_does_not_divide_is_padded_on_the_last_rank() -> None:
    assert [Shard(r, 2).vocab(65) for r in range(2)] == [range(0, 33), range(33, 65)]
    assert [Shard(r, 4).vocab(5) for r in range(4)] == [
        range(0, 2),
        range(2, 4),
        range(4, 5),
        range(5, 5),
    ]
    assert padded_vocab(65, 2) == 66 and padded_vocab(64, 2) == 64


def test_a_rank_outside_its_group_is_refused() -> None:
    with pytest.raises(ValueError, match=r"rank: 2, must be in \[0, 2\)"):
        Shard(2, 2)


def test_a_rank_reads_only_its_rows_or_columns_and_a_part_outside_is_refused(
    tmp_path: Path,
) -> None:
    """What ``load_weights`` fills from a ``Part``: the rows (column-parallel) or columns
    (row-parallel) of the checkpoint's tensor, read through a slice of the file."""
    full = torch.arange(24.0).view(4, 6)
    save_file({"w": full}, str(tmp_path / "model.safetensors"))
    reader = CheckpointReader(tmp_path)
    assert torch.equal(reader.get("w", Part(0, 2, 4)), full[2:4])
    assert torch.equal(reader.get("w", Part(1, 3, 6)), full[:, 3:6])
    model = torch.nn.Linear(3, 4, bias=False)
    load_weights(model, reader, [TensorRule("weight", (Source("w", (4, 6), Part(1, 0, 3)),))])
    assert torch.equal(model.weight.detach(), full[:, :3])
    outside = TensorRule("weight", (Source("w", (4, 6), Part(1, 4, 7)),))
    with pytest.raises(
        WeightError, match=r"w: part \[4, 7\) of dim 1 is outside its shape \[4, 6\]"
    ):
        load_weights(model, reader, [outside])
    reader.close()
