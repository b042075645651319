# SPDX-License-Identifier: Apache-2.0
"""The cached ring (``RINGKV_RING_PREFIX_CACHE=1``): where a prefix hit on a ring is decided
(``CachedRing.find_longest_cache_hit``, with the request's length from ``lookup_tokens``) and where a freed request's
tail is hashed (``CachedRing.hash_tail``). ``RingSWAManager`` inherits these rules; it adopts the hit's blocks and
keeps every hashed or shared block from being overwritten (``kv_cache.py``).

A tail is the ring blocks a freed request leaves hashed: at most R, its last window, which its next turn, a sibling
branch or its own resumption adopts; with sinks its ns sink blocks beside it, which every hit of the prefix needs.
The hit, the hash rules and the hazards they guard against:
[docs/vllm-plugin.md](../../docs/vllm-plugin.md#prefix-caching).
"""

from __future__ import annotations

import math
from collections.abc import Container, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from ringkv.kernels.ring_geometry import RingPlan

from ._compat import BlockPool, KVCacheBlock, cached_copies, drop_cached_hash, resolve_block_hashes
from .errors import RingConfigError
from .eviction import CachedTails
from .request_ring import RequestRing
from .ring_spec import RingSWASpec

# the number of tokens of the request whose hit the coordinator is looking up (its max_cache_hit_length + 1)
_LOOKUP_TOKENS: ContextVar[int | None] = ContextVar("ringkv_lookup_tokens", default=None)


@contextmanager
def lookup_tokens(num_tokens: int) -> Iterator[None]:
    """Tell the cached rings' finder, inside, the length of the request whose hit is looked up (vLLM's finder API
    has none; the coordinator's wrap in ``prefix_cache.py`` sets it)."""
    token = _LOOKUP_TOKENS.set(num_tokens)
    try:
        yield
    finally:
        _LOOKUP_TOKENS.reset(token)


def looked_up_tokens() -> int:
    """The length ``lookup_tokens`` set; a lookup outside it is refused."""
    num_tokens = _LOOKUP_TOKENS.get()
    if num_tokens is None:
        raise RingConfigError(
            "ringkv: a cached ring group was looked up outside HybridKVCacheCoordinator.find_longest_cache_hit "
            "(or _per_group), so the request's length is unknown; register the plugin "
            "(ringkv.integration.vllm.register) before vLLM builds its scheduler, or set RINGKV_RING_PREFIX_CACHE=0"
        )
    return num_tokens


class DrafterSkipGuard:
    """Which requests took part in a scheduler step whose batch may have skipped the drafter (vLLM's V1 runner runs
    it, and so stores context K/V, only for a batch whose longest sequence + lookahead fits the drafter's max
    length; Model Runner V2 always stores them): per request, the longest sequence of any step it took part in.
    ``record`` each allocation, ``close`` the step when the next one starts."""

    def __init__(self) -> None:
        self.open: dict[str, int] = {}  # this step's requests -> their sequence length after the step
        self.peaks: dict[str, int] = {}

    def record(self, request_id: str, seq_len: int) -> None:
        self.open[request_id] = seq_len

    def close(self, live: Container[str]) -> None:
        longest = max(self.open.values(), default=0)
        for request_id in self.open:
            if request_id in live:
                self.peaks[request_id] = max(self.peaks.get(request_id, 0), longest)
        self.open.clear()

    def peak(self, request_id: str) -> int:
        """The longest sequence of any step ``request_id`` took part in, this one included."""
        longest = max(self.open.values(), default=0) if request_id in self.open else 0
        return max(self.peaks.get(request_id, 0), longest)

    def skipped(self, request_id: str, lookahead: int, drafter_max_len: int) -> bool:
        """Whether a step ``request_id`` took part in may have run without the drafter."""
        return self.peak(request_id) + lookahead > drafter_max_len

    def forget(self, request_id: str) -> None:
        self.peaks.pop(request_id, None)


