# SPDX-License-Identifier: Apache-2.0
"""Instrumentation for engine-level runs, installed in every vLLM process of a run by the ``ringkv_e2e_probe``
entry point the e2e worker declares for its run alone (``declare_plugin``; no install of ringkv carries it) when
``RINGKV_E2E_PROBE`` names a JSON probe config (``ProbeConfig``); a no-op otherwise.

Per process it records, and writes to ``<dir>/probe-<pid>.pt`` when the scheduler or a worker shuts down:
- calls of ringkv's impl per layer (``forward``, ``do_kv_cache_update``);
- for the layers in ``record_layers``, every attention output of either backend (ring or vLLM's CPU one);
- with ``record_inputs``, for those layers on the ring, every forward's inputs (what a dense oracle needs) and
  every context K/V row stored, with its position (DFlash's ``precompute_and_store_context_kv``);
- at every scheduler step, per running request, its tokens computed before the step and the drafter group's
  distinct physical blocks it holds after it;
- every admission from the waiting queue: the request's tokens, the prefix hit vLLM granted, whether it resumes
  after a preemption;
- the scheduler's class and the most output placeholders (steps in flight) a running request had;
- torch.compile's graphs and graph breaks in the process (``enforce_eager`` off);
- at scheduler shutdown, the block pool's free blocks against its size.
"""

from __future__ import annotations

import functools
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ENV = "RINGKV_E2E_PROBE"
PLUGIN = "ringkv_e2e_probe"


@dataclass
class ProbeConfig:
    directory: str
    # layer names whose attention outputs are recorded (the drafter's), and whose KV group is the drafter's
    drafter_layers: list[str] = field(default_factory=list)
    record_outputs: bool = True
    # the drafter layers' ring forward inputs and context K/V rows by position (ForwardInputs, ContextRows)
    record_inputs: bool = False
    # print "PROGRESS <tokens computed>" after every scheduler step (the runner's progress bar)
    progress: bool = False


