# SPDX-License-Identifier: Apache-2.0
"""A shadow of what the drafter's ring holds, slot by slot, under vLLM's real ``Scheduler`` (no model), and the
checks that the ring only ever serves the K/V of the position and prefix a query asks for.

Each slot holds the *key* of what was written there: ``prefix_key(tokens[: p + 1])`` for a context row at position
``p`` (so a rejected draft's row has another key than the token committed there later), ``JUNK`` for a drafter
query row. Per scheduler step, in V1 DFlash's order: every request's context rows ``[s, e)`` through the worker's
block-table row (append-only, built from the ``SchedulerOutput``; a null entry stores nothing; a later row of the
step wins a slot it shares), then the drafter's query rows ``[c, c + la)`` (``c``: the committed count after the
step), then the reads: each request that sampled a token sees ``[c - (W - 1), c)`` (and, with sinks, ``[0, S)``)
and every one of those slots must hold its own prefix's key. The driver (``run``) samples drafts that differ from
the committed tokens, so a rejected row is never mistaken for a committed one.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any

from ringkv.bench.lab.simulation._vllm import DraftTokenIds, runner_output

JUNK = ("junk",)
# what a block holds once the pool hands it out again while some request's row still names it (a ring column that
# moved on released it): no read through the old entry may see anything (``watch_handouts``)
POISON = ("poison",)


class PrefixKeys:
    """``key(p)``: a chain hash of a token sequence's first ``p + 1`` tokens (equal iff the prefixes are)."""

    def __init__(self) -> None:
        self.chain: list[int] = []
        self.tokens: list[int] = []

    def keys(self, tokens: list[int]) -> list[int]:
        common = 0
        while common < min(len(tokens), len(self.tokens)) and tokens[common] == self.tokens[common]:
            common += 1
        del self.chain[common:], self.tokens[common:]
        for token in tokens[common:]:
            self.chain.append(hash((self.chain[-1] if self.chain else 0, token)))
            self.tokens.append(token)
        return self.chain


@dataclass
class RingAudit:
    """The shadow contents of one ring group (``group``: its index in the KV-cache config)."""

    group: int
    block_size: int
    window: int
    lookahead: int
    drafter_max_len: int
    # V1's runner skips the drafter (and its store) near the drafter's max length; Model Runner V2 never does
    runner_skips: bool = True
    # keys 0 .. sink_tokens - 1 every query sees besides its window (a windowed full-attention layer's sinks)
    sink_tokens: int = 0
    slots: dict[int, list[Any]] = field(default_factory=dict)  # block id -> per-slot key
    rows: dict[str, list[int]] = field(default_factory=dict)  # request id -> the worker's row (block ids)
    keys: dict[str, PrefixKeys] = field(default_factory=dict)
    # positions a step that skipped the drafter left unwritten, per request: its own later reads may see them (vLLM
    # drafts worse there), no other request may
    skipped: dict[str, set[int]] = field(default_factory=dict)
    reads_checked: int = 0
    hashes_checked: int = 0
    sink_reads_checked: int = 0
    # block id -> the logical block it was last hashed as
    hashed_as: dict[int, int] = field(default_factory=dict)
    # blocks handed out again while a row still named them, and how many of those in a schedule() that preempted
    poisoned: int = 0
    poisoned_beside_preemption: int = 0
    poisoned_this_schedule: int = 0

    def follow(self, output: Any) -> None:
        """Update the worker's rows as vLLM's worker does from a ``SchedulerOutput``."""
        if output.preempted_req_ids:
            self.poisoned_beside_preemption += self.poisoned_this_schedule
        self.poisoned_this_schedule = 0
        for new in output.scheduled_new_reqs:
            self.rows[new.req_id] = list(new.block_ids[self.group])
        cached = output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", ())  # 0.34 sends a resumed request as a new one
        for index, request_id in enumerate(cached.req_ids):
            ids = cached.new_block_ids[index]
            if request_id in resumed:
                self.rows[request_id] = list(ids[self.group]) if ids is not None else []
            elif ids is not None:
                self.rows[request_id].extend(ids[self.group])

    def slot(self, request_id: str, position: int) -> tuple[int, int] | None:
        row = self.rows[request_id]
        block = row[position // self.block_size] if position // self.block_size < len(row) else 0
        return None if block == 0 else (block, position % self.block_size)

    def store(self, request_id: str, position: int, key: Any) -> None:
        where = self.slot(request_id, position)
        if where is not None:
            self.slots.setdefault(where[0], [None] * self.block_size)[where[1]] = key

    def step(self, output: Any, requests: dict[str, Any], committed: dict[str, int], sampled: set[str]) -> None:
        """One scheduled step's writes and reads (``committed``: each request's count after the step). V1 runs no
        drafter for a batch whose longest sequence is within the lookahead of the drafter's max length."""
        longest = max(requests[request_id].num_computed_tokens for request_id in output.num_scheduled_tokens)
        if self.runner_skips and longest + self.lookahead > self.drafter_max_len:
            for request_id, scheduled in output.num_scheduled_tokens.items():
                end = requests[request_id].num_computed_tokens
                self.skipped.setdefault(request_id, set()).update(range(end - scheduled, end))
            return
        for request_id, scheduled in output.num_scheduled_tokens.items():
            request = requests[request_id]
            end = request.num_computed_tokens  # vLLM counts the scheduled tokens as computed at schedule time
            drafts = list(output.scheduled_spec_decode_tokens.get(request_id, ()))
            keys = self.keys.setdefault(request_id, PrefixKeys()).keys([*request.all_token_ids, *drafts])
            for position in range(end - scheduled, end):
                self.store(request_id, position, keys[position])
        for request_id in output.num_scheduled_tokens:
            for position in range(committed[request_id], committed[request_id] + self.lookahead):
                self.store(request_id, position, JUNK)
        for request_id in sampled:  # accepted drafts are the committed tokens: the schedule-time keys hold
            self.check_reads(request_id, committed[request_id])

    def check_reads(self, request_id: str, committed: int) -> None:
        keys = self.keys[request_id].chain
        own_holes = self.skipped.get(request_id, set())
        window_start = max(0, committed - (self.window - 1))
        sinks = range(min(self.sink_tokens, window_start))
        for position in [*sinks, *range(window_start, committed)]:
            if position in own_holes:
                continue
            where = self.slot(request_id, position)
            held = None if where is None else self.slots.get(where[0], [None] * self.block_size)[where[1]]
            assert held == keys[position], (
                f"request {request_id} reads position {position} (committed {committed}) from "
                f"{'no block' if where is None else f'block {where[0]} slot {where[1]}'}: it holds "
                f"{'another prefix or position' if held not in (None, JUNK) else held}"
            )
            self.reads_checked += 1
            self.sink_reads_checked += position < window_start

    def watch_handouts(self, block_pool: Any, live: Callable[[], Container[str]]) -> None:
        """Poison every block ``BlockPool.get_new_blocks`` hands out (to any group) while the ring row of a request
        still in the scheduler (``live()``) names it: that entry is dead (its column moved on and released the
        block), so no later read through it may find K/V there (the target's groups write blocks this shadow does
        not follow)."""
        get_new_blocks = block_pool.get_new_blocks

        def poisoning(num_blocks: int) -> list[Any]:
            blocks = get_new_blocks(num_blocks)
            running = live()
            named = {block for request_id, row in self.rows.items() if request_id in running for block in row}
            for block in blocks:
                if block.block_id in named:
                    self.slots[block.block_id] = [POISON] * self.block_size
                    self.poisoned += 1
                    self.poisoned_this_schedule += 1
            return blocks

        block_pool.get_new_blocks = poisoning

    def watch_hashing(self, block_pool: Any) -> None:
        """Check every block the ring group hashes (``BlockPool.cache_full_blocks``): each of its slots holds its
        logical block's position with the hashing request's committed prefix."""
        cache_full_blocks = block_pool.cache_full_blocks

        def checked(request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id, **kwargs):
            if kv_cache_group_id == self.group:
                mask = kwargs.get("block_mask") or [True] * (num_full_blocks - num_cached_blocks)
                keys = PrefixKeys().keys(list(request.all_token_ids))
                for j in range(num_cached_blocks, num_full_blocks):
                    if not mask[j - num_cached_blocks] or blocks[j].is_null:
                        continue
                    held = self.slots.get(blocks[j].block_id, [None] * block_size)
                    wanted = keys[j * block_size : (j + 1) * block_size]
                    assert held == wanted, (
                        f"request {request.request_id} hashes block {blocks[j].block_id} as logical block {j}, but it "
                        "holds other K/V"
                    )
                    self.hashes_checked += 1
                    self.hashed_as[blocks[j].block_id] = j
            return cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, block_size,
                                     kv_cache_group_id, **kwargs)  # fmt: skip

        block_pool.cache_full_blocks = checked


