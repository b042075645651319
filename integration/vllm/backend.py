# SPDX-License-Identifier: Apache-2.0
"""The ring attention backend: declares what the ring kernels support and swaps the drafter's
``SlidingWindowSpec`` for ``RingSWASpec`` (``customize_spec``, the hook vLLM offers out-of-tree backends)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from ringkv.kernels.attention_inputs import MAX_HEAD_DIM, MAX_QUERY_LEN

from ._compat import AttentionBackend, MultipleOf, SlidingWindowSpec, get_current_vllm_config_or_none, init_logger
from .impl import RingKVImpl
from .kv_cache import RingSWASpec, lookahead_from_config, to_ring_spec
from .metadata import RingKVMetadataBuilder

logger = init_logger(__name__)

BACKEND_NAME = "RINGKV"


class RingConfigError(ValueError):
    """A vLLM configuration the ring cannot serve correctly; the message names the fix."""


def check_ring_config(vllm_config: Any) -> None:
    """Refuse configurations that would silently lose the ring or its contents."""
    if vllm_config is None:
        return
    scheduler = getattr(vllm_config, "scheduler_config", None)
    if scheduler is not None and getattr(scheduler, "disable_hybrid_kv_cache_manager", False):
        raise RingConfigError(
            "ringkv: the hybrid KV-cache manager is disabled, so vLLM would turn the ring's sliding-window spec "
            "into full attention (every token kept). Remove --disable-hybrid-kv-cache-manager (and KV connectors "
            "without hybrid support)."
        )
    cache = getattr(vllm_config, "cache_config", None)
    if cache is not None and getattr(cache, "enable_prefix_caching", False):
        raise RingConfigError(
            "ringkv: prefix caching is on, but a target prefix hit carries no drafter ring K/V (the drafter would "
            "attend garbage, vLLM #47930). Start vLLM with --no-enable-prefix-caching."
        )
    lookahead = lookahead_from_config(vllm_config)
    if lookahead > MAX_QUERY_LEN:
        raise RingConfigError(
            f"ringkv: num_lookahead_tokens={lookahead} exceeds the {MAX_QUERY_LEN} draft-block rows ring_attention "
            "handles; lower num_speculative_tokens"
        )


class RingKVBackend(AttentionBackend):
    """Drop-in attention backend for sliding-window drafter layers on a fixed per-request ring."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto", "float16", "bfloat16"]
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
        """Sliding-window layers -> ``RingSWASpec`` (idempotent); full-attention layers keep vLLM's spec."""
        if isinstance(spec, RingSWASpec):
            return spec
        if not isinstance(spec, SlidingWindowSpec):
            logger.info("ringkv: a full-attention drafter layer keeps vLLM's own %s", type(spec).__name__)
            return spec
        vllm_config = get_current_vllm_config_or_none()
        check_ring_config(vllm_config)
        return to_ring_spec(spec, lookahead_from_config(vllm_config))
