# SPDX-License-Identifier: Apache-2.0
"""vLLM #55800 under vLLM's real ``Scheduler`` on CPU: a config-only model (no weights), the deployment's
KV-cache groups, chunked prefill, then speculative decode steps with random rejections.

CPU vLLM turns async scheduling off (one batch in flight). With ``async_scheduling`` the stock drafter's
admission cap is set to what a GPU deployment computes (``cdiv(W - 1 + 2 * max_num_batched_tokens, bs) + 1``);
the ring's need does not depend on it. The scheduler's lookahead is DFlash's ``num_speculative_tokens + 1``
(a real ``SpeculativeConfig`` would need a draft checkpoint).
"""

from __future__ import annotations

import json
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ringkv.integration.vllm import register

from ._vllm import (
    DraftTokenIds,
    EngineArgs,
    ModelRunnerOutput,
    Scheduler,
    StructuredOutputManager,
    VllmConfig,
    runner_output,
)
from .admission import Deployment, drafter_blocks_held, largest_satisfying, make_request


def write_model_config(folder: Path, max_model_len: int) -> Path:
    """A tiny Llama ``config.json`` (the scheduler reads the config only; no weights are loaded)."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024, "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "max_position_embeddings": max_model_len, "bos_token_id": 1, "eos_token_id": 2,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def build_vllm_config(deployment: Deployment, model_dir: Path | None = None) -> VllmConfig:
    """vLLM's own config for the deployment (prefix caching off, chunked prefill on)."""
    register()
    model_dir = model_dir or write_model_config(
        Path(tempfile.mkdtemp(prefix="ringkv-model-")), deployment.max_model_len
    )
    args = EngineArgs(
        model=str(model_dir), skip_tokenizer_init=True, max_model_len=deployment.max_model_len,
        max_num_batched_tokens=deployment.max_num_batched_tokens, max_num_seqs=deployment.max_num_seqs,
        enable_chunked_prefill=True, enable_prefix_caching=False, block_size=deployment.drafter.block_size,
        enforce_eager=True,
    )  # fmt: skip
    config = args.create_engine_config()
    config.cache_config.num_gpu_blocks = deployment.pool_blocks
    return config


def make_scheduler(config: VllmConfig, deployment: Deployment, ring: bool) -> Scheduler:
    scheduler = Scheduler(
        config, deployment.kv_cache_config(ring), StructuredOutputManager(config),
        block_size=deployment.target_block_size, hash_block_size=deployment.drafter.block_size,
    )  # fmt: skip
    scheduler.num_lookahead_tokens = deployment.drafter.lookahead
    scheduler.num_spec_tokens = deployment.drafter.num_speculative_tokens
    if deployment.async_scheduling and not ring:
        drafter = scheduler.kv_cache_manager.coordinator.single_type_managers[-1]
        drafter.max_admission_blocks_per_request = drafter.kv_cache_spec.max_admission_blocks_per_request(
            deployment.max_in_flight_tokens, deployment.max_model_len
        )
    return scheduler


def scheduler_admits(config: VllmConfig, deployment: Deployment, ring: bool, num_tokens: int) -> bool:
    """Does one ``schedule()`` on an empty engine start a ``num_tokens`` prompt?"""
    scheduler = make_scheduler(config, deployment, ring)
    scheduler.add_request(make_request("probe", num_tokens, max_tokens=1))
    return bool(scheduler.schedule().num_scheduled_tokens)


def scheduler_largest_admissible(config: VllmConfig, deployment: Deployment, ring: bool) -> int:
    """The longest prompt an empty engine starts; 0 if none."""
    return largest_satisfying(lambda n: scheduler_admits(config, deployment, ring, n), deployment.max_model_len)


@dataclass
class SchedulerTrace:
    """Per step: context_len tokens and drafter blocks held; ``wedged`` if a step scheduled nothing."""

    computed: list[int] = field(default_factory=list)
    drafter_blocks: list[int] = field(default_factory=list)
    finished: bool = False
    wedged: bool = False


