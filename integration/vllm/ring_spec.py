# SPDX-License-Identifier: Apache-2.0
"""The ring's KV-cache spec: a ``SlidingWindowSpec`` whose group holds ``R`` blocks per request, planned from the
group's final block size, the window and vLLM's ``num_lookahead_tokens`` (``ring_geometry.RingPlan``). Its manager
is ``kv_cache.RingSWAManager``; the spec's sizing rule: [docs/vllm-plugin.md](../../docs/vllm-plugin.md)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ringkv.kernels.ring_geometry import RingPlan

from ._compat import SlidingWindowSpec, VllmConfig, replace_as
from .errors import RingConfigError
from .names import RING_PREFIX_CACHE_ENV, UNPLANNED


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
    # the model runner skips the drafter, and its context K/V store, for a batch within the lookahead of that length
    # (V1's rule); Model Runner V2 has no such skip: it stores the context K/V and clamps the queries instead
    drafter_skips_near_max_len: bool = field(default=True)
    # attention sinks of a windowed full-attention drafter layer (``full_window.py``): keys 0 .. sink_tokens - 1 every
    # query sees besides its window, in cdiv(sink_tokens, bs) blocks the request holds beside its ring
    sink_tokens: int = field(default=0)

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
            RingPlan(self.sliding_window, self.block_size, self.lookahead, self.sink_tokens)

    @property
    def plan(self) -> RingPlan:
        if self.lookahead == UNPLANNED:
            raise RingConfigError(
                "ringkv: a ring KV spec reached the scheduler without vLLM's num_lookahead_tokens (it was built "
                "outside vLLM's config scope), so its ring size is unknown; register the plugin "
                "(ringkv.integration.vllm.register) before vLLM builds its workers"
            )
        return RingPlan(window=self.sliding_window, kv_block_size=self.block_size, lookahead=self.lookahead,
                        sink_tokens=self.sink_tokens)  # fmt: skip

    @property
    def ring_blocks(self) -> int:
        """R for the current block size."""
        return self.plan.ring_blocks

    @property
    def num_retained_tokens(self) -> int:
        """Tokens below a request's first scheduled position that stay readable: 0.34's Model Runner V2 nulls the
        block-table columns wholly below them each step (``SlidingWindowSpec.num_retained_tokens``). With sinks 0,
        which turns that off for the group (it would null the sink columns ``j < ns``); the ring's row is null below
        its window already (``kv_cache.py``)."""
        return 0 if self.sink_tokens else self.sliding_window - 1 + self.extra_retained_tokens

    @property
    def prefix_cacheable(self) -> bool:
        # cache_ring: freed windows are hashed and adopted (cached_ring.py); else vLLM leaves the group out of the
        # hit lookup and prefix_cache.py caps the hit so the recompute rebuilds the ring
        return self.cache_ring

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        """The sink blocks and R (capped by the blocks a max_model_len request would hold), whatever is in flight."""
        del max_in_flight_tokens
        return self.plan.blocks_for_tokens(max_model_len)

    def max_memory_usage_bytes(self, vllm_config: VllmConfig) -> int:
        blocks = self.max_admission_blocks_per_request(0, vllm_config.model_config.max_model_len)
        return blocks * self.page_size_bytes


def ring_prefix_cache_enabled() -> bool:
    """``RINGKV_RING_PREFIX_CACHE``: ``1`` (the default) puts the ring's blocks in vLLM's prefix cache, ``0`` keeps
    every hit capped so the target rebuilds the window. Any other value is refused."""
    value = os.environ.get(RING_PREFIX_CACHE_ENV, "1")
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


def _ring_layer_specs(spec: Any) -> list[RingSWASpec]:
    layers = getattr(spec, "kv_cache_specs", None)
    specs = list(layers.values()) if isinstance(layers, dict) else [spec]
    return [layer for layer in specs if isinstance(layer, RingSWASpec)]


def _group_value(spec: Any, attribute: str) -> int | None:
    values = {getattr(layer, attribute) for layer in _ring_layer_specs(spec)}
    if len(values) > 1:
        raise RingConfigError(f"ringkv: one KV-cache group holds ring layers of {attribute} {sorted(values)}")
    return values.pop() if values else None


def ring_window(spec: Any) -> int | None:
    """The window a ring group's layers attend over: a ``RingSWASpec``'s, or the one window of vLLM's
    ``UniformTypeKVCacheSpecs`` of them; None for any other spec (a layer keeps its own window)."""
    return _group_value(spec, "sliding_window")


def ring_sink_tokens(spec: Any) -> int:
    """The sink tokens of a ring group's layers (as ``ring_window`` finds them); 0 for any other spec."""
    return _group_value(spec, "sink_tokens") or 0


def to_ring_spec(
    spec: Any, lookahead: int, drafter_max_len: int = 0, drafter_skips_near_max_len: bool = True, sink_tokens: int = 0
) -> Any:
    """Turn a ``SlidingWindowSpec`` into a ``RingSWASpec`` planned for ``lookahead`` (and the drafter's max length,
    skip rule and ``sink_tokens``), its ``cache_ring`` from ``ring_prefix_cache_enabled()`` (other specs pass
    through; a ring spec is re-planned only while unplanned, keeping its sinks)."""
    if isinstance(spec, RingSWASpec):
        if spec.lookahead != UNPLANNED or lookahead == UNPLANNED:
            return spec
        sink_tokens = spec.sink_tokens
    elif not isinstance(spec, SlidingWindowSpec):
        return spec
    return replace_as(spec, RingSWASpec, lookahead=lookahead, cache_ring=ring_prefix_cache_enabled(),
                      drafter_max_len=drafter_max_len, drafter_skips_near_max_len=drafter_skips_near_max_len,
                      sink_tokens=sink_tokens)  # fmt: skip
