# SPDX-License-Identifier: Apache-2.0
"""Model Runner V2's DFlash speculator (DFlash2's too: it subclasses it) and the ring: one ordering fix.

With FULL CUDA graphs, a step whose target batch has more rows than the graph's context rows (a prefill chunk)
stores the drafter's context K/V in two calls: rows ``[num_context, T)`` eagerly before the replay, then rows
``[0, num_context)`` inside the graph (``DFlashSpeculator._prepare_graph_replay``, ``_prepare_graph_forward``).
On the ring two rows of one step can share a slot: a long chunk's first rows sit in a block the manager
appended live in an earlier step (the previous step's partial or lookahead block), its last rows in the block
R columns further on, the same physical block. ``do_kv_cache_update`` keeps only the last writer of a slot
*within one call*; split, the chunk's first (dead) row is written after its later (live) one and wins.

``wrap_precompute_context_kv`` (installed by ``register()`` from ``patches.PATCHES``) PADs, before the eager part,
every row of a ring group's context slot mapping whose slot a later row of the same step also writes, in place:
the graph reads that buffer. Groups that are not on the ring are left alone (their slots never repeat within a
step).
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
