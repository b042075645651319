# SPDX-License-Identifier: Apache-2.0
"""Ring geometry: R, slot arithmetic, dead positions, and property tests over random step sequences."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ringkv.kernels.ring_geometry import (
    PAD_SLOT,
    RingPlan,
    block_column,
    first_visible_position,
    longest_rebuilding_prefix_hit,
    sinks_below_window,
    visible,
)


@pytest.mark.parametrize(
    ("window", "kv_block_size", "num_spec", "expected"),
    [(2048, 16, 7, 130), (2048, 16, 15, 130), (2048, 16, 17, 130), (2048, 16, 18, 131), (4096, 16, 7, 258),
     (1, 16, 0, 1), (16, 16, 0, 2), (17, 16, 7, 3)],
)  # fmt: skip
def test_ring_blocks(window, kv_block_size, num_spec, expected):
    plan = RingPlan.for_dflash(window, kv_block_size, num_spec)
    assert plan.ring_blocks == expected
    assert plan.num_slots == expected * kv_block_size


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"window": 0, "kv_block_size": 16, "lookahead": 8}, "window=0"),
     ({"window": 2048, "kv_block_size": 0, "lookahead": 8}, "kv_block_size=0"),
     ({"window": 2048, "kv_block_size": 16, "lookahead": 0}, "lookahead=0"),
     ({"window": 2048.0, "kv_block_size": 16, "lookahead": 8}, "window=2048.0"),
     ({"window": True, "kv_block_size": 16, "lookahead": 8}, "window=True")],
)  # fmt: skip
def test_impossible_plans_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RingPlan(**kwargs)


def test_for_dflash_rejects_negative_tokens():
    with pytest.raises(ValueError, match="num_speculative_tokens=-1"):
        RingPlan.for_dflash(2048, 16, -1)


def test_check_step_names_the_fix():
    plan = RingPlan(2048, 16, 8)
    plan.check_step(8)
    with pytest.raises(ValueError, match="query_len=9 exceeds the ring's lookahead la=8"):
        plan.check_step(9)


def test_blocks_for_tokens_caps_at_ring():
    plan = RingPlan.for_dflash(2048, 16, 7)
    assert [plan.blocks_for_tokens(n) for n in (0, 1, 16, 17, 2080, 262144)] == [0, 1, 1, 2, 130, 130]


def test_slot_mapping_pads_negative_and_dead_positions():
    plan = RingPlan(window=4, kv_block_size=2, lookahead=2)  # R = cdiv(4, 2) + 1 = 3, S = 6
    ring = torch.tensor([7, 3, 5])
    positions = torch.tensor([-1, 0, 1, 2, 3, 4, 5, 6, 7])
    slots = plan.slot_mapping(positions, ring, seq_len=8)
    # live: positions >= 8 - 3 = 5 -> p=5: block 2 -> ring[2]=5 -> 11; p=6: block 3 -> ring[0]=7 -> 14; p=7 -> 15
    assert slots.tolist() == [PAD_SLOT] * 6 + [11, 14, 15]
    everything = plan.slot_mapping(positions, ring)
    assert everything.tolist() == [PAD_SLOT, 14, 15, 6, 7, 10, 11, 14, 15]


def test_full_rows_and_compact_rows_agree():
    plan = RingPlan(window=37, kv_block_size=8, lookahead=8)
    ring = torch.randperm(100)[: plan.ring_blocks]
    positions = torch.arange(0, 1000)
    full_row = ring[torch.arange(1000 // 8 + 1) % plan.ring_blocks]
    compact = plan.slot_mapping(positions, ring)
    full = plan.slot_mapping(positions, full_row, period=full_row.shape[0])
    assert torch.equal(compact, full)


def test_sink_blocks_keep_their_columns():
    # ns = 2 sink blocks, then a ring of 3 columns: [s0 s1 | r0 r1 r2]
    columns = [block_column(j, 3, sink_blocks=2) for j in range(9)]
    assert columns == [0, 1, 2, 3, 4, 2, 3, 4, 2]
    assert block_column(torch.arange(9), 3, sink_blocks=2).tolist() == columns
    assert block_column(torch.arange(9), 3).tolist() == [j % 3 for j in range(9)]
    # a full logical row (period = its width) reads column j with or without sinks
    assert block_column(torch.arange(9), 9, sink_blocks=2).tolist() == list(range(9))


def test_slot_mapping_with_sinks():
    plan = RingPlan(window=4, kv_block_size=2, lookahead=2, sink_tokens=3)  # ns = 2, R = 3: [s0 s1 | r0 r1 r2]
    assert (plan.sink_blocks, plan.ring_blocks, plan.row_blocks) == (2, 3, 5)
    row = torch.tensor([11, 12, 7, 3, 5])
    positions = torch.arange(-1, 14)
    # logical blocks 0..6 -> columns 0 1 | 2 3 4 2 3 (blocks 5 and 6 wrap onto r0, r1)
    everything = [PAD_SLOT, 22, 23, 24, 25, 14, 15, 6, 7, 10, 11, 14, 15, 6, 7]
    assert plan.slot_mapping(positions, row).tolist() == everything
    # a batch ending at 14: the sink blocks' positions 0..3 (the 4th is no sink: it shares the block) are never
    # dead, the others from 14 - 3 = 11 on are live
    live = plan.slot_mapping(positions, row, seq_len=14).tolist()
    assert live == [PAD_SLOT, 22, 23, 24, 25] + [PAD_SLOT] * 7 + [15, 6, 7]


def test_sink_plans():
    plan = RingPlan.for_dflash(2048, 16, 7)
    with_sinks = RingPlan(2048, 16, 8, sink_tokens=4)
    assert (with_sinks.ring_blocks, with_sinks.sink_blocks, with_sinks.row_blocks) == (130, 1, 131)
    assert [with_sinks.blocks_for_tokens(n) for n in (0, 1, 16, 17, 2096, 262144)] == [0, 1, 1, 2, 131, 131]
    assert plan.row_blocks == plan.ring_blocks == 130 and plan.sink_tokens == 0
    assert RingPlan(2048, 16, 8, sink_tokens=2048).sink_blocks == 128
    assert [sinks_below_window(q, 10, 4) for q in (0, 9, 10, 12, 13, 100)] == [0, 0, 1, 3, 4, 4]


def test_visible_with_sinks():
    q, k = torch.tensor([[20]]), torch.arange(-1, 25)[None]
    seen = k[visible(q, k, 5, causal=True, sink_tokens=3)].tolist()
    assert seen == [0, 1, 2, 16, 17, 18, 19, 20]
    assert k[visible(q, k, 5, causal=False, sink_tokens=3)].tolist() == [0, 1, 2, *range(16, 25)]
    # a query before the sinks end sees no later sink when causal
    assert k[visible(torch.tensor([[1]]), k, 1, causal=True, sink_tokens=3)].tolist() == [0, 1]


def test_a_prefix_hit_needs_the_sink_blocks_and_the_window():
    """W 64, bs 16, S 20 (two sink blocks): a request of 200 tokens, whose first query sees keys from 137 (block 8)
    on, needs blocks 0, 1 and 8.. from a hit; a recompute rebuilds the sinks only from the first token."""
    plan = RingPlan(64, 16, 4, sink_tokens=20)
    assert [j for j in range(13) if plan.hit_needs_block(j, 200)] == [0, 1, 8, 9, 10, 11, 12]
    assert [j for j in range(13) if RingPlan(64, 16, 4).hit_needs_block(j, 200)] == [8, 9, 10, 11, 12]
    # a request still inside its first window needs every block
    assert all(plan.hit_needs_block(j, 50) for j in range(4))
    assert (longest_rebuilding_prefix_hit(200, 64), longest_rebuilding_prefix_hit(200, 64, sink_tokens=20)) == (137, 0)


def test_live_span():
    plan = RingPlan(window=2048, kv_block_size=16, lookahead=8)
    assert plan.live_span(0) == (0, 8)
    assert plan.live_span(5000) == (5000 - 2047, 5008)
    assert first_visible_position(torch.tensor([0, 2047, 2048]), 2048).tolist() == [0, 0, 1]


# a ring's shape and a context length, for the live-block properties below
RING_SHAPES = {
    "window": st.integers(1, 300),
    "kv_block_size": st.integers(1, 40),
    "lookahead": st.integers(1, 40),
    "context_len": st.integers(0, 5000),
}


@settings(max_examples=300, deadline=None)
@given(**RING_SHAPES)
def test_live_blocks_map_to_distinct_physical_blocks(window, kv_block_size, lookahead, context_len):
    plan = RingPlan(window, kv_block_size, lookahead)
    logical = plan.live_blocks(context_len)
    assert len(logical) <= plan.ring_blocks
    assert len({j % plan.ring_blocks for j in logical}) == len(logical)


@settings(max_examples=300, deadline=None)
@given(**RING_SHAPES, data=st.data())
def test_live_ring_blocks_never_take_a_sink_column(window, kv_block_size, lookahead, context_len, data):
    plan = RingPlan(window, kv_block_size, lookahead, data.draw(st.integers(1, window), label="sink_tokens"))
    ns = plan.sink_blocks
    live = [j for j in plan.live_blocks(context_len) if j >= ns]
    columns = [block_column(j, plan.ring_blocks, ns) for j in live]
    assert len(set(columns)) == len(columns) and all(ns <= c < plan.row_blocks for c in columns)
    assert [block_column(j, plan.ring_blocks, ns) for j in range(ns)] == list(range(ns))


class RingSimulator:
    """Tracks which absolute position every ring slot holds, through the slot mappings of ``RingPlan``."""

    def __init__(self, plan: RingPlan, ring: torch.Tensor) -> None:
        self.plan, self.ring = plan, ring
        self.stored: dict[int, tuple[str, int]] = {}
        self.context_len = 0

    def write(self, positions: range, kind: str, seq_len: int | None) -> None:
        pos = torch.tensor(list(positions), dtype=torch.int64)
        slots = self.plan.slot_mapping(pos, self.ring, seq_len=seq_len)
        kept = slots[slots >= 0].tolist()
        assert len(kept) == len(set(kept)), "one launch writes a slot twice (parallel writers would race)"
        for p, s in zip(pos.tolist(), slots.tolist(), strict=True):
            if s >= 0:
                self.stored[s] = (kind, p)

    def assert_window_intact(self) -> None:
        """Every context position the next block's queries can see (its sinks too) is in its own slot."""
        lo = first_visible_position(self.context_len, self.plan.window)
        sinks = sinks_below_window(self.context_len, self.plan.window, self.plan.sink_tokens)
        pos = torch.cat([torch.arange(sinks), torch.arange(lo, self.context_len)])
        for p, s in zip(pos.tolist(), self.plan.slot_mapping(pos, self.ring).tolist(), strict=True):
            assert self.stored.get(s) == ("ctx", p), f"position {p} (slot {s}) holds {self.stored.get(s)}"


