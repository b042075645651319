# SPDX-License-Identifier: Apache-2.0
"""CI's smoke test of vLLM 0.34's Model Runner V2 path (marker ``v2``; ``ci/v2_smoke.sh`` builds vLLM 0.34's
environment and runs this file in it, with the CPU shims of ``ci/vllm_cpu_shims.py``). Untrained (randomly
initialised) drafters: no training in CI; the ring is checked against vLLM's own sliding-window rows ("rows":
RINGKV's kernels over vLLM's spec, unchanged) and the target's own greedy continuation.

- #55800, scaled: W 64, KV block 32, a 1,064-token prompt (16 windows and more) and vLLM's in-flight token budget
  above it, so vLLM charges stock's drafter group the prompt's full length. In a pool of ``SMALL_POOL`` blocks
  vLLM refuses stock's drafter at startup (its own capacity check, the admission gate's rule), while the ring
  admits the prompt and holds R = 4 drafter blocks at every scheduler step.
- The ring beside stock rows in a roomy pool, same prompts: greedy tokens equal the target's own, spec-decode
  counters and every drafter attention output equal.
- Prefix caching on: the conversation's second turn adopts the ring's cached tail, so its hit reaches past the
  rebuild cap ``N - (W - 1)``; a third stops at the max length with drafts within the lookahead of it.
- Async scheduling forced on (``force_async_scheduling``: vLLM's CPU platform turns it off) for those runs:
  vLLM's ``AsyncScheduler`` with two batches in flight.
- A DFlash2 drafter mixing a sliding and a full layer, on the V2 CPU runner's default (synchronous) scheduling:
  the sliding layer on the ring, the full layer on vLLM's spec, tokens and counters those of stock rows.
- The same drafter with ``RINGKV_DRAFTER_FULL_WINDOW`` = W: its full layer on the ring too (R blocks), every
  drafter attention output that of the dense oracle windowed to W over the K/V vLLM stored, by position (the rest
  on V2, trained drafters and prefix caching: ``test_vllm_v2_full_window_engine.py``, slow).

The target's greedy continuation (what no speculation gives) is its chain map (``engine_models``: attention outputs
zeroed), computed by transformers outside vLLM. Skipped unless vLLM 0.34.0 (the GPU wheel) is the installed vLLM;
deselected from the main suite (``-m "not v2"``); ``ci/v2_smoke.sh``, which builds that environment, fails on any
skip of it.
"""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from ringkv.bench.lab.e2e.runner import (
    EngineRun,
    EngineRunError,
    drafter_layer_names,
    held_blocks,
    request_index,
    run_engine,
)
from ringkv.bench.lab.e2e.worker import EngineRunSpec
from ringkv.dflash2.config import FULL, SLIDING
from ringkv.dflash2.harness.dflash2_models import (
    CandidateSelector,
    DFlash2ModelSpec,
    identity_convolutions,
    save_drafter,
)
from ringkv.dflash2.harness.dflash2_models import drafter_config as dflash2_config
from ringkv.dflash2.harness.engine_models import (
    FIRST_TOKEN,
    EngineModels,
    EngineModelSpec,
    build_target,
    chain_map,
    continuation,
    drafter_config,
    reuse_or_build,
)
from ringkv.kernels.ring_geometry import ring_blocks_needed
from ringkv.kernels.testing import FP32_ABS_BOUND

from tests.integration.drafter_oracle import drafter_forwards, stored_history_oracle

pytestmark = pytest.mark.v2