def run(
    scheduler: Any,
    audit: RingAudit,
    submit: Callable[[Any], None],
    rng: random.Random,
    vocab: int = 1000,
    on_step: Callable[[Any], None] | None = None,
    abort: Callable[[Any, int], list[str]] | None = None,
) -> int:
    """Drive ``scheduler`` until no request is left: drafts of random tokens, each accepted with probability 1/2
    in order; the first rejected position gets a bonus token unlike its draft. ``submit(scheduler)`` is called
    after every step (to add the next requests); ``abort(scheduler, step)`` names requests to abort. Returns the
    number of steps."""
    steps = 0
    while scheduler.requests:
        output = scheduler.schedule()
        assert output.num_scheduled_tokens, "nothing scheduled: the pool is too small for the waiting requests"
        steps += 1
        audit.follow(output)
        ids = list(output.num_scheduled_tokens)
        sampled_tokens, committed, sampled = [], {}, set()
        for request_id in ids:
            request = scheduler.requests[request_id]
            drafts = list(output.scheduled_spec_decode_tokens.get(request_id, ()))
            if request.num_computed_tokens < request.num_tokens:
                sampled_tokens.append([])
                committed[request_id] = request.num_computed_tokens
                continue
            accepted = 0
            while accepted < len(drafts) and rng.random() < 0.5:
                accepted += 1
            bonus = rng.randrange(3, vocab)
            if accepted < len(drafts) and bonus == drafts[accepted]:
                bonus = 3 + (bonus - 2) % (vocab - 3)
            sampled_tokens.append([*drafts[:accepted], bonus])
            committed[request_id] = request.num_computed_tokens - len(drafts) + accepted
            sampled.add(request_id)
        audit.step(output, scheduler.requests, committed, sampled)
        if on_step is not None:
            on_step(output)
        scheduler.update_from_output(output, runner_output(ids, sampled_tokens))
        running = [rid for rid in ids if rid in scheduler.requests]
        draft_len = scheduler.num_spec_tokens
        scheduler.update_draft_token_ids(
            DraftTokenIds(running, [[rng.randrange(3, vocab) for _ in range(draft_len)] for _ in running])
        )
        if abort is not None:
            aborted = abort(scheduler, steps)
            if aborted:
                scheduler.finish_requests(aborted, _finished_aborted())
        submit(scheduler)
    return steps


def _finished_aborted() -> Any:
    from ringkv.bench.lab.simulation._vllm import RequestStatus

    return RequestStatus.FINISHED_ABORTED