@dataclass
class ForwardInputs:
    """One ring forward of a recorded layer: its rows (``q [n, Hq, D]``, ``k``/``v [n, Hkv, D]``), vLLM's batch
    layout, and the attention rule the layer served."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    causal: bool
    window: int
    sink_tokens: int
    scale: float


@dataclass
class ContextRows:
    """Context K/V rows one ``do_kv_cache_update`` of a recorded layer was handed, at their absolute positions, and
    which of them it stored (``stored [n]``: a slot, not PAD). An unstored row's position may be a placeholder: Model
    Runner V2's DFlash prepare kernel gives a rejected row position 0 and PAD (so its K/V are not position 0's), and
    PADs the rows of null (dead) blocks, whose positions are real."""

    positions: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    stored: torch.Tensor


@dataclass
class SchedulerStep:
    """One ``schedule()``: per running request, (tokens computed before the step, drafter blocks held after it).
    A request admitted by the step starts from its prefix hit. ``groups``: per running request, the blocks it holds
    after the step in each of the drafter's KV groups, by group index (a drafter whose rings differ, as a sliding
    layer's and a windowed full layer's with sinks, has several)."""

    requests: dict[str, tuple[int, int]]
    groups: dict[str, dict[int, int]] = field(default_factory=dict)


@dataclass
class Admission:
    """A request taken from the waiting queue (``KVCacheManager.record_prefix_cache_stats``, called once per
    admission with the hit the request starts from, after every cap on it)."""

    request_id: str
    num_tokens: int
    hit: int
    # admitted again after a preemption (vLLM counts these apart from its prefix_cache_* counters)
    resumed: bool


@dataclass
class BlockPool:
    """The scheduler's block pool at shutdown. ``free`` counts cached-but-unreferenced blocks too (they sit in
    the free queue), so with nothing running ``free == num_blocks - 1`` (the null block) unless a block leaked."""

    num_blocks: int
    free: int


@dataclass
class ProbeRecord:
    pid: int
    forward_calls: Counter = field(default_factory=Counter)
    kv_update_calls: Counter = field(default_factory=Counter)
    outputs: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    # record_inputs: per drafter layer on the ring, its forwards and context stores in call order
    drafter_events: dict[str, list[ForwardInputs | ContextRows]] = field(default_factory=dict)
    steps: list[SchedulerStep] = field(default_factory=list)
    admissions: list[Admission] = field(default_factory=list)
    pool_at_shutdown: BlockPool | None = None
    ring_blocks: int | None = None
    drafter_kv_block_size: int | None = None
    # the scheduler's KV groups: (spec class name, layer names)
    kv_cache_groups: list[tuple[str, list[str]]] = field(default_factory=list)
    # the scheduler's class (vLLM's AsyncScheduler under async scheduling), and the most output placeholders (tokens
    # of steps scheduled but not yet processed) any running request had after a schedule()
    scheduler_class: str | None = None
    max_output_placeholders: int = 0
    # torch.compile in this process (enforce_eager off): graphs compiled, and graph breaks (torch._dynamo's counters)
    compiled_graphs: int = 0
    graph_breaks: int = 0


_record: ProbeRecord | None = None
_config: ProbeConfig | None = None
# the positions of the context rows DFlash's precompute_and_store_context_kv is storing, layer by layer
_context_positions: torch.Tensor | None = None


def _save() -> None:
    if _record is None or _config is None:
        return
    from torch._dynamo.utils import counters

    _record.compiled_graphs = int(counters["stats"].get("unique_graphs", 0))
    _record.graph_breaks = sum(counters["graph_break"].values())
    path = Path(_config.directory) / f"probe-{_record.pid}.pt"
    torch.save(_record.__dict__, path)


def _wrap(owner: type, name: str, make: Any) -> None:
    original = getattr(owner, name)
    if getattr(original, "_ringkv_probe", False):
        return
    wrapped = functools.wraps(original)(make(original))
    wrapped._ringkv_probe = True
    setattr(owner, name, wrapped)


def _record_output(layer: Any, output: torch.Tensor, rows: int) -> None:
    if _config is not None and _config.record_outputs and layer.layer_name in _config.drafter_layers:
        _record.outputs.setdefault(layer.layer_name, []).append(output[:rows].detach().float().cpu().clone())


def _recording_inputs(layer: Any) -> bool:
    return _config is not None and _config.record_inputs and layer.layer_name in _config.drafter_layers


def _copy(tensor: torch.Tensor, rows: int, heads: int) -> torch.Tensor:
    return tensor[:rows].detach().float().cpu().reshape(rows, heads, -1).clone()


def _record_inputs(impl: Any, layer: Any, query, key, value, md: Any) -> None:
    n = md.num_actual_tokens
    _record.drafter_events.setdefault(layer.layer_name, []).append(ForwardInputs(
        _copy(query, n, impl.num_heads), _copy(key, n, impl.num_kv_heads), _copy(value, n, impl.num_kv_heads),
        md.query_start_loc.cpu().clone(), md.seq_lens.cpu().clone(), md.causal, impl.served_window(md),
        md.sink_tokens, impl.scale))  # fmt: skip


def _record_context(impl: Any, layer: Any, key, value, slot_mapping) -> None:
    n = key.shape[0]
    assert _context_positions is not None and _context_positions.shape[0] >= n, "context rows without positions"
    _record.drafter_events.setdefault(layer.layer_name, []).append(ContextRows(
        _context_positions[:n].cpu().clone(), _copy(key, n, impl.num_kv_heads), _copy(value, n, impl.num_kv_heads),
        (slot_mapping[:n] >= 0).cpu().clone(),
    ))  # fmt: skip


def _attention_probes() -> None:
    from ringkv.integration.vllm.impl import RingKVImpl
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    def ring_forward(original):
        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
            result = original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
            if attn_metadata is not None:
                _record.forward_calls[layer.layer_name] += 1
                _record_output(layer, result, attn_metadata.num_actual_tokens)
                if _recording_inputs(layer):
                    _record_inputs(self, layer, query, key, value, attn_metadata)
            return result

        return forward

    def kv_update(original):
        def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
            _record.kv_update_calls[layer.layer_name] += 1
            if _recording_inputs(layer):
                _record_context(self, layer, key, value, slot_mapping)
            return original(self, layer, key, value, kv_cache, slot_mapping)

        return do_kv_cache_update

    def cpu_forward(original):
        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
            result = original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
            if attn_metadata is not None:
                _record_output(layer, result, query.shape[0])
            return result

        return forward

    _wrap(RingKVImpl, "forward", ring_forward)
    _wrap(RingKVImpl, "do_kv_cache_update", kv_update)
    _wrap(CPUAttentionBackendImpl, "forward", cpu_forward)


def _context_probes() -> None:
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    def precompute(original):
        def precompute_and_store_context_kv(self, context_states, context_positions, *args, **kwargs):
            global _context_positions
            _context_positions = context_positions
            try:
                return original(self, context_states, context_positions, *args, **kwargs)
            finally:
                _context_positions = None

        return precompute_and_store_context_kv

    _wrap(DFlashQwen3Model, "precompute_and_store_context_kv", precompute)


def _held_blocks(manager: Any, request_id: str) -> int:
    rings = getattr(manager, "rings", None)
    if rings is not None:
        ring = rings.get(request_id)
        return 0 if ring is None else len(ring.blocks)
    return len({b.block_id for b in manager.req_to_blocks.get(request_id, ()) if not b.is_null})


def _scheduler_probes() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    def schedule(original):
        def wrapped(self, *args, **kwargs):
            group = _drafter_group(self)
            _record.kv_cache_groups = [(type(g.kv_cache_spec).__name__, list(g.layer_names))
                                       for g in self.kv_cache_config.kv_cache_groups]  # fmt: skip
            output = original(self, *args, **kwargs)
            _record.scheduler_class = type(self).__name__
            _record.max_output_placeholders = max(
                [_record.max_output_placeholders, *(getattr(r, "num_output_placeholders", 0) for r in self.running)]
            )
            if group is not None:
                manager = self.kv_cache_manager.coordinator.single_type_managers[group]
                _record.ring_blocks = getattr(manager, "ring_blocks", None)
                _record.drafter_kv_block_size = manager.block_size
                # schedule() has already advanced num_computed_tokens by the step's scheduled tokens
                scheduled = output.num_scheduled_tokens
                held = {r.request_id: (r.num_computed_tokens - scheduled.get(r.request_id, 0),
                                       _held_blocks(manager, r.request_id))
                        for r in self.running}  # fmt: skip
                managers = self.kv_cache_manager.coordinator.single_type_managers
                indices = _drafter_groups(self)
                groups = {r.request_id: {g: _held_blocks(managers[g], r.request_id) for g in indices}
                          for r in self.running}  # fmt: skip
                _record.steps.append(SchedulerStep(held, groups))
            if _config.progress:
                computed = sum(r.num_computed_tokens for r in self.running)
                print(f"PROGRESS {computed}", flush=True)  # read by the runner
            return output

        return wrapped

    def record_admission(original):
        def wrapped(self, request, num_hits, *args, **kwargs):
            resumed = request.num_preemptions > 0
            _record.admissions.append(Admission(request.request_id, request.num_tokens, num_hits, resumed))
            return original(self, request, num_hits, *args, **kwargs)

        return wrapped

    def shutdown(original):
        def wrapped(self, *args, **kwargs):
            pool = self.kv_cache_manager.block_pool
            _record.pool_at_shutdown = BlockPool(pool.num_gpu_blocks, pool.get_num_free_blocks())
            _save()
            return original(self, *args, **kwargs)

        return wrapped

    _wrap(Scheduler, "schedule", schedule)
    _wrap(KVCacheManager, "record_prefix_cache_stats", record_admission)
    _wrap(Scheduler, "shutdown", shutdown)


def _drafter_groups(scheduler: Any) -> list[int]:
    """The KV groups holding the drafter's layers, by index."""
    names = set(_config.drafter_layers)
    groups = scheduler.kv_cache_config.kv_cache_groups
    return [index for index, group in enumerate(groups) if names & set(group.layer_names)]


