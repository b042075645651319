# SPDX-License-Identifier: Apache-2.0
"""ringkv's vLLM plugin. ``register()`` is the ``vllm.general_plugins`` entry point (it runs in every vLLM
process): the ring KV spec and manager, the ring attention backend as ``CUSTOM`` and ``RINGKV``, the prefix-hit
cap that keeps prefix caching exact with rings (``prefix_cache.py``), and the ordering fix for Model Runner V2's
DFlash context store (``speculator.py``)."""

from __future__ import annotations

import os

from .names import BACKEND_PATH

_registered = False


def register() -> None:
    """Register ringkv with vLLM (idempotent)."""
    global _registered
    if _registered:
        return
    from ._compat import (
        AttentionBackendEnum,
        KVCacheSpecRegistry,
        alias_attention_backend,
        ensure_builtin_kv_specs,
        register_backend,
    )
    from .kv_cache import RingSWAManager, RingSWASpec
    from .planning import collect_specs_in_config_scope
    from .prefix_cache import cap_prefix_hits_at_ring_windows
    from .selection import honour_attention_backend_env, route_ring_selection_on_cpu
    from .speculator import keep_last_writers_across_split_writes

    # the registry only fills in vLLM's built-ins while it is empty: fill it first, then add the ring
    ensure_builtin_kv_specs()
    KVCacheSpecRegistry.register(RingSWASpec, RingSWAManager, uniform_type_base_spec=RingSWASpec)
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    # "RINGKV" names CUSTOM: a selection must survive pickling into processes where no plugin has run yet
    alias_attention_backend("RINGKV", AttentionBackendEnum.CUSTOM)
    honour_attention_backend_env(os.environ.get("VLLM_ATTENTION_BACKEND"))
    route_ring_selection_on_cpu(BACKEND_PATH)
    collect_specs_in_config_scope()
    cap_prefix_hits_at_ring_windows()
    keep_last_writers_across_split_writes()
    if os.environ.get("RINGKV_CPU_SLIDING_RING") == "1":
        from .cpu_sliding import enable_cpu_sliding_ring

        enable_cpu_sliding_ring()
    _registered = True
