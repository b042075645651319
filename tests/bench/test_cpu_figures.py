# SPDX-License-Identifier: Apache-2.0
"""The CPU benchmark figures run (quick form, through ``ringkv bench cpu-figures``) and say what they should: the
ring is flat in context and admits more requests."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm


def test_cpu_figures_quick(tmp_path):
    done = subprocess.run([sys.executable, "-m", "ringkv.bench.cli", "bench", "cpu-figures", "--quick",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "cpu_figures_quick.jsonl").read_text().splitlines()]
    assert all(row["env"]["commit"] for row in rows)
    ring_bytes = {r["context"]: r["bytes_per_request"] for r in rows if r["figure"] == "drafter_kv_bytes"
                  and r["kind"] == "ring"}  # fmt: skip
    assert len(set(ring_bytes.values())) == 1, "ring KV must not grow with the context"
    concurrent = {r["kind"]: r["requests"] for r in rows if r["figure"] == "max_concurrent"}
    assert concurrent["ring"] > concurrent["stock"] >= concurrent["full"]
    assert (tmp_path / "kv_bytes.png").stat().st_size > 10_000 and (tmp_path / "concurrency.png").exists()
