# SPDX-License-Identifier: Apache-2.0
"""Issue 38's bound under load: ``ringkv bench load``'s mixed drafter (a sliding group plus a full-attention group,
windowed on the ring with ``--full-window``) through vLLM's real Scheduler + KVCacheManager, one cell per test
(in this process): every request of a ring group holds at most ``ns + R`` drafter blocks at every step (the
bound from ``ring_geometry``), preempted and resumed with prefix caching on, with sinks with it off, every block
back in the pool at the end; the stock full group grows with the context."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("vllm")

from ringkv.bench.lab.simulation.admission import Deployment, make_request
from ringkv.bench.lab.simulation.cells import Cell, run_cell
from ringkv.bench.lab.simulation.drafter_groups import leaked_blocks
from ringkv.bench.load import bound_failures
from ringkv.bench.load_options import LoadOptions
from ringkv.integration.vllm.errors import RingConfigError
from ringkv.kernels.ring_geometry import ring_blocks_needed, sink_block_count

pytestmark = pytest.mark.vllm

# the chat workload's first 3 conversations, W 64 / bs 16 / N 7 (R = 6), the full group windowed to 128 (R = 10),
# one 64-token target group; 200 blocks preempt one request, and stock's full group does not fit them
TINY = LoadOptions(window=64, full_window=128, target_groups=1, target_kv_block_size=64,
                   max_num_batched_tokens=1024, max_num_seqs=8, conversations=3)  # fmt: skip
PRESSED, ROOMY = 200, 3000


def ring_bound(window: int, sinks: int = 0) -> int:
    """ns + R of a DFlash ring of ``window`` at TINY's block and lookahead."""
    block, lookahead = TINY.drafter_kv_block_size, TINY.num_speculative_tokens + 1
    return sink_block_count(sinks, block) + ring_blocks_needed(window, block, lookahead)


@pytest.mark.parametrize("mode", ["ring-today", "ring-cached"])
def test_the_windowed_full_group_stays_within_its_ring_through_preemption(mode):
    row = run_cell(Cell(TINY.shape("chat"), mode, PRESSED))
    assert row["preemptions"] > 0
    assert (row["sliding_bound"], row["full_bound"]) == (ring_bound(64), ring_bound(128)) == (6, 10)
    # every step and request within the bound, and the bound reached
    assert row["requests_over_bound"] == 0
    assert (row["sliding_peak_per_request"], row["full_peak_per_request"]) == (6, 10)
    assert row["leaked_blocks"] == 0


def test_the_stock_full_group_grows_with_the_context():
    """vLLM's FullAttentionSpec keeps every block of a request's history: no bound, far above the ring's."""
    row = run_cell(Cell(TINY.shape("chat"), "stock", ROOMY))
    assert row["full_bound"] == row["sliding_bound"] == 0
    assert row["full_peak_per_request"] > 20 * ring_bound(128)
    assert row["leaked_blocks"] == 0


def test_262144_token_requests_hold_the_ring_and_stock_holds_their_history():
    """#55800's shape (W 2048, bs 16, N 7), the full group windowed to 8192: one request of 262,144 tokens."""
    options = LoadOptions(full_window=8192, conversations=1)
    ring = run_cell(Cell(options.shape("long"), "ring-today", 1500))
    assert (ring["sliding_bound"], ring["full_bound"]) == (
        ring_blocks_needed(2048, 16, 8),
        ring_blocks_needed(8192, 16, 8),
    )
    assert (ring["sliding_peak_per_request"], ring["full_peak_per_request"]) == (130, 514)
    assert ring["requests_over_bound"] == ring["leaked_blocks"] == 0
    stock = run_cell(Cell(options.shape("long"), "stock", 20_000))
    assert stock["full_peak_per_request"] > 262_144 // 16 and stock["leaked_blocks"] == 0


def test_sinks_without_prefix_caching_hold_their_blocks_beside_the_ring():
    options = replace(TINY, sinks=5, prefix_caching=False)
    row = run_cell(Cell(options.shape("chat"), "ring-today", PRESSED))
    assert row["full_bound"] == ring_bound(128, sinks=5) == 11
    assert row["full_peak_per_request"] == 11 and row["requests_over_bound"] == 0 and row["leaked_blocks"] == 0


def test_sinks_with_every_hit_capped_are_refused_as_the_plugin_refuses_them():
    with pytest.raises(RingConfigError, match=r"RINGKV_RING_PREFIX_CACHE=0.*--no-enable-prefix-caching"):
        run_cell(Cell(replace(TINY, sinks=5).shape("chat"), "ring-today", PRESSED))


def test_sinks_with_the_cached_ring_hold_the_bound_and_leak_nothing():
    row = run_cell(Cell(replace(TINY, sinks=5).shape("chat"), "ring-cached", PRESSED))
    assert row["preemptions"] > 0 and row["prefix_hit_tokens"] > 0
    assert (row["requests_over_bound"], row["leaked_blocks"]) == (0, 0)


def test_a_request_still_holding_blocks_is_a_leak():
    deployment = Deployment(pool_blocks=64, target_groups=1, target_kv_block_size=16,
                            drafter=TINY.shape("chat").drafter, max_model_len=4096, full_window=128)  # fmt: skip
    manager = deployment.manager(ring=True)
    request = make_request("r", 100)
    assert manager.allocate_slots(request, 100, num_lookahead_tokens=deployment.drafter.lookahead) is not None
    assert leaked_blocks(manager) == 7 + 6 + 7  # 108 slots: 7 target blocks, the sliding ring's R = 6, 7 of 10
    manager.free(request)
    assert leaked_blocks(manager) == 0


def test_bound_failures_name_the_cell():
    row = {"workload": "long", "mode": "ring-today", "pool_blocks": 9, "requests_over_bound": 0, "leaked_blocks": 0}
    assert bound_failures([row, {"pool_too_small": "x"}]) == []
    assert bound_failures([{**row, "requests_over_bound": 2, "leaked_blocks": 3}]) == [
        "long/ring-today/9: 2 (step, request, group) over the ring's bound",
        "long/ring-today/9: 3 blocks not back in the pool",
    ]


def test_the_files_are_named_for_the_mixed_drafter():
    assert LoadOptions().stem == "load_w2048"
    assert replace(TINY, sinks=5, prefix_caching=False).stem == "load_w64_wf128_s5_nopc"
    assert "--full-window 128 --sinks 0 --prefix-caching " in TINY.command("out")
    assert "--no-prefix-caching" in replace(TINY, prefix_caching=False).command("out")
