# SPDX-License-Identifier: Apache-2.0
"""What the ring attention backend declares it supports, apart from the backend itself: selection validates a ring
selection against these (``selection.validate_ring_selection``, through vLLM's ``validate_configuration``) without
importing ``backend.py``, which imports the planning and spec modules. ``RingKVBackend`` inherits them."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from ringkv.kernels.kv_quant import FP8_KV_CACHE_DTYPES, UNQUANTIZED_KV_CACHE_DTYPES
from ringkv.kernels.validation import MAX_HEAD_DIM

from ._compat import AttentionBackend, MultipleOf


class RingKVCapabilities(AttentionBackend):
    """The ring kernels' declared capabilities (each one has a test in ``test_vllm_backend.py``)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    # vLLM CacheDType names: unquantized, and per-tensor fp8 with the layer's k_scale / v_scale (kernels/kv_quant.py)
    supported_kv_cache_dtypes: ClassVar[list[Any]] = [*UNQUANTIZED_KV_CACHE_DTYPES, *FP8_KV_CACHE_DTYPES]

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
