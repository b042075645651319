# SPDX-License-Identifier: Apache-2.0
"""vLLM #55800 on vLLM's own ``KVCacheManager`` (coordinator, ``BlockPool``, per-group managers), stock
``SlidingWindowSpec`` against ``RingSWASpec``: admission, the largest admissible prompt, and the drafter
blocks held through a chunked prefill plus speculative decode steps with random rejections."""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from ringkv.integration.vllm import register
from ringkv.integration.vllm.ring_spec import RingSWASpec
from ringkv.kernels.testing import ISSUE_55800, DrafterShape

from ._vllm import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    Request,
    SamplingParams,
    SlidingWindowSpec,
)

# vLLM's request block hasher: request -> the hashes of its newly full blocks
BlockHasher = Callable[[Request], list[Any]]


@dataclass(frozen=True)
class Deployment:
    """The KV-cache shape of a DFlash2 deployment (defaults: vLLM #55800)."""

    pool_blocks: int = 1012
    target_groups: int = 6
    target_kv_block_size: int = 2304
    drafter: DrafterShape = ISSUE_55800
    max_model_len: int = 262_144
    max_num_batched_tokens: int = 8192
    async_scheduling: bool = True
    # the non-ring drafter: "sliding" (vLLM's SlidingWindowSpec) or "full" (every token kept, as vLLM does
    # when the hybrid KV-cache manager is off)
    stock_drafter: str = "sliding"
    max_num_seqs: int = 16
    prefix_caching: bool = False
    # the ring's blocks in vLLM's prefix cache (RingSWASpec.cache_ring); False: every hit capped to rebuild the ring
    cache_ring: bool = False
    # a mixed drafter (issue 38): a full-attention group beside the sliding one, windowed on the ring to
    # full_window keys (RINGKV_DRAFTER_FULL_WINDOW); vLLM's FullAttentionSpec in the stock drafter; 0: no such group
    full_window: int = 0
    # the ring's sink tokens (a windowed full-attention drafter layer's: RingSWASpec.sink_tokens): the full group's
    # with full_window, else the one drafter group's
    sink_tokens: int = 0

    @property
    def max_in_flight_tokens(self) -> int:
        """vLLM's ``max_concurrent_batches * max_num_batched_tokens`` (2 batches with async scheduling)."""
        return (2 if self.async_scheduling else 1) * self.max_num_batched_tokens

    def drafter_spec(self, ring: bool) -> FullAttentionSpec | SlidingWindowSpec:
        fields = {
            "block_size": self.drafter.kv_block_size,
            "num_kv_heads": self.drafter.num_kv_heads,
            "head_size": self.drafter.head_dim,
            "dtype": torch.bfloat16,
            "sliding_window": self.drafter.window,
        }
        if ring:
            return RingSWASpec(**fields, lookahead=self.drafter.lookahead, cache_ring=self.cache_ring,
                               sink_tokens=0 if self.full_window else self.sink_tokens)  # fmt: skip
        if self.stock_drafter == "full":
            del fields["sliding_window"]
            return FullAttentionSpec(**fields)
        return SlidingWindowSpec(**fields)

    def full_drafter_spec(self, ring: bool) -> FullAttentionSpec | RingSWASpec:
        """A mixed drafter's full-attention group: vLLM's ``FullAttentionSpec`` (stock), or on the ring a window of
        ``full_window`` plus ``sink_tokens`` sinks, as ``full_window.windowed_drafter_full_layers`` plans it."""
        fields = {"block_size": self.drafter.kv_block_size, "num_kv_heads": self.drafter.num_kv_heads,
                  "head_size": self.drafter.head_dim, "dtype": torch.bfloat16}  # fmt: skip
        if not ring:
            return FullAttentionSpec(**fields)
        return RingSWASpec(**fields, sliding_window=self.full_window, lookahead=self.drafter.lookahead,
                           cache_ring=self.cache_ring, sink_tokens=self.sink_tokens)  # fmt: skip

    @property
    def drafter_ring_blocks(self) -> int:
        """R over the drafter's groups on the ring (the sliding group's, plus a windowed full group's)."""
        full = self.full_drafter_spec(ring=True).plan.ring_blocks if self.full_window else 0
        return self.drafter.plan.ring_blocks + full

    def drafter_group_ids(self) -> range:
        """The drafter's KV-cache groups, after the target's: a mixed drafter's full group, then the sliding group
        (always the last)."""
        return range(self.target_groups, self.target_groups + 1 + bool(self.full_window))

    def kv_cache_config(self, ring: bool) -> KVCacheConfig:
        target = FullAttentionSpec(block_size=self.target_kv_block_size, num_kv_heads=self.drafter.num_kv_heads,
                                   head_size=self.drafter.head_dim, dtype=torch.bfloat16)  # fmt: skip
        groups = [KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"], target) for i in range(self.target_groups)]
        if self.full_window:
            groups.append(KVCacheGroupSpec(["drafter.layers.1.self_attn.attn"], self.full_drafter_spec(ring)))
        groups.append(KVCacheGroupSpec(["drafter.layers.0.self_attn.attn"], self.drafter_spec(ring)))
        return KVCacheConfig(num_blocks=self.pool_blocks, kv_cache_tensors=[], kv_cache_groups=groups)

    def manager(self, ring: bool) -> KVCacheManager:
        register()
        return KVCacheManager(
            self.kv_cache_config(ring),
            max_model_len=self.max_model_len,
            scheduler_block_size=self.target_kv_block_size,
            hash_block_size=self.drafter.kv_block_size,
            max_in_flight_tokens=self.max_in_flight_tokens,
            enable_caching=self.prefix_caching,
        )


def make_request(
    request_id: str, prompt: int | list[int], max_tokens: int = 1 << 20, block_hasher: BlockHasher | None = None
) -> Request:
    """A request of ``prompt`` token ids (or that many 1s); ``block_hasher`` (vLLM's, with prefix caching on)
    hashes its blocks as tokens arrive, as the engine's does."""
    tokens = [1] * prompt if isinstance(prompt, int) else prompt
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, tokens, params, None, block_hasher=block_hasher)