def scheduler_run(
    config: VllmConfig,
    deployment: Deployment,
    ring: bool,
    num_prompt_tokens: int,
    decode_steps: int,
    seed: int = 0,
    on_step: Callable[[int], None] | None = None,
) -> SchedulerTrace:
    """One request: chunked prefill, then ``decode_steps`` speculative steps (N drafts, 0..N accepted)."""
    rng = random.Random(seed)
    scheduler = make_scheduler(config, deployment, ring)
    request = make_request("r0", num_prompt_tokens, max_tokens=decode_steps * (deployment.drafter.lookahead) + 1)
    scheduler.add_request(request)
    trace = SchedulerTrace()
    drafts = deployment.drafter.num_speculative_tokens
    decodes = 0
    while decodes < decode_steps:
        output = scheduler.schedule()
        scheduled = output.num_scheduled_tokens.get("r0", 0)
        if not scheduled:
            trace.wedged = True
            break
        prefilling = request.num_computed_tokens + scheduled < request.num_prompt_tokens
        if prefilling:
            sampled: list[int] = []
        else:
            speculated = len(output.scheduled_spec_decode_tokens.get("r0", ()))
            sampled = [1] * (1 + (rng.randint(0, speculated) if speculated else 0))
            decodes += bool(speculated)
        scheduler.update_from_output(output, runner_output(["r0"], [sampled]))
        if sampled:
            scheduler.update_draft_token_ids(DraftTokenIds(["r0"], [[1] * drafts]))
        trace.computed.append(request.num_computed_tokens)
        trace.drafter_blocks.append(drafter_blocks_held(scheduler.kv_cache_manager, "r0"))
        if on_step is not None:
            on_step(request.num_computed_tokens)
    trace.finished = not trace.wedged
    return trace


def _runner_output(output, accept: Callable[[], int]) -> tuple[ModelRunnerOutput, list[str]]:
    """Sampled tokens for every scheduled request: nothing mid-prefill, else 1 + accepted drafts."""
    ids = list(output.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        speculated = len(output.scheduled_spec_decode_tokens.get(rid, ()))
        finishing_prefill = rid not in output.scheduled_spec_decode_tokens
        sampled.append([1] * (1 + accept() % (speculated + 1)) if speculated or finishing_prefill else [])
    return runner_output(ids, sampled), ids


def scheduler_step_times(
    config: VllmConfig, deployment: Deployment, ring: bool, num_requests: int, context: int, steps: int, seed: int = 0
) -> list[float]:
    """Seconds of ``schedule()`` + ``update_from_output()`` per decode step with ``num_requests`` running
    requests of ``context`` tokens (prefilled first, untimed)."""
    import time

    rng = random.Random(seed)
    scheduler = make_scheduler(config, deployment, ring)
    requests = [make_request(f"r{i}", context, max_tokens=1 << 20) for i in range(num_requests)]
    for request in requests:
        scheduler.add_request(request)
    drafts = deployment.drafter.num_speculative_tokens
    timings: list[float] = []
    while len(timings) < steps:
        decoding = all(r.num_computed_tokens >= r.num_prompt_tokens for r in requests)
        start = time.perf_counter()
        output = scheduler.schedule()
        scheduled = time.perf_counter() - start
        if not output.num_scheduled_tokens:
            raise RuntimeError(f"{num_requests} x {context} tokens do not fit the pool ({deployment.pool_blocks})")
        runner_output, ids = _runner_output(output, lambda: rng.randrange(1 << 16))
        start = time.perf_counter()
        scheduler.update_from_output(output, runner_output)
        updated = time.perf_counter() - start
        scheduler.update_draft_token_ids(DraftTokenIds(ids, [[1] * drafts for _ in ids]))
        if decoding:
            timings.append(scheduled + updated)
    return timings
