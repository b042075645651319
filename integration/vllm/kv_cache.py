# SPDX-License-Identifier: Apache-2.0
"""The ring KV-cache spec and manager: a sliding-window group that holds exactly ``R`` blocks per request.

``R = cdiv(W + la - 2, bs) + 1`` (``ringkv.kernels.ring_geometry``) from the group's *final* block size
(page-size unification may change it after the spec is built), the window W and the lookahead la
(vLLM's ``num_lookahead_tokens``, ``num_speculative_tokens + 1`` for DFlash).

The request's block-table row stays a position-indexed logical row, as vLLM's workers expect::

    logical block   0    1   ...  j0-1 | j0        j0+1        ...   j          ...
    row entry       null null ... null | ring[j0%R] ring[(j0+1)%R] ... ring[j%R]
                    \\__ wholly before the window __/  (the DFlash prepare kernel PADs their context rows)

    j0 = (P_min - (W - 1)) // bs,   P_min = num_tokens_main_model - (la - 1)

``P_min`` is the lowest context_len position this step can end at (every speculative token rejected), so
no block a query may still read is nulled. The R ring blocks are claimed on first need and held until the
request is freed: admission, pool sizing, per-step prediction and allocation all count
``min(cdiv(N, bs), R)`` blocks. With ``cache_ring`` (``cached_ring.py``) a prefix hit's cached blocks are adopted
at their columns, and a column whose block another request shares takes a fresh block when it moves on (the
shared one released): still at most R held, and an entry the row wrote before (dead to every query, as in the
worker's append-only row) may name the block its column held then.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import triton
from ringkv.kernels.ring_geometry import RingPlan, first_visible_position, ring_block

from ._compat import KVCacheBlock, SlidingWindowManager, SlidingWindowSpec, VllmConfig, replace_as
from .cached_ring import StepLengths, keep_windows, ring_hit, superseded_windows, uncached, window_to_hash
from .errors import RingConfigError
from .names import UNPLANNED


@dataclass(frozen=True, kw_only=True)
class RingSWASpec(SlidingWindowSpec):
    """A ``SlidingWindowSpec`` whose group lives in a fixed per-request ring of ``ring_blocks`` blocks.

    ``lookahead``: vLLM's ``num_lookahead_tokens``; ``UNPLANNED`` (0) when the spec was built with no vLLM
    config in scope (a page-size probe): such a spec has a page size but no ring.
    """

    lookahead: int = field(default=UNPLANNED)
    # the ring's blocks take part in vLLM's prefix cache (``RINGKV_RING_PREFIX_CACHE``); False: every hit is capped
    # so the target's recompute rebuilds the ring (``prefix_cache.ring_hit_cap``)
    cache_ring: bool = field(default=False)
    # the longest sequence vLLM runs the drafter for (its speculative config's max_model_len); 0: the engine's own
    drafter_max_len: int = field(default=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.extra_retained_tokens:
            raise ValueError(
                f"extra_retained_tokens={self.extra_retained_tokens}: a ring keeps no tokens below the window "
                "(multi-module MTP re-prefill is not supported on the ring)"
            )
        if isinstance(self.lookahead, bool) or not isinstance(self.lookahead, int) or self.lookahead < 0:
            raise ValueError(f"lookahead={self.lookahead!r} must be an int >= 0 (0 = not planned yet)")
        if self.lookahead != UNPLANNED:
            RingPlan(self.sliding_window, self.block_size, self.lookahead)

    @property
    def plan(self) -> RingPlan:
        if self.lookahead == UNPLANNED:
            raise RingConfigError(
                "ringkv: a ring KV spec reached the scheduler without vLLM's num_lookahead_tokens (it was built "
                "outside vLLM's config scope), so its ring size is unknown; register the plugin "
                "(ringkv.integration.vllm.register) before vLLM builds its workers"
            )
        return RingPlan(window=self.sliding_window, kv_block_size=self.block_size, lookahead=self.lookahead)

    @property
    def ring_blocks(self) -> int:
        """R for the current block size."""
        return self.plan.ring_blocks

    @property
    def prefix_cacheable(self) -> bool:
        # cache_ring: freed windows are hashed and adopted (cached_ring.py); else vLLM leaves the group out of the
        # hit lookup and prefix_cache.py caps the hit so the recompute rebuilds the ring
        return self.cache_ring

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        """R (capped by the blocks a max_model_len request would hold), whatever is in flight."""
        del max_in_flight_tokens
        return min(self.ring_blocks, triton.cdiv(max_model_len, self.block_size))

    def max_memory_usage_bytes(self, vllm_config: VllmConfig) -> int:
        blocks = self.max_admission_blocks_per_request(0, vllm_config.model_config.max_model_len)
        return blocks * self.page_size_bytes


def ring_prefix_cache_enabled() -> bool:
    """``RINGKV_RING_PREFIX_CACHE``: ``1`` (the default) puts the ring's blocks in vLLM's prefix cache, ``0`` keeps
    every hit capped so the target rebuilds the window. Any other value is refused."""
    value = os.environ.get("RINGKV_RING_PREFIX_CACHE", "1")
    if value not in ("0", "1"):
        raise RingConfigError(
            f"ringkv: RINGKV_RING_PREFIX_CACHE={value!r}; set it to 1 (the ring's windows in the prefix cache, the "
            "default) or 0 (every hit capped so the target rebuilds the window)"
        )
    return value == "1"


def is_ring_spec(spec: Any) -> bool:
    """A ``RingSWASpec``, or vLLM's ``UniformTypeKVCacheSpecs`` of them (``kv_cache_specs``, per layer)."""
    layers = getattr(spec, "kv_cache_specs", None)
    return isinstance(spec, RingSWASpec) or (
        isinstance(layers, dict) and any(isinstance(layer, RingSWASpec) for layer in layers.values())
    )


