# SPDX-License-Identifier: Apache-2.0
"""How users select the ring backend beyond ``speculative_config.attention_backend``.

vLLM >= 0.32 no longer reads ``VLLM_ATTENTION_BACKEND``. People still set it, so with
``VLLM_ATTENTION_BACKEND=RINGKV`` the plugin puts the *drafter's* layers on the ring backend, exactly as
``--speculative-config '{..., "attention_backend": "RINGKV"}'`` would; an explicit choice there wins.
"""

from __future__ import annotations

import functools
from typing import Any

from ._compat import EngineArgs, init_logger

logger = init_logger(__name__)

RING_NAMES = ("RINGKV", "CUSTOM")


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


def honour_attention_backend_env(value: str | None) -> None:
    """Hook ``EngineArgs.create_speculative_config`` when ``VLLM_ATTENTION_BACKEND`` names the ring."""
    if value is None or value.upper() not in RING_NAMES:
        return
    original = EngineArgs.create_speculative_config
    if getattr(original, "_ringkv_wrapped", False):
        return

    @functools.wraps(original)
    def create_speculative_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        apply_drafter_backend(self)
        return original(self, *args, **kwargs)

    create_speculative_config._ringkv_wrapped = True  # type: ignore[attr-defined]
    EngineArgs.create_speculative_config = create_speculative_config