class CachedRing:
    """The cached ring's hit and hash rules, as methods of the ring manager (``RingSWAManager`` inherits them)."""

    # what the rules read of the manager (``RingSWAManager`` and vLLM's single-type manager set them)
    plan: RingPlan
    block_size: int
    block_pool: BlockPool
    kv_cache_spec: RingSWASpec
    kv_cache_group_id: int
    enable_caching: bool
    req_to_blocks: dict[str, list[KVCacheBlock]]
    rings: dict[str, RequestRing]
    drafter_skips: DrafterSkipGuard

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[Any],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: RingSWASpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """vLLM's finder contract for a ring group: per group the hit's row (the cached sink blocks, null up to the
        block the request's first query sees, then the cached tail blocks from there on), and the hit in tokens (a
        multiple of ``alignment_tokens``, never longer than the candidate the coordinator asks about): it ends at
        the first block the hit needs (``RingPlan.hit_needs_block``) that has no cached copy. Without
        ``cache_ring`` vLLM leaves the group out of the lookup (not ``prefix_cacheable``).

        ``drop_eagle_block``: the coordinator asked for one ring block past its candidate (its EAGLE margin; the
        ring manager has no fine-grained lookup, so the margin is one block); the ring drops no block of its own, it
        stops at the candidate."""
        if not kv_cache_spec.cache_ring:
            return tuple([] for _ in kv_cache_group_ids), 0
        block_size, plan, num_tokens = kv_cache_spec.block_size, kv_cache_spec.plan, looked_up_tokens()
        candidate = (max_length - (block_size if drop_eagle_block else 0)) // block_size
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, block_size)
        null = [block_pool.null_block] * len(kv_cache_group_ids)
        found: list[list[KVCacheBlock]] = []  # per logical block, a block per group
        for j in range(candidate):
            if not plan.hit_needs_block(j, num_tokens):
                found.append(null)
                continue
            cached = block_pool.get_cached_block(hashes[j], kv_cache_group_ids) if j < len(hashes) else None
            if cached is None:
                break
            found.append(cached)
        step = math.lcm(alignment_tokens, block_size) // block_size  # the hit stays a multiple of both
        end = len(found) // step * step
        rows = tuple([blocks[index] for blocks in found[:end]] for index in range(len(kv_cache_group_ids)))
        return rows, end * block_size

    def hit_row(self, new_computed_blocks: Sequence[KVCacheBlock], num_computed_tokens: int) -> list[KVCacheBlock]:
        """The ring group's row for a prefix hit of ``num_computed_tokens`` (the lookup's row cut to the hit the
        coordinator settled on): null placeholders, and with ``cache_ring`` the blocks to adopt."""
        hit = num_computed_tokens // self.block_size
        if not self.kv_cache_spec.cache_ring:
            return [self.block_pool.null_block] * hit
        if len(new_computed_blocks) < hit:
            raise RingConfigError(
                f"ringkv: a prefix hit of {num_computed_tokens} tokens reached the ring group with only "
                f"{len(new_computed_blocks)} blocks of {self.block_size}: its ring would hold no K/V; set "
                "RINGKV_RING_PREFIX_CACHE=0 and report this"
            )
        return list(new_computed_blocks[:hit])

    def hash_tail(self, request: Any, max_model_len: int) -> list[KVCacheBlock]:
        """With ``cache_ring``, hash the tail of a request being freed (``tail_to_hash``, less what is cached
        already; its sink blocks too) and drop the hashes of the tails it supersedes; its ring's window blocks, the
        sink blocks aside (none without ``cache_ring``): what ``keep_tail`` records for eviction before the
        target's blocks. A sink block is evicted as a target block is: every hit of its prefix needs it."""
        request_id = request.request_id
        if not (self.enable_caching and self.kv_cache_spec.cache_ring and request_id in self.rings):
            return []
        drafter_max_len = min(max_model_len, self.kv_cache_spec.drafter_max_len or max_model_len)
        tail = self.tail_to_hash(request, drafter_max_len)
        sinks = self.plan.sink_blocks
        window = min((j for j in tail if j >= sinks), default=len(self.req_to_blocks[request_id]))
        for block in self.superseded_tails(request, window):
            drop_cached_hash(self.block_pool, block)
        for block in self.duplicated(request_id):
            drop_cached_hash(self.block_pool, block)
        hashable = self.uncached(request, tail)
        if hashable:
            first, last = min(hashable), max(hashable)
            self.block_pool.cache_full_blocks(
                request=request, blocks=self.req_to_blocks[request_id], num_cached_blocks=first,
                num_full_blocks=last + 1, block_size=self.block_size, kv_cache_group_id=self.kv_cache_group_id,
                block_mask=[j in hashable for j in range(first, last + 1)],
            )  # fmt: skip
        return self.rings[request_id].claimed(first_column=sinks)

    def tail_to_hash(self, request: Any, drafter_max_len: int) -> set[int]:
        """The logical blocks of ``request``'s ring whose K/V a later request may adopt as it is freed: held by their
        column, named by the row, wholly below the committed tokens less the steps in flight, from a request none of
        whose steps may have skipped the drafter (V1's rule, ``RingSWASpec.drafter_skips_near_max_len``); those
        already hashed (adopted) aside."""
        request_id = request.request_id
        lookahead = self.plan.lookahead
        spec = self.kv_cache_spec
        if spec.drafter_skips_near_max_len and self.drafter_skips.skipped(request_id, lookahead, drafter_max_len):
            return set()
        # vLLM's materialized frontier: its computed tokens less the tokens of the steps in flight (output placeholders
        # count tokens, 1 + N per step), as vLLM caches its own blocks; a request stopped by its length may have
        # verified drafts past its last token: they have no hash
        frontier = request.num_computed_tokens - getattr(request, "num_output_placeholders", 0)
        written = min(frontier, request.num_tokens)
        row = self.req_to_blocks.get(request_id, [])
        return {
            j for j, block in self.rings[request_id].held()
            if j < len(row) and row[j] is block and block.block_hash is None and (j + 1) * self.block_size <= written
        }  # fmt: skip

    def uncached(self, request: Any, blocks: set[int]) -> set[int]:
        """The logical ``blocks`` no cached copy serves yet (a turn that recomputed past an earlier turn's tail holds
        blocks that tail left cached: hashing them again would duplicate it). A copy a running request holds
        (it adopted it: a shared prefix, such as a system prompt, puts one conversation's tail blocks in another's
        ring) serves only while that request runs: its column moves on and rewrites the block, hash dropped
        (``allocate_new_blocks``). So this tail hashes its own copy too (``duplicated`` keeps one later)."""
        hashes = resolve_block_hashes(request.block_hashes, self.block_pool.hash_block_size, self.block_size)

        def served(j: int) -> bool:  # the copy a lookup adopts (vLLM's get_cached_block names one) is unheld
            found = self.block_pool.get_cached_block(hashes[j], [self.kv_cache_group_id])
            return found is not None and found[0].ref_cnt == 0

        return {j for j in blocks if not served(j)}

    def duplicated(self, request_id: str) -> list[KVCacheBlock]:
        """The hashed blocks of a ring being freed whose hash another cached block carries too (a tail freed while
        this request held its copy hashed its own, ``uncached``): the other copy stays."""
        pool = self.block_pool
        return [
            block for block in self.rings[request_id].claimed()
            if block.block_hash is not None
            and len(cached_copies(pool, block.block_hash)) > 1
        ]  # fmt: skip

    def superseded_tails(self, request: Any, below: int) -> list[KVCacheBlock]:
        """The unheld cached ring blocks of ``request``'s own prefix below logical block ``below`` (its tail's window),
        the sink blocks aside: the tails of its earlier turns (or of itself before a preemption). Dropping their hashes
        bounds the ring's share of the cache to one tail per conversation branch, and the sink blocks, which every
        turn and branch of the prefix shares, once."""
        hashes = resolve_block_hashes(request.block_hashes, self.block_pool.hash_block_size, self.block_size)
        group = [self.kv_cache_group_id]
        window = range(self.plan.sink_blocks, min(below, len(hashes)))
        found = (self.block_pool.get_cached_block(hashes[j], group) for j in window)
        return [blocks[0] for blocks in found if blocks is not None and blocks[0].ref_cnt == 0]

    def keep_tail(self, ring: Sequence[KVCacheBlock], freed: bool = True) -> None:
        """Record a freed ring's blocks that kept their hash for eviction before the target's (``CachedTails``)."""
        CachedTails.of(self.block_pool).record(ring, self.kv_cache_group_id, freed)