def drafter_manager(manager: KVCacheManager, group_id: int = -1):
    """A drafter group's single-type manager (default: the sliding group, the last)."""
    return manager.coordinator.single_type_managers[group_id]


def held_rows(manager: KVCacheManager, group_id: int = -1) -> dict[str, list]:
    """Per request, a drafter group's blocks it holds a reference to (default: the sliding group's): a ring's
    claimed columns (None until claimed; its row may still name a block it replaced, as the worker's row does),
    else the row."""
    group = drafter_manager(manager, group_id)
    rings = getattr(group, "rings", None)
    if rings is None:
        return group.req_to_blocks
    return {request_id: ring.claimed() for request_id, ring in rings.items()}


def drafter_blocks_held(manager: KVCacheManager, request_id: str) -> int:
    """Distinct physical (non-null) blocks the drafter group holds for a request."""
    return len({block.block_id for block in held_rows(manager).get(request_id, []) if not block.is_null})


def drafter_blocks_in_use(manager: KVCacheManager, group_id: int = -1) -> int:
    """Distinct physical (non-null) blocks a drafter group (default: the sliding one) holds for all requests
    together (a block two requests share through the prefix cache counts once)."""
    rows = held_rows(manager, group_id).values()
    return len({block.block_id for row in rows for block in row if not block.is_null})


def admits(deployment: Deployment, ring: bool, num_tokens: int) -> bool:
    """Does a fresh pool admit an ``num_tokens`` prompt (first chunk, ``full_sequence_must_fit``)?"""
    manager = deployment.manager(ring)
    request = make_request("probe", num_tokens)
    chunk = min(deployment.max_num_batched_tokens, num_tokens)
    blocks = manager.allocate_slots(
        request, chunk, num_lookahead_tokens=deployment.drafter.lookahead, full_sequence_must_fit=True
    )
    return blocks is not None


def largest_satisfying(predicate: Callable[[int], bool], upper: int) -> int:
    """The largest ``n`` in ``1..upper`` with ``predicate(n)`` for a predicate true up to some point and false
    after it (bisection); 0 if ``predicate(1)`` is false."""
    return bisect.bisect_left(range(1, upper + 1), True, key=lambda n: not predicate(n))


def largest_admissible(deployment: Deployment, ring: bool) -> int:
    """The longest prompt a fresh pool admits (admission is monotone in the prompt length); 0 if none."""
    return largest_satisfying(lambda n: admits(deployment, ring, n), deployment.max_model_len)


@dataclass
class StepRecord:
    """One scheduler step of one request."""

    step: int
    kind: str  # "prefill" or "decode"
    computed: int  # context_len tokens after the step
    drafter_blocks: int
    free_blocks: int


@dataclass
class RunResult:
    admitted: bool
    steps: list[StepRecord] = field(default_factory=list)
    failure: str | None = None
    free_before: int = 0
    free_after: int = 0


