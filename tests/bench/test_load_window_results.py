# SPDX-License-Identifier: Apache-2.0
"""The committed ``ringkv bench load`` runs of a mixed drafter at the seed's shape, the full-attention group windowed
to 8192 (``bench/results/load_w2048_wf8192*``; with 64 sinks and prefix caching off: ``..._s64_nopc*``): what
issue 38 asks of them, read from the files (nothing is run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ringkv.kernels.ring_geometry import ring_blocks_needed, sink_block_count

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
RUNS = {"load_w2048_wf8192": 0, "load_w2048_wf8192_s64_nopc": 64}  # stem -> sinks
LOOKAHEAD, BLOCK = 8, 16


def rows(stem: str) -> list[dict]:
    return [json.loads(line) for line in (RESULTS / f"{stem}.jsonl").read_text().splitlines()]


def measured(stem: str) -> list[dict]:
    return [row for row in rows(stem) if "pool_too_small" not in row]


@pytest.mark.parametrize("stem", RUNS)
def test_each_run_is_the_seed_shape_headed_by_its_command_and_passed(stem):
    options = rows(stem)[0]["options"]
    assert (options["window"], options["full_window"], options["sinks"]) == (2048, 8192, RUNS[stem])
    assert "long" in options["workload"] and options["conversations"] == 0
    header = (RESULTS / f"{stem}_cpu.txt").read_text().splitlines()[:4]
    assert header[0].startswith("Measured ") and "-dirty" not in header[0]
    assert header[1].startswith("Command: ringkv bench load ") and "--full-window 8192" in header[1]
    assert header[2].endswith("every row identical") and header[3].endswith("yes, in every cell")


@pytest.mark.parametrize("stem", RUNS)
def test_every_ring_request_held_at_most_ns_plus_r_and_nothing_leaked(stem):
    """The bound from ring_geometry: the sliding ring's R, the windowed full group's cdiv(S, bs) + R."""
    sliding = ring_blocks_needed(2048, BLOCK, LOOKAHEAD)
    full = sink_block_count(RUNS[stem], BLOCK) + ring_blocks_needed(8192, BLOCK, LOOKAHEAD)
    for row in measured(stem):
        assert row["leaked_blocks"] == row["requests_over_bound"] == 0, row
        if row["mode"] != "stock":
            assert (row["sliding_bound"], row["full_bound"]) == (sliding, full)
            assert row["sliding_peak_per_request"] <= sliding and row["full_peak_per_request"] <= full


@pytest.mark.parametrize("stem", RUNS)
def test_at_262144_tokens_the_ring_holds_its_bound_and_stock_the_whole_context(stem):
    long = {row["mode"]: row for row in measured(stem) if row["workload"] == "long" and row["repeat"] == 1}
    assert long["ring-today"]["full_peak_per_request"] == long["ring-today"]["full_bound"]
    assert long["stock"]["full_peak_per_request"] >= 262_144 // BLOCK


def test_ring_requests_are_preempted_with_prefix_caching_on():
    ring = [row for row in measured("load_w2048_wf8192") if row["mode"] != "stock"]
    assert {row["mode"] for row in ring if row["preemptions"]} == {"ring-today", "ring-cached"}
    # the 262,144-token requests wait for room rather than being preempted (none at any pool)
    assert {row["workload"] for row in ring if row["preemptions"]} == {"chat", "agentic"}
