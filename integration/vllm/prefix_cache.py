# SPDX-License-Identifier: Apache-2.0
"""Prefix caching with a ring: vLLM's lookup and free, wrapped so that every hit is one the ring can serve.

``wrap_find_longest_cache_hit`` (vLLM's coordinator, both finders) stops the hit at the rebuild cap of every ring group
without ``cache_ring`` (``rebuild_cap``, ``ring_hit_cap``) and tells a cached ring's finder the request's length
(``cached_ring.lookup_tokens``); ``wrap_free`` and ``wrap_pop_blocks_for_free`` have each ring hash its tail
(``RingSWAManager.release``, ``hash_tail``) before vLLM frees the other groups. The rebuild cap, the cached ring's
hit and hash rules: [docs/vllm-plugin.md](../../docs/vllm-plugin.md#prefix-caching).
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
    ring group (those with ``cache_ring`` too only if ``cached_rings``); None when there is none. A group with sink
    tokens is rebuilt only from the first token: 0."""
    specs = [g.kv_cache_spec for g in kv_cache_groups if isinstance(g.kv_cache_spec, RingSWASpec)
             and (cached_rings or not g.kv_cache_spec.cache_ring)]  # fmt: skip
    return min((longest_rebuilding_prefix_hit(num_tokens, spec.sliding_window, spec.sink_tokens) for spec in specs),
               default=None)  # fmt: skip


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