def to_ring_spec(spec: Any, lookahead: int, drafter_max_len: int = 0) -> Any:
    """Turn a ``SlidingWindowSpec`` into a ``RingSWASpec`` planned for ``lookahead`` (and ``drafter_max_len``), its
    ``cache_ring`` from ``ring_prefix_cache_enabled()`` (other specs pass through; a ring spec is re-planned only
    while unplanned)."""
    if isinstance(spec, RingSWASpec):
        if spec.lookahead != UNPLANNED or lookahead == UNPLANNED:
            return spec
    elif not isinstance(spec, SlidingWindowSpec):
        return spec
    return replace_as(spec, RingSWASpec, lookahead=lookahead, cache_ring=ring_prefix_cache_enabled(),
                      drafter_max_len=drafter_max_len)  # fmt: skip


@dataclass(frozen=True)
class RingStep:
    """What one allocation does to a request's ring (``RingSWAManager.plan``): the columns that take a fresh block
    (unclaimed so far, or holding a block another request also holds, which this request releases); the adopted
    prefix-hit blocks that leave vLLM's free queue when touched. ``cost``: blocks the step takes from the pool, what
    admission and execution both count."""

    claims: tuple[int, ...]
    replaced: tuple[int, ...]
    evictable: int

    @property
    def cost(self) -> int:
        return len(self.claims) + len(self.replaced) + self.evictable


