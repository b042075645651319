# SPDX-License-Identifier: Apache-2.0
"""Cached tails are evicted before any cached target block: a tail (the hashed ring blocks a freed request leaves)
saves one conversation at most a window of recompute, a target block serves every later hit of its prefix.
``CachedTails`` records each block pool's unheld tail blocks, oldest first; ``wrap_get_new_blocks`` has vLLM's
``BlockPool.get_new_blocks`` take them first. Why and what it costs: [docs/vllm-plugin.md](../../docs/vllm-plugin.md).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from ._compat import BlockPool, KVCacheBlock, free_queue_front, get_group_id, move_to_free_queue_front


class CachedTails:
    """One block pool's tail blocks (block id -> (block, its group)), oldest first. An entry goes stale when a request
    adopts the block or vLLM reuses it: checked when read (``is_tail``)."""

    _by_pool: ClassVar[weakref.WeakKeyDictionary[BlockPool, CachedTails]] = weakref.WeakKeyDictionary()

    def __init__(self) -> None:
        self.entries: dict[int, tuple[KVCacheBlock, int]] = {}

    @classmethod
    def of(cls, block_pool: BlockPool) -> CachedTails:
        """The pool's registry (made on first use)."""
        tails = cls._by_pool.get(block_pool)
        if tails is None:
            tails = cls._by_pool[block_pool] = cls()
        return tails

    @classmethod
    def find(cls, block_pool: BlockPool) -> CachedTails | None:
        """The pool's registry, None while no tail was ever recorded."""
        return cls._by_pool.get(block_pool)

    def record(self, blocks: Sequence[KVCacheBlock], group_id: int, freed: bool = True) -> None:
        """Record ring blocks that kept their hash, newest last: freed ones, or, with ``freed`` False, ones vLLM returns
        to the pool a step later (the deferred free; an entry read before that counts as stale)."""
        for block in blocks:
            if (block.ref_cnt == 0 or not freed) and block.block_hash is not None:
                self.entries.pop(block.block_id, None)
                self.entries[block.block_id] = (block, group_id)

    def is_tail(self, block: KVCacheBlock) -> bool:
        """Whether ``block`` is still an unheld, hashed tail block of the group it was recorded for."""
        entry = self.entries.get(block.block_id)
        return (entry is not None and entry[0] is block and block.ref_cnt == 0 and block.block_hash is not None
                and get_group_id(block.block_hash) == entry[1])  # fmt: skip

    def take_oldest(self, count: int, handed_out: set[int]) -> list[KVCacheBlock]:
        """Up to ``count`` tail blocks, oldest first, none of ``handed_out``; each entry read leaves the registry
        (taken, stale, or handed out anyway)."""
        taken: list[KVCacheBlock] = []
        while len(taken) < count and self.entries:
            block_id, (block, _) = next(iter(self.entries.items()))
            if block_id not in handed_out and self.is_tail(block):
                taken.append(block)
            del self.entries[block_id]
        return taken


def wrap_get_new_blocks(original: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's ``BlockPool.get_new_blocks(num_blocks)`` taking unheld tail blocks before any cached target block: it
    counts the cached non-tail blocks among the ``num_blocks`` the free queue would hand out, and moves that many
    tail blocks, oldest first, to the queue's front (where ``get_new_blocks`` drops their hashes)."""

    def get_new_blocks(self: BlockPool, num_blocks: int) -> list[KVCacheBlock]:
        tails = CachedTails.find(self)
        if tails is not None and tails.entries:
            front: list[KVCacheBlock] = []  # what the queue would hand out, less its cached target blocks
            doomed = 0  # how many cached target blocks it would hand out
            for block in free_queue_front(self):
                if len(front) + doomed >= num_blocks:
                    break
                if block.block_hash is None or tails.is_tail(block):
                    front.append(block)
                else:
                    doomed += 1
            spared = tails.take_oldest(doomed, {block.block_id for block in front})
            if spared:  # the front's blocks and the spared tails first, in that order
                move_to_free_queue_front(self, front + spared)
        return original(self, num_blocks)

    return get_new_blocks
