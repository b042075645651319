# SPDX-License-Identifier: Apache-2.0
"""Launch engine runs (``worker``) in their own processes and compare them: greedy tokens, vLLM's spec-decode,
prefix-cache and preemption counters, ringkv's calls per drafter layer, drafter blocks held and tokens computed
per scheduler step, prefix hits per admission, the block pool at shutdown, drafter attention outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from ringkv.integration.vllm.names import PLUGIN_SWITCHES

from .probe import ENV as PROBE_ENV
from .probe import Admission, BlockPool, ContextRows, ForwardInputs, ProbeConfig, load_records
from .worker import RESULT_PREFIX, EngineRunSpec

PROGRESS_PREFIX = "PROGRESS "


class EngineRunError(RuntimeError):
    """An engine process failed; the message carries the end of its output."""


@dataclass
class EngineRun:
    spec: EngineRunSpec
    # per request, in submission order (every wave's): the prompt submitted and its greedy reply
    prompts: list[list[int]]
    tokens: list[list[int]]
    spec_decode: dict[str, Any]
    # vLLM's prefix_cache_queries / prefix_cache_hits (tokens; requests never preempted) and num_preemptions
    prefix_cache: dict[str, int]
    preemptions: int
    init_seconds: float
    generate_seconds: float
    wall_seconds: float
    records: list[dict[str, Any]] = field(repr=False)

    @property
    def forward_calls(self) -> Counter:
        return sum((Counter(r["forward_calls"]) for r in self.records), Counter())

    @property
    def kv_update_calls(self) -> Counter:
        return sum((Counter(r["kv_update_calls"]) for r in self.records), Counter())

    @property
    def scheduler(self) -> dict[str, Any]:
        """The record of the process that ran the scheduler (steps, admissions, ring_blocks, drafter_kv_block_size,
        pool_at_shutdown)."""
        owners = [r for r in self.records if r["pool_at_shutdown"] is not None]
        if len(owners) != 1:
            raise EngineRunError(f"{len(owners)} processes shut a scheduler down; expected 1")
        return owners[0]

    @property
    def admissions(self) -> list[Admission]:
        """Every admission from the waiting queue, in order (a preempted request is admitted again)."""
        return self.scheduler["admissions"]

    @property
    def leaked_blocks(self) -> int:
        """Blocks neither free nor cached-and-unreferenced once the engine shut down (0 unless a block leaked)."""
        pool: BlockPool = self.scheduler["pool_at_shutdown"]
        return pool.num_blocks - 1 - pool.free

    def outputs(self) -> dict[tuple[int, str], list[torch.Tensor]]:
        """Drafter attention outputs per (recording process index, layer), in call order."""
        ordered = sorted((r for r in self.records if r["outputs"]), key=lambda r: r["pid"])
        return {(i, layer): calls for i, r in enumerate(ordered) for layer, calls in r["outputs"].items()}

    def drafter_events(self) -> dict[str, list[ForwardInputs | ContextRows]]:
        """Per drafter layer on the ring (``record_inputs``; one process records them, the worker): its forwards'
        inputs and its context rows stored, in call order."""
        recorded = [r for r in self.records if r["drafter_events"]]
        if len(recorded) != 1:
            raise EngineRunError(f"{len(recorded)} processes recorded drafter inputs; expected 1 (record_inputs)")
        return recorded[0]["drafter_events"]

    @property
    def acceptance(self) -> float:
        """Accepted draft tokens / draft tokens (vLLM's counters)."""
        drafted = self.spec_decode.get("draft_tokens", 0)
        return self.spec_decode.get("accepted", 0) / drafted if drafted else 0.0


def drafter_layer_names(num_target_layers: int, num_drafter_layers: int) -> list[str]:
    """vLLM numbers a DFlash drafter's layers after the target's (``start_layer_id``)."""
    return [f"model.layers.{num_target_layers + i}.self_attn.attn" for i in range(num_drafter_layers)]


def inherited_switches(spec: EngineRunSpec) -> list[str]:
    """The plugin's switches this process's environment sets and ``spec`` does not: inherited, one would reach every
    run, the references a run is compared with included (an exported window would window a "full" run)."""
    return sorted(name for name in PLUGIN_SWITCHES if name in os.environ and name not in spec.environment)


def run_engine(
    spec: EngineRunSpec,
    *,
    drafter_layers: list[str],
    record_outputs: bool = True,
    record_inputs: bool = False,
    on_progress: Callable[[int], None] | None = None,
    timeout: float = 3600,
) -> EngineRun:
    """Run ``spec`` in a fresh process with the probe on; ``on_progress(tokens computed)`` per scheduler step;
    ``record_inputs``: the drafter layers' ring forward inputs and context rows too (``EngineRun.drafter_events``)."""
    with tempfile.TemporaryDirectory(prefix="ringkv-e2e-") as directory:
        probe = ProbeConfig(directory, drafter_layers, record_outputs, record_inputs, progress=on_progress is not None)
        spec = EngineRunSpec(**{**asdict(spec), "probe": asdict(probe)})
        spec_file = Path(directory) / "spec.json"
        spec_file.write_text(json.dumps(asdict(spec)))
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_") and k != PROBE_ENV}
        for name in inherited_switches(spec):
            warnings.warn(f"ringkv: {name}={env.pop(name)} is set in this process's environment; a lab engine run "
                          "takes the plugin's switches from its own spec (EngineRunSpec.environment), so this run "
                          "(references included) runs without it; unset it", stacklevel=2)  # fmt: skip
        start = time.perf_counter()
        process = subprocess.Popen(
            [sys.executable, "-m", "ringkv.bench.lab.e2e.worker", str(spec_file)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )  # fmt: skip
        lines, result = [], None
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith(PROGRESS_PREFIX) and on_progress is not None:
                on_progress(int(line[len(PROGRESS_PREFIX) :]))
            elif line.startswith(RESULT_PREFIX):
                result = json.loads(line[len(RESULT_PREFIX) :])
            else:
                lines.append(line)
                del lines[:-200]
        code = process.wait(timeout=timeout)
        wall = time.perf_counter() - start
        if code != 0 or result is None:
            raise EngineRunError(f"engine run failed (exit {code}):\n" + "".join(lines[-80:]))
        return EngineRun(
            spec=spec, prompts=result["prompts"], tokens=result["tokens"], spec_decode=result["spec_decode"],
            prefix_cache=result["prefix_cache"], preemptions=result["preemptions"],
            init_seconds=result["init_seconds"], generate_seconds=result["generate_seconds"], wall_seconds=wall,
            records=load_records(directory),
        )  # fmt: skip


def request_index(request_id: str) -> int:
    """The request's index in submission order: the worker names requests by it, vLLM appends ``-<random>``."""
    return int(request_id.rsplit("-", 1)[0])


def held_blocks(run: EngineRun) -> list[dict[str, tuple[int, int]]]:
    """Per scheduler step: request -> (tokens computed before the step, drafter blocks held after it)."""
    return [step.requests for step in run.scheduler["steps"]]


def held_blocks_per_group(run: EngineRun) -> list[dict[str, dict[int, int]]]:
    """Per scheduler step: request -> {drafter KV group index: blocks held after the step}."""
    return [step.groups for step in run.scheduler["steps"]]


def max_output_difference(ring: EngineRun, stock: EngineRun) -> tuple[float, int]:
    """Largest |ring - stock| over every drafter attention output, and how many outputs were compared."""
    ring_outputs, stock_outputs = ring.outputs(), stock.outputs()
    if ring_outputs.keys() != stock_outputs.keys():
        raise EngineRunError(f"recorded layers differ: {sorted(ring_outputs)} vs {sorted(stock_outputs)}")
    worst, compared = 0.0, 0
    for key, calls in ring_outputs.items():
        if len(calls) != len(stock_outputs[key]):
            raise EngineRunError(f"{key}: {len(calls)} ring forwards vs {len(stock_outputs[key])} stock forwards")
        for got, want in zip(calls, stock_outputs[key], strict=True):
            if got.shape != want.shape:
                raise EngineRunError(f"{key}: output shapes {tuple(got.shape)} vs {tuple(want.shape)}")
            worst = max(worst, float((got - want).abs().max()) if got.numel() else 0.0)
            compared += 1
    return worst, compared
