# SPDX-License-Identifier: Apache-2.0
"""Seeded scheduler fuzz on vLLM's KVCacheManager: admit / chunk / decode with rejections / preempt / abort,
with the ring invariants checked after every action."""

from __future__ import annotations

import random

import pytest
import triton

pytest.importorskip("vllm")

from ringkv.bench.lab.simulation.admission import Deployment, drafter_manager, make_request
from ringkv.kernels.testing import DrafterShape

pytestmark = pytest.mark.vllm

SMALL = Deployment(pool_blocks=700, target_groups=2, target_kv_block_size=64, max_model_len=60_000,
                   max_num_batched_tokens=700,
                   drafter=DrafterShape(window=200, kv_block_size=8, num_speculative_tokens=3))  # fmt: skip


def held_by_group(manager, request_ids) -> int:
    total = 0
    for group in manager.coordinator.single_type_managers:
        blocks = set()
        for rid in request_ids:
            blocks |= {b.block_id for b in group.req_to_blocks.get(rid, []) if not b.is_null}
            ring = getattr(group, "rings", {}).get(rid)
            blocks |= {b.block_id for b in ([] if ring is None else ring.claimed())}
        total += len(blocks)
    return total


def check_invariants(manager, live, needs, initial_free) -> None:
    drafter = drafter_manager(manager)
    plan = SMALL.drafter.plan
    rings = {rid: [b.block_id for b in drafter.rings[rid].blocks] for rid in live}
    all_ring_blocks = [b for blocks in rings.values() for b in blocks]
    assert len(all_ring_blocks) == len(set(all_ring_blocks)), "two requests share a ring block"
    for rid, request in live.items():
        assert len(rings[rid]) == min(triton.cdiv(needs[rid], plan.kv_block_size), plan.ring_blocks)
        context_len = request.num_computed_tokens
        row = drafter.req_to_blocks[rid]
        window_blocks = [row[j] for j in plan.live_blocks(context_len) if j < len(row)]
        assert not any(b.is_null for b in window_blocks), f"{rid}: null block inside the live window"
        assert len({b.block_id for b in window_blocks}) == len(window_blocks), f"{rid}: live blocks alias"
    assert manager.block_pool.get_num_free_blocks() + held_by_group(manager, live) == initial_free


def fuzz(seed: int, actions: int) -> dict[str, int]:
    rng = random.Random(seed)
    manager = SMALL.manager(ring=True)
    initial_free = manager.block_pool.get_num_free_blocks()
    live: dict = {}
    needs: dict[str, int] = {}
    counts = {"admit": 0, "refused": 0, "chunk": 0, "decode": 0, "preempt": 0, "abort": 0, "stalled": 0}
    next_id = 0

    def allocate(rid, request, num_new, gate=False) -> bool:
        need = min(request.num_computed_tokens + num_new + SMALL.drafter.lookahead, SMALL.max_model_len)
        ok = manager.allocate_slots(request, num_new, num_lookahead_tokens=SMALL.drafter.lookahead,
                                    full_sequence_must_fit=gate) is not None  # fmt: skip
        if ok:
            needs[rid] = need
        return ok

    for _ in range(actions):
        action = rng.choices(["admit", "step", "preempt", "abort"], weights=[2, 12, 1, 1])[0]
        if action == "admit" and len(live) < 4:
            rid, next_id = f"q{next_id}", next_id + 1
            # mostly short prompts (decode gets exercised), some several windows and chunks long
            request = make_request(rid, rng.randint(1, 20_000) if rng.random() < 0.2 else rng.randint(1, 1500))
            chunk = min(rng.randint(1, SMALL.max_num_batched_tokens), request.num_prompt_tokens)
            if allocate(rid, request, chunk, gate=True):
                request.num_computed_tokens += chunk
                live[rid] = request
                counts["admit"] += 1
            else:
                counts["refused"] += 1
        elif action == "step" and live:
            rid = rng.choice(sorted(live))
            request = live[rid]
            remaining = request.num_prompt_tokens - request.num_computed_tokens
            if remaining > 0:
                chunk = rng.randint(1, min(remaining, SMALL.max_num_batched_tokens))
                if allocate(rid, request, chunk):
                    request.num_computed_tokens += chunk
                    if request.num_computed_tokens == request.num_prompt_tokens:
                        request.append_output_token_ids([1])
                    counts["chunk"] += 1
                else:
                    counts["stalled"] += 1
            elif request.num_tokens + 2 * SMALL.drafter.lookahead - 1 < SMALL.max_model_len:
                if allocate(rid, request, 1 + SMALL.drafter.num_speculative_tokens):
                    accepted = 1 + rng.randint(0, SMALL.drafter.num_speculative_tokens)
                    request.num_computed_tokens += accepted
                    request.append_output_token_ids([1] * accepted)
                    counts["decode"] += 1
                else:
                    counts["stalled"] += 1
        elif action in ("preempt", "abort") and live:
            rid = rng.choice(sorted(live))
            request = live.pop(rid)
            manager.free(request)
            needs.pop(rid)
            counts[action] += 1
            if action == "preempt":
                # resumed later from scratch (no prefix caching): a new admission of the same prompt
                resumed = make_request(rid + "r", request.num_prompt_tokens)
                chunk = min(SMALL.max_num_batched_tokens, resumed.num_prompt_tokens)
                if allocate(rid + "r", resumed, chunk, gate=True):
                    resumed.num_computed_tokens += chunk
                    live[rid + "r"] = resumed
        check_invariants(manager, live, needs, initial_free)
    for request in live.values():
        manager.free(request)
    assert manager.block_pool.get_num_free_blocks() == initial_free
    return counts


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scheduler_fuzz_quick(seed):
    counts = fuzz(seed, actions=300)
    assert counts["admit"] and counts["chunk"] and counts["decode"], counts


@pytest.mark.slow
def test_scheduler_fuzz_10000_steps():
    counts = fuzz(1234, actions=10_000)
    assert counts["preempt"] and counts["abort"] and counts["decode"] > 1000, counts