V2_FIX = (
    "run `bash ci/v2_smoke.sh` (it builds vLLM 0.34's env with `.venv/bin/nox -s 'vllm(0.34.0)' --install-only` "
    "and runs this file there with the CPU shims)"
)
ENGINE_VLLM = ("vllm", "0.34.0")
DFLASH = EngineModelSpec()  # W 64, N 7, two sliding drafter layers
MIXED = DFlash2ModelSpec(layer_types=(SLIDING, FULL))  # N 3
WINDOW = DFLASH.drafter_window
BLOCK = 32
RING_BLOCKS = ring_blocks_needed(WINDOW, BLOCK, lookahead=DFLASH.draft_block)
PROMPT = 16 * WINDOW + 40  # 1,064 tokens: 16 windows and more
REPLY, TAIL = 8, 8  # the second turn: the first's prompt + reply + TAIL new tokens (< a block: see the V2 test)
MAX_MODEL_LEN = 1120  # the second turn and its reply fit, and the third's tokens stay within a window
# the third turn: the second's prompt + reply + tokens up to EDGE_REPLY short of MAX_MODEL_LEN, so it stops at the
# length limit with its last drafts within the lookahead of it (V2 clamps them; the tail guard is off on V2)
EDGE_REPLY = 3
EDGE_TAIL = MAX_MODEL_LEN - EDGE_REPLY - (PROMPT + REPLY + TAIL + REPLY)
# vLLM's in-flight budget (max_num_batched_tokens) above max_model_len: vLLM caps stock's sliding-window charge at
# cdiv(W - 1 + in-flight tokens, block) + 1 blocks, so here stock's drafter is charged the full length (#55800's
# 8192-token batches against W 2048); the prefill still runs in LONG_PREFILL-token chunks
BATCHED_TOKENS, LONG_PREFILL = 2048, 256
SMALL_POOL, ROOMY_POOL = 96, 192  # blocks of vLLM's unified page
MIXED_PROMPTS = (300, 170)
ASYNC_REPORT = "RINGKV_V2_SMOKE_ASYNC_REPORT"


def force_async_scheduling() -> None:
    """Preloaded in an engine process after the CPU shims (``EngineRunSpec.preload``): vLLM's CPU platform turns
    async scheduling off in ``check_and_update_config``; this sets it back on after it ran, and writes to the file
    ``$RINGKV_V2_SMOKE_ASYNC_REPORT`` at exit what the engine then used: the platform's setting, the scheduler
    class, the batch queue and the most batches in flight when a step was scheduled."""
    import atexit
    import os

    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    report: dict = {"platform_async": [], "scheduler": None, "batch_queue_size": None, "max_in_flight": 0}
    engine: list = []
    platform_check = CpuPlatform.check_and_update_config.__func__
    engine_init, schedule = EngineCore.__init__, Scheduler.schedule

    def check_and_update_config(cls, vllm_config) -> None:
        platform_check(cls, vllm_config)
        report["platform_async"].append(vllm_config.scheduler_config.async_scheduling)
        vllm_config.scheduler_config.async_scheduling = True

    def init(self, *args, **kwargs) -> None:
        engine_init(self, *args, **kwargs)
        engine.append(self)
        report["scheduler"] = type(self.scheduler).__name__
        report["batch_queue_size"] = self.batch_queue_size

    def scheduled(self, *args, **kwargs):
        queue = engine[0].batch_queue if engine else None
        if queue is not None:  # batches scheduled whose output is not processed yet, and this one
            report["max_in_flight"] = max(report["max_in_flight"], len(queue) + 1)
        return schedule(self, *args, **kwargs)

    def write() -> None:
        Path(os.environ[ASYNC_REPORT]).write_text(json.dumps(report))

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    EngineCore.__init__ = init
    Scheduler.schedule = scheduled
    atexit.register(write)


def untrained_dflash(folder: Path) -> EngineModels:
    """The chain target of ``engine_models`` and a randomly initialised DFlash drafter (no training)."""
    import torch
    from ringkv.dflash2.model import DFlash2Drafter

    def build() -> float:
        build_target(DFLASH, folder / "target")
        torch.manual_seed(DFLASH.seed)
        DFlash2Drafter(drafter_config(DFLASH), target_hidden_size=DFLASH.hidden_size).save_pretrained(
            folder / "drafter"
        )
        return 0.0

    return reuse_or_build(folder, "untrained_dflash.json", DFLASH, DFLASH, build)


def untrained_mixed(folder: Path) -> EngineModels:
    """The chain target and a randomly initialised DFlash2 drafter with a sliding and a full layer."""
    import torch
    from ringkv.dflash2.model import DFlash2Drafter

    shape = MIXED.models

    def build() -> float:
        build_target(shape, folder / "target")
        config, raw = dflash2_config(MIXED)
        torch.manual_seed(shape.seed)
        drafter = DFlash2Drafter(config, target_hidden_size=shape.hidden_size)
        identity_convolutions(drafter)
        save_drafter(folder / "drafter", raw, drafter, CandidateSelector(shape.hidden_size, shape.vocab_size,
                                                                          MIXED.selector_rank))  # fmt: skip
        return 0.0

    return reuse_or_build(folder, "untrained_dflash2.json", MIXED, shape, build)


