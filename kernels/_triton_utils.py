# SPDX-License-Identifier: Apache-2.0
"""Small helpers shared by the Triton launchers: interpreter detection, the debug-checks switch, SM count."""

from __future__ import annotations

import functools
import os

import torch


def is_interpreter() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def debug_checks_enabled() -> bool:
    """``RINGKV_DEBUG_CHECKS=1`` adds input checks that synchronise with the device."""
    return os.environ.get("RINGKV_DEBUG_CHECKS") == "1"


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (cached; 1 off-GPU)."""
    if not torch.cuda.is_available():
        return 1
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(device: torch.device) -> int:
    """SM count for ``device``; a small constant under the interpreter so configs stay tiny."""
    if device.type != "cuda":
        return 1
    return num_sms(device.index if device.index is not None else torch.cuda.current_device())
