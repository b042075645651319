# SPDX-License-Identifier: Apache-2.0
"""vLLM 0.34's engine (Model Runner V2's CPU runner, ``ci/vllm_cpu_shims.py``) serving trained drafters with
``RINGKV_DRAFTER_FULL_WINDOW`` = W and ``RINGKV_DRAFTER_FULL_SINKS`` = S: each full-attention drafter layer on the
ring with window W plus S sink tokens in ``ns = cdiv(S, bs)`` blocks beside its R ring blocks. The drafters of
``test_vllm_v2_full_window_engine.py``: DFlash's, all full attention, and a DFlash2 one mixing a sliding layer (W,
no sinks: a ring group of its own) and a full one. vLLM has no attention with sinks to compare with; the oracle is
the dense masked attention over the K/V vLLM stored for the drafter, kept by position (``drafter_oracle.py``), every
forward. Also: the target's tokens (as without speculation), at most ``ns + R`` blocks per request in the sink group
(exactly that once the context fills them) and R in the sliding one, and with prefix caching on the second turn's
hit past the rebuild cap (it adopts the first turn's sink block and window).

Each drafter with prefix caching off (one request) and on (a conversation's two turns, one after the other): four
engine runs, one at a time (one request at a time, so the probe's context rows are that request's by position
alone). Slow (not in CI): the command is ``VLLM_FIX`` with this file.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest

pytest.importorskip("vllm")

from ringkv.bench.lab.e2e.runner import (
    EngineRun,
    drafter_layer_names,
    held_blocks,
    held_blocks_per_group,
    request_index,
    run_engine,
)
from ringkv.dflash2.config import FULL
from ringkv.dflash2.harness.dflash2_models import build_dflash2_models
from ringkv.dflash2.harness.engine_models import FIRST_TOKEN, EngineModels, build_engine_models, chain_map, continuation
from ringkv.kernels.ring_geometry import ring_blocks_needed, sink_block_count
from ringkv.kernels.testing import FP32_ABS_BOUND

from tests.integration.drafter_oracle import drafter_forwards, stored_history_oracle
from tests.integration.test_vllm_v2_full_window_engine import (  # the fixture, requested by name in pytestmark
    BLOCK,
    DFLASH,
    MIXED,
    WINDOW,
    chain_prompt,
    engine_spec,
    v2_engine,  # noqa: F401
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.usefixtures("v2_engine")]

SINKS = 5  # not a multiple of the block: the sink block holds positions 5 .. 31 too, which only the window shows
SINK_BLOCKS = sink_block_count(SINKS, BLOCK)
PROMPT = 300  # prefix caching off: one request, past W many times
REPLY = 40
FIRST_TURN, TAIL = 6 * WINDOW + 20, 8  # prefix caching on: the second turn is the first's prompt + reply + TAIL
LAYER_TYPES = {"dflash": (FULL,) * DFLASH.drafter_layers, "mixed": MIXED.layer_types}


@pytest.fixture(scope="module")
def runs(pytestconfig, tmp_path_factory) -> dict[str, Any]:
    """(drafter, caching) -> its run with sinks; "models" and "chains" per drafter."""
    cache = getattr(pytestconfig, "cache", None)
    folder = cache.mkdir("v2-full-window-models") if cache else tmp_path_factory.mktemp("v2-full-window-models")
    dflash2_folder = cache.mkdir("dflash2-engine-models") if cache else folder
    models = {"dflash": build_engine_models(folder / "dflash-full", DFLASH),
              "mixed": build_dflash2_models(dflash2_folder / "mixed", MIXED)}  # fmt: skip
    chains = {name: chain_map(m) for name, m in models.items()}
    result: dict[str, Any] = {"models": models, "chains": chains}
    for name, m in models.items():
        generator, vocab = random.Random(11), m.spec.vocab_size
        # a trained drafter may accept every draft after a chain tail (DFlash's does; the mixed one did on this
        # prompt): random prompts but the mixed drafter's first turn, so drafts are rejected, whose rows V2 hands
        # the context store at position 0 with PAD
        tail = name == "mixed"
        plain = engine_spec(m, [chain_prompt(chains[name], generator, PROMPT, vocab, False)])
        turn = [generator.randrange(FIRST_TOKEN, vocab - 1) for _ in range(TAIL)]
        first = chain_prompt(chains[name], generator, FIRST_TURN, vocab, tail)
        caching = engine_spec(m, [first], later_waves=[[turn]], continued_slots=[0], enable_prefix_caching=True)
        for mode, spec in (("off", plain), ("on", caching)):
            sinks = {"RINGKV_DRAFTER_FULL_WINDOW": str(WINDOW), "RINGKV_DRAFTER_FULL_SINKS": str(SINKS)}
            result[name, mode] = launch(m, replace(spec, max_tokens=REPLY, environment={**spec.environment, **sinks}))
    return result


def launch(models: EngineModels, spec: Any) -> EngineRun:
    layers = drafter_layer_names(models.spec.target_layers, models.spec.drafter_layers)
    return run_engine(spec, drafter_layers=layers, record_inputs=True, timeout=1800)


CASES = [pytest.param(name, mode, id=f"{name}-prefix-caching-{mode}") for name in ("dflash", "mixed")
         for mode in ("off", "on")]  # fmt: skip


def layer_sinks(run: EngineRun) -> dict[str, int]:
    """The sink tokens each drafter layer's forwards served with (one value per layer, asserted)."""
    served: dict[str, set[int]] = {}
    for layer, event, _, _ in drafter_forwards(run):
        served.setdefault(layer, set()).add(event.sink_tokens)
    assert all(len(values) == 1 for values in served.values()), served
    return {layer: values.pop() for layer, values in served.items()}


