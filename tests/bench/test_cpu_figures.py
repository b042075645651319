# SPDX-License-Identifier: Apache-2.0
"""The CPU benchmark figures run (quick form) and say what they should: the ring is flat in context,
admits more requests, and schedules no slower. Timed with pytest-benchmark (disabled in CI: runs once)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.vllm


def test_cpu_figures_quick(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "bench" / "cpu_figures.py"), "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "cpu_figures_quick.jsonl").read_text().splitlines()]
    assert all(row["env"]["commit"] for row in rows)
    ring_bytes = {r["context"]: r["bytes_per_request"] for r in rows if r["figure"] == "drafter_kv_bytes"
                  and r["kind"] == "ring"}  # fmt: skip
    assert len(set(ring_bytes.values())) == 1, "ring KV must not grow with the context"
    concurrent = {r["kind"]: r["requests"] for r in rows if r["figure"] == "max_concurrent"}
    assert concurrent["ring"] > concurrent["stock"] >= concurrent["full"]
    assert (tmp_path / "kv_bytes.png").stat().st_size > 10_000 and (tmp_path / "concurrency.png").exists()


def test_bench_scheduler_step(benchmark):
    """One decode step of the real Scheduler with four running ring requests."""
    from ringkv.integration.simulation.admission import Deployment
    from ringkv.integration.simulation.scheduler_run import build_vllm_config, scheduler_step_times

    deployment = Deployment(pool_blocks=4 * 1900 + 100)
    config = build_vllm_config(deployment)
    times = benchmark(scheduler_step_times, config, deployment, True, 4, 16_384, 5)
    assert len(times) == 5
