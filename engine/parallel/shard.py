"""Which part of each tensor-parallel layer one rank holds, as vLLM and SGLang split them.

Query heads, the MLP's intermediate size and the vocabulary are split into equal runs, one
per rank: q/k/v and gate/up projections by output rows (column-parallel), o and down
projections by input columns (row-parallel, followed by an all-reduce), the embedding and
the LM head by vocabulary rows. KV heads are split too; where there are fewer KV heads than
ranks, each is replicated on the ranks whose query heads read it. What does not divide is
refused before anything loads (``check_divisible``), naming both numbers.
"""

from __future__ import annotations

from dataclasses import dataclass


class TensorParallelError(ValueError):
    """A model that cannot be split over this many ranks; the message names the numbers."""


def check_divisible(num_heads: int, num_kv_heads: int, size: int) -> None:
    """Raises TensorParallelError unless ``size`` ranks can split these heads."""
    if size < 1:
        raise TensorParallelError(f"tensor_parallel_size: {size}, must be at least 1")
    if num_heads % size:
        raise TensorParallelError(
            f"tensor_parallel_size: {size} does not divide num_attention_heads {num_heads}"
        )
    if num_kv_heads >= size and num_kv_heads % size:
        raise TensorParallelError(
            f"tensor_parallel_size: {size} does not divide num_key_value_heads {num_kv_heads}"
        )
    if num_kv_heads < size and size % num_kv_heads:
        raise TensorParallelError(
            f"tensor_parallel_size: {size} is not a multiple of num_key_value_heads "
            f"{num_kv_heads}, so the KV heads cannot be replicated evenly"
        )


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``size``: the runs of heads, channels and vocabulary it holds."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank: {self.rank}, must be in [0, {self.size})")

    def even(self, n: int, what: str) -> range:
        """This rank's equal share of ``n`` (heads, channels); ``n`` must divide."""
        if n % self.size:
            raise TensorParallelError(
                f"tensor_parallel_size: {self.size} does not divide {what} {n}"
            )
        per_rank = n // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def kv_heads(self, num_kv_heads: int) -> range:
        """The KV heads this rank holds: its share, or, with fewer KV heads than ranks, the
        one its query heads read (replicated on ``size / num_kv_heads`` ranks)."""
        if num_kv_heads >= self.size:
            return self.even(num_kv_heads, "num_key_value_heads")
        replicas = self.size // num_kv_heads
        head = self.rank // replicas
        return range(head, head + 1)

    def vocab(self, vocab_size: int) -> range:
        """This rank's rows of the embedding and LM head: ``ceil(V / size)`` each, the
        last rank's fewer (or none) when the vocabulary does not divide."""
        per_rank = -(-vocab_size // self.size)
        start = min(self.rank * per_rank, vocab_size)
        return range(start, min(start + per_rank, vocab_size))


def padded_vocab(vocab_size: int, size: int) -> int:
    """The vocabulary padded to a multiple of ``size``: what an all-gather of the ranks'
    logits returns before the padding is cut."""
    return -(-vocab_size // size) * size


def data_parallel_shards(world: Shard, data_parallel_size: int) -> tuple[Shard, Shard]:
    """A worker's ranks under data-parallel attention with tensor parallelism inside each
    data-parallel rank: ``world.size / data_parallel_size`` ranks run each data-parallel
    rank's rows, its attention and dense layers split over them by heads and channels.
    Rank ``w`` is tensor-parallel rank ``w % tp`` of data-parallel rank ``w // tp``.
    Returns (the rank's attention shard: its place among its data-parallel rank's ranks,
    its data-parallel rank among ``data_parallel_size``)."""
    if data_parallel_size < 1 or world.size % data_parallel_size:
        raise TensorParallelError(
            f"data_parallel_size: {data_parallel_size} does not divide the worker's "
            f"{world.size} ranks"
        )
    tp = world.size // data_parallel_size
    return Shard(world.rank % tp, tp), Shard(world.rank // tp, data_parallel_size)