def _check_ring_row(manager: KVCacheManager, request_id: str, context_len: int, deployment: Deployment) -> None:
    """Every live logical block on a non-null, distinct physical block of the request's ring."""
    row = drafter_manager(manager).req_to_blocks[request_id]
    live = [row[j] for j in deployment.drafter.plan.live_blocks(context_len) if j < len(row)]
    if any(block.is_null for block in live):
        raise AssertionError(f"{request_id}: a live drafter block is the null block (context_len={context_len})")
    if len({block.block_id for block in live}) != len(live):
        raise AssertionError(
            f"{request_id}: two live logical blocks share a physical block (context_len={context_len})"
        )


def run_requests(
    deployment: Deployment,
    ring: bool,
    prompts: list[int],
    decode_steps: int,
    seed: int = 0,
    on_step: Callable[[StepRecord], None] | None = None,
) -> RunResult:
    """Requests of the given prompt lengths in one fresh pool, advanced round-robin: chunked prefill
    (``max_num_batched_tokens`` chunks), then speculative decode steps accepting a random 0..N drafts each.
    Every request is freed at the end; ``free_after`` must equal ``free_before``."""
    rng = random.Random(seed)
    manager = deployment.manager(ring)
    requests = [make_request(f"r{i}", n) for i, n in enumerate(prompts)]
    schedules = [_schedule(deployment, n, decode_steps, rng) for n in prompts]
    result = RunResult(admitted=False, free_before=manager.block_pool.get_num_free_blocks())
    step = 0
    active = list(range(len(requests)))
    while active and result.failure is None:
        for index in list(active):
            request = requests[index]
            item = next(schedules[index], None)
            if item is None:
                active.remove(index)
                continue
            kind, num_new, accept = item
            first = request.num_computed_tokens == 0
            blocks = manager.allocate_slots(
                request, num_new, num_lookahead_tokens=deployment.drafter.lookahead, full_sequence_must_fit=first
            )
            if blocks is None:
                result.failure = f"{request.request_id} step {step} ({kind}, {num_new} tokens): allocate_slots -> None"
                break
            result.admitted = True
            request.num_computed_tokens += accept
            if kind == "decode":
                # the sampled tokens: the accepted drafts plus the bonus token
                request.append_output_token_ids([1] * accept)
            elif request.num_computed_tokens == request.num_prompt_tokens:
                # the prefill's last chunk samples the first output token
                request.append_output_token_ids([1])
            if ring:
                _check_ring_row(manager, request.request_id, request.num_computed_tokens, deployment)
            record = StepRecord(step, kind, request.num_computed_tokens,
                                drafter_blocks_held(manager, request.request_id),
                                manager.block_pool.get_num_free_blocks())  # fmt: skip
            result.steps.append(record)
            if on_step is not None:
                on_step(record)
            step += 1
    for request in requests:
        manager.free(request)
    result.free_after = manager.block_pool.get_num_free_blocks()
    return result


def run_request(deployment: Deployment, ring: bool, num_prompt_tokens: int, decode_steps: int, seed: int = 0,
                on_step: Callable[[StepRecord], None] | None = None) -> RunResult:  # fmt: skip
    """One request through chunked prefill and ``decode_steps`` speculative steps."""
    return run_requests(deployment, ring, [num_prompt_tokens], decode_steps, seed, on_step)


def _schedule(deployment: Deployment, num_prompt: int, decode_steps: int, rng: random.Random) -> Iterator[tuple]:
    """(kind, tokens scheduled, tokens context_len) per step."""
    computed = 0
    while computed < num_prompt:
        chunk = min(deployment.max_num_batched_tokens, num_prompt - computed)
        computed += chunk
        yield "prefill", chunk, chunk
    for _ in range(decode_steps):
        # the last sampled token plus N drafts are verified; 1 + accepted drafts are context_len
        drafts = deployment.drafter.num_speculative_tokens
        yield "decode", 1 + drafts, 1 + rng.randint(0, drafts)


def max_concurrent(deployment: Deployment, ring: bool, num_tokens: int, decode_steps: int = 2) -> int:
    """The most ``num_tokens`` requests that run to completion together in one pool (interleaved prefill and
    decode, nothing preempted): doubling to an upper bound, then bisection."""

    def fits(count: int) -> bool:
        return run_requests(deployment, ring, [num_tokens] * count, decode_steps).failure is None

    upper = 1
    while fits(upper):
        upper *= 2
    return largest_satisfying(fits, upper)
