# SPDX-License-Identifier: Apache-2.0
"""vLLM 0.34's engine (Model Runner V2's CPU runner, ``ci/vllm_cpu_shims.py``) serving trained drafters with
``RINGKV_DRAFTER_FULL_WINDOW`` = W: the drafter's full-attention layers go on the ring with window W. Two drafters:
DFlash's whose layers are all full attention, and a DFlash2 drafter mixing a sliding layer (W) and a full one.
The oracle is the same checkpoint declared sliding with window W in every layer, on the ring ("declared"): greedy
tokens (the target's own, as without speculation), spec-decode counters, every drafter attention output (forward by
forward, bitwise: the same kernels over the same ring), drafter blocks held at every step (<= R) and, with prefix
caching on, every request's prefix hit must equal it. Prefix caching off and on (a conversation's second turn and a
request sharing an earlier one's prefix), each drafter: eight engine runs.

Each engine run in its own process, two at a time.

Slow (not in CI; CI's V2 smoke has one windowed run: ``test_vllm_v2_ci_smoke.py``). The command is ``VLLM_FIX``.
"""

from __future__ import annotations

import json
import random
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from ringkv.bench.lab.e2e.runner import EngineRun, drafter_layer_names, held_blocks, request_index, run_engine
from ringkv.bench.lab.e2e.worker import EngineRunSpec
from ringkv.dflash2.config import FULL, SLIDING
from ringkv.dflash2.harness.dflash2_models import DFlash2ModelSpec, build_dflash2_models
from ringkv.dflash2.harness.engine_models import (
    FIRST_TOKEN,
    EngineModels,
    EngineModelSpec,
    build_engine_models,
    chain_map,
    continuation,
)
from ringkv.kernels.ring_geometry import ring_blocks_needed

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

VLLM_FIX = (
    "build vLLM 0.34's env and run these tests in it: .venv/bin/nox -s 'vllm(0.34.0)' --install-only, then "
    "VLLM_TARGET_DEVICE=cpu TRITON_INTERPRET=1 PYTHONPATH=ci .nox/vllm-0-34-0/bin/python -m pytest "
    "-p vllm_cpu_shims -n 0 -m slow tests/integration/test_vllm_v2_full_window_engine.py"
)
ENGINE_VLLM = ("vllm", "0.34.0")
DFLASH = EngineModelSpec(drafter_window=None)  # every drafter layer full attention; N 7
MIXED = DFlash2ModelSpec(layer_types=(SLIDING, FULL))  # N 3, its sliding layer's window 64
WINDOW = 64  # W: the mixed drafter's own window (the option may not go below it)
BLOCK = 32
MAX_TOKENS = 12
PROMPTS = (300, 97, 200)  # one wave, prefix caching off: the first runs past W many times
# prefix caching on: wave 1 a conversation's first turn and a request of SHARED tokens; wave 2 the second turn (the
# first's prompt + reply + TAIL: TAIL < BLOCK, see test_vllm_v2_dflash2_engine.py) and a request sharing SHARED
FIRST_TURN, SHARED, TAIL = 6 * WINDOW + 20, 4 * WINDOW + 10, 8


@pytest.fixture(scope="module")
def v2_engine(pytestconfig) -> None:
    """Skip (naming the fix) unless vLLM 0.34.0's GPU wheel is installed; fail when the CPU shims are not loaded."""
    from ringkv.integration.vllm._compat import VLLM_DIST, VLLM_VERSION

    if (VLLM_DIST, VLLM_VERSION) != ENGINE_VLLM:
        pytest.skip(f"needs {' '.join(ENGINE_VLLM)}'s GPU wheel (Model Runner V2's CPU runner), not "
                    f"{VLLM_DIST} {VLLM_VERSION}: {VLLM_FIX}")  # fmt: skip
    if not pytestconfig.pluginmanager.has_plugin("vllm_cpu_shims"):
        pytest.fail(f"vLLM's GPU wheel on CPU needs ci/vllm_cpu_shims.py (-p vllm_cpu_shims): {VLLM_FIX}")


