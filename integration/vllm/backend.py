# SPDX-License-Identifier: Apache-2.0
"""The ring attention backend: declares what the ring kernels support and swaps the drafter's
``SlidingWindowSpec`` for ``RingSWASpec`` (``customize_spec``, the hook vLLM offers out-of-tree backends)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from ringkv.kernels.kv_quant import FP8_KV_CACHE_DTYPES, UNQUANTIZED_KV_CACHE_DTYPES
from ringkv.kernels.validation import MAX_HEAD_DIM

from ._compat import AttentionBackend, MultipleOf, SlidingWindowSpec, get_current_vllm_config_or_none
from .impl import RingKVImpl
from .kv_cache import to_ring_spec
from .metadata import RingKVMetadataBuilder
from .planning import check_ring_config, lookahead_from_config

BACKEND_NAME = "RINGKV"


class RingKVBackend(AttentionBackend):
    """Drop-in attention backend for sliding-window drafter layers on a fixed per-request ring."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    # vLLM CacheDType names: unquantized, and per-tensor fp8 with the layer's k_scale / v_scale (kernels/kv_quant.py)
    supported_kv_cache_dtypes: ClassVar[list[Any]] = [*UNQUANTIZED_KV_CACHE_DTYPES, *FP8_KV_CACHE_DTYPES]
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

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        # the kernels take any block size; 16-multiples keep vLLM's kernel-block splitting out of the way
        return [MultipleOf(16)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(range(1, MAX_HEAD_DIM + 1))

    @classmethod
    def supports_head_size_v(cls, head_size: int, head_size_v: int) -> bool:
        # asked from vLLM 0.34 on: the kernels take K and V head sizes independently
        return cls.supports_head_size(head_size) and cls.supports_head_size(head_size_v)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_non_causal(cls) -> bool:
        return True

    @classmethod
    def supports_compute_capability(cls, capability: Any) -> bool:
        return True

    @classmethod
    def customize_spec(cls, spec: Any) -> Any:
        """Sliding-window layers -> ``RingSWASpec`` planned with vLLM's ``num_lookahead_tokens`` (idempotent;
        unplanned when no vLLM config is in scope: a page-size probe); full-attention layers keep vLLM's spec."""
        if not isinstance(spec, SlidingWindowSpec):
            return spec
        vllm_config = get_current_vllm_config_or_none()
        if vllm_config is not None:
            check_ring_config(vllm_config)
        return to_ring_spec(spec, lookahead_from_config(vllm_config))
