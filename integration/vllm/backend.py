# SPDX-License-Identifier: Apache-2.0
"""The ring attention backend: what the ring kernels support (declared in ``capabilities.py``), its impl and
metadata builder, and the swap of the drafter's ``SlidingWindowSpec`` for ``RingSWASpec`` (``customize_spec``, the
hook vLLM offers out-of-tree backends). Registered by dotted path (``names.BACKEND_PATH``), so no other plugin
module imports this one to select it."""

from __future__ import annotations

from typing import Any

from ._compat import SlidingWindowSpec, get_current_vllm_config_or_none
from .capabilities import RingKVCapabilities
from .impl import RingKVImpl
from .metadata import RingKVMetadataBuilder
from .planning import plan_ring_spec


class RingKVBackend(RingKVCapabilities):
    """Drop-in attention backend for sliding-window drafter layers on a fixed per-request ring (declared
    capabilities: ``RingKVCapabilities``)."""

    # forward reads the block's own K/V from its inputs and stores nothing (see impl.py)
    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_name() -> str:
        # must name an AttentionBackendEnum member in every process: CUSTOM is static (RINGKV is registered too)
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[RingKVImpl]:
        return RingKVImpl

    @staticmethod
    def get_builder_cls() -> type[RingKVMetadataBuilder]:
        return RingKVMetadataBuilder

    @classmethod
    def customize_spec(cls, spec: Any) -> Any:
        """Sliding-window layers -> ``RingSWASpec`` planned with vLLM's ``num_lookahead_tokens`` (idempotent;
        unplanned when no vLLM config is in scope: a page-size probe); full-attention layers keep vLLM's spec."""
        if not isinstance(spec, SlidingWindowSpec):
            return spec
        return plan_ring_spec(spec, get_current_vllm_config_or_none())