def declared_sliding(models: EngineModels, folder: Path) -> Path:
    """A copy of ``models``' drafter whose config declares every layer sliding with window ``WINDOW``."""
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(models.drafter, folder)
    config = json.loads((folder / "config.json").read_text())
    # Qwen3Config drops sliding_window unless use_sliding_window is set
    config.update(layer_types=[SLIDING] * models.spec.drafter_layers, sliding_window=WINDOW, use_sliding_window=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def chain_prompt(chain: list[int], generator: random.Random, length: int, vocab: int, tail: bool = True) -> list[int]:
    """Random tokens whose second half follows the target's chain (``tail``; else all random): the drafter copies
    it from its window. The trained DFlash drafter accepts every draft after a chain tail, so its prefix-caching-off
    prompts are all random (partial acceptance either way)."""
    tokens = [generator.randrange(FIRST_TOKEN, vocab - 1) for _ in range(length - length // 2 if tail else length)]
    while len(tokens) < length:
        tokens.append(chain[tokens[-1]])
    return tokens


def engine_spec(models: EngineModels, prompts: list[list[int]], **kwargs: Any) -> EngineRunSpec:
    import vllm_cpu_shims

    return EngineRunSpec(
        target=str(models.target), drafter=str(models.drafter), drafter_backend="ring", prompts=prompts,
        max_tokens=MAX_TOKENS, kv_block_size=BLOCK, max_model_len=2048, max_num_seqs=len(prompts),
        extra_engine_args=vllm_cpu_shims.ENGINE_ARGS, environment={"VLLM_TARGET_DEVICE": "cpu"},
        preload=["vllm_cpu_shims:install"], **kwargs,
    )  # fmt: skip


@pytest.fixture(scope="module")
def runs(v2_engine, pytestconfig, tmp_path_factory) -> dict[str, Any]:
    """(drafter, caching, way) -> its run, way "windowed" (the checkpoint, the option set) or "declared"; and each
    drafter's target chain map."""
    cache = getattr(pytestconfig, "cache", None)
    folder = cache.mkdir("v2-full-window-models") if cache else tmp_path_factory.mktemp("v2-full-window-models")
    dflash2_folder = cache.mkdir("dflash2-engine-models") if cache else folder
    models = {"dflash": build_engine_models(folder / "dflash-full", DFLASH),
              "mixed": build_dflash2_models(dflash2_folder / "mixed", MIXED)}  # fmt: skip
    declared = {name: declared_sliding(m, tmp_path_factory.mktemp(name) / "declared") for name, m in models.items()}
    chains = {name: chain_map(m) for name, m in models.items()}
    specs: dict[tuple[str, str, str], tuple[EngineModels, EngineRunSpec]] = {}
    for name, m in models.items():
        generator, vocab = random.Random(7), m.spec.vocab_size
        plain = engine_spec(m, [chain_prompt(chains[name], generator, n, vocab, name == "mixed") for n in PROMPTS])
        shared = chain_prompt(chains[name], generator, SHARED, vocab)
        first, tails = (
            chain_prompt(chains[name], generator, FIRST_TURN, vocab),
            [[generator.randrange(FIRST_TOKEN, vocab - 1) for _ in range(TAIL)] for _ in range(3)],
        )
        caching = engine_spec(m, [first, shared + tails[0]], later_waves=[[tails[1], shared + tails[2]]],
                              continued_slots=[0], enable_prefix_caching=True)  # fmt: skip
        for mode, spec in (("off", plain), ("on", caching)):
            windowed = replace(spec, environment={**spec.environment, "RINGKV_DRAFTER_FULL_WINDOW": str(WINDOW)})
            specs[name, mode, "windowed"] = (m, windowed)
            specs[name, mode, "declared"] = (m, replace(spec, drafter=str(declared[name])))
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {key: pool.submit(launch, m, spec) for key, (m, spec) in specs.items()}
        return {"runs": {key: future.result() for key, future in futures.items()}, "chains": chains,
                "models": models}  # fmt: skip


def launch(models: EngineModels, spec: EngineRunSpec) -> EngineRun:
    layers = drafter_layer_names(models.spec.target_layers, models.spec.drafter_layers)
    return run_engine(spec, drafter_layers=layers, timeout=1800)


CASES = [pytest.param(name, mode, id=f"{name}-prefix-caching-{mode}") for name in ("dflash", "mixed")
         for mode in ("off", "on")]  # fmt: skip


def ring_blocks(models: EngineModels) -> int:
    return ring_blocks_needed(WINDOW, BLOCK, lookahead=models.spec.draft_block)


@pytest.mark.parametrize(("name", "mode"), CASES)
def test_every_drafter_layer_is_a_ring_layer_holding_at_most_r_blocks(runs, name, mode):
    windowed, declared = runs["runs"][name, mode, "windowed"], runs["runs"][name, mode, "declared"]
    models = runs["models"][name]
    layers = drafter_layer_names(models.spec.target_layers, models.spec.drafter_layers)
    for run in (windowed, declared):
        groups = {layer: kind for kind, members in run.scheduler["kv_cache_groups"] for layer in members}
        assert {groups[layer] for layer in layers} == {"RingSWASpec"}, groups
        # one group: the sliding layer and the windowed full one share a spec, so the blocks counted are all of them
        assert sum(bool(set(members) & set(layers)) for _, members in run.scheduler["kv_cache_groups"]) == 1
    r = ring_blocks(models)
    assert windowed.scheduler["ring_blocks"] == declared.scheduler["ring_blocks"] == r == 4
    held = [blocks for step in held_blocks(windowed) for _, blocks in step.values()]
    assert len(held) > 10 and max(held) == r, held
    full = {blocks for step in held_blocks(windowed) for computed, blocks in step.values() if computed >= r * BLOCK}
    assert full == {r}, full
    assert held == [blocks for step in held_blocks(declared) for _, blocks in step.values()]
    assert windowed.leaked_blocks == 0 and windowed.preemptions == 0
    print(f"{name}, prefix caching {mode}: R {r}, drafter blocks max {max(held)} over {len(held)} steps")  # noqa: T201


@pytest.mark.parametrize(("name", "mode"), CASES)
def test_tokens_counters_and_drafter_outputs_equal_the_checkpoint_declared_sliding(runs, name, mode):
    import torch

    windowed, declared = runs["runs"][name, mode, "windowed"], runs["runs"][name, mode, "declared"]
    chain = runs["chains"][name]
    assert windowed.prompts == declared.prompts and windowed.tokens == declared.tokens
    assert windowed.tokens == [continuation(chain, p, MAX_TOKENS) for p in windowed.prompts], "no speculation's"
    assert windowed.spec_decode == declared.spec_decode
    counters = windowed.spec_decode
    assert counters["drafts"] > 5 and 0 < counters["accepted"] < counters["draft_tokens"], counters
    ours, theirs = windowed.outputs(), declared.outputs()
    assert ours.keys() == theirs.keys() and len(ours) == runs["models"][name].spec.drafter_layers
    compared = 0
    for key, calls in ours.items():
        assert len(calls) == len(theirs[key]) >= 5, key
        for call, (a, b) in enumerate(zip(calls, theirs[key], strict=True)):
            assert torch.isfinite(a).all() and torch.equal(a, b), f"{key} forward {call}: windowed != declared"
            compared += 1
    print(f"{name}, prefix caching {mode}: {counters}; {compared} drafter outputs bitwise equal; "  # noqa: T201
          f"wall {windowed.wall_seconds:.0f} s / {declared.wall_seconds:.0f} s")  # fmt: skip


@pytest.mark.parametrize("name", ["dflash", "mixed"])
def test_prefix_hits_are_the_sliding_rings(runs, name):
    """Prefix caching on: the second turn and the sharer hit, each exactly what the declared sliding ring hits, and
    past the rebuild cap ``N - (W - 1)`` for the second turn (it adopted the ring's cached tail)."""
    windowed, declared = runs["runs"][name, "on", "windowed"], runs["runs"][name, "on", "declared"]
    hits = {request_index(a.request_id): a.hit for a in windowed.admissions}
    sliding = {request_index(a.request_id): a.hit for a in declared.admissions}
    assert hits == sliding and len(hits) == 4, (hits, sliding)
    prompts = windowed.prompts
    assert hits[0] == hits[1] == 0 and hits[2] > len(prompts[2]) - (WINDOW - 1) and hits[3] > 0, hits
    assert windowed.prefix_cache == declared.prefix_cache
    assert windowed.prefix_cache["hits"] == sum(hits.values())
    print(f"{name}: hits {hits} (declared sliding {sliding}); {windowed.prefix_cache}")  # noqa: T201