def greedy(chain: list[int], prompts: list[list[int]]) -> list[list[int]]:
    """The target's own replies: REPLY tokens each, fewer where ``MAX_MODEL_LEN`` stops a request first."""
    return [continuation(chain, prompt, min(REPLY, MAX_MODEL_LEN - len(prompt))) for prompt in prompts]


def random_tokens(generator: random.Random, n: int, vocab: int) -> list[int]:
    return [generator.randrange(FIRST_TOKEN, vocab - 1) for _ in range(n)]


@pytest.fixture(scope="module")
def v2_engine(pytestconfig) -> None:
    """Skip (naming the fix) unless vLLM 0.34.0's GPU wheel is installed; fail when the CPU shims are not loaded."""
    from ringkv.integration.vllm._compat import VLLM_DIST, VLLM_VERSION

    if (VLLM_DIST, VLLM_VERSION) != ENGINE_VLLM:
        pytest.skip(f"needs {' '.join(ENGINE_VLLM)}'s GPU wheel (Model Runner V2's CPU runner), not "
                    f"{VLLM_DIST} {VLLM_VERSION}: {V2_FIX}")  # fmt: skip
    if not pytestconfig.pluginmanager.has_plugin("vllm_cpu_shims"):
        pytest.fail(f"vLLM's GPU wheel on CPU needs ci/vllm_cpu_shims.py (-p vllm_cpu_shims): {V2_FIX}")


def engine_spec(models: EngineModels, backend: str | None, prompts: list[list[int]], engine_args: dict | None = None,
                **kwargs) -> EngineRunSpec:  # fmt: skip
    """A run on vLLM's GPU wheel on CPU: the CPU shims in the engine process, the target on RINGKV too."""
    import vllm_cpu_shims

    return EngineRunSpec(
        target=str(models.target), drafter=str(models.drafter), drafter_backend=backend, prompts=prompts,
        max_tokens=REPLY, kv_block_size=BLOCK, max_num_seqs=len(prompts),
        extra_engine_args={**vllm_cpu_shims.ENGINE_ARGS, **(engine_args or {})},
        environment={"VLLM_TARGET_DEVICE": "cpu"}, preload=["vllm_cpu_shims:install"], **kwargs,
    )  # fmt: skip


def asynchronous(spec: EngineRunSpec, report: Path) -> EngineRunSpec:
    """``spec`` with async scheduling forced on, reporting to ``report``."""
    return replace(spec, preload=[*spec.preload, f"{__name__}:force_async_scheduling"],
                   environment={**spec.environment, ASYNC_REPORT: str(report)})  # fmt: skip


def launch(models: EngineModels, spec: EngineRunSpec, record_inputs: bool = False) -> EngineRun | str:
    """The run, or the end of its output where the engine failed."""
    layers = drafter_layer_names(models.spec.target_layers, models.spec.drafter_layers)
    try:
        return run_engine(spec, drafter_layers=layers, record_inputs=record_inputs, timeout=600)
    except EngineRunError as error:
        return str(error)