class RingSWAManager(SlidingWindowManager):
    """Allocates each request's ring once and keeps its logical row periodic; never more than R blocks.

    With ``cache_ring`` (``cached_ring.py`` explains the rules) a prefix hit's ring blocks are adopted at their
    columns, a hashed or shared block is never written (replaced, or its hash dropped, before its column takes the
    next logical block), and a request's window is hashed when it is freed (``release``)."""

    # the coordinator's EAGLE margin for this manager is one block (ring_hits.ring_hit relies on it)
    supports_fine_grained_hash_lookup = False

    def __init__(self, kv_cache_spec: RingSWASpec, **kwargs: Any) -> None:
        # the factory passes the spec's admission cap (R); the ring needs no cap, it is the ring
        kwargs.pop("max_admission_blocks_per_request", None)
        self.plan = kv_cache_spec.plan  # refuses an unplanned spec before anything is built
        super().__init__(kv_cache_spec, **kwargs)
        self.ring_blocks = self.plan.ring_blocks
        # request id -> column c's physical block (None: not claimed yet) and the logical block it holds (-1: none)
        self.rings: dict[str, list[KVCacheBlock | None]] = {}
        self.holds: dict[str, list[int]] = {}
        self.steps = StepLengths()

    def ring_size(self, num_tokens: int) -> int:
        """Physical blocks a request with ``num_tokens`` slots holds: ``min(cdiv(N, bs), R)``."""
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
        """Logical blocks below this are wholly before any window this step's queries can have."""
        lowest_commit = max(0, num_tokens_main_model - (self.plan.lookahead - 1))
        return first_visible_position(lowest_commit, self.plan.window) // self.block_size

    def hit_blocks(self, new_computed_blocks: Sequence[KVCacheBlock], num_computed_tokens: int) -> list[KVCacheBlock]:
        """The ring group's row for a prefix hit of ``num_computed_tokens`` (the lookup's row cut to the hit the
        coordinator settled on): null placeholders, and with ``cache_ring`` the adopted blocks."""
        hit = num_computed_tokens // self.block_size
        if not self.kv_cache_spec.cache_ring:
            return [self._null_block] * hit
        if len(new_computed_blocks) < hit:
            raise RingConfigError(
                f"ringkv: a prefix hit of {num_computed_tokens} tokens reached the ring group with only "
                f"{len(new_computed_blocks)} blocks of {self.block_size}: its window would hold no K/V; set "
                "RINGKV_RING_PREFIX_CACHE=0 and report this"
            )
        return list(new_computed_blocks[:hit])

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
        ring = self.rings.get(request_id, [])
        adopted = {ring_block(j, self.ring_blocks): block for j, block in enumerate(hit) if not block.is_null}

        def occupant(column: int) -> KVCacheBlock | None:
            held = ring[column] if column < len(ring) else None
            return held if held is not None else adopted.get(column)

        end = triton.cdiv(num_tokens, self.block_size)
        claims = tuple(column for column in range(min(end, self.ring_blocks)) if occupant(column) is None)
        start = max(len(self.req_to_blocks.get(request_id, ())), len(hit), self.first_live_block(num_tokens_main_model))
        written = range(self.ring_blocks) if end - start >= self.ring_blocks else [
            ring_block(j, self.ring_blocks) for j in range(start, end)
        ]  # fmt: skip
        # other holders of a column's block: its references less this request's own (a ring block, not a hit);
        # every allocation of every running request asks this: set membership, not a scan of the claims
        claimed = set(claims)
        replaced = tuple(
            column for column in written
            if column not in claimed
            and occupant(column).ref_cnt - (column < len(ring) and ring[column] is not None) > 0
        )  # fmt: skip
        evictable = sum(block.ref_cnt == 0 for block in adopted.values())
        return RingStep(claims=claims, replaced=replaced, evictable=evictable)

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
        hit = self.hit_blocks(new_computed_blocks, num_local_computed_tokens) if new_computed_blocks else ()
        return self.plan_step(request_id, num_tokens, num_tokens_main_model, hit).cost

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int) -> list[KVCacheBlock]:
        self.check_lookahead(num_tokens, num_tokens_main_model)
        step = self.plan_step(request_id, num_tokens, num_tokens_main_model)
        ring, holds = self.rings.setdefault(request_id, []), self.holds.setdefault(request_id, [])
        width = max(len(ring), *(column + 1 for column in step.claims), 0)
        ring.extend([None] * (width - len(ring)))
        holds.extend([-1] * (width - len(holds)))
        row = self.req_to_blocks[request_id]
        # release first: another request keeps each replaced block (it never returns to the free queue here)
        self.block_pool.free_blocks([ring[column] for column in step.replaced])
        for column in step.replaced:
            holds[column] = -1  # the column stops holding its logical block: never hashed under it
        fresh = self.block_pool.get_new_blocks(len(step.claims) + len(step.replaced)) if step.cost else []
        for column, block in zip(step.claims + step.replaced, fresh, strict=True):
            ring[column], holds[column] = block, -1
        if self._record_new_block_ids:
            self.new_block_ids.extend(block.block_id for block in fresh)
        first_live = self.first_live_block(num_tokens_main_model)
        start = len(row)
        for j in range(start, triton.cdiv(num_tokens, self.block_size)):
            if j < first_live:
                row.append(self._null_block)
                continue
            column = ring_block(j, self.ring_blocks)
            block = ring[column]
            # the column stops holding its logical block (never hashed under it again; the row keeps naming it there,
            # as the worker's append-only row does: dead to every query, the R proof of ring_geometry)
            if holds[column] not in (-1, j) and block.block_hash is not None:
                self.block_pool._maybe_evict_cached_block(block)  # held by this request alone: none may adopt it now
            holds[column] = j
            row.append(block)
        self.steps.record(request_id, num_tokens_main_model)
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
        row.extend([self._null_block] * (whole - len(row)))

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """A prefix hit: the row takes the hit's entries (``hit_blocks``), so it stays position-indexed; with
        ``cache_ring`` each adopted block is touched and sits at its column ``j mod R``."""
        del num_external_computed_tokens
        hit = self.hit_blocks(new_computed_blocks, num_local_computed_tokens)
        row = self.req_to_blocks[request_id]
        adopted = [block for block in hit if not block.is_null]
        self.block_pool.touch(adopted)
        ring, holds = self.rings.setdefault(request_id, []), self.holds.setdefault(request_id, [])
        for j, block in enumerate(hit):
            if block.is_null:
                continue
            column = ring_block(j, self.ring_blocks)
            ring.extend([None] * (column + 1 - len(ring)))
            holds.extend([-1] * (column + 1 - len(holds)))
            ring[column], holds[column] = block, j
        row.extend(hit)

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec,
                               drop_eagle_block, alignment_tokens, *args: Any, **kwargs: Any):  # fmt: skip
        if not kv_cache_spec.cache_ring:  # not prefix_cacheable: vLLM leaves the group out of the lookup
            return tuple([] for _ in kv_cache_group_ids), 0
        return ring_hit(block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec, drop_eagle_block,
                        alignment_tokens)  # fmt: skip

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
        self.steps.close(self.rings)

    def release(self, request: Any, max_model_len: int) -> None:
        """Free a finished, aborted or preempted request's ring before vLLM frees its other groups, its window
        hashed first (``hash_window``)."""
        ring = self.hash_window(request, max_model_len)
        self.free(request.request_id)
        keep_windows(self.block_pool, ring, self.kv_cache_group_id)

    def hash_window(self, request: Any, max_model_len: int) -> list[KVCacheBlock]:
        """With ``cache_ring``, hash the window a request being freed holds and drop the hashes of the windows it
        supersedes (``cached_ring.window_to_hash``, ``superseded_windows``); its ring's blocks (none without)."""
        request_id = request.request_id
        if not (self.enable_caching and self.kv_cache_spec.cache_ring and request_id in self.rings):
            return []
        drafter_max_len = min(max_model_len, self.kv_cache_spec.drafter_max_len or max_model_len)
        window = window_to_hash(self, request, drafter_max_len)
        for block in superseded_windows(self, request, min(window, default=len(self.req_to_blocks[request_id]))):
            self.block_pool._maybe_evict_cached_block(block)
        hashable = uncached(self, request, window)
        if hashable:
            first, last = min(hashable), max(hashable)
            self.block_pool.cache_full_blocks(
                request=request, blocks=self.req_to_blocks[request_id], num_cached_blocks=first,
                num_full_blocks=last + 1, block_size=self.block_size, kv_cache_group_id=self.kv_cache_group_id,
                block_mask=[j in hashable for j in range(first, last + 1)],
            )  # fmt: skip
        return [block for block in self.rings[request_id] if block is not None]

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """The distinct ring blocks (each once: the pool counts one reference per request), the newest logical
        block first: the caller frees them in reverse, so the oldest is evicted first and the window's end (what the
        next turn or a resumed request adopts) stays cached longest."""
        super().pop_blocks_for_free(request_id)
        self.steps.forget(request_id)
        ring, holds = self.rings.pop(request_id, []), self.holds.pop(request_id, [])
        held = sorted(zip(holds, range(len(ring)), ring, strict=True), reverse=True)
        return [block for _, _, block in held if block is not None]
