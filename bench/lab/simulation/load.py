# SPDX-License-Identifier: Apache-2.0
"""A stream of requests through vLLM's real ``Scheduler`` (no model): conversations whose turns re-send the whole
history (``workloads.py``), each turn arriving when the one before finishes. A fake model samples
(``fake_sample``: random acceptance, one generator per request, so a request draws the same acceptances
whatever the pool does to it). Counts what the pool costs the target: preemptions, tokens computed beyond the
least (in all and per turn), steps, concurrency, drafter blocks held, prefix-cache hits, and what the prefix
cache holds (``census.py``): evictions, the drafter's unheld hashed blocks, conversations with cached target
blocks. With a ``kv_transfer_config`` (``offloading.enable_offloading``) vLLM's ``OffloadingConnector`` runs
beside the prefix cache (``offloading.Offloading``) and the tokens it loads are counted. Per step, per request and
per drafter group, the blocks held against a ring group's bound, and at the end the blocks not back in the pool
(``drafter_groups.py``)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
from ringkv.kernels.ring_geometry import longest_rebuilding_prefix_hit

from ._vllm import DraftTokenIds, Request, SchedulerOutput, VllmConfig, runner_output
from .admission import Deployment, drafter_blocks_in_use, make_request
from .census import CacheCensus
from .drafter_groups import DrafterGroupWatch, leaked_blocks
from .offloading import Offloading
from .scheduler_run import fake_sample, make_scheduler, request_block_hasher
from .workloads import Conversation


class PoolTooSmall(RuntimeError):
    """A step scheduled nothing: the empty pool cannot hold a waiting request."""


@dataclass
class LoadResult:
    """Totals over a run. ``computed_tokens``: target tokens computed and kept (scheduled minus rejected drafts,
    every step); ``distinct_tokens``: the distinct prefixes among the requests' computed tokens (each request's
    first ``num_computed_tokens`` at finish), what a target with an unbounded token-exact cache would compute.
    ``turn_recompute_*``: over the turns after a conversation's first, the target tokens a turn computes beyond
    what is new to it (its tokens past the previous turn's computed ones), nearest-rank percentiles. The cache
    counts are ``census.CacheCensus``'s. ``prefix_hit_tokens``: what admissions started from (the local prefix
    cache's hit plus what a connector loaded); ``offload_loaded_tokens``: the connector's part;
    ``offload_offers_past_cap``: the connector's answers reaching past the ring's rebuild cap (``N - (W - 1)``
    with the local hit; the ring's connector wrap must keep it 0, stock has no such cap). ``sliding_*`` / ``full_*``:
    the drafter's sliding group and a mixed drafter's full-attention group (0 without one), ``DrafterGroupWatch``'s
    most blocks one request held at a step and the ring's bound ``ns + R`` (0: a stock group, no bound);
    ``requests_over_bound``: (step, request, group) triples above it; ``leaked_blocks``: not back in the pool."""

    requests: int = 0
    steps: int = 0
    preemptions: int = 0
    computed_tokens: int = 0
    distinct_tokens: int = 0
    later_turns: int = 0
    turn_recompute_p50: int = 0
    turn_recompute_p99: int = 0
    peak_running: int = 0
    running_summed: int = 0  # requests running (admitted, holding KV), summed over steps
    peak_drafter_blocks: int = 0  # distinct drafter blocks the requests hold (shared ones once), every drafter group
    drafter_blocks_summed: int = 0
    prefix_hit_tokens: int = 0
    offload_loaded_tokens: int = 0
    offload_offers_past_cap: int = 0
    target_evictions: int = 0
    drafter_evictions: int = 0
    unheld_drafter_blocks_end: int = 0
    unheld_drafter_blocks_peak: int = 0
    conversations_cached_end: int = 0
    conversations_cached_at_peak: int = 0
    # max over steps of unheld hashed drafter blocks - R x conversations with cached target blocks
    share_excess_peak: int = 0
    sliding_peak_per_request: int = 0
    sliding_bound: int = 0
    full_peak_per_request: int = 0
    full_bound: int = 0
    requests_over_bound: int = 0
    leaked_blocks: int = 0

    @property
    def mean_running(self) -> float:
        return self.running_summed / self.steps if self.steps else 0.0

    @property
    def mean_drafter_blocks(self) -> float:
        return self.drafter_blocks_summed / self.steps if self.steps else 0.0

    @property
    def recomputed_tokens(self) -> int:
        """Target tokens computed beyond ``distinct_tokens``: preempted work redone, history re-sent and not
        (or not wholly) served by the prefix cache."""
        return self.computed_tokens - self.distinct_tokens


@dataclass
class Live:
    """A request in flight: its generator, conversation and turn, the target tokens computed for it so far and
    the tokens of its prompt an earlier turn of its conversation computed."""

    request: Request
    rng: random.Random
    conversation: int
    turn: int
    known: int
    computed: int = 0


def run_load(
    config: VllmConfig, deployment: Deployment, ring: bool, conversations: list[Conversation], seed: int = 0
) -> LoadResult:
    """Every conversation's first turn queued at once, each later turn added when the one before finishes; runs
    until all have finished; ``PoolTooSmall`` if a step schedules nothing and starts no load."""
    scheduler = make_scheduler(config, deployment, ring)
    offloading = Offloading(scheduler) if config.kv_transfer_config is not None else None
    manager = scheduler.kv_cache_manager
    census = CacheCensus(manager.block_pool, deployment.drafter_group_ids(), deployment.drafter_ring_blocks)
    groups = DrafterGroupWatch(manager, deployment.drafter_group_ids())
    hasher = request_block_hasher(config, deployment)
    drafts = deployment.drafter.num_speculative_tokens
    live: dict[str, Live] = {}
    finished: list[Request] = []
    turn_recompute: list[int] = []

    def submit(conversation: int, turn: int, history: list[int], known: int) -> None:
        rid = f"c{conversation}t{turn}"
        spec = conversations[conversation]
        request = make_request(rid, [*history, *spec.turns[turn]], spec.max_tokens[turn], hasher)
        live[rid] = Live(request, random.Random(f"{seed}/{rid}"), conversation, turn, known)
        scheduler.add_request(request)

    for index in range(len(conversations)):
        submit(index, 0, [], 0)
    result = LoadResult()
    while live:
        output = scheduler.schedule()
        connector_output, loading = offloading.step(output) if offloading else (None, False)
        if not output.num_scheduled_tokens and not loading:
            raise PoolTooSmall(f"step {result.steps}: nothing scheduled with {len(live)} requests waiting; the "
                               f"{deployment.pool_blocks}-block pool cannot hold one of them")  # fmt: skip
        result.steps += 1
        result.preemptions += len(output.preempted_req_ids)
        result.prefix_hit_tokens += admitted_hits(output)
        result.peak_running = max(result.peak_running, len(scheduler.running))
        result.running_summed += len(scheduler.running)
        held = sum(drafter_blocks_in_use(manager, group) for group in deployment.drafter_group_ids())
        result.peak_drafter_blocks = max(result.peak_drafter_blocks, held)
        result.drafter_blocks_summed += held
        groups.observe()
        ids = list(output.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            drafted = len(output.scheduled_spec_decode_tokens.get(rid, ()))
            tokens = fake_sample(live[rid].request, drafted, live[rid].rng)
            rejected = drafted - (len(tokens) - 1) if drafted else 0
            live[rid].computed += output.num_scheduled_tokens[rid] - rejected
            sampled.append(tokens)
        scheduler.update_from_output(output, runner_output(ids, sampled, connector_output))
        scheduler.update_draft_token_ids(DraftTokenIds(ids, [[1] * drafts for _ in ids]))
        for rid in ids:
            entry = live[rid]
            census.own(entry.request, entry.conversation)
            if not entry.request.is_finished():
                continue
            del live[rid]
            request = entry.request
            finished.append(request)
            result.computed_tokens += entry.computed
            if entry.turn:
                turn_recompute.append(entry.computed - (request.num_computed_tokens - entry.known))
            if entry.turn + 1 < len(conversations[entry.conversation].turns):
                history = list(request.all_token_ids)
                submit(entry.conversation, entry.turn + 1, history, min(request.num_computed_tokens, len(history)))
        census.observe()
    result.requests = len(finished)
    if offloading:
        window = deployment.drafter.window
        result.offload_loaded_tokens = offloading.loaded_tokens
        result.offload_offers_past_cap = sum(local + offered > longest_rebuilding_prefix_hit(tokens, window)
                                             for tokens, local, offered in offloading.offers if offered)  # fmt: skip
    result.distinct_tokens = distinct_prefixes([computed_sequence(r, i) for i, r in enumerate(finished)])
    result.later_turns = len(turn_recompute)
    result.turn_recompute_p50, result.turn_recompute_p99 = (nearest_rank(turn_recompute, q) for q in (50, 99))
    result.target_evictions, result.drafter_evictions = census.evictions["target"], census.evictions["drafter"]
    result.unheld_drafter_blocks_end, result.conversations_cached_end = census.observe()
    result.unheld_drafter_blocks_peak = census.peak_unheld
    result.conversations_cached_at_peak = census.conversations_at_peak
    result.share_excess_peak = census.peak_excess
    *full, sliding = groups.groups
    result.sliding_peak_per_request, result.sliding_bound = sliding.peak_per_request, sliding.bound or 0
    if full:
        result.full_peak_per_request, result.full_bound = full[0].peak_per_request, full[0].bound or 0
    result.requests_over_bound = sum(group.over_bound for group in groups.groups)
    result.leaked_blocks = leaked_blocks(manager)
    return result


def nearest_rank(values: list[int], percent: int) -> int:
    """The nearest-rank percentile (a value of the list; 0 for an empty list)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(percent / 100 * len(ordered)) - 1)] if ordered else 0


