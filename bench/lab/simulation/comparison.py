# SPDX-License-Identifier: Apache-2.0
"""vLLM #55800, stock drafter vs the ring, under vLLM's real Scheduler (``ringkv admission``): which prompts each
admits, the largest it admits, then one scheduler run per drafter of the prompt (and, where the stock drafter
admits less, one of its largest); with prefix caching each run's prompt plus a tail arrives again after it ends."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace

from ringkv.kernels.testing import ISSUE_55800

from .admission import Deployment
from .scheduler_run import (
    SchedulerTrace,
    build_vllm_config,
    scheduler_admits,
    scheduler_largest_admissible,
    scheduler_prefix_rerun,
    scheduler_run,
)

# (description, total tokens) -> a context whose value takes the tokens computed so far, step by step
Track = Callable[[str, int], AbstractContextManager[Callable[[int], None]]]


def drafter_label(ring: bool) -> str:
    return "ringkv ring" if ring else "stock vLLM"


@contextlib.contextmanager
def untracked(description: str, total: int) -> Iterator[Callable[[int], None]]:
    yield lambda computed: None


def issue_deployment(
    *,
    pool_blocks: int,
    target_groups: int,
    target_kv_block_size: int,
    window: int,
    drafter_kv_block_size: int,
    num_speculative_tokens: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    async_scheduling: bool,
    prefix_caching: bool,
) -> Deployment:
    """The #55800 drafter (``ISSUE_55800``) with this window, KV block and N, in this deployment."""
    drafter = replace(ISSUE_55800, window=window, kv_block_size=drafter_kv_block_size,
                      num_speculative_tokens=num_speculative_tokens)  # fmt: skip
    return Deployment(
        pool_blocks=pool_blocks, target_groups=target_groups, target_kv_block_size=target_kv_block_size,
        drafter=drafter,
        max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens, async_scheduling=async_scheduling,
        prefix_caching=prefix_caching,
    )  # fmt: skip


@dataclass(frozen=True)
class AdmissionRun:
    """One scheduler run: its drafter, its prompt, its trace; with prefix caching, the second request's."""

    ring: bool
    prompt: int
    trace: SchedulerTrace
    second: SchedulerTrace | None


@dataclass(frozen=True)
class AdmissionComparison:
    deployment: Deployment
    # prompt tokens -> (stock admits it, ring admits it), the prompt and max_model_len in ascending order
    admits: dict[int, tuple[bool, bool]]
    # ring -> the largest prompt admitted
    largest: dict[bool, int]
    runs: list[AdmissionRun]

    def series(self) -> dict[str, tuple[list[int], list[int]]]:
        """The plot's series: per run (and its second request) with steps, tokens computed and drafter blocks held
        per step."""
        series = {}
        for run in self.runs:
            label = f"{drafter_label(run.ring)} ({run.prompt}-token prompt)"
            if run.trace.computed:
                series[label] = (run.trace.computed, run.trace.drafter_blocks)
            if run.second is not None and run.second.computed:
                series[f"{label}, second request"] = (run.second.computed, run.second.drafter_blocks)
        return series


def compare_admission(
    deployment: Deployment, prompt: int, decode_steps: int, tail_tokens: int, seed: int, track: Track = untracked
) -> AdmissionComparison:
    """Stock vs ring for a ``prompt``-token request and ``decode_steps`` decode steps (``tail_tokens``: the second
    request's new tokens, with prefix caching); ``track`` follows each run's prefill."""
    config = build_vllm_config(deployment)
    largest = {ring: scheduler_largest_admissible(config, deployment, ring) for ring in (False, True)}
    admits = {
        probe: (scheduler_admits(config, deployment, False, probe), scheduler_admits(config, deployment, True, probe))
        for probe in sorted({prompt, deployment.max_model_len})
    }
    plan = [(False, prompt), (True, prompt)]
    if 0 < largest[False] < prompt:
        plan.insert(1, (False, largest[False]))
    runs = []
    for ring, run_prompt in plan:
        with track(f"{drafter_label(ring)}, {run_prompt:,}-token prompt", run_prompt) as on_step:
            if deployment.prefix_caching:
                rerun = scheduler_prefix_rerun(config, deployment, ring, run_prompt, tail_tokens, decode_steps,
                                               seed=seed, on_step=on_step)  # fmt: skip
                trace, second = rerun.first, rerun.second
            else:
                trace, second = scheduler_run(config, deployment, ring, run_prompt, decode_steps, seed=seed,
                                              on_step=on_step), None  # fmt: skip
        runs.append(AdmissionRun(ring, run_prompt, trace, second))
    return AdmissionComparison(deployment, admits, largest, runs)