step = st.one_of(
    st.tuples(st.just("prefill"), st.integers(1, 700)),
    st.tuples(st.just("decode"), st.integers(1, 40), st.integers(0, 40), st.booleans()),
)


@settings(max_examples=150, deadline=None)
@given(
    window=st.integers(1, 200),
    kv_block_size=st.integers(1, 32),
    lookahead=st.integers(1, 33),
    steps=st.lists(step, min_size=1, max_size=25),
)
def test_random_step_sequences_never_overwrite_a_live_window(window, kv_block_size, lookahead, steps):
    """Prefill chunks of any size (larger than the ring too) and decode blocks with random rejections."""
    run_steps(RingPlan(window, kv_block_size, lookahead), steps)


@settings(max_examples=150, deadline=None)
@given(
    window=st.integers(1, 200),
    kv_block_size=st.integers(1, 32),
    lookahead=st.integers(1, 33),
    steps=st.lists(step, min_size=1, max_size=25),
    data=st.data(),
)
def test_random_step_sequences_never_overwrite_a_sink(window, kv_block_size, lookahead, steps, data):
    """The same steps over ``[sink blocks | ring]``: every sink and every live window position stays in its slot."""
    run_steps(RingPlan(window, kv_block_size, lookahead, data.draw(st.integers(1, window), label="sink_tokens")), steps)


