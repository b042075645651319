# SPDX-License-Identifier: Apache-2.0
"""Prefix caching with a ring: a hit never reaches into a window the ring cannot serve.

With ``cache_ring`` (the default, ``RINGKV_RING_PREFIX_CACHE``) the ring group takes part in vLLM's lookup and a
freed request's window is hashed (``cached_ring.py``); two wraps serve it: ``wrap_find_longest_cache_hit`` tells the
ring's finder the request's length, ``wrap_free`` has the ring hash its window and free it before vLLM frees the
other groups.

Without it, a ring group keeps no K/V across requests (its blocks are overwritten in place, never hashed), so vLLM's
hybrid coordinator leaves it out of the hit lookup (``prefix_cacheable`` is False) and would grant the target groups'
whole hit. A drafter's context K/V at position ``p`` are a function of the target's hidden state at ``p`` alone,
so recomputing the target from the hit on rebuilds the drafter's ring as a side effect, provided the hit stops
where the ring's first query can still see (``ring_geometry.longest_rebuilding_prefix_hit``):

    hit <= num_tokens - (W - 1)            (then aligned down to vLLM's block by the full-attention lookup)

``wrap_find_longest_cache_hit`` (installed by ``register()`` from ``patches.PATCHES``) makes vLLM's coordinator
ask for no longer a hit than that (the smallest cap over the ring groups); the full-attention groups keep their hit
up to the cap, and the target recomputes at most ``W - 1`` tokens plus one block. A target's own sliding layers on
the ring cannot be rebuilt that way (each recomputed query needs the keys before it): ``planning.check_ring_config``
refuses that with prefix caching on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ringkv.kernels.ring_geometry import longest_rebuilding_prefix_hit

from .cached_ring import lookup_tokens
from .kv_cache import RingSWAManager
from .ring_spec import RingSWASpec


def rebuild_cap(kv_cache_groups: Iterable[Any], num_tokens: int, cached_rings: bool) -> int | None:
    """The longest prefix of a request of ``num_tokens`` tokens after which the recompute of the rest rebuilds every
    ring group (those with ``cache_ring`` too only if ``cached_rings``); None when there is none."""
    windows = [g.kv_cache_spec.sliding_window for g in kv_cache_groups if isinstance(g.kv_cache_spec, RingSWASpec)
               and (cached_rings or not g.kv_cache_spec.cache_ring)]  # fmt: skip
    return min((longest_rebuilding_prefix_hit(num_tokens, window) for window in windows), default=None)


def ring_hit_cap(kv_cache_groups: Iterable[Any], num_tokens: int) -> int:
    """The longest hit a request of ``num_tokens`` tokens may take so that every ring group without ``cache_ring``
    is rebuilt by the recompute (``num_tokens`` when there is none; a cached ring caps its own hit)."""
    cap = rebuild_cap(kv_cache_groups, num_tokens, cached_rings=False)
    return num_tokens if cap is None else cap


def wrap_find_longest_cache_hit(original: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's ``HybridKVCacheCoordinator.find_longest_cache_hit`` (and ``find_longest_cache_hit_per_group``, the
    same arguments) capped at ``ring_hit_cap``, with the request's length in ``cached_ring.LOOKUP_TOKENS`` for the
    cached rings' finder.

    vLLM asks with ``max_cache_hit_length = request.num_tokens - 1`` (the last prompt token is always
    recomputed for its logits); a smaller bound from another caller only makes the cap stricter."""

    def find_longest_cache_hit(self: Any, block_hashes: Any, max_cache_hit_length: int) -> Any:
        cap = ring_hit_cap(self.kv_cache_config.kv_cache_groups, max_cache_hit_length + 1)
        with lookup_tokens(max_cache_hit_length + 1):
            return original(self, block_hashes, min(max_cache_hit_length, cap))

    return find_longest_cache_hit


def wrap_free(original: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's ``KVCacheManager.free(request)`` where every ring is released first (``RingSWAManager.release``:
    hash the window, then free): its blocks join vLLM's free queue before the target's, so they are evicted first."""

    def free(self: Any, request: Any) -> None:
        for manager in self.coordinator.single_type_managers:
            if isinstance(manager, RingSWAManager):
                manager.release(request, self.max_model_len)
        original(self, request)

    return free


def wrap_pop_blocks_for_free(original: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's ``KVCacheManager.pop_blocks_for_free(request)``, the deferred twin of ``free`` (with a KV consumer
    connector and overlapping batches, a freed request's blocks return to the pool once the step in flight is
    processed): every cached ring hashes its window first, as ``wrap_free`` has it do, by the same rules (a block
    the step in flight may still write is never hashed: its column holds a later block, or it reaches past the
    committed tokens less the placeholders in flight)."""

    def pop_blocks_for_free(self: Any, request: Any) -> Any:
        managers = [m for m in self.coordinator.single_type_managers if isinstance(m, RingSWAManager)]
        rings = [(manager, manager.hash_tail(request, self.max_model_len)) for manager in managers]
        blocks = original(self, request)
        for manager, ring in rings:
            manager.keep_tail(ring, freed=False)
        return blocks

    return pop_blocks_for_free
