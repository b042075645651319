# SPDX-License-Identifier: Apache-2.0
"""One cell of ``ringkv bench load`` (a workload, a drafter mode, a pool) and the search for the base pool.

A cell builds everything it needs from its ``Cell`` (the workload from the seed, vLLM's config, a fresh
scheduler), so it gives the same row in any process; ``bench/load.py`` runs each in a process of its own.

The base pool is the smallest pool where the stock drafter **neither preempts nor evicts**: no request is
preempted and vLLM's ``BlockPool`` never reuses a block that still carries a prefix-cache hash
(``census.CacheCensus.evictions``, target and drafter groups), so every block any request hashed stays cached to
the end. ``search_base_pool`` doubles a pool until stock is roomy, then bisects between the last pool that was not
and the first that was (assuming roominess is monotone in the pool; the smallest roomy pool's neighbour below is
a probe that was not roomy).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from ringkv.integration.vllm.full_window import DrafterFullWindow, check_sinks_config
from ringkv.kernels.testing import ISSUE_55800, DrafterShape

from .admission import Deployment
from .load import PoolTooSmall, run_load
from .offloading import enable_offloading
from .scheduler_run import build_vllm_config
from .workloads import WORKLOADS, Conversation, conversations


@dataclass(frozen=True)
class Mode:
    """A drafter mode: the drafter on the ring; the ring's blocks in the prefix cache (``RingSWASpec.cache_ring``);
    vLLM's ``OffloadingConnector`` beside the prefix cache (``offloading.py``)."""

    ring: bool
    cache_ring: bool = False
    offload: bool = False


MODES = {
    "stock": Mode(ring=False), "ring-today": Mode(ring=True), "ring-cached": Mode(ring=True, cache_ring=True),
    "stock-offload": Mode(ring=False, offload=True), "ring-offload": Mode(ring=True, offload=True),
    "ring-cached-offload": Mode(ring=True, cache_ring=True, offload=True),
}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Shape:
    """The deployment and the workload every cell of one table shares (``LoadOptions.shape``, whose flags hold the
    defaults). ``conversations``: 0 takes the workload's own count, a smaller number its first conversations (a
    tiny run). ``full_window``: a mixed drafter, a full-attention group beside the sliding one, windowed to
    ``full_window`` keys plus ``sinks`` sink tokens on the ring (``Deployment.full_window``); 0: #55800's drafter."""

    workload: str
    window: int
    drafter_kv_block_size: int
    num_speculative_tokens: int
    target_groups: int
    target_kv_block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    conversations: int
    seed: int
    full_window: int = 0
    sinks: int = 0
    prefix_caching: bool = True

    @property
    def drafter(self) -> DrafterShape:
        return replace(ISSUE_55800, window=self.window, kv_block_size=self.drafter_kv_block_size,
                       num_speculative_tokens=self.num_speculative_tokens)  # fmt: skip

    def conversations_list(self) -> list[Conversation]:
        drawn = conversations(WORKLOADS[self.workload], self.seed)
        return drawn[: self.conversations] if self.conversations else drawn

    def deployment(self, pool_blocks: int, cache_ring: bool) -> Deployment:
        longest = max(c.longest_request for c in self.conversations_list())
        drafter = self.drafter
        return Deployment(
            pool_blocks=pool_blocks, target_groups=self.target_groups, target_kv_block_size=self.target_kv_block_size,
            drafter=drafter, max_model_len=longest + 2 * drafter.lookahead,  # room for drafts verified past the end
            max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
            prefix_caching=self.prefix_caching, cache_ring=cache_ring, full_window=self.full_window,
            sink_tokens=self.sinks,
        )  # fmt: skip


@dataclass(frozen=True)
class Cell:
    """``cpu_blocks``: the CPU tier of an offloading mode (``offloading.enable_offloading``), else 0."""

    shape: Shape
    mode: str
    pool_blocks: int
    cpu_blocks: int = 0


def run_cell(cell: Cell) -> dict[str, Any]:
    """The cell's row: its coordinates, ``LoadResult``'s counts and the derived columns; ``pool_too_small``
    (and nothing else measured) when a step scheduled nothing."""
    mode = MODES[cell.mode]
    if mode.offload != bool(cell.cpu_blocks):
        raise ValueError(f"mode {cell.mode} with cpu_blocks={cell.cpu_blocks}: an offloading mode needs a CPU tier, "
                         "another none")  # fmt: skip
    setup = cell.shape.deployment(cell.pool_blocks, mode.cache_ring)
    # a mixed drafter's full group on the ring: its ns + R, the bound its rows are checked against
    full_row_blocks = setup.full_drafter_spec(ring=True).plan.row_blocks if setup.full_window else 0
    row: dict[str, Any] = {"workload": cell.shape.workload, "mode": cell.mode, "pool_blocks": cell.pool_blocks,
                           "cpu_blocks": cell.cpu_blocks, "ring_blocks": setup.drafter.plan.ring_blocks,
                           "full_row_blocks": full_row_blocks}  # fmt: skip
    config = build_vllm_config(setup)
    if mode.offload:
        enable_offloading(config, setup.kv_cache_config(mode.ring), cell.cpu_blocks)
    if cell.shape.sinks:
        # the plugin's own refusals: sinks beside a KV connector, or beside prefix caching with every hit capped
        check_sinks_config(DrafterFullWindow(cell.shape.full_window, cell.shape.sinks), config, mode.cache_ring)
    try:
        result = run_load(config, setup, mode.ring, cell.shape.conversations_list(), cell.shape.seed)
    except PoolTooSmall as error:
        return {**row, "pool_too_small": str(error)}
    return {**row, **asdict(result), "recomputed_tokens": result.recomputed_tokens,
            "mean_running": result.mean_running, "mean_drafter_blocks": result.mean_drafter_blocks}  # fmt: skip


def roomy(row: dict[str, Any]) -> bool:
    """Neither preempted nor evicted (and ran)."""
    return "pool_too_small" not in row and not (
        row["preemptions"] or row["target_evictions"] or row["drafter_evictions"]
    )


def search_base_pool(shape: Shape, start: int = 256) -> tuple[int, list[dict[str, Any]]]:
    """The smallest pool where stock is ``roomy``, and every probe's row (pool order)."""
    probes: dict[int, dict[str, Any]] = {}

    def probe(pool: int) -> bool:
        probes[pool] = run_cell(Cell(shape, "stock", pool))
        return roomy(probes[pool])

    low, high = 0, start  # low: not roomy (0: none tried), high: being tried
    while not probe(high):
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if probe(middle) else (middle, high)
    return high, [probes[pool] for pool in sorted(probes)]
