"""The KV blocks of data-parallel attention (DeepSeek-V3's latent cache, issue 39): each
data-parallel rank attends its own rows over its own pool, so blocks are managed per rank,
one ``BlockManager`` each, with block ids local to that rank's pool.

A request is placed on one rank when it first gets blocks (``allocate``) and keeps it
while it holds any; once freed (finished, or preempted to be recomputed) it may be placed
again elsewhere. The place: the rank with most free blocks, counting the blocks of its
prompt that rank has cached as free too (so a shared prefix does not pull every request
onto one rank), then the lowest. Capacity is per rank: a request is admitted only where
one rank can hold it, whatever the others have free.

Where one pool holds every rank's blocks (a worker's shared KV segment, from which KV
transfers read and into which they write: ``engine.executor.shared_kv``), rank r's block
b is block ``r * num_blocks + b`` of it (``whole_table``).
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.block_manager import BlockManager, BlockOwner


class DataParallelBlocks:
    """``num_ranks`` block managers of ``num_blocks`` each, behind ``BlockManager``'s
    interface; a request's calls go to its rank's (``seq.dp_rank``)."""

    def __init__(
        self,
        num_ranks: int,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_lookahead_slots: int = 0,
    ) -> None:
        if num_ranks < 1:
            raise ValueError(f"data_parallel_size: {num_ranks}, must be at least 1")
        self.ranks = [
            BlockManager(num_blocks, block_size, enable_prefix_caching, num_lookahead_slots)
            for _ in range(num_ranks)
        ]
        self.num_blocks = num_blocks  # per rank: the most one request can ever hold
        self.num_placed = [0] * num_ranks  # requests placed on each rank, so far
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_lookahead_slots = num_lookahead_slots

    @property
    def total_blocks(self) -> int:
        """Every rank's blocks together (``num_blocks`` is one rank's)."""
        return self.num_blocks * len(self.ranks)

    @property
    def free_blocks_per_rank(self) -> list[int]:
        return [rank.num_free_blocks for rank in self.ranks]

    @property
    def num_free_blocks(self) -> int:
        return sum(self.free_blocks_per_rank)

    @property
    def num_clean_blocks(self) -> int:
        return sum(rank.num_clean_blocks for rank in self.ranks)

    @property
    def clean_block_ids(self) -> list[int]:
        """Block ids free and holding no cached prefix on every rank: scratch steps (a
        warm-up's, adaptive K's costs) may put their rows on any rank there."""
        clean = set(self.ranks[0].clean_block_ids)
        for rank in self.ranks[1:]:
            clean &= set(rank.clean_block_ids)
        return sorted(clean)

    @property
    def num_prefix_hit_blocks(self) -> int:
        return sum(rank.num_prefix_hit_blocks for rank in self.ranks)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _place(self, seq: BlockOwner) -> int | None:
        """The rank ``seq`` would be placed on, or None where no rank can hold it."""
        fits = [r for r, rank in enumerate(self.ranks) if rank.can_allocate(seq)]
        if not fits:
            return None
        free = self.free_blocks_per_rank

        def preference(r: int) -> tuple[int, int]:
            # Blocks it would find cached count as free ones: a shared prefix draws
            # requests to its rank only while that rank is no fuller than the others.
            return (self.ranks[r].num_prefix_hits(seq) + free[r], -r)

        return max(fits, key=preference)

    def can_allocate(self, seq: BlockOwner) -> bool:
        return self._place(seq) is not None

    def allocate(self, seq: BlockOwner) -> None:
        rank = self._place(seq)
        if rank is None:
            raise MemoryError(
                f"KV cache: no data-parallel rank has room for {len(seq.token_ids)} tokens "
                f"(free blocks per rank: {self.free_blocks_per_rank})"
            )
        seq.dp_rank = rank  # type: ignore[attr-defined]
        self.ranks[rank].allocate(seq)
        self.num_placed[rank] += 1

    def _of(self, seq: BlockOwner) -> BlockManager:
        return self.ranks[getattr(seq, "dp_rank", 0)]

    def can_append(self, seq: BlockOwner, num_new_tokens: int) -> bool:
        return self._of(seq).can_append(seq, num_new_tokens)

    def append(self, seq: BlockOwner, num_new_tokens: int) -> None:
        self._of(seq).append(seq, num_new_tokens)

    def free(self, seq: BlockOwner) -> None:
        self._of(seq).free(seq)

    def cache_computed_blocks(self, seq: BlockOwner, num_tokens: int | None = None) -> None:
        self._of(seq).cache_computed_blocks(seq, num_tokens)

    def reset_prefix_cache(self) -> None:
        for rank in self.ranks:
            rank.reset_prefix_cache()


# What the scheduler allocates from: one pool's blocks, or each data-parallel rank's.
KvBlocks = BlockManager | DataParallelBlocks


def rank_of(blocks: KvBlocks, whole_block: int) -> int:
    """The data-parallel rank whose block ``whole_block`` is, as ``whole_table`` numbers
    them (0 for one pool's)."""
    if not isinstance(blocks, DataParallelBlocks):
        return 0
    return whole_block // blocks.num_blocks


def whole_ids(block_table: Iterable[int], rank: int, num_blocks: int) -> list[int]:
    """Rank ``rank``'s block ids as a pool of every rank's ``num_blocks`` numbers them:
    after the ranks before it."""
    return [rank * num_blocks + block for block in block_table]


def whole_table(blocks: KvBlocks, seq: BlockOwner) -> list[int]:
    """``seq``'s block ids as a pool of every rank's blocks numbers them (``whole_ids``);
    one pool's as they are."""
    if not isinstance(blocks, DataParallelBlocks):
        return list(seq.block_table)
    return whole_ids(seq.block_table, getattr(seq, "dp_rank", 0), blocks.num_blocks)
