# SPDX-License-Identifier: Apache-2.0
"""The ring's KV-cache manager: each request's drafter K/V in a ring of ``R`` blocks (``RingSWASpec``), its
block-table row vLLM's position-indexed logical row::

    logical block   0    1   ...  j0-1 | j0          j0+1          ...  j            ...
    row entry       null null ... null | ring[j0%R]  ring[(j0+1)%R] ... ring[j%R]
    j0 = first_visible_block(P_min),  P_min = num_tokens_main_model - (la - 1)  (every draft rejected)

With sinks the columns are ``[sink blocks | ring]``: entries ``j < ns = cdiv(S, bs)`` are the sink blocks, never
null, and ``j >= ns`` column ``ns + (j - ns) mod R`` (``ring_geometry.block_column``). Admission, pool sizing,
per-step prediction and allocation count ``min(cdiv(N, bs), ns + R)`` blocks (``plan_step``). Hit and hash rules:
``cached_ring.CachedRing``; the row and the ring: [docs/vllm-plugin.md](../../docs/vllm-plugin.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ringkv.kernels.ring_geometry import block_column

from ._compat import KVCacheBlock, SlidingWindowManager, drop_cached_hash, records_new_block_ids
from .cached_ring import CachedRing, DrafterSkipGuard
from .errors import RingConfigError
from .request_ring import NO_BLOCK, RequestRing
from .ring_spec import RingSWASpec


@dataclass(frozen=True)
class RingStep:
    """What one allocation does to a request's ring (``RingSWAManager.plan_step``). ``unclaimed_columns``: columns
    that take their first block; ``shared_columns``: columns about to be written whose block another request also
    holds, which take a fresh block (the shared one released); ``adopted_free``: the prefix hit's blocks that leave
    vLLM's free queue when adopted. ``cost``: blocks the step takes from the pool, what admission and execution
    both count."""

    unclaimed_columns: tuple[int, ...]
    shared_columns: tuple[int, ...]
    adopted_free: int

    @property
    def cost(self) -> int:
        return len(self.unclaimed_columns) + len(self.shared_columns) + self.adopted_free


class RingSWAManager(CachedRing, SlidingWindowManager):
    """Allocates each request's ring once and keeps its logical row periodic; never more than ns + R blocks.

    With ``cache_ring`` a prefix hit's cached blocks are adopted at their columns, a hashed or shared block is never
    written (replaced, or its hash dropped, before its column takes the next logical block), and a request's tail
    is hashed when it is freed (``release``)."""

    # the coordinator's EAGLE margin for this manager is one block (CachedRing.find_longest_cache_hit relies on it)
    supports_fine_grained_hash_lookup = False

    def __init__(self, kv_cache_spec: RingSWASpec, **kwargs: Any) -> None:
        # the factory passes the spec's admission cap (R); the ring needs no cap, it is the ring
        kwargs.pop("max_admission_blocks_per_request", None)
        self.plan = kv_cache_spec.plan  # refuses an unplanned spec before anything is built
        super().__init__(kv_cache_spec, **kwargs)
        self.ring_blocks = self.plan.ring_blocks
        self.sink_blocks = self.plan.sink_blocks
        self.rings: dict[str, RequestRing] = {}
        self.drafter_skips = DrafterSkipGuard()

    def ring_size(self, num_tokens: int) -> int:
        """Physical blocks a request with ``num_tokens`` slots holds: ``min(cdiv(N, bs), ns + R)``."""
        return self.plan.blocks_for_tokens(num_tokens)

    def check_lookahead(self, num_tokens: int, num_tokens_main_model: int) -> None:
        """Refuse slots past the main model's tokens beyond the lookahead the ring was planned for: the step
        would write positions that alias live ones."""
        lookahead = num_tokens - num_tokens_main_model
        if lookahead > self.plan.lookahead:
            raise RingConfigError(
                f"ringkv: an allocation asks for {lookahead} lookahead slots but the ring was planned for "
                f"{self.plan.lookahead} (R = {self.ring_blocks} blocks of {self.block_size}, window "
                f"{self.plan.window}); plan the ring spec with vLLM's num_lookahead_tokens >= {lookahead}"
            )

    def first_live_block(self, num_tokens_main_model: int) -> int:
        """Logical blocks below this are wholly before any window this step's queries can have (the sink blocks
        aside: ``dead``)."""
        return self.plan.first_visible_block(max(0, num_tokens_main_model - (self.plan.lookahead - 1)))

    def dead(self, logical_block: int, first_live: int) -> bool:
        """Whether ``logical_block`` is null in the row: below ``first_live`` and no sink block."""
        return self.sink_blocks <= logical_block < first_live

    def column(self, logical_block: int) -> int:
        """The request's column holding ``logical_block``: ``[sink blocks | ring]`` (``ring_geometry.block_column``)."""
        return block_column(logical_block, self.ring_blocks, self.sink_blocks)

    def plan_step(
        self,
        request_id: str,
        num_tokens: int,
        num_tokens_main_model: int,
        hit: Sequence[KVCacheBlock] = (),
    ) -> RingStep:
        """The one account of an allocation, for the prediction and the allocation alike: claim every unclaimed
        column of the first ``min(cdiv(N, bs), R)``; a live logical block appended to a column whose block another
        request also holds replaces it (a block held by this request alone is written in place, its hash dropped);
        ``hit``: the prefix hit this first allocation adopts."""
        ring = self.rings.get(request_id) or RequestRing()
        adopted = {self.column(j): block for j, block in enumerate(hit) if not block.is_null}

        def occupant(column: int) -> KVCacheBlock | None:
            held = ring.occupant(column)
            return held if held is not None else adopted.get(column)

        def shared(column: int) -> bool:
            # another request holds it: an adopted block's references less this ring's own (none before adoption)
            return ring.shared(column) if ring.occupant(column) is not None else adopted[column].ref_cnt > 0

        end = self.plan.logical_blocks(num_tokens)
        unclaimed = tuple(column for column in range(min(end, self.plan.row_blocks)) if occupant(column) is None)
        start = max(len(self.req_to_blocks.get(request_id, ())), len(hit))
        written = self.written_columns(start, end, self.first_live_block(num_tokens_main_model))
        # every allocation of every running request asks this: set membership, not a scan of the unclaimed
        fresh = set(unclaimed)
        shared_columns = tuple(column for column in written if column not in fresh and shared(column))
        adopted_free = sum(block.ref_cnt == 0 for block in adopted.values())
        return RingStep(unclaimed_columns=unclaimed, shared_columns=shared_columns, adopted_free=adopted_free)

    def written_columns(self, start: int, end: int, first_live: int) -> list[int]:
        """The columns the logical blocks ``start .. end - 1`` not ``dead`` are written to."""
        sinks = range(start, min(end, self.sink_blocks))
        ring_start = max(start, first_live, self.sink_blocks)
        if end - ring_start >= self.ring_blocks:
            return [*sinks, *range(self.sink_blocks, self.plan.row_blocks)]
        return [self.column(j) for j in [*sinks, *range(ring_start, end)]]

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        # admission (capped) and execution (uncapped) ask the same question: the same answer. Only execution
        # plans writes; a capped count may reserve past the lookahead (vLLM's _request_remaining_blocks adds
        # 1 + num_spec_tokens + num_lookahead_tokens for a prefill waiting on a KV connector's async load)
        del total_computed_tokens, prefill_end
        if not apply_admission_cap:
            self.check_lookahead(num_tokens, num_tokens_main_model)
        hit = self.hit_row(new_computed_blocks, num_local_computed_tokens) if new_computed_blocks else ()
        return self.plan_step(request_id, num_tokens, num_tokens_main_model, hit).cost

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int) -> list[KVCacheBlock]:
        self.check_lookahead(num_tokens, num_tokens_main_model)
        step = self.plan_step(request_id, num_tokens, num_tokens_main_model)
        ring = self.rings.setdefault(request_id, RequestRing())
        row = self.req_to_blocks[request_id]
        # release first: another request keeps each shared block (it never returns to the free queue here); the
        # column stops holding its logical block, so it is never hashed under it
        self.block_pool.free_blocks([ring.release(column) for column in step.shared_columns])
        columns = step.unclaimed_columns + step.shared_columns
        fresh = self.block_pool.get_new_blocks(len(columns)) if step.cost else []
        for column, block in zip(columns, fresh, strict=True):
            ring.claim(column, block)
        if records_new_block_ids(self):
            self.new_block_ids.extend(block.block_id for block in fresh)
        first_live = self.first_live_block(num_tokens_main_model)
        start = len(row)
        for j in range(start, self.plan.logical_blocks(num_tokens)):
            if self.dead(j, first_live):
                row.append(self.block_pool.null_block)
                continue
            column = self.column(j)
            block = ring.occupant(column)
            assert block is not None, f"column {column} of request {request_id} was never claimed"
            # the column stops holding its logical block (never hashed under it again; the row keeps naming it there,
            # as the worker's append-only row does: dead to every query, the R proof of ring_geometry)
            if ring.store(column, j) not in (NO_BLOCK, j) and block.block_hash is not None:
                drop_cached_hash(self.block_pool, block)  # held by this request alone: none may adopt it now
            row.append(block)
        self.drafter_skips.record(request_id, num_tokens_main_model)
        return row[start:]

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        record_for_zeroing: bool = True,
    ) -> None:
        """A KV connector's hit (capped by ``connectors.external_hit_cap``: no connector moves a ring, so the hit
        stops where the first query still sees) is dead to the ring: null placeholders up to its last whole block,
        after the local hit's entries."""
        del record_for_zeroing
        row = self.req_to_blocks[request_id]
        whole = (num_local_computed_tokens + num_external_computed_tokens) // self.block_size
        row.extend([self.block_pool.null_block] * (whole - len(row)))

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """A prefix hit: the row takes the hit's entries (``hit_row``), so it stays position-indexed; with
        ``cache_ring`` each adopted block (sink blocks included) is touched and sits at its column (``column``)."""
        del num_external_computed_tokens
        hit = self.hit_row(new_computed_blocks, num_local_computed_tokens)
        row = self.req_to_blocks[request_id]
        self.block_pool.touch([block for block in hit if not block.is_null])
        ring = self.rings.setdefault(request_id, RequestRing())
        for j, block in enumerate(hit):
            if not block.is_null:
                ring.adopt(j, self.column(j), block)
        row.extend(hit)

    def cache_blocks(self, request: Any, num_tokens: int, retention_interval: int | None = None, **kwargs: Any) -> None:
        # a ring block is hashed only when its request is freed (release): until then its column may be rewritten
        return

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        # ring blocks are reused in place, never returned before the request ends
        return

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return 0

    def new_step_starts(self) -> None:
        super().new_step_starts()
        self.drafter_skips.close(self.rings)

    def release(self, request: Any, max_model_len: int) -> None:
        """Free a finished, aborted or preempted request's ring before vLLM frees its other groups, its tail hashed
        first (``hash_tail``)."""
        ring = self.hash_tail(request, max_model_len)
        self.free(request.request_id)
        self.keep_tail(ring)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """The distinct ring blocks (each once: the pool counts one reference per request), the newest logical
        block first: the caller frees them in reverse, so the oldest is evicted first and the tail's end (what the
        next turn or a resumed request adopts) stays cached longest."""
        super().pop_blocks_for_free(request_id)
        self.drafter_skips.forget(request_id)
        ring = self.rings.pop(request_id, None)
        return [] if ring is None else ring.newest_first()
