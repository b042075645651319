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
    Request,
    RequestStatus,
    Scheduler,
    SchedulerOutput,
    StructuredOutputManager,
    VllmConfig,
    get_hash_fn_by_name,
    get_request_block_hasher,
    init_none_hash,
    runner_output,
)
from .admission import BlockHasher, Deployment, drafter_blocks_held, largest_satisfying, make_request


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
    """vLLM's own config for the deployment (chunked prefill on, prefix caching as the deployment says)."""
    register()
    model_dir = model_dir or write_model_config(
        Path(tempfile.mkdtemp(prefix="ringkv-model-")), deployment.max_model_len
    )
    args = EngineArgs(
        model=str(model_dir), skip_tokenizer_init=True, max_model_len=deployment.max_model_len,
        max_num_batched_tokens=deployment.max_num_batched_tokens, max_num_seqs=deployment.max_num_seqs,
        enable_chunked_prefill=True, enable_prefix_caching=deployment.prefix_caching,
        block_size=deployment.drafter.kv_block_size, enforce_eager=True,
    )  # fmt: skip
    config = args.create_engine_config()
    config.cache_config.num_gpu_blocks = deployment.pool_blocks
    # the simulation hashes requests at the drafter's block in every mode (request_block_hasher, make_scheduler);
    # vLLM's KV connectors key what they store by those hashes at the unit they resolve from this config
    config.cache_config.prefix_match_unit = deployment.drafter.kv_block_size
    return config


def request_block_hasher(config: VllmConfig, deployment: Deployment) -> BlockHasher | None:
    """The block hasher vLLM's engine core gives every request with prefix caching on (None when off): the
    config's hash algorithm over blocks of the drafter's size (the scheduler's ``hash_block_size``)."""
    if not config.cache_config.enable_prefix_caching:
        return None
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(deployment.drafter.kv_block_size, hash_fn)


