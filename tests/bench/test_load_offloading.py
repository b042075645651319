# SPDX-License-Identifier: Apache-2.0
"""The offloading modes of ``ringkv bench load``: vLLM's ``OffloadingConnector`` (its scheduler side, and its worker
side over a worker that copies nothing) beside the prefix cache in the no-model simulation, on a tiny shape (the
chat workload's first 3 conversations, W 256, one 64-token target group) at a pool too small to keep the
conversations' prefixes cached and at a roomy one."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from ringkv.bench.lab.simulation.cells import Cell, run_cell
from ringkv.bench.lab.simulation.offloading import Offloading
from ringkv.bench.lab.simulation.scheduler_run import build_vllm_config, make_scheduler
from ringkv.bench.load_options import LoadOptions

pytestmark = pytest.mark.vllm

SHAPE = LoadOptions(window=256, target_groups=1, target_kv_block_size=64, max_num_batched_tokens=1024,
                    max_num_seqs=8, conversations=3).shape("chat")  # fmt: skip
TIGHT, ROOMY, CPU_TIER = 300, 800, 400  # pool blocks; the CPU tier in pool blocks


@pytest.fixture(scope="module")
def rows() -> dict[tuple[str, int], dict]:
    modes = {"stock": 0, "ring-today": 0, "ring-cached": 0, "stock-offload": CPU_TIER, "ring-offload": CPU_TIER,
             "ring-cached-offload": CPU_TIER}  # fmt: skip
    return {(mode, pool): run_cell(Cell(SHAPE, mode, pool, cpu)) for pool in (TIGHT, ROOMY)
            for mode, cpu in modes.items()}  # fmt: skip


def test_the_tight_pool_evicts_cached_prefixes(rows):
    """The precondition of the next tests: prefix caching alone loses cached target blocks at the tight pool."""
    assert rows["ring-today", TIGHT]["target_evictions"] > 0 and rows["stock", TIGHT]["target_evictions"] > 0


@pytest.mark.parametrize(("alone", "offloaded"), [("ring-today", "ring-offload"), ("stock", "stock-offload"),
                                                  ("ring-cached", "ring-cached-offload")])  # fmt: skip
def test_offloading_loads_what_the_pool_evicted_and_the_target_recomputes_less(rows, alone, offloaded):
    alone, offloaded = rows[alone, TIGHT], rows[offloaded, TIGHT]
    assert offloaded["offload_loaded_tokens"] > 0 and offloaded["cpu_blocks"] == CPU_TIER
    assert offloaded["recomputed_tokens"] < alone["recomputed_tokens"]


@pytest.mark.parametrize("mode", ["ring-offload", "ring-cached-offload"])
def test_the_ring_s_connector_answers_stay_within_the_rebuild_cap(rows, mode):
    """Every ``OffloadingConnector`` answer of a ring deployment, its windows cached or not, ends at or below
    ``N - (W - 1)`` with the local hit (ringkv's ``_max_loadable_tokens`` wrap), while loading."""
    ring = rows[mode, TIGHT]
    assert ring["offload_loaded_tokens"] > 0 and ring["offload_offers_past_cap"] == 0


def test_offloading_and_the_cached_ring_together_recompute_least(rows):
    """The CPU tier returns what the pool evicted, the cached windows save the rebuild where the pool kept them."""
    recomputed = {mode: rows[mode, TIGHT]["recomputed_tokens"] for mode in ("ring-cached", "ring-offload")}
    assert rows["ring-cached-offload", TIGHT]["recomputed_tokens"] < min(recomputed.values()), recomputed


def test_a_roomy_pool_loads_nothing_and_offloading_changes_no_count(rows):
    """Where the pool keeps every prefix, the CPU tier is never read: the rows equal prefix caching alone's."""
    for alone, offloaded in (
        ("stock", "stock-offload"),
        ("ring-today", "ring-offload"),
        ("ring-cached", "ring-cached-offload"),
    ):
        expected = {k: v for k, v in rows[alone, ROOMY].items() if k not in ("mode", "cpu_blocks")}
        got = {k: v for k, v in rows[offloaded, ROOMY].items() if k not in ("mode", "cpu_blocks")}
        assert got == expected


def test_an_offloading_mode_needs_a_cpu_tier_and_the_others_none():
    with pytest.raises(ValueError, match="an offloading mode needs a CPU tier"):
        run_cell(Cell(SHAPE, "ring-offload", ROOMY, 0))
    with pytest.raises(ValueError, match="an offloading mode needs a CPU tier"):
        run_cell(Cell(SHAPE, "ring-today", ROOMY, CPU_TIER))


def test_offloading_needs_the_connector_in_the_config():
    setup = SHAPE.deployment(ROOMY, cache_ring=False)
    with pytest.raises(TypeError, match="not vLLM's OffloadingConnector: enable_offloading"):
        Offloading(make_scheduler(build_vllm_config(setup), setup, ring=True))
