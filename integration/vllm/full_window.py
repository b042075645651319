# SPDX-License-Identifier: Apache-2.0
"""The opt-in window for a drafter's full-attention layers (``RINGKV_DRAFTER_FULL_WINDOW``): each becomes a ring
layer of window ``Wf`` (plus ``RINGKV_DRAFTER_FULL_SINKS`` sink tokens), so the drafter's KV and attention work stop
growing with the context. The drafter only proposes tokens, so this changes acceptance, never the output. The
rule, its cost and when not to use it:
[docs/vllm-plugin.md](../../docs/vllm-plugin.md#a-window-for-full-attention-drafter-layers).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ringkv.kernels.ring_geometry import check_sink_tokens

from ._compat import (
    FullAttentionSpec,
    SlidingWindowSpec,
    drafter_layer_names,
    full_attention_as_sliding,
    layer_backend_paths,
)
from .errors import RingConfigError
from .names import BACKEND_PATH, SINKS_ENV, WINDOW_ENV
from .ring_spec import ring_prefix_cache_enabled


@dataclass(frozen=True)
class DrafterFullWindow:
    """``window`` (Wf): keys a query of a windowed full-attention drafter layer sees, itself included; ``sinks``
    (S): the first tokens it keeps seeing as well (StreamingLLM's attention sinks)."""

    window: int
    sinks: int = 0


def _read_int(name: str, lowest: int) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < lowest:
        raise RingConfigError(f"ringkv: {name}={value!r}; set an integer >= {lowest}, or unset it")
    return number


def drafter_full_window_from_env() -> DrafterFullWindow | None:
    """The option as the environment sets it (None: unset, the default: full-attention layers stay full)."""
    window, sinks = _read_int(WINDOW_ENV, 1), _read_int(SINKS_ENV, 0)
    if window is None:
        if sinks:
            raise RingConfigError(
                f"ringkv: {SINKS_ENV}={sinks} without {WINDOW_ENV}: sinks keep the first tokens of a windowed "
                f"full-attention drafter layer; set {WINDOW_ENV} too, or unset {SINKS_ENV}"
            )
        return None
    try:
        check_sink_tokens(sinks or 0, window)
    except ValueError as error:
        raise RingConfigError(
            f"ringkv: {SINKS_ENV}={sinks} with {WINDOW_ENV}={window}: {error}; set {SINKS_ENV} <= {WINDOW_ENV}"
        ) from None
    return DrafterFullWindow(window=window, sinks=sinks or 0)


def windowed_drafter_full_layers(worker: Any, specs: dict[str, Any]) -> tuple[dict[str, SlidingWindowSpec], int]:
    """With the option set, the drafter's full-attention layers among a worker's ``specs`` as ``SlidingWindowSpec``
    of ``Wf``, and their sink tokens S (``planning`` plans them as ring specs); nothing when unset. Refused
    (``RingConfigError`` naming the fix) where the option cannot take effect as asked."""
    option = drafter_full_window_from_env()
    if option is None:
        return {}, 0
    drafter = drafter_layer_names(worker, specs)
    if not drafter:
        raise RingConfigError(
            f"ringkv: {WINDOW_ENV}={option.window} windows a speculative drafter's full-attention layers, but this "
            "engine runs no drafter (a target's layers are never windowed); unset it or enable speculative decoding"
        )
    full = sorted(name for name in drafter if type(specs[name]) is FullAttentionSpec)
    if not full:
        raise RingConfigError(
            f"ringkv: {WINDOW_ENV}={option.window}, but the drafter has no full-attention layer (its layers: "
            f"{sorted(drafter)}, already bounded); unset it"
        )
    slides = {specs[name].sliding_window for name in drafter if isinstance(specs[name], SlidingWindowSpec)}
    if slides and option.window < max(slides):
        raise RingConfigError(
            f"ringkv: {WINDOW_ENV}={option.window} is below the drafter's own sliding window W={max(slides)}: a "
            f"full-attention layer would see less than a sliding one; set {WINDOW_ENV} >= {max(slides)}"
        )
    backends = layer_backend_paths(worker.vllm_config, set(full))
    elsewhere = sorted(name for name in full if backends.get(name) != BACKEND_PATH)
    if elsewhere:
        raise RingConfigError(
            f"ringkv: {WINDOW_ENV}={option.window}, but the drafter's full-attention layers {elsewhere} are not on "
            "the RINGKV backend, which alone serves the window; set speculative_config attention_backend to RINGKV"
        )
    if option.sinks:
        check_sinks_config(option, worker.vllm_config)
    return {name: full_attention_as_sliding(specs[name], option.window) for name in full}, option.sinks


def check_sinks_config(option: DrafterFullWindow, vllm_config: Any, cache_ring: bool | None = None) -> None:
    """Refuse what sink blocks cannot be served beside: a connector's load skips the recompute of the sink tokens,
    and no connector moves a ring's sink blocks. Both model runners serve them (V1; 0.34's Model Runner V2, where
    ``RingSWASpec.num_retained_tokens`` keeps the sink columns of the row). Prefix caching is served:
    the sink blocks are hashed and adopted as a cached ring's window blocks are (``cached_ring.py``), and without
    ``RINGKV_RING_PREFIX_CACHE`` every hit, the target's included, would be capped to 0 (``prefix_cache.
    rebuild_cap``): refused, since prefix caching could not take effect. ``cache_ring``: that switch (None: read
    from the environment)."""
    setting = f"{SINKS_ENV}={option.sinks}"
    cache = getattr(vllm_config, "cache_config", None)
    cache_ring = ring_prefix_cache_enabled() if cache_ring is None else cache_ring
    if getattr(cache, "enable_prefix_caching", False) and not cache_ring:
        raise RingConfigError(
            f"ringkv: {setting} with prefix caching on and RINGKV_RING_PREFIX_CACHE=0: only a recompute from token 0 "
            "rebuilds the sink blocks, so every prefix hit, the target's included, would be 0. Unset "
            f"RINGKV_RING_PREFIX_CACHE (the sink blocks join the prefix cache), start vLLM with "
            f"--no-enable-prefix-caching, or unset {SINKS_ENV}"
        )
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    if transfer is not None and getattr(transfer, "kv_connector", None) is not None:
        raise RingConfigError(
            f"ringkv: {setting} with the KV connector {transfer.kv_connector}: a loaded prefix would skip the sink "
            f"tokens' K/V, which no connector moves. Remove --kv-transfer-config / --kv-offloading-size, or unset "
            f"{SINKS_ENV}"
        )
