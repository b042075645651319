# SPDX-License-Identifier: Apache-2.0
"""Per step, per request, per drafter group: the blocks a request holds, against the ring's bound, for
``ringkv bench load`` (issue 38: a mixed drafter's full-attention group windowed on the ring).

A ring group's bound is its plan's row, ``ns + R`` (``RingPlan.row_blocks``: ``cdiv(S, bs)`` sink blocks for life
plus ``R = ring_blocks_needed``); a stock group (``SlidingWindowSpec``, ``FullAttentionSpec``) has none and is only
measured. At the end of a run every block but the null block must be back in the pool (``leaked_blocks``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ringkv.integration.vllm.ring_spec import RingSWASpec

from ._vllm import KVCacheManager
from .admission import held_rows


@dataclass
class GroupBlocks:
    """One drafter group over a run: ``bound`` (the ring's ``ns + R``; None for a stock group), the most blocks
    any request held at any step (``peak_per_request``), the (step, request) pairs above the bound
    (``over_bound``) and, per step, the most any request held (``per_step``)."""

    group_id: int
    bound: int | None
    peak_per_request: int = 0
    over_bound: int = 0
    per_step: list[int] = field(default_factory=list)


class DrafterGroupWatch:
    """``observe`` after every ``schedule()`` (the step's blocks allocated, the preempted requests' freed)."""

    def __init__(self, manager: KVCacheManager, group_ids: range) -> None:
        self.manager = manager
        groups = manager.kv_cache_config.kv_cache_groups
        self.groups = [GroupBlocks(g, ring_bound(groups[g].kv_cache_spec)) for g in group_ids]

    def observe(self) -> None:
        for group in self.groups:
            held = [len({b.block_id for b in row if not b.is_null})
                    for row in held_rows(self.manager, group.group_id).values()]  # fmt: skip
            most = max(held, default=0)
            group.per_step.append(most)
            group.peak_per_request = max(group.peak_per_request, most)
            if group.bound is not None:
                group.over_bound += sum(n > group.bound for n in held)


def ring_bound(spec: object) -> int | None:
    """A ring group's blocks per request at any context, ``ns + R`` (None for any other spec)."""
    return spec.plan.row_blocks if isinstance(spec, RingSWASpec) else None


def leaked_blocks(manager: KVCacheManager) -> int:
    """Blocks not back in the pool's free queue (the null block aside): 0 once every request has finished."""
    pool = manager.block_pool
    return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
