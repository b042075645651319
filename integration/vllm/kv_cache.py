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
``min(cdiv(N, bs), R)`` blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import triton
from ringkv.kernels.ring_geometry import RingPlan, first_visible_position, ring_block

from ._compat import KVCacheBlock, SlidingWindowManager, SlidingWindowSpec, VllmConfig, replace_as
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
        # ring contents are positional and per request: nothing a later request could reuse; vLLM leaves the
        # group out of the hit lookup and prefix_cache.py caps the hit so the recompute rebuilds the ring
        return False

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        """R (capped by the blocks a max_model_len request would hold), whatever is in flight."""
        del max_in_flight_tokens
        return min(self.ring_blocks, triton.cdiv(max_model_len, self.block_size))

    def max_memory_usage_bytes(self, vllm_config: VllmConfig) -> int:
        blocks = self.max_admission_blocks_per_request(0, vllm_config.model_config.max_model_len)
        return blocks * self.page_size_bytes


def to_ring_spec(spec: Any, lookahead: int) -> Any:
    """Turn a ``SlidingWindowSpec`` into a ``RingSWASpec`` planned for ``lookahead`` (other specs pass
    through; a ring spec is re-planned only while unplanned)."""
    if isinstance(spec, RingSWASpec):
        if spec.lookahead != UNPLANNED or lookahead == UNPLANNED:
            return spec
        return replace_as(spec, RingSWASpec, lookahead=lookahead)
    if not isinstance(spec, SlidingWindowSpec):
        return spec
    return replace_as(spec, RingSWASpec, lookahead=lookahead)


class RingSWAManager(SlidingWindowManager):
    """Allocates each request's ring once and keeps its logical row periodic; never more than R blocks."""

    def __init__(self, kv_cache_spec: RingSWASpec, **kwargs: Any) -> None:
        # the factory passes the spec's admission cap (R); the ring needs no cap, it is the ring
        kwargs.pop("max_admission_blocks_per_request", None)
        self.plan = kv_cache_spec.plan  # refuses an unplanned spec before anything is built
        super().__init__(kv_cache_spec, **kwargs)
        self.ring_blocks = self.plan.ring_blocks
        # request id -> the physical ring blocks claimed so far (column c holds ring[c])
        self.rings: dict[str, list[KVCacheBlock]] = {}

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
        # admission (capped) and execution (uncapped) ask the same question: the same answer
        del new_computed_blocks, total_computed_tokens, num_local_computed_tokens, apply_admission_cap, prefill_end
        self.check_lookahead(num_tokens, num_tokens_main_model)
        return max(0, self.ring_size(num_tokens) - len(self.rings.get(request_id, ())))

    def first_live_block(self, num_tokens_main_model: int) -> int:
        """Logical blocks below this are wholly before any window this step's queries can have."""
        lowest_commit = max(0, num_tokens_main_model - (self.plan.lookahead - 1))
        return first_visible_position(lowest_commit, self.plan.window) // self.block_size

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int) -> list[KVCacheBlock]:
        self.check_lookahead(num_tokens, num_tokens_main_model)
        ring = self.rings.setdefault(request_id, [])
        missing = self.ring_size(num_tokens) - len(ring)
        if missing > 0:
            claimed = self.block_pool.get_new_blocks(missing)
            ring.extend(claimed)
            if self._record_new_block_ids:
                self.new_block_ids.extend(block.block_id for block in claimed)
        row = self.req_to_blocks[request_id]
        first_live = self.first_live_block(num_tokens_main_model)
        new_entries = [
            self._null_block if j < first_live else ring[ring_block(j, self.ring_blocks)]
            for j in range(len(row), triton.cdiv(num_tokens, self.block_size))
        ]
        row.extend(new_entries)
        return new_entries

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        record_for_zeroing: bool = True,
    ) -> None:
        if num_external_computed_tokens > 0:  # planning.check_ring_config refuses KV connectors at startup
            raise RingConfigError(
                f"ringkv: {num_external_computed_tokens} KV-connector tokens for request {request_id} carry no ring "
                "K/V; remove --kv-transfer-config"
            )

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """A prefix hit (capped by ``prefix_cache`` below the first window the ring serves) is dead to the ring:
        its blocks are null placeholders, so the row stays position-indexed."""
        del new_computed_blocks, num_external_computed_tokens  # a ring group takes no part in the lookup
        row = self.req_to_blocks[request_id]
        row.extend([self._null_block] * (num_local_computed_tokens // self.block_size - len(row)))

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, *args: Any, **kwargs: Any):
        return tuple([] for _ in kv_cache_group_ids), 0

    def cache_blocks(self, request: Any, num_tokens: int, retention_interval: int | None = None, **kwargs: Any) -> None:
        return

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        # ring blocks are reused in place, never returned before the request ends
        return

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return 0

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """The distinct ring blocks (each once: the pool counts one reference per request)."""
        super().pop_blocks_for_free(request_id)
        return self.rings.pop(request_id, [])