def run_steps(plan: RingPlan, steps: list[tuple]) -> None:
    """``steps`` through a RingSimulator of a random row of ``plan``, the window checked after every write."""
    lookahead = plan.lookahead
    ring = torch.randperm(4 * plan.row_blocks)[: plan.row_blocks]
    sim = RingSimulator(plan, ring)
    for action in steps:
        if action[0] == "prefill":
            end = sim.context_len + action[1]
            sim.write(range(sim.context_len, end), "ctx", seq_len=end)
            sim.context_len = end
        else:
            block = min(action[1], lookahead)
            # the drafter's block K/V land at the future slots P..P+B-1 (vLLM style), then attention reads
            sim.write(range(sim.context_len, sim.context_len + block), "block", seq_len=None)
            sim.assert_window_intact()
            # the target verifies B rows; the accepted prefix becomes context, the rejected suffix is
            # either PAD (V2) or written anyway (V1 padded mode) and must not harm the window
            accepted = min(action[2], block - 1) + 1
            end = sim.context_len + accepted
            if action[3]:
                sim.write(range(end, sim.context_len + block), "rejected", seq_len=end)
            sim.write(range(sim.context_len, end), "ctx", seq_len=end)
            sim.context_len = end
        sim.assert_window_intact()


def test_last_writer_slots_keeps_the_later_row():
    from ringkv.kernels.ring_geometry import last_writer_slots

    slots = torch.tensor([5, 9, -1, 5, 7, 9, 5])
    assert last_writer_slots(slots).tolist() == [-1, -1, -1, -1, 7, 9, 5]
    assert last_writer_slots(torch.tensor([3])).tolist() == [3]