def admitted_hits(output: SchedulerOutput) -> int:
    """Prefix-cache hit tokens of the requests a ``SchedulerOutput`` admits (new, or resumed after preemption):
    their ``num_computed_tokens`` before the step."""
    cached = output.scheduled_cached_reqs
    # resumed among the cached ones up to 0.33; 0.34 re-sends a resumed request in full, as a new one
    resumed_ids = getattr(cached, "resumed_req_ids", set())
    resumed = sum(n for rid, n in zip(cached.req_ids, cached.num_computed_tokens, strict=True) if rid in resumed_ids)
    return resumed + sum(new.num_computed_tokens for new in output.scheduled_new_reqs)


def computed_sequence(request: Request, index: int) -> list[int]:
    """The tokens whose K/V the target computed for a finished request: its first ``num_computed_tokens``;
    drafts verified past the stop (beyond its tokens) stand as tokens of its own (``-1 - index``)."""
    tokens = list(request.all_token_ids[: request.num_computed_tokens])
    return tokens + [-1 - index] * (request.num_computed_tokens - len(tokens))


def distinct_prefixes(sequences: list[list[int]]) -> int:
    """The number of distinct non-empty prefixes (nodes of the sequences' trie): the sum of lengths less, in
    sorted order, each sequence's common prefix with the one before."""
    ordered = sorted(sequences)
    shared = sum(common_prefix(a, b) for a, b in pairwise(ordered))
    return sum(map(len, ordered)) - shared


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n
