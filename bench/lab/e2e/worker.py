# SPDX-License-Identifier: Apache-2.0
"""One engine run in its own process: ``python -m ringkv.bench.lab.e2e.worker SPEC.json`` (an ``EngineRunSpec``).

vLLM keeps process-wide state (its platform, backend cache, distributed groups), so every configuration gets a
fresh process. With a probe config the worker declares the probe's plugin for its run (``probe_on_path``) before
vLLM is imported, so the engine core and every tensor-parallel worker vLLM starts load it. The requests go in waves
through ``LLMEngine``'s own loop (``add_request`` / ``step`` / ``abort_request``), each wave once the previous one
finished. Prints one line ``RESULT {json}``: the prompts submitted and their greedy tokens, vLLM's spec-decode,
prefix-cache and preemption counters, and timings.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RESULT_PREFIX = "RESULT "
# the drafter's attention: None = no speculative decoding, "stock" = vLLM's choice, "ring" = RINGKV, "rows" =
# RINGKV's kernels over vLLM's own sliding-window rows (its spec left as vLLM made it: the stock layout where
# vLLM's own attention cannot run, as on the GPU wheel on CPU)
DRAFTER_BACKENDS = (None, "stock", "ring", "rows")


@dataclass(frozen=True)
class EngineRunSpec:
    target: str
    drafter: str | None
    drafter_backend: str | None
    # the first wave of prompts
    prompts: list[list[int]]
    max_tokens: int
    # further waves, each submitted once every request of the previous one finished
    later_waves: list[list[list[int]]] = field(default_factory=list)
    # slots (positions in a wave) whose request in a later wave continues the slot's request of the wave before:
    # its prompt = that prompt + its reply + the tokens this wave gives for the slot (a conversation's next turn)
    continued_slots: list[int] = field(default_factory=list)
    # slot (as a string: the spec travels as JSON) -> the previous wave's slot its request continues, where that is
    # another slot (a conversation's branches sent together: several slots continuing one)
    continue_from: dict[str, int] = field(default_factory=dict)
    # request name (its index in submission order, as a string) -> reply length once reached it is aborted at
    # (``LLMEngine.abort_request`` after the step that reached it)
    abort_after_tokens: dict[str, int] = field(default_factory=dict)
    enable_prefix_caching: bool = False
    # speculative tokens N; None: the drafter's own draft block - 1 (its dflash_config block_size)
    num_speculative_tokens: int | None = None
    max_model_len: int = 4096
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 4
    kv_block_size: int = 32
    tensor_parallel_size: int = 1
    # the target's sliding-window layers on RINGKV too (backend_per_kind)
    target_on_ring: bool = False
    kv_cache_gib: int = 1
    # the KV pool in blocks of the unified page (vLLM num_gpu_blocks_override); None: what kv_cache_gib holds
    num_gpu_blocks: int | None = None
    probe: dict[str, Any] | None = None
    dtype: str = "float32"
    # the drafter's own KV cache dtype (vLLM speculative_config.kv_cache_dtype, e.g. "fp8_e4m3"); None inherits
    drafter_kv_cache_dtype: str | None = None
    extra_engine_args: dict[str, Any] = field(default_factory=dict)
    # set in the engine process before vLLM is imported (e.g. VLLM_TARGET_DEVICE)
    environment: dict[str, str] = field(default_factory=dict)
    # "module:function"s the engine process calls before it imports vLLM (e.g. "vllm_cpu_shims:install")
    preload: list[str] = field(default_factory=list)
    # vLLM's async scheduling (its GPU default), which its CPU platform turns off (``async_scheduling.py``)
    async_scheduling: bool = False


def engine_environment(spec: EngineRunSpec) -> dict[str, str]:
    """What the engine process needs: CPU KV space, offline, the interpreter for ringkv's Triton kernels on
    CPU, in-process engine unless tensor parallel, and the probe config."""
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(spec.kv_cache_gib),
        "HF_HUB_OFFLINE": "1",
        "TRITON_INTERPRET": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if spec.tensor_parallel_size == 1 else "1",
    }
    if spec.tensor_parallel_size > 1:
        # vllm-cpu binds each rank's threads to a NUMA node; one core per rank where there are fewer nodes
        cores = os.cpu_count() or 1
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(rank % cores) for rank in range(spec.tensor_parallel_size))
    if spec.probe is not None:
        env["RINGKV_E2E_PROBE"] = json.dumps(spec.probe)
    env.update(spec.environment)
    return env


def probe_on_path(directory: Path) -> None:
    """Declare the probe's ``vllm.general_plugins`` entry point in ``directory`` and put it on this process's
    ``sys.path`` and on ``PYTHONPATH``, which the processes vLLM starts (engine core, tensor-parallel workers)
    inherit: the probe loads in this run's processes only, never in a user's vLLM."""
    from .probe import declare_plugin

    path = str(declare_plugin(directory))
    sys.path.insert(0, path)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (path, os.environ.get("PYTHONPATH")) if p)


def speculative_tokens(spec: EngineRunSpec) -> int:
    """N: the spec's, else the drafter's draft block - 1 (what the DFlash drafter was trained to fill)."""
    if spec.num_speculative_tokens is not None:
        return spec.num_speculative_tokens
    from ringkv.dflash2.config import load_config

    return load_config(spec.drafter).num_speculative_tokens


def engine_kwargs(spec: EngineRunSpec) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "model": spec.target, "skip_tokenizer_init": True, "dtype": spec.dtype, "max_model_len": spec.max_model_len,
        "max_num_batched_tokens": spec.max_num_batched_tokens, "max_num_seqs": spec.max_num_seqs,
        "enforce_eager": True, "seed": 0, "enable_prefix_caching": spec.enable_prefix_caching,
        "block_size": spec.kv_block_size, "num_gpu_blocks_override": spec.num_gpu_blocks, "disable_log_stats": False,
        "tensor_parallel_size": spec.tensor_parallel_size,
        "distributed_executor_backend": "uni" if spec.tensor_parallel_size == 1 else "mp",
    }  # fmt: skip
    if spec.drafter_backend is not None:
        speculative: dict[str, Any] = {
            "method": "dflash", "model": spec.drafter, "num_speculative_tokens": speculative_tokens(spec),
        }  # fmt: skip
        if spec.drafter_backend in ("ring", "rows"):
            # the documented selection
            speculative["attention_backend"] = "RINGKV"
        if spec.drafter_kv_cache_dtype is not None:
            speculative["kv_cache_dtype"] = spec.drafter_kv_cache_dtype
        kwargs["speculative_config"] = speculative
    if spec.target_on_ring:
        kwargs["attention_config"] = {"backend_per_kind": {"sliding_window": "RINGKV"}}
    kwargs.update(spec.extra_engine_args)
    return kwargs


SPEC_DECODE_METRICS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_position",
}
# tokens looked up and found by admissions of requests never preempted (vLLM counts resumed ones apart, unexported)
PREFIX_CACHE_METRICS = {"vllm:prefix_cache_queries": "queries", "vllm:prefix_cache_hits": "hits"}
PREEMPTION_METRICS = {"vllm:num_preemptions": "preemptions"}


def engine_counters(metrics: list[Any], names: dict[str, str]) -> dict[str, Any]:
    """vLLM's counters (``LLM.get_metrics``) named in ``names``, under their short names; a vector stays a list."""
    return {
        names[metric.name]: list(metric.values) if hasattr(metric, "values") else metric.value
        for metric in metrics
        if metric.name in names
    }