def _drafter_group(scheduler: Any) -> int | None:
    """The KV group of the drafter's layers; of its sliding-window group where it has full layers too."""
    groups = [(index, scheduler.kv_cache_config.kv_cache_groups[index]) for index in _drafter_groups(scheduler)]
    sliding = [index for index, group in groups if getattr(group.kv_cache_spec, "sliding_window", None)]
    return (sliding or [index for index, _ in groups] or [None])[0]


def _saving_first(original):
    """A shutdown that writes this process's record first."""

    def shutdown(self, *args, **kwargs):
        _save()
        return original(self, *args, **kwargs)

    return shutdown


def _worker_probes() -> None:
    from vllm.v1.worker.gpu_worker import Worker

    _wrap(Worker, "shutdown", _saving_first)


def declare_plugin(directory: Path) -> Path:
    """Write into ``directory`` a ``dist-info`` declaring ``install`` as the ``vllm.general_plugins`` entry point
    ``ringkv_e2e_probe``, and return ``directory``. vLLM finds general plugins through entry points only, and
    ``importlib.metadata`` reads ``*.dist-info/entry_points.txt`` in every ``sys.path`` folder: with ``directory``
    on ``sys.path`` (and on ``PYTHONPATH`` for the processes vLLM starts) every vLLM process of the run loads it."""
    info = directory / f"{PLUGIN}-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN}\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{PLUGIN} = {__name__}:install\n")
    return directory


def install() -> None:
    """The ``ringkv_e2e_probe`` plugin: instrument this process when ``RINGKV_E2E_PROBE`` is set."""
    global _record, _config
    raw = os.environ.get(ENV)
    if not raw or _record is not None:
        return
    _config = ProbeConfig(**json.loads(raw))
    _record = ProbeRecord(pid=os.getpid())
    _attention_probes()
    if _config.record_inputs:
        _context_probes()
    _scheduler_probes()
    _worker_probes()


def load_records(directory: str | Path) -> list[dict[str, Any]]:
    """Every probe file one run left (one per vLLM process that shut down)."""
    return [torch.load(path, weights_only=False) for path in sorted(Path(directory).glob("probe-*.pt"))]