@pytest.fixture(scope="module")
def smoke(v2_engine, tmp_path_factory) -> dict[str, Any]:
    """Every engine run of the file, two at a time (each its own process; CI has two cores):

    - the DFlash conversation (turn 1: the long prompt; turn 2: it + reply + TAIL) with prefix caching on and async
      scheduling forced on: on the ring in the small pool ("ring"), on stock rows in a roomy one ("rows"), and on
      stock rows in the small pool ("rows in the small pool": vLLM refuses it at startup);
    - the mixed DFlash2 drafter on short prompts, default (synchronous) scheduling, on the ring and on stock rows;
      on the ring with its full layer windowed, the first prompt alone (the probe's context rows are then that
      request's by position), recording the drafter's inputs.
    """
    folder = tmp_path_factory.mktemp("v2-smoke")
    dflash, mixed = untrained_dflash(folder / "dflash"), untrained_mixed(folder / "mixed")
    generator = random.Random(5)
    first, tail, edge = (random_tokens(generator, n, DFLASH.vocab_size) for n in (PROMPT, TAIL, EDGE_TAIL))
    conversation = engine_spec(
        dflash, "ring", [first], later_waves=[[tail], [edge]], continued_slots=[0], enable_prefix_caching=True,
        max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=BATCHED_TOKENS, num_gpu_blocks=SMALL_POOL,
        engine_args={"long_prefill_token_threshold": LONG_PREFILL},
    )  # fmt: skip
    mixed_prompts = [random_tokens(generator, n, MIXED.models.vocab_size) for n in MIXED_PROMPTS]
    short = engine_spec(mixed, "ring", mixed_prompts, max_model_len=512, max_num_batched_tokens=128)
    reports = {way: folder / f"{way}-async.json" for way in ("ring", "rows")}
    specs = {
        "ring": (dflash, asynchronous(conversation, reports["ring"])),
        "rows": (dflash, asynchronous(replace(conversation, drafter_backend="rows", num_gpu_blocks=ROOMY_POOL),
                                      reports["rows"])),
        "mixed ring": (mixed, short),
        "mixed rows": (mixed, replace(short, drafter_backend="rows")),
        "mixed window": (mixed, replace(short, prompts=mixed_prompts[:1], max_num_seqs=1,
                                        environment={**short.environment, "RINGKV_DRAFTER_FULL_WINDOW": str(WINDOW)})),
        "rows in the small pool": (dflash, asynchronous(replace(conversation, drafter_backend="rows"),
                                                        folder / "refused-async.json")),
    }  # fmt: skip
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            name: pool.submit(launch, models, spec, name == "mixed window") for name, (models, spec) in specs.items()
        }
        runs = {name: future.result() for name, future in futures.items()}
    for name, run in runs.items():
        if name != "rows in the small pool" and isinstance(run, str):
            pytest.fail(f"{name}: {run}")
    return {
        "runs": runs, "chain": chain_map(dflash), "mixed chain": chain_map(mixed),
        "async": {way: json.loads(path.read_text()) for way, path in reports.items()},
    }  # fmt: skip


def drafter_blocks(run: EngineRun) -> list[tuple[int, int]]:
    """Per scheduler step and running request: (tokens computed before the step, drafter blocks held after it)."""
    return [entry for step in held_blocks(run) for entry in step.values()]


def assert_ring_holds_r_blocks(run: EngineRun, steps: int) -> list[int]:
    """At most R drafter blocks at every step, exactly R once a window and the lookahead are written."""
    assert run.scheduler["ring_blocks"] == RING_BLOCKS == 4
    held = drafter_blocks(run)
    assert len(held) >= steps and max(blocks for _, blocks in held) == RING_BLOCKS, held
    assert {blocks for computed, blocks in held if computed >= RING_BLOCKS * BLOCK} == {RING_BLOCKS}, held
    return [blocks for _, blocks in held]


def assert_same_drafter_outputs(ring: EngineRun, rows: EngineRun) -> int:
    """Every drafter attention output of the ring bitwise equal to stock rows', forward by forward; returns how many
    outputs were compared."""
    import torch

    ring_outputs, rows_outputs = ring.outputs(), rows.outputs()
    assert ring_outputs.keys() == rows_outputs.keys() and ring_outputs
    compared = 0
    for key, calls in ring_outputs.items():
        assert len(calls) == len(rows_outputs[key]) >= 5, key
        for call, (a, b) in enumerate(zip(calls, rows_outputs[key], strict=True)):
            assert torch.isfinite(a).all() and torch.equal(a, b), f"{key} forward {call}: ring != stock rows"
            compared += 1
    return compared


def test_stock_drafter_cannot_be_served_the_long_prompt_in_a_pool_where_the_ring_admits_it(smoke):
    """#55800, scaled: vLLM's own capacity check (the rule its admission gate applies: ``SlidingWindowSpec.
    max_admission_blocks_per_request``) refuses stock's drafter in the small pool and estimates the longest
    prompt it could serve there below the prompt's length; the ring admits the prompt in that pool."""
    runs = smoke["runs"]
    refused, ring = runs["rows in the small pool"], runs["ring"]
    assert isinstance(refused, str), "stock rows started in the small pool"
    assert f"To serve at least one request with the model's max seq len ({MAX_MODEL_LEN})" in refused, refused
    estimate = re.search(r"estimated maximum model length is (\d+)", refused)
    stock_longest = int(estimate.group(1)) if estimate else 0
    assert PROMPT >= 16 * WINDOW and stock_longest < PROMPT, refused
    pool = ring.scheduler["pool_at_shutdown"]
    assert pool.num_blocks == SMALL_POOL and ring.leaked_blocks == 0
    groups = {layer: kind for kind, layers in ring.scheduler["kv_cache_groups"] for layer in layers}
    drafter = drafter_layer_names(DFLASH.target_layers, DFLASH.drafter_layers)
    assert {groups[layer] for layer in drafter} == {"RingSWASpec"}, groups
    first = ring.admissions[0]
    assert (first.num_tokens, first.hit, first.resumed) == (PROMPT, 0, False) and ring.preemptions == 0
    assert len(ring.tokens[0]) == REPLY
    print(f"pool {SMALL_POOL} blocks: ring admits {PROMPT} tokens; stock refused (vLLM's longest: {stock_longest})")  # noqa: T201


