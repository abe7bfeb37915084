"""KV block allocation with reference counts and prefix caching by chained block hashes.

Every block is in exactly one of three places: owned (ref_count > 0), free and clean,
or free but still holding a cached prefix (evictable, least recently freed first).
Allocation prefers runs of consecutive ids, because KV is shipped between workers one
run of consecutive blocks at a time.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


class BlockOwner(Protocol):
    """What the block manager needs to know about a request."""

    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int
    num_cached_tokens: int
    block_hashes: list[int]


def block_hash(parent: int | None, token_ids: Seq[int]) -> int:
    """Hash of a full block, chained on the hash of the block before it."""
    h = hashlib.blake2b(digest_size=8)
    h.update(b"root" if parent is None else parent.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little")


def chain_root(seq: BlockOwner) -> int | None:
    """What a request's first block hash chains on: nothing, or its LoRA adapter's digest
    (KV made under one adapter is never another's, nor the base model's)."""
    salt = getattr(seq, "cache_salt", None)
    return None if salt is None else block_hash(None, [salt])


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = field(default=())  # kept to rule out hash collisions


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_lookahead_slots: int = 0,
    ) -> None:
        """``num_lookahead_slots``: slots every request holds past its next tokens, where
        speculative decoding writes drafts and draft KV before it knows what is accepted."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"num_blocks and block_size must be positive ({num_blocks}, {block_size})"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_lookahead_slots = num_lookahead_slots
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._clean: list[int] = list(range(num_blocks))  # sorted free ids without cached content
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free ids with cached content
        self._by_hash: dict[int, int] = {}  # block hash -> block id
        self.num_prefix_hit_blocks = 0

    @property
    def total_blocks(self) -> int:
        """Its blocks (``DataParallelBlocks``' are every rank's)."""
        return self.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._clean) + len(self._evictable)

    @property
    def num_clean_blocks(self) -> int:
        return len(self._clean)

    @property
    def clean_block_ids(self) -> list[int]:
        """Free blocks that hold no cached prefix: writing them loses nothing."""
        return list(self._clean)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- allocation -----------------------------------------------------------------

    def can_allocate(self, seq: BlockOwner) -> bool:
        hits = self._prefix_hits(seq)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        needed = self.num_blocks_for(len(seq.token_ids) + self.num_lookahead_slots) - len(hits)
        return needed <= self.num_free_blocks - revived

    def allocate(self, seq: BlockOwner) -> None:
        """Gives ``seq`` blocks for all its known tokens, reusing cached prefix blocks."""
        assert not seq.block_table, "allocate() on a request that already holds blocks"
        hits = self._prefix_hits(seq)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        missing = self.num_blocks_for(len(seq.token_ids) + self.num_lookahead_slots) - len(hits)
        if missing > self.num_free_blocks - revived:
            raise MemoryError(
                f"KV cache: need {missing} blocks, {self.num_free_blocks - revived} free"
            )
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._evictable[block_id]
            block.ref_count += 1
        self.num_prefix_hit_blocks += len(hits)
        seq.block_table = list(hits)
        seq.block_hashes = [self.blocks[b].hash for b in hits]  # type: ignore[misc]
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens
        self._grow(seq, self.num_blocks_for(len(seq.token_ids) + self.num_lookahead_slots))

    def can_append(self, seq: BlockOwner, num_new_tokens: int) -> bool:
        needed = self.num_blocks_for(
            seq.num_computed_tokens + num_new_tokens + self.num_lookahead_slots
        ) - len(seq.block_table)
        return needed <= self.num_free_blocks

    def append(self, seq: BlockOwner, num_new_tokens: int) -> None:
        """Grows ``seq``'s table so that its next ``num_new_tokens`` tokens have slots."""
        self._grow(
            seq,
            self.num_blocks_for(
                seq.num_computed_tokens + num_new_tokens + self.num_lookahead_slots
            ),
        )

    def free(self, seq: BlockOwner) -> None:
        # Tail blocks first, so a later eviction takes the end of a prefix before its start.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                if block.hash is not None and self.enable_prefix_caching:
                    self._evictable[block_id] = None
                else:
                    self._reset(block)
                    bisect.insort(self._clean, block_id)
        seq.block_table = []
        seq.block_hashes = []

    # -- prefix caching --------------------------------------------------------------

    def cache_computed_blocks(self, seq: BlockOwner, num_tokens: int | None = None) -> None:
        """Registers the hashes of ``seq``'s blocks that are now full and computed (in every
        pool: ``num_tokens`` bounds them where the draft KV is behind the target's)."""
        if not self.enable_prefix_caching:
            return
        computed = seq.num_computed_tokens if num_tokens is None else num_tokens
        num_full = min(computed // self.block_size, len(seq.block_table))
        bs = self.block_size
        for i in range(len(seq.block_hashes), num_full):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            parent = seq.block_hashes[-1] if seq.block_hashes else chain_root(seq)
            h = block_hash(parent, tokens)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self._by_hash:
                block.hash, block.token_ids = h, tokens
                self._by_hash[h] = block.block_id

    def num_prefix_hits(self, seq: BlockOwner) -> int:
        """Blocks of ``seq``'s prefix that allocating it would take from the cache."""
        return len(self._prefix_hits(seq))

    def _prefix_hits(self, seq: BlockOwner) -> list[int]:
        """Cached blocks matching ``seq``'s prefix, leaving at least one token to compute."""
        if not self.enable_prefix_caching or not getattr(seq, "reads_prefix_cache", True):
            return []
        bs = self.block_size
        max_hits = (len(seq.token_ids) - 1) // bs
        hits: list[int] = []
        parent = chain_root(seq)
        for i in range(max_hits):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            parent = block_hash(parent, tokens)
            block_id = self._by_hash.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix held by a free block (the engine's warm-up leaves
        none behind): the allocator is as a new one, apart from blocks in use."""
        for block_id in list(self._evictable):
            self._reset(self.blocks[block_id])
            bisect.insort(self._clean, block_id)
        self._evictable.clear()

    # -- internals -------------------------------------------------------------------

    def _grow(self, seq: BlockOwner, num_blocks: int) -> None:
        missing = num_blocks - len(seq.block_table)
        if missing <= 0:
            return
        if missing > self.num_free_blocks:
            raise MemoryError(f"KV cache: need {missing} blocks, {self.num_free_blocks} free")
        hint = seq.block_table[-1] + 1 if seq.block_table else None
        new = self._take(missing, hint)
        for block_id in new:
            self.blocks[block_id].ref_count = 1
        seq.block_table.extend(new)

    def _take(self, n: int, hint: int | None) -> list[int]:
        """``n`` free ids: continue the run at ``hint``, else the first long-enough run."""
        taken: list[int] = []
        clean = self._clean
        if hint is not None:
            i = bisect.bisect_left(clean, hint)
            while len(taken) < n and i < len(clean) and clean[i] == hint + len(taken):
                taken.append(clean.pop(i))
        remaining = min(n - len(taken), len(clean))
        if remaining:
            start = self._find_run(remaining)
            taken.extend(clean[start : start + remaining])
            del clean[start : start + remaining]
        while len(taken) < n:  # evict cached prefixes, least recently freed first
            block_id, _ = self._evictable.popitem(last=False)
            self._reset(self.blocks[block_id])
            taken.append(block_id)
        return taken

    def _find_run(self, n: int, max_scan: int = 512) -> int:
        """Index in the clean list where ``n`` consecutive ids start (0 when none is found).

        The list is sorted and unique, so ids ``clean[i:i+n]`` are consecutive exactly when
        ``clean[i+n-1] - clean[i] == n-1``. Only the first ``max_scan`` starts are tried:
        consecutive ids are a preference (fewer, larger KV copies), not a requirement.
        """
        clean = self._clean
        for i in range(min(len(clean) - n + 1, max_scan)):
            if clean[i + n - 1] - clean[i] == n - 1:
                return i
        return 0

    def _reset(self, block: Block) -> None:
        if block.hash is not None and self._by_hash.get(block.hash) == block.block_id:
            del self._by_hash[block.hash]
        block.hash, block.token_ids = None, ()
