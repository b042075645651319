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
  rebuild cap ``N - (W - 1)``.
- Async scheduling forced on (``force_async_scheduling``: vLLM's CPU platform turns it off) for those runs:
  vLLM's ``AsyncScheduler`` with two batches in flight.
- A DFlash2 drafter mixing a sliding and a full layer, on the V2 CPU runner's default (synchronous) scheduling:
  the sliding layer on the ring, the full layer on vLLM's spec, tokens and counters those of stock rows.

Skipped unless vLLM 0.34.0 (the GPU wheel) is the installed vLLM; under ``RINGKV_REQUIRE=v2`` that skip fails the
run (``tests/requirements_plugin.py``).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import replace
from pathlib import Path

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
    drafter_config,
    reuse_or_build,
)
from ringkv.kernels.ring_geometry import ring_blocks_needed

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
MAX_MODEL_LEN = 1152  # the second turn and its reply fit
# vLLM's in-flight budget (max_num_batched_tokens) above max_model_len: vLLM caps stock's sliding-window charge at
# cdiv(W - 1 + in-flight tokens, block) + 1 blocks, so here stock's drafter is charged the full length (#55800's
# 8192-token batches against W 2048); the prefill still runs in LONG_PREFILL-token chunks
BATCHED_TOKENS, LONG_PREFILL = 2048, 256
SMALL_POOL, ROOMY_POOL = 96, 192  # blocks of vLLM's unified page
MIXED_PROMPTS, MIXED_REPLY = (300, 170), 8
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


def chain_map(models: EngineModels) -> list[int]:
    """The target's next token per last token (its attention outputs are zeroed): its greedy continuation."""
    import torch
    from transformers import Qwen3ForCausalLM

    target = Qwen3ForCausalLM.from_pretrained(models.target).eval()
    with torch.no_grad():
        return target(torch.arange(models.spec.vocab_size)[:, None]).logits[:, -1].argmax(-1).tolist()


def continuation(chain: list[int], tokens: list[int], count: int) -> list[int]:
    out = [chain[tokens[-1]]]
    while len(out) < count:
        out.append(chain[out[-1]])
    return out


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


def engine_spec(models: EngineModels, backend: str | None, prompts: list[list[int]], **kwargs) -> EngineRunSpec:
    import vllm_cpu_shims

    return EngineRunSpec(
        target=str(models.target), drafter=str(models.drafter), drafter_backend=backend, prompts=prompts,
        max_tokens=REPLY, kv_block_size=BLOCK, max_num_seqs=len(prompts),
        extra_engine_args=vllm_cpu_shims.ENGINE_ARGS, environment={"VLLM_TARGET_DEVICE": "cpu"},
        preload=["vllm_cpu_shims:install"], **kwargs,
    )  # fmt: skip


def asynchronous(spec: EngineRunSpec, report: Path) -> EngineRunSpec:
    """``spec`` with async scheduling forced on, reporting to ``report``."""
    return replace(spec, preload=[*spec.preload, f"{__name__}:force_async_scheduling"],
                   environment={**spec.environment, ASYNC_REPORT: str(report)})  # fmt: skip


def run(models: EngineModels, spec: EngineRunSpec) -> EngineRun:
    return run_engine(spec, drafter_layers=drafter_layer_names(models.spec.target_layers, models.spec.drafter_layers))


@pytest.fixture(scope="module")
def dflash(v2_engine, tmp_path_factory):
    """The conversation (turn 1: the long prompt; turn 2: it + reply + TAIL) with prefix caching on and async
    scheduling forced on: the ring in the small pool, stock rows in a roomy one, and stock rows in the small pool
    (its startup error)."""
    folder = tmp_path_factory.mktemp("v2-smoke")
    models = untrained_dflash(folder / "dflash")
    generator = random.Random(5)
    first, tail = (random_tokens(generator, n, DFLASH.vocab_size) for n in (PROMPT, TAIL))
    base = engine_spec(models, "ring", [first], later_waves=[[tail]], continued_slots=[0],
                       enable_prefix_caching=True, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=BATCHED_TOKENS,
                       extra_engine_args={**engine_spec(models, None, []).extra_engine_args,
                                          "long_prefill_token_threshold": LONG_PREFILL})  # fmt: skip
    runs, reports = {}, {}
    for way, backend, pool in (("ring", "ring", SMALL_POOL), ("rows", "rows", ROOMY_POOL)):
        reports[way] = folder / f"{way}-async.json"
        runs[way] = run(models, asynchronous(replace(base, drafter_backend=backend, num_gpu_blocks=pool),
                                             reports[way]))  # fmt: skip
    with pytest.raises(EngineRunError) as refused:
        run(models, asynchronous(replace(base, drafter_backend="rows", num_gpu_blocks=SMALL_POOL),
                                 folder / "rows-small.json"))  # fmt: skip
    return {
        "chain": chain_map(models), "runs": runs, "stock_refused": str(refused.value),
        "async": {way: json.loads(path.read_text()) for way, path in reports.items()},
    }


@pytest.fixture(scope="module")
def mixed(v2_engine, tmp_path_factory):
    """The mixed DFlash2 drafter on the ring and on stock rows, default (synchronous) scheduling."""
    models = untrained_mixed(tmp_path_factory.mktemp("v2-smoke-mixed"))
    generator = random.Random(7)
    prompts = [random_tokens(generator, n, MIXED.models.vocab_size) for n in MIXED_PROMPTS]
    spec = engine_spec(models, "ring", prompts, max_model_len=512, max_num_batched_tokens=128)
    runs = {way: run(models, replace(spec, drafter_backend=way)) for way in ("ring", "rows")}
    return chain_map(models), prompts, runs


def drafter_blocks(run: EngineRun) -> list[int]:
    return [held for step in held_blocks(run) for _, held in step.values()]


def test_smoke_figures(dflash, mixed):
    ring, rows = dflash["runs"]["ring"], dflash["runs"]["rows"]
    print("ring", ring.scheduler["ring_blocks"], max(drafter_blocks(ring)), len(drafter_blocks(ring)))  # noqa: T201
    print("rows", max(drafter_blocks(rows)))  # noqa: T201
    print("admissions ring", ring.admissions, "rows", rows.admissions)  # noqa: T201
    print("spec", ring.spec_decode, rows.spec_decode)  # noqa: T201
    print("tokens", ring.tokens, rows.tokens)  # noqa: T201
    print("groups", ring.scheduler["kv_cache_groups"], ring.scheduler["pool_at_shutdown"])  # noqa: T201
    print("refused", dflash["stock_refused"][-1500:])  # noqa: T201
    print("async", dflash["async"])  # noqa: T201
    print("times", ring.wall_seconds, rows.wall_seconds)  # noqa: T201
    _, _, m = mixed
    print("mixed", m["ring"].spec_decode, m["rows"].spec_decode, m["ring"].wall_seconds, m["rows"].wall_seconds)  # noqa: T201
    print("mixed groups", m["ring"].scheduler["kv_cache_groups"], max(drafter_blocks(m["ring"])))  # noqa: T201
