# SPDX-License-Identifier: Apache-2.0
"""Host synchronisation guard: an operation that reads a device value on the host is refused while a CUDA
graph is being captured (the capture would fail later, or bake in one step's value), with the fix named."""

from __future__ import annotations

import torch


class HostSyncDuringCapture(RuntimeError):
    """A host synchronisation was about to happen inside CUDA-graph capture."""


def forbid_during_capture(what: str, fix: str) -> None:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise HostSyncDuringCapture(f"ringkv: {what} synchronises with the host during CUDA-graph capture; {fix}")