def spec_decode_counters(metrics: list[Any]) -> dict[str, Any]:
    """vLLM's spec-decode counters: drafts, draft tokens, accepted, accepted per position."""
    return engine_counters(metrics, SPEC_DECODE_METRICS)


def wave_prompts(
    spec: EngineRunSpec, wave: list[list[int]], previous: list[tuple[list[int], list[int]]]
) -> list[list[int]]:
    """The prompts a wave submits, given the previous wave's (prompt, reply) per slot."""
    sources = {i: i for i in spec.continued_slots} | {int(slot): source for slot, source in spec.continue_from.items()}
    sources = sources if previous else {}
    return [previous[sources[i]][0] + previous[sources[i]][1] + tokens if i in sources else tokens
            for i, tokens in enumerate(wave)]  # fmt: skip


def run_wave(engine: Any, spec: EngineRunSpec, prompts: list[list[int]], first: int, params: Any) -> list[list[int]]:
    """Submit ``prompts`` as requests ``first, first + 1, ...`` and step the engine until none is left, aborting
    those in ``spec.abort_after_tokens`` on the way (an aborted request's reply: the tokens it had by then)."""
    names = [str(first + i) for i in range(len(prompts))]
    for name, prompt in zip(names, prompts, strict=True):
        engine.add_request(name, {"prompt_token_ids": prompt}, params)
    replies: dict[str, list[int]] = {name: [] for name in names}
    pending_aborts = {name: spec.abort_after_tokens[name] for name in names if name in spec.abort_after_tokens}
    while engine.has_unfinished_requests():
        for output in engine.step():
            replies[output.request_id] = list(output.outputs[0].token_ids)
        due = [name for name, length in pending_aborts.items() if len(replies[name]) >= length]
        if due:
            engine.abort_request(due)
            for name in due:
                del pending_aborts[name]
    return [replies[name] for name in names]


