# SPDX-License-Identifier: Apache-2.0
"""Async scheduling on vLLM's CPU platform, for engine runs only (``EngineRunSpec.async_scheduling``): vLLM's GPU
default (the scheduler plans step t + 1 while step t runs, with output placeholders), which vLLM's
``CpuPlatform.check_and_update_config`` turns off ("not required on CPU"). ``force_async_scheduling`` sets it back
after vLLM's own check, in the engine process: vLLM then runs its ``AsyncScheduler`` with two batches in flight
(the spike in docs/testing.md). Never installed by the plugin."""

from __future__ import annotations

from typing import Any


def force_async_scheduling() -> None:
    """Wrap ``CpuPlatform.check_and_update_config`` so that every config it checks keeps async scheduling on."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__
    if getattr(original, "_ringkv_async", False):
        return

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        original(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    check_and_update_config._ringkv_async = True  # type: ignore[attr-defined]
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
