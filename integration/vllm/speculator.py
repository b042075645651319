# SPDX-License-Identifier: Apache-2.0
"""Model Runner V2's DFlash speculator (DFlash2's too: it subclasses it) and the ring: one ordering fix.

With FULL CUDA graphs a prefill chunk's context K/V are stored in two calls around the graph replay, the chunk's
first rows last, and on the ring a dead first row can share a slot with a live later one.
``wrap_precompute_context_kv`` (a ``patches.PATCHES`` entry) PADs, in place and before the eager call, every row of
a ring group's context slot mapping whose slot a later row of the same step also writes. Why two rows share a slot:
[docs/vllm-plugin.md](../../docs/vllm-plugin.md#model-runner-v2s-split-context-store).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from ringkv.kernels.ring_geometry import last_writer_slots

from ._compat import context_slot_mappings
from .ring_spec import RingSWASpec


def ring_context_slot_rows(speculator: Any) -> list[torch.Tensor]:
    """The speculator's persistent context slot mappings (one row per draft KV group) of the ring groups."""
    groups = speculator.kv_cache_config.kv_cache_groups
    return [
        context_slot_mappings(speculator)[index]
        for index, group_id in enumerate(speculator.draft_kv_cache_group_ids)
        if isinstance(groups[group_id].kv_cache_spec, RingSWASpec)
    ]


def wrap_precompute_context_kv(original: Callable[..., Any]) -> Callable[..., Any]:
    """``DFlashSpeculator._precompute_context_kv`` where a call that starts past row 0 (the eager half of a split
    write) first PADs every earlier row a row up to its end supersedes."""

    def precompute_context_kv(self: Any, start: int, end: int, dummy_run: bool = False) -> None:
        if start > 0 and not dummy_run:
            for row in ring_context_slot_rows(self):
                row[:end].copy_(last_writer_slots(row[:end]))
        original(self, start, end, dummy_run)

    return precompute_context_kv
