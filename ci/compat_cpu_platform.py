# SPDX-License-Identifier: Apache-2.0
"""pytest plugin for ``ci/compat.sh`` only: run vLLM's GPU wheel (0.33, 0.34) on its own CPU platform.

``VLLM_TARGET_DEVICE=cpu`` (set by compat.py) selects ``CpuPlatform``, so ``EngineArgs.create_engine_config()``
gets a device. From 0.34 that platform's ``check_and_update_config`` refuses x86 without a CPU Triton backend
("vLLM on x86 CPUs requires Triton (triton-cpu)"); the tests here build configs and drive the scheduler and never
run vLLM's own kernels, so the check is answered yes for the duration of that call only.
"""

from __future__ import annotations

import functools
from typing import Any

import vllm.triton_utils
from vllm.platforms.cpu import CpuPlatform

_check_and_update_config = CpuPlatform.check_and_update_config.__func__


@functools.wraps(_check_and_update_config)
def _check_without_triton_cpu(cls: type, vllm_config: Any) -> None:
    saved = vllm.triton_utils.HAS_TRITON
    vllm.triton_utils.HAS_TRITON = True
    try:
        _check_and_update_config(cls, vllm_config)
    finally:
        vllm.triton_utils.HAS_TRITON = saved


CpuPlatform.check_and_update_config = classmethod(_check_without_triton_cpu)