def run(spec: EngineRunSpec) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.plugins import load_general_plugins
    from vllm.sampling_params import RequestOutputKind

    start = time.perf_counter()
    if spec.drafter_backend == "rows":
        from ringkv.integration.vllm.backend import RingKVBackend

        RingKVBackend.customize_spec = classmethod(lambda cls, kv_cache_spec: kv_cache_spec)
    # LLM() validates attention_config before it loads plugins: "RINGKV" must be registered first
    load_general_plugins()
    llm = LLM(**engine_kwargs(spec))
    ready = time.perf_counter()
    # cumulative outputs: an aborted request's reply is what it had generated
    params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, detokenize=False, ignore_eos=True,
                            output_kind=RequestOutputKind.CUMULATIVE)  # fmt: skip
    prompts: list[list[int]] = []
    replies: list[list[int]] = []
    previous: list[tuple[list[int], list[int]]] = []
    for wave in [spec.prompts, *spec.later_waves]:
        submitted = wave_prompts(spec, wave, previous)
        tokens = run_wave(llm.llm_engine, spec, submitted, len(prompts), params)
        previous = list(zip(submitted, tokens, strict=True))
        prompts += submitted
        replies += tokens
    done = time.perf_counter()
    metrics = llm.get_metrics()
    result = {
        "prompts": prompts,
        "tokens": replies,
        "spec_decode": spec_decode_counters(metrics),
        "prefix_cache": engine_counters(metrics, PREFIX_CACHE_METRICS),
        **engine_counters(metrics, PREEMPTION_METRICS),
        "init_seconds": ready - start,
        "generate_seconds": done - ready,
    }
    # shuts the scheduler and workers down, which writes the probe records
    llm.llm_engine.engine_core.shutdown()
    return result


def main(argv: list[str]) -> None:
    spec = EngineRunSpec(**json.loads(Path(argv[1]).read_text()))
    if spec.drafter_backend not in DRAFTER_BACKENDS:
        raise SystemExit(f"drafter_backend={spec.drafter_backend!r}; use one of {DRAFTER_BACKENDS}")
    os.environ.update(engine_environment(spec))
    for target in spec.preload:
        module, function = target.split(":")
        getattr(importlib.import_module(module), function)()
    if spec.async_scheduling:
        from .async_scheduling import force_async_scheduling

        force_async_scheduling()
    with tempfile.TemporaryDirectory(prefix="ringkv-e2e-plugin-") as plugins:
        if spec.probe is not None:
            probe_on_path(Path(plugins))
        result = run(spec)
    sys.stdout.write(RESULT_PREFIX + json.dumps({"spec": asdict(spec), **result}) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv)
