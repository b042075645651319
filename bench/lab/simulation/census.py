# SPDX-License-Identifier: Apache-2.0
"""What vLLM's ``BlockPool`` holds in its prefix cache, step by step, for ``ringkv bench load``.

The census watches the pool's ``cached_block_hash_to_block`` map (its ``insert`` and ``pop``, wrapped on the
instance; the map's keys are a block hash plus the KV-cache group id, ``make_block_hash_with_group_id``) and the
pool's ``get_new_blocks``:

- **evictions**: cache entries (hash -> block) the pool drops while ``get_new_blocks`` hands out a free block
  that still carried a hash, i.e. a cached block reused for new K/V; counted apart for the target groups and the
  drafter groups (a mixed drafter's full-attention group with its sliding one). Hashes a manager drops by itself
  (outside ``get_new_blocks``) are not evictions.
- **unheld hashed drafter blocks** (the drafter's share of the cache): distinct blocks holding at least one
  drafter-group entry whose ``ref_cnt`` is 0 (no request holds them; they wait in the free queue).
- **conversations with cached target blocks**: conversations owning at least one block hash that is cached in
  the first target group (a full block, or a partial prompt tail). A hash is owned by every conversation one of
  whose requests hashed it, so the shared system prompt's blocks belong to all of them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from typing import Any

from ._vllm import KVCacheBlock, Request

GROUP_ID_BYTES = 4  # the group id's bytes at the end of a cache key (make_block_hash_with_group_id)


def group_of(key: bytes) -> int:
    return int.from_bytes(key[-GROUP_ID_BYTES:], "big")


class CacheCensus:
    """Counts kept while a scheduler runs; ``observe`` after every step and at the end."""

    def __init__(self, block_pool: Any, drafter_groups: Collection[int], ring_blocks: int) -> None:
        self.drafter_groups = frozenset(drafter_groups)
        self.ring_blocks = ring_blocks
        self.evictions = Counter({"target": 0, "drafter": 0})
        # block id -> (the block, how many drafter-group entries it has)
        self._drafter_blocks: dict[int, tuple[KVCacheBlock, int]] = {}
        self._target_hashes: Counter[bytes] = Counter()  # cached first-target-group hashes (key less group id)
        self._owners: dict[bytes, set[int]] = {}  # block hash -> conversations whose requests hashed it
        self._seen: dict[str, int] = {}  # request id -> block hashes already given owners
        self._evicting = False
        self.peak_unheld = 0
        self.conversations_at_peak = 0
        self.peak_excess = -(1 << 62)  # max over steps of unheld - R x conversations with cached target blocks
        self._watch(block_pool)

    def _watch(self, block_pool: Any) -> None:
        cache = block_pool.cached_block_hash_to_block
        insert, pop, get_new_blocks = cache.insert, cache.pop, block_pool.get_new_blocks

        def watched_insert(key: bytes, block: KVCacheBlock) -> None:
            insert(key, block)
            self._count(key, block, +1)

        def watched_pop(key: bytes, block_id: int) -> KVCacheBlock | None:
            block = pop(key, block_id)
            if block is not None:
                self._count(key, block, -1)
                if self._evicting:
                    self.evictions["drafter" if group_of(key) in self.drafter_groups else "target"] += 1
            return block

        def watched_get_new_blocks(num_blocks: int) -> list[KVCacheBlock]:
            self._evicting = True
            try:
                return get_new_blocks(num_blocks)
            finally:
                self._evicting = False

        cache.insert, cache.pop, block_pool.get_new_blocks = watched_insert, watched_pop, watched_get_new_blocks

    def _count(self, key: bytes, block: KVCacheBlock, sign: int) -> None:
        group = group_of(key)
        if group in self.drafter_groups:
            count = self._drafter_blocks.get(block.block_id, (block, 0))[1] + sign
            if count:
                self._drafter_blocks[block.block_id] = (block, count)
            else:
                del self._drafter_blocks[block.block_id]
        elif group == 0:
            self._target_hashes[key[:-GROUP_ID_BYTES]] += sign
            if not self._target_hashes[key[:-GROUP_ID_BYTES]]:
                del self._target_hashes[key[:-GROUP_ID_BYTES]]

    def own(self, request: Request, conversation: int) -> None:
        """Record ``conversation`` as an owner of the request's block hashes not recorded yet (call after every
        step for every live request: decode appends hashes)."""
        hashes = request.block_hashes
        for block_hash in hashes[self._seen.get(request.request_id, 0) :]:
            self._owners.setdefault(bytes(block_hash), set()).add(conversation)
        self._seen[request.request_id] = len(hashes)

    def unheld_drafter_blocks(self) -> int:
        return sum(block.ref_cnt == 0 for block, _ in self._drafter_blocks.values())

    def conversations_cached(self) -> int:
        owners: set[int] = set()
        for block_hash in self._target_hashes:
            owners |= self._owners.get(block_hash, set())
        return len(owners)

    def observe(self) -> tuple[int, int]:
        """(unheld hashed drafter blocks, conversations with cached target blocks) now; keeps the peak."""
        unheld, conversations = self.unheld_drafter_blocks(), self.conversations_cached()
        if unheld > self.peak_unheld:
            self.peak_unheld, self.conversations_at_peak = unheld, conversations
        self.peak_excess = max(self.peak_excess, unheld - self.ring_blocks * conversations)
        return unheld, conversations