def test_the_ring_holds_at_most_r_blocks_at_every_step_and_stock_rows_more(smoke):
    runs = smoke["runs"]
    held = assert_ring_holds_r_blocks(runs["ring"], steps=PROMPT // LONG_PREFILL + REPLY)
    rows = [blocks for _, blocks in drafter_blocks(runs["rows"])]
    assert runs["rows"].scheduler["ring_blocks"] is None and max(rows) > RING_BLOCKS
    print(f"drafter blocks: ring max {max(held)} over {len(held)} steps, stock rows max {max(rows)}")  # noqa: T201


def test_greedy_tokens_are_the_targets_and_counters_and_drafter_outputs_equal_stock_rows(smoke):
    runs, chain = smoke["runs"], smoke["chain"]
    ring, rows = runs["ring"], runs["rows"]
    assert ring.prompts == rows.prompts and ring.tokens == rows.tokens
    assert ring.tokens == greedy(chain, ring.prompts), "the target's own tokens"
    assert ring.spec_decode == rows.spec_decode
    # every draft N tokens, but those vLLM shortens at the max length (turn 3's last steps)
    assert 0 < ring.spec_decode["draft_tokens"] <= DFLASH.num_speculative_tokens * ring.spec_decode["drafts"]
    compared = assert_same_drafter_outputs(ring, rows)
    print(f"spec decode {ring.spec_decode}; {compared} drafter outputs bitwise equal")  # noqa: T201


def test_prefix_caching_the_second_turn_adopts_the_cached_ring_tail_past_the_rebuild_cap(smoke):
    """Turn 2 (turn 1's prompt + reply + TAIL) hits past ``N - (W - 1)``, where a hit stops when the ring is rebuilt
    by the target's recompute (``RINGKV_RING_PREFIX_CACHE=0``): it adopted the ring's cached tail. At least stock
    rows' hit; vLLM's counters agree."""
    runs = smoke["runs"]
    ring, rows = runs["ring"], runs["rows"]
    prompts, replies = ring.prompts, ring.tokens
    assert prompts[1][: PROMPT + REPLY] == prompts[0] + replies[0] and len(prompts[1]) == PROMPT + REPLY + TAIL
    hits = {request_index(a.request_id): a.hit for a in ring.admissions}
    stock = {request_index(a.request_id): a.hit for a in rows.admissions}
    cap = len(prompts[1]) - (WINDOW - 1)
    assert hits[0] == 0 and hits[1] > cap and hits[1] >= stock[1], (hits, stock, cap)
    assert ring.prefix_cache == {"hits": sum(hits.values()), "queries": sum(len(p) for p in prompts)}
    assert ring.leaked_blocks == 0
    print(f"turn 2: {len(prompts[1])} tokens, hit {hits[1]} (rebuild cap {cap}; stock rows {stock[1]})")  # noqa: T201


def test_a_turn_that_stops_at_the_max_length_drafts_beside_it_and_adopts_the_tail_before(smoke):
    """Turn 3 stops at ``MAX_MODEL_LEN``: its last steps draft within the lookahead of it, where V2 clamps the draft
    positions and still stores the context K/V (no drafter skip: the cached ring's guard is off on V2). It adopted
    turn 2's tail past the rebuild cap, at least stock rows' hit; its tokens and every drafter output equal stock
    rows' (the tests above compare all turns), the ring <= R, no leak."""
    ring, rows = smoke["runs"]["ring"], smoke["runs"]["rows"]
    prompts, replies = ring.prompts, ring.tokens
    assert len(prompts) == 3 and prompts[2][: len(prompts[1]) + REPLY] == prompts[1] + replies[1]
    assert (len(replies[2]), len(prompts[2]) + len(replies[2])) == (EDGE_REPLY, MAX_MODEL_LEN)
    hits = {request_index(a.request_id): a.hit for a in ring.admissions}
    stock = {request_index(a.request_id): a.hit for a in rows.admissions}
    cap = len(prompts[2]) - (WINDOW - 1)
    assert hits[2] > cap and hits[2] >= stock[2], (hits, stock, cap)
    assert ring.leaked_blocks == 0
    print(f"turn 3: {len(prompts[2])} tokens to the max length {MAX_MODEL_LEN}, hit {hits[2]} (stock {stock[2]})")  # noqa: T201


def test_async_scheduling_forced_on_runs_vllms_async_scheduler(smoke):
    """vLLM's CPU platform turned async scheduling off; forced back on, the engine ran ``AsyncScheduler`` with two
    batches in flight, and the tokens are still the target's own (and stock rows')."""
    for way, report in smoke["async"].items():
        assert report["platform_async"] and not any(report["platform_async"]), (way, report)
        assert (report["scheduler"], report["batch_queue_size"], report["max_in_flight"]) == ("AsyncScheduler", 2, 2)
    ring = smoke["runs"]["ring"]
    assert ring.tokens == greedy(smoke["chain"], ring.prompts)
    print(f"async: {smoke['async']}")  # noqa: T201


def test_a_mixed_dflash2_drafter_rings_its_sliding_layer_and_matches_stock_rows(smoke):
    runs = smoke["runs"]
    ring, rows = runs["mixed ring"], runs["mixed rows"]
    sliding, full = drafter_layer_names(MIXED.models.target_layers, MIXED.models.drafter_layers)
    groups = {layer: kind for kind, layers in ring.scheduler["kv_cache_groups"] for layer in layers}
    assert (groups[sliding], groups[full]) == ("RingSWASpec", "FullAttentionSpec"), groups
    chain = smoke["mixed chain"]
    assert ring.tokens == rows.tokens == greedy(chain, ring.prompts)
    assert ring.spec_decode == rows.spec_decode and ring.spec_decode["drafts"] > 0
    held = assert_ring_holds_r_blocks(ring, steps=2 * REPLY)
    compared = assert_same_drafter_outputs(ring, rows)
    print(f"mixed: {ring.spec_decode}, ring max {max(held)} blocks, {compared} drafter outputs equal")  # noqa: T201
    for name, run in runs.items():
        if not isinstance(run, str):
            print(f"{name}: init {run.init_seconds:.0f} s, generate {run.generate_seconds:.0f} s, "  # noqa: T201
                  f"wall {run.wall_seconds:.0f} s")  # fmt: skip


def test_a_mixed_drafters_full_layer_windowed_goes_on_the_ring_and_attends_over_its_window(smoke):
    """``RINGKV_DRAFTER_FULL_WINDOW`` = W on V2: both layers on the ring (R blocks at every step), the target's own
    tokens, and every drafter forward equal to the dense oracle windowed to W over the K/V vLLM stored; the full
    layer's forwards past the window differ from full attention (the window binds)."""
    run = smoke["runs"]["mixed window"]
    layers = drafter_layer_names(MIXED.models.target_layers, MIXED.models.drafter_layers)
    groups = {layer: kind for kind, members in run.scheduler["kv_cache_groups"] for layer in members}
    assert {groups[layer] for layer in layers} == {"RingSWASpec"}, groups
    assert run.tokens == greedy(smoke["mixed chain"], run.prompts) and run.spec_decode["drafts"] > 0
    held = assert_ring_holds_r_blocks(run, steps=REPLY)
    compared, past_window = 0, 0
    for layer, event, got, history in drafter_forwards(run):
        assert event.window == WINDOW, (layer, event.window)
        worst = (got - stored_history_oracle(event, history, WINDOW)).abs().max().item()
        assert worst <= FP32_ABS_BOUND, f"{layer} forward {compared}: |ring - windowed oracle| = {worst:.3e}"
        compared += 1
        if layer == layers[1] and int(event.seq_lens[0]) - event.q.shape[0] >= WINDOW:
            past_window += 1
            full = (got - stored_history_oracle(event, history, MAX_MODEL_LEN)).abs().max().item()
            assert full > 100 * FP32_ABS_BOUND, f"{layer} forward {compared}: the window changed nothing"
    assert compared == sum(run.forward_calls[layer] for layer in layers) and past_window >= 2
    print(f"mixed window: {run.spec_decode}, ring max {max(held)} blocks, {compared} drafter outputs equal the "  # noqa: T201
          f"windowed oracle ({past_window} of the full layer's past W); wall {run.wall_seconds:.0f} s")  # fmt: skip