@pytest.mark.parametrize(("name", "mode"), CASES)
def test_the_sink_group_holds_its_blocks_beside_the_ring_and_the_tokens_are_the_targets(runs, name, mode):
    run, models = runs[name, mode], runs["models"][name]
    assert run.tokens == [continuation(runs["chains"][name], p, REPLY) for p in run.prompts], "no speculation's"
    counters = run.spec_decode
    assert counters["drafts"] > 5 and 0 < counters["accepted"] < counters["draft_tokens"], counters
    layers = drafter_layer_names(models.spec.target_layers, models.spec.drafter_layers)
    sinks = layer_sinks(run)
    full = {layer for layer, kind in zip(layers, LAYER_TYPES[name], strict=True) if kind == FULL}
    assert sinks == {layer: SINKS if layer in full else 0 for layer in layers}, sinks
    group_of = {layer: index for index, (_, members) in enumerate(run.scheduler["kv_cache_groups"])
                for layer in members}  # fmt: skip
    assert {run.scheduler["kv_cache_groups"][group_of[layer]][0] for layer in layers} == {"RingSWASpec"}
    r = ring_blocks_needed(WINDOW, BLOCK, lookahead=models.spec.draft_block)
    assert r == 4
    limits = {group_of[layer]: SINK_BLOCKS * bool(sinks[layer]) + r for layer in layers}
    steps = [(held_blocks(run)[i][request][0], groups) for i, step in enumerate(held_blocks_per_group(run))
             for request, groups in step.items()]  # fmt: skip
    assert len(steps) > 10
    for group, limit in limits.items():
        held = [groups[group] for _, groups in steps]
        assert max(held) == limit, (group, held)
        assert {groups[group] for computed, groups in steps if computed >= limit * BLOCK} == {limit}, group
    assert run.leaked_blocks == 0 and run.preemptions == 0
    print(f"{name}, prefix caching {mode}: {counters}; drafter blocks max {limits} (group: blocks); "  # noqa: T201
          f"wall {run.wall_seconds:.0f} s")  # fmt: skip


@pytest.mark.parametrize(("name", "mode"), CASES)
def test_every_drafter_forward_equals_the_sink_masked_oracle(runs, name, mode):
    """Every forward of every drafter layer equals the dense oracle over the K/V vLLM stored, masked by its window
    and sinks (``k < S or q - k < W``; the sliding layer: no sinks); a sink layer's forwards past the window differ
    from the oracle without sinks (the sinks are read)."""
    run = runs[name, mode]
    compared, past_window = 0, 0
    for layer, event, got, history in drafter_forwards(run):
        assert event.window == WINDOW, (layer, event.window)
        worst = (got - stored_history_oracle(event, history, WINDOW, event.sink_tokens)).abs().max().item()
        assert worst <= FP32_ABS_BOUND, f"{layer} forward {compared}: |ring - sink oracle| = {worst:.3e}"
        compared += 1
        if event.sink_tokens and int(event.seq_lens[0]) - event.q.shape[0] >= WINDOW:
            past_window += 1
            unsunk = (got - stored_history_oracle(event, history, WINDOW, 0)).abs().max().item()
            assert unsunk > 100 * FP32_ABS_BOUND, f"{layer} forward {compared}: the sinks changed nothing"
    models = runs["models"][name]
    layers = drafter_layer_names(models.spec.target_layers, models.spec.drafter_layers)
    assert compared == sum(run.forward_calls[layer] for layer in layers) > 10
    assert past_window > 10
    print(f"{name}, prefix caching {mode}: {compared} drafter forwards equal the sink oracle, "  # noqa: T201
          f"{past_window} of a sink layer's past W")  # fmt: skip


def test_with_sinks_the_second_turn_adopts_the_sink_block_and_window(runs):
    """Prefix caching on: the second turn's hit passes the rebuild cap ``N - (W - 1)`` (a hit that left the sink
    block to recompute would be 0), each drafter."""
    for name in ("dflash", "mixed"):
        run = runs[name, "on"]
        hits = {request_index(a.request_id): (a.hit, a.num_tokens) for a in run.admissions}
        assert sorted(hits) == [0, 1] and hits[0][0] == 0, hits
        hit, num_tokens = hits[1]
        assert num_tokens == FIRST_TURN + REPLY + TAIL and hit > num_tokens - (WINDOW - 1), hits
        print(f"{name}: second turn of {num_tokens} tokens hits {hit}; {run.prefix_cache}")  # noqa: T201
