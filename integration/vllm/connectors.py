# SPDX-License-Identifier: Apache-2.0
"""KV connectors with a ring: which ones the ring can serve, and the cap on what they load.

No connector moves a ring (its row names blocks overwritten since): ``wrap_group_spec_init`` sets vLLM's
``KVCacheGroupSpec.enable_kv_transfer`` to False for every ring group, so it leaves the groups vLLM's connectors
store, load or move. A connector's hit stops at the rebuild cap inside its own answer (``external_hit_cap``:
``wrap_max_loadable_tokens`` bounds ``OffloadingConnector``'s load by it; a connector outside vLLM that sets
``RING_SAFE_ATTRIBUTE`` calls it itself). ``check_connector`` (from ``planning.check_ring_config``) refuses every
other connector at startup, naming the fix. The conditions, and vLLM's connectors one by one:
[docs/connectors.md](../../docs/connectors.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ._compat import (
    VllmConfig,
    connector_kv_cache_config,
    kv_connector_class,
    kv_transfer_config_class,
    offloading_connector_class,
    supports_hma,
)
from .errors import RingConfigError
from .prefix_cache import rebuild_cap
from .ring_spec import is_ring_spec

# a connector class attribute: True = it loads no ring group and caps its hits with external_hit_cap
RING_SAFE_ATTRIBUTE = "ringkv_ring_safe"


def external_hit_cap(kv_cache_groups: Iterable[Any], num_tokens: int, num_computed_tokens: int) -> int | None:
    """The most tokens a connector may load past ``num_computed_tokens`` (the local hit) for a request of
    ``num_tokens`` tokens, so that the recompute rebuilds every ring group (no connector moves a ring, whether or
    not the ring's windows are in the local prefix cache); None when no group is a ring."""
    cap = rebuild_cap(kv_cache_groups, num_tokens, cached_rings=True)
    return None if cap is None else max(0, cap - num_computed_tokens)


def wrap_group_spec_init(original: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's ``KVCacheGroupSpec.__init__``, with ``enable_kv_transfer = False`` for a ring group (see the module
    docstring); every other group as vLLM makes it."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if is_ring_spec(self.kv_cache_spec):
            self.enable_kv_transfer = False

    return __init__


def wrap_max_loadable_tokens(original: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's ``OffloadingConnector._max_loadable_tokens(request, num_computed_tokens)`` (the bound its
    ``get_num_new_matched_tokens`` hands its lookup as ``max_num_new_tokens``; None = unbounded), bounded by
    ``external_hit_cap``."""

    def max_loadable_tokens(self: Any, request: Any, num_computed_tokens: int) -> int | None:
        bound = original(self, request, num_computed_tokens)
        cap = external_hit_cap(connector_kv_cache_config(self).kv_cache_groups, request.num_tokens, num_computed_tokens)
        if cap is None:
            return bound
        return cap if bound is None else min(bound, cap)

    return max_loadable_tokens


def ring_safe_reason(connector_class: type) -> str | None:
    """None when ringkv can serve ``connector_class`` beside a ring; else why not (for the error)."""
    if getattr(connector_class, RING_SAFE_ATTRIBUTE, False):
        return None
    if issubclass(connector_class, offloading_connector_class()):
        return None
    return (
        "ringkv has not made it safe: a connector may store and load a ring group by row position (the ring's row "
        "names blocks overwritten since), and its hit must be capped inside its own get_num_new_matched_tokens "
        "(docs/connectors.md lists vLLM's connectors)"
    )


def _children(kv_transfer_config: Any) -> list[Any]:
    """The child configs of a ``MultiConnector`` (its ``kv_connector_extra_config["connectors"]``)."""
    config_class = kv_transfer_config_class()
    children = kv_transfer_config.kv_connector_extra_config.get("connectors", [])
    return [child if isinstance(child, config_class) else config_class(**child) for child in children]


def _refusal(kv_transfer_config: Any) -> str | None:
    connector_class = kv_connector_class(kv_transfer_config)
    name = kv_transfer_config.kv_connector
    if name == "MultiConnector":
        reasons = [_refusal(child) for child in _children(kv_transfer_config)]
        return next((reason for reason in reasons if reason is not None), None)
    if not supports_hma(connector_class):
        return (
            f"the KV connector {name} does not implement vLLM's SupportsHMA, so vLLM turns the hybrid KV-cache "
            "manager off and would turn the ring's sliding-window spec into full attention"
        )
    reason = ring_safe_reason(connector_class)
    return None if reason is None else f"the KV connector {name}: {reason}"


def check_connector(vllm_config: VllmConfig, target_sliding_on_ring: bool) -> None:
    """Refuse a ``kv_transfer_config`` whose connector cannot serve beside a ring (see the module docstring), and
    any connector when the target's own sliding-window layers are on the ring (a recompute cannot rebuild them)."""
    kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
    if kv_transfer_config is None or kv_transfer_config.kv_connector is None:
        return
    name = kv_transfer_config.kv_connector
    if target_sliding_on_ring:
        raise RingConfigError(
            f"ringkv: the KV connector {name} would give the target a prefix whose sliding-window K/V the ring does "
            "not hold and recomputing cannot rebuild (each recomputed query needs the keys before it). Remove "
            "--kv-transfer-config / --kv-offloading-size, or keep the target's sliding layers on vLLM's backend "
            "(drop backend_per_kind sliding_window=RINGKV / RINGKV_CPU_SLIDING_RING) and only the drafter on RINGKV."
        )
    reason = _refusal(kv_transfer_config)
    if reason is not None:
        raise RingConfigError(
            f"ringkv: {reason}. Use OffloadingConnector (--kv-offloading-size, or kv_connector OffloadingConnector; "
            "MultiConnector when every child is one), a connector that sets "
            f"{RING_SAFE_ATTRIBUTE} = True and caps its hits with ringkv.integration.vllm.connectors."
            "external_hit_cap, or remove --kv-transfer-config."
        )