def make_scheduler(config: VllmConfig, deployment: Deployment, ring: bool) -> Scheduler:
    scheduler = Scheduler(
        config, deployment.kv_cache_config(ring), StructuredOutputManager(config),
        block_size=deployment.target_kv_block_size, hash_block_size=deployment.drafter.kv_block_size,
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
    scheduler.add_request(make_request("probe", num_tokens, 1, request_block_hasher(config, deployment)))
    return bool(scheduler.schedule().num_scheduled_tokens)


def scheduler_largest_admissible(config: VllmConfig, deployment: Deployment, ring: bool) -> int:
    """The longest prompt an empty engine starts; 0 if none."""
    return largest_satisfying(lambda n: scheduler_admits(config, deployment, ring, n), deployment.max_model_len)


@dataclass
class SchedulerTrace:
    """Per step: context_len tokens and drafter blocks held; ``wedged`` if a step scheduled nothing;
    ``prefix_hit``: the tokens the request's admission took from the prefix cache."""

    computed: list[int] = field(default_factory=list)
    drafter_blocks: list[int] = field(default_factory=list)
    finished: bool = False
    wedged: bool = False
    prefix_hit: int = 0


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
    scheduler = make_scheduler(config, deployment, ring)
    request = make_request("r0", num_prompt_tokens, decode_steps * deployment.drafter.lookahead + 1,
                           request_block_hasher(config, deployment))  # fmt: skip
    return _drive(scheduler, request, decode_steps, random.Random(seed), on_step)


@dataclass
class PrefixRerun:
    """A request run, ended, then a second one sharing its prompt as a prefix, on the same engine."""

    first: SchedulerTrace
    second: SchedulerTrace


def scheduler_prefix_rerun(
    config: VllmConfig,
    deployment: Deployment,
    ring: bool,
    num_prompt_tokens: int,
    tail_tokens: int,
    decode_steps: int,
    seed: int = 0,
    on_step: Callable[[int], None] | None = None,
) -> PrefixRerun:
    """``scheduler_run``'s request, ended after its decode steps; then a request of its prompt plus
    ``tail_tokens`` new tokens arrives and runs up to ``decode_steps`` steps (as many as ``max_model_len`` leaves
    room for); its ``prefix_hit`` is what the cache gave it."""
    rng = random.Random(seed)
    scheduler = make_scheduler(config, deployment, ring)
    hasher = request_block_hasher(config, deployment)
    lookahead = deployment.drafter.lookahead
    first = make_request("r0", num_prompt_tokens, decode_steps * lookahead + 1, hasher)
    first_trace = _drive(scheduler, first, decode_steps, rng, on_step)
    if first_trace.wedged:
        return PrefixRerun(first_trace, SchedulerTrace(wedged=True))
    scheduler.finish_requests("r0", RequestStatus.FINISHED_ABORTED)
    # the tail's token (2) differs from the first request's sampled tokens (1): the shared prefix is the prompt
    prompt = [*first.prompt_token_ids, *[2] * tail_tokens]
    steps = min(decode_steps, (deployment.max_model_len - len(prompt)) // lookahead)
    second = make_request("r1", prompt, steps * lookahead + 1, hasher)
    return PrefixRerun(first_trace, _drive(scheduler, second, steps, rng, on_step))


def _drive(
    scheduler: Scheduler, request: Request, decode_steps: int, rng: random.Random, on_step: Callable[[int], None] | None
) -> SchedulerTrace:
    """Add ``request`` to an idle engine and step it through its prefill and ``decode_steps`` speculative steps."""
    rid = request.request_id
    scheduler.add_request(request)
    trace = SchedulerTrace()
    drafts = scheduler.num_spec_tokens
    decodes = 0
    while decodes < decode_steps:
        output = scheduler.schedule()
        scheduled = output.num_scheduled_tokens.get(rid, 0)
        if not scheduled:
            trace.wedged = True
            break
        if not trace.computed:
            trace.prefix_hit = output.scheduled_new_reqs[0].num_computed_tokens
        speculated = len(output.scheduled_spec_decode_tokens.get(rid, ()))
        sampled = fake_sample(request, speculated, rng)
        decodes += bool(speculated)
        scheduler.update_from_output(output, runner_output([rid], [sampled]))
        if sampled:
            scheduler.update_draft_token_ids(DraftTokenIds([rid], [[1] * drafts]))
        trace.computed.append(request.num_computed_tokens)
        trace.drafter_blocks.append(drafter_blocks_held(scheduler.kv_cache_manager, rid))
        if on_step is not None:
            on_step(request.num_computed_tokens)
    trace.finished = not trace.wedged
    return trace


def fake_sample(request: Request, num_drafts: int, rng: random.Random) -> list[int]:
    """What the model samples for a request ``schedule()`` just scheduled with ``num_drafts`` drafts: nothing
    while its prompt (or a preempted request's recompute) is unfinished, else the bonus token plus 0..num_drafts
    accepted drafts, drawn from ``rng``."""
    if request.num_computed_tokens < request.num_tokens:
        return []
    return [1] * (1 + (rng.randint(0, num_drafts) if num_drafts else 0))


def _runner_output(
    scheduler: Scheduler, output: SchedulerOutput, rng: random.Random
) -> tuple[ModelRunnerOutput, list[str]]:
    """``fake_sample`` for every scheduled request."""
    ids = list(output.num_scheduled_tokens)
    sampled = [fake_sample(scheduler.requests[rid], len(output.scheduled_spec_decode_tokens.get(rid, ())), rng)
               for rid in ids]  # fmt: skip
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
        runner_output, ids = _runner_output(scheduler, output, rng)
        start = time.perf_counter()
        scheduler.update_from_output(output, runner_output)
        updated = time.perf_counter() - start
        scheduler.update_draft_token_ids(DraftTokenIds(ids, [[1] * drafts for _ in ids]))
        if decoding:
            timings.append(scheduled + updated)
    return timings
