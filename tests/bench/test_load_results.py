# SPDX-License-Identifier: Apache-2.0
"""The committed ``ringkv bench load`` run at the seed's shape (``bench/results/load_w2048*.txt``,
``load_w2048.jsonl``): what the run must show for issue 31, read from the files (nothing is run)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
ROWS = [json.loads(line) for line in (RESULTS / "load_w2048.jsonl").read_text().splitlines()]
WORKLOADS = ("chat", "agentic")
TEXTS = {"chat": RESULTS / "load_w2048_cpu.txt", "agentic": RESULTS / "load_w2048_agentic_cpu.txt"}


def first_run(workload: str) -> dict[tuple[int, str], dict]:
    """(pool, mode) -> the first repeat's row."""
    return {(r["pool_blocks"], r["mode"]): r for r in ROWS if r["workload"] == workload and r["repeat"] == 1}


@pytest.mark.parametrize("workload", WORKLOADS)
def test_the_run_is_the_seed_shape_at_six_pools_or_more_headed_by_its_command(workload):
    rows = first_run(workload)
    options = ROWS[0]["options"]
    assert (options["window"], options["drafter_kv_block_size"], options["num_speculative_tokens"]) == (2048, 16, 7)
    assert options["conversations"] == 0 and len({pool for pool, _ in rows}) >= 6
    assert {mode for _, mode in rows} >= {"stock", "ring-today"}
    header = TEXTS[workload].read_text().splitlines()[:3]
    assert header[0].startswith("Measured ") and " commit " in header[0] and "-dirty" not in header[0]
    assert header[1].startswith("Command: ringkv bench load ") and "--seed 0" in header[1]
    assert header[2].endswith("every row identical")


@pytest.mark.parametrize("workload", WORKLOADS)
def test_both_runs_gave_identical_rows(workload):
    runs: dict[int, dict] = defaultdict(dict)
    for row in ROWS:
        if row["workload"] == workload:
            runs[row["repeat"]][row["pool_blocks"], row["mode"]] = {k: v for k, v in row.items() if k != "repeat"}
    assert sorted(runs) == [1, 2] and runs[1] == runs[2]


@pytest.mark.parametrize("workload", WORKLOADS)
def test_stock_at_the_base_pool_neither_preempts_nor_evicts(workload):
    rows = first_run(workload)
    base = {row["base_pool"] for row in rows.values()}
    assert len(base) == 1
    stock = rows[base.pop(), "stock"]
    assert stock["preemptions"] == stock["target_evictions"] == stock["drafter_evictions"] == 0


def cached_pools(workload: str) -> list[int]:
    rows = first_run(workload)
    pools = sorted(pool for pool, mode in rows if mode == "ring-cached")
    assert pools and all((pool, "ring-today") in rows for pool in pools), "the run has no ring-cached rows"
    return pools


# Issue 31's gate: the cached ring never recomputes more than the rebuild cap alone, and its share of the cache stays
# within R blocks per conversation whose target blocks are cached (what RINGKV_RING_PREFIX_CACHE defaulting on needs)
@pytest.mark.parametrize("workload", WORKLOADS)
def test_gate_ring_cached_recomputes_no_more_than_ring_today_at_every_pool(workload):
    rows = first_run(workload)
    recomputed = {pool: (rows[pool, "ring-cached"]["recomputed_tokens"], rows[pool, "ring-today"]["recomputed_tokens"])
                  for pool in cached_pools(workload)}  # fmt: skip
    worse = {pool: pair for pool, pair in recomputed.items() if pair[0] > pair[1]}
    assert not worse, f"pool: (ring-cached, ring-today) recomputed tokens: {worse}"


@pytest.mark.parametrize("workload", WORKLOADS)
def test_gate_ring_cached_unheld_drafter_blocks_stay_within_r_per_conversation_with_cached_target_blocks(workload):
    """At the end, at the peak and at every step between (``share_excess_peak``: the most unheld hashed drafter
    blocks exceeded R x the conversations with cached target blocks at any step)."""
    rows = first_run(workload)
    over = {}
    for pool in cached_pools(workload):
        row = rows[pool, "ring-cached"]
        bound_end, bound_peak = (row["ring_blocks"] * row[k] for k in ("conversations_cached_end",
                                                                          "conversations_cached_at_peak"))  # fmt: skip
        if row["unheld_drafter_blocks_end"] > bound_end or row["unheld_drafter_blocks_peak"] > bound_peak:
            over[pool] = (row["unheld_drafter_blocks_end"], bound_end, row["unheld_drafter_blocks_peak"], bound_peak)
        elif row["share_excess_peak"] > 0:
            over[pool] = ("a step between", row["share_excess_peak"])
    assert not over, f"pool: (unheld at the end, its bound, at the peak, its bound): {over}"


# Issue 30's row: vLLM's OffloadingConnector beside the prefix cache, a CPU tier of --offload-multiple x the base pool
def offload_pools(workload: str) -> list[int]:
    rows = first_run(workload)
    pools = sorted(pool for pool, mode in rows if mode == "ring-offload")
    assert pools and all(
        (pool, mode) in rows for pool in pools for mode in ("ring-today", "ring-cached", "ring-cached-offload")
    ), "the run has no offloading rows"
    return pools


@pytest.mark.parametrize("workload", WORKLOADS)
def test_offloading_never_costs_the_ring_recompute_and_saves_where_the_pool_costs_some(workload):
    """Ring-offload recomputes no more than ring-today at every pool, and strictly less, loading from the CPU tier,
    at every pool where ring-today recomputes more than at the roomiest pool (where evicting cost recompute)."""
    rows = first_run(workload)
    pools = offload_pools(workload)
    roomiest = rows[pools[-1], "ring-today"]["recomputed_tokens"]
    worse, pressed, idle = {}, [], []
    for pool in pools:
        offloaded, alone = (rows[pool, mode]["recomputed_tokens"] for mode in ("ring-offload", "ring-today"))
        if offloaded > alone:
            worse[pool] = (offloaded, alone)
        if alone > roomiest:
            pressed.append(pool)
            if not (rows[pool, "ring-offload"]["offload_loaded_tokens"] and offloaded < alone):
                idle.append(pool)
    assert not worse, f"pool: (ring-offload, ring-today) recomputed tokens: {worse}"
    assert pressed, "no pool cost ring-today recompute: the run shows nothing of offloading"
    assert not idle, f"pools where the pool cost ring-today recompute and offloading saved none: {idle}"


@pytest.mark.parametrize("workload", WORKLOADS)
def test_the_cached_ring_with_offloading_never_recomputes_more_than_without(workload):
    rows = first_run(workload)
    pairs = {pool: tuple(rows[pool, mode]["recomputed_tokens"] for mode in ("ring-cached-offload", "ring-cached"))
             for pool in offload_pools(workload)}  # fmt: skip
    assert not {pool: pair for pool, pair in pairs.items() if pair[0] > pair[1]}, pairs


@pytest.mark.parametrize("workload", WORKLOADS)
def test_the_ring_s_connector_never_offered_past_the_rebuild_cap(workload):
    rows = first_run(workload)
    past = {(pool, mode): rows[pool, mode]["offload_offers_past_cap"] for pool in offload_pools(workload)
            for mode in ("ring-offload", "ring-cached-offload")}  # fmt: skip
    assert not any(past.values()), past
