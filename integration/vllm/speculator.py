# SPDX-License-Identifier: Apache-2.0
"""Model Runner V2's DFlash speculator (DFlash2's too: it subclasses it) and the ring: one ordering fix.

With FULL CUDA graphs, a step whose target batch has more rows than the graph's context rows (a prefill chunk)
stores the drafter's context K/V in two calls: rows ``[num_context, T)`` eagerly before the replay, then rows
``[0, num_context)`` inside the graph (``DFlashSpeculator._prepare_graph_replay``, ``_prepare_graph_forward``).
On the ring two rows of one step can share a slot: a long chunk's first rows sit in a block the manager
appended live in an earlier step (the previous step's partial or lookahead block), its last rows in the block
R columns further on, the same physical block. ``do_kv_cache_update`` keeps only the last writer of a slot
*within one call*; split, the chunk's first (dead) row is written after its later (live) one and wins.

``keep_last_writers_across_split_writes`` PADs, before the eager part, every row of a ring group's context slot
mapping whose slot a later row of the same step also writes, in place: the graph reads that buffer. Groups that
are not on the ring are left alone (their slots never repeat within a step).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from ringkv.kernels.ring_geometry import last_writer_slots

from ._compat import dflash_speculator_class
from .kv_cache import RingSWASpec


def ring_context_slot_rows(speculator: Any) -> list[torch.Tensor]:
    """The speculator's persistent context slot mappings (one row per draft KV group) of the ring groups."""
    groups = speculator.kv_cache_config.kv_cache_groups
    return [
        speculator._context_slot_mappings[index]
        for index, group_id in enumerate(speculator.draft_kv_cache_group_ids)
        if isinstance(groups[group_id].kv_cache_spec, RingSWASpec)
    ]


def keep_last_writers_across_split_writes() -> None:
    """Wrap ``DFlashSpeculator._precompute_context_kv`` (idempotent): a call that starts past row 0 is the eager
    half of a split write, so first PAD every earlier row a row up to its end supersedes."""
    speculator_class = dflash_speculator_class()
    original = speculator_class._precompute_context_kv
    if getattr(original, "_ringkv_wrapped", False):
        return

    @functools.wraps(original)
    def precompute_context_kv(self: Any, start: int, end: int, dummy_run: bool = False) -> None:
        if start > 0 and not dummy_run:
            for row in ring_context_slot_rows(self):
                row[:end].copy_(last_writer_slots(row[:end]))
        original(self, start, end, dummy_run)

    precompute_context_kv._ringkv_wrapped = True  # type: ignore[attr-defined]
    speculator_class._precompute_context_kv = precompute_context_kv
