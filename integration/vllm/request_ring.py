# SPDX-License-Identifier: Apache-2.0
"""One request's ring in one ring group: per column, its physical block and the logical block whose K/V it holds.
The manager (``kv_cache.RingSWAManager``) claims, adopts and stores through it; the cached ring's hash rules
(``cached_ring.py``) read which logical block each column holds. Column arithmetic: ``ring_geometry.block_column``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from ._compat import KVCacheBlock

NO_BLOCK = -1  # a column that holds no logical block a later request may adopt (fresh, or its block released)


@dataclass
class RequestRing:
    """``blocks[c]``: column ``c``'s physical block (None: not claimed yet); ``logical[c]``: the logical block whose
    K/V it holds (``NO_BLOCK``: none). A column claimed is held until the request is freed."""

    blocks: list[KVCacheBlock | None] = field(default_factory=list)
    logical: list[int] = field(default_factory=list)

    def widen(self, width: int) -> None:
        """Make room for columns ``0 .. width - 1``."""
        missing = width - len(self.blocks)
        if missing > 0:
            self.blocks.extend([None] * missing)
            self.logical.extend([NO_BLOCK] * missing)

    def occupant(self, column: int) -> KVCacheBlock | None:
        """The block ``column`` holds, None while unclaimed."""
        return self.blocks[column] if column < len(self.blocks) else None

    def shared(self, column: int) -> bool:
        """Whether another request also holds ``column``'s block (an adopted block two requests share): its
        references less this request's own."""
        block = self.occupant(column)
        return block is not None and block.ref_cnt > 1

    def claim(self, column: int, block: KVCacheBlock) -> None:
        """``column`` takes a fresh ``block``, holding no logical block yet."""
        self.widen(column + 1)
        self.blocks[column], self.logical[column] = block, NO_BLOCK

    def adopt(self, logical_block: int, column: int, block: KVCacheBlock) -> None:
        """``column`` takes a prefix hit's cached ``block``, which holds ``logical_block``'s K/V."""
        self.widen(column + 1)
        self.blocks[column], self.logical[column] = block, logical_block

    def release(self, column: int) -> KVCacheBlock:
        """``column`` gives up its block (another request keeps it); the column holds nothing until claimed."""
        block = self.blocks[column]
        assert block is not None, f"column {column} has no block to release"
        self.blocks[column], self.logical[column] = None, NO_BLOCK
        return block

    def store(self, column: int, logical_block: int) -> int:
        """``column`` takes ``logical_block``'s K/V; the logical block it held before (``NO_BLOCK``: none)."""
        before, self.logical[column] = self.logical[column], logical_block
        return before

    def held(self) -> Iterator[tuple[int, KVCacheBlock]]:
        """(logical block, physical block) of every column that holds one."""
        for logical_block, block in zip(self.logical, self.blocks, strict=True):
            if block is not None and logical_block != NO_BLOCK:
                yield logical_block, block

    def claimed(self, first_column: int = 0) -> list[KVCacheBlock]:
        """The ring's blocks, by column, from ``first_column`` on."""
        return [block for block in self.blocks[first_column:] if block is not None]

    def newest_first(self) -> list[KVCacheBlock]:
        """The ring's blocks, the newest logical block first (columns holding none last)."""
        order = sorted(zip(self.logical, range(len(self.blocks)), self.blocks, strict=True), reverse=True)
        return [block for _, _, block in order if block is not None]
