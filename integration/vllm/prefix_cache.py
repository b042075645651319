# SPDX-License-Identifier: Apache-2.0
"""Prefix caching with a ring: a hit never reaches into the window the ring must still serve.

A ring group keeps no K/V across requests (its blocks are overwritten in place, never hashed), so vLLM's hybrid
coordinator leaves it out of the hit lookup (``prefix_cacheable`` is False) and would grant the target groups'
whole hit. A drafter's context K/V at position ``p`` are a function of the target's hidden state at ``p`` alone,
so recomputing the target from the hit on rebuilds the drafter's ring as a side effect, provided the hit stops
where the ring's first query can still see (``ring_geometry.longest_rebuilding_prefix_hit``):

    hit <= num_tokens - (W - 1)            (then aligned down to vLLM's block by the full-attention lookup)

``cap_prefix_hits_at_ring_windows`` makes vLLM's coordinator ask for no longer a hit than that (the smallest
cap over the ring groups); the full-attention groups keep their hit up to the cap, and the target recomputes
at most ``W - 1`` tokens plus one block. A target's own sliding layers on the ring cannot be rebuilt that way
(each recomputed query needs the keys before it): ``planning.check_ring_config`` refuses that with prefix
caching on.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from ringkv.kernels.ring_geometry import longest_rebuilding_prefix_hit

from ._compat import hybrid_coordinator_class
from .kv_cache import RingSWASpec


def ring_hit_cap(kv_cache_groups: Iterable[Any], num_tokens: int) -> int:
    """The longest hit a request of ``num_tokens`` tokens may take so that every ring group is rebuilt by the
    recompute (``num_tokens`` when no group is a ring)."""
    windows = [g.kv_cache_spec.sliding_window for g in kv_cache_groups if isinstance(g.kv_cache_spec, RingSWASpec)]
    return min((longest_rebuilding_prefix_hit(num_tokens, window) for window in windows), default=num_tokens)


def cap_prefix_hits_at_ring_windows() -> None:
    """Cap every prefix-cache lookup of vLLM's hybrid coordinator at ``ring_hit_cap`` (idempotent).

    vLLM asks with ``max_cache_hit_length = request.num_tokens - 1`` (the last prompt token is always
    recomputed for its logits); a smaller bound from another caller only makes the cap stricter."""
    coordinator = hybrid_coordinator_class()
    original = coordinator.find_longest_cache_hit
    if getattr(original, "_ringkv_wrapped", False):
        return

    @functools.wraps(original)
    def find_longest_cache_hit(self: Any, block_hashes: Any, max_cache_hit_length: int) -> Any:
        cap = ring_hit_cap(self.kv_cache_config.kv_cache_groups, max_cache_hit_length + 1)
        return original(self, block_hashes, min(max_cache_hit_length, cap))

    find_longest_cache_hit._ringkv_wrapped = True  # type: ignore[attr-defined]
    coordinator.find_longest_cache_hit = find_longest_cache_hit
