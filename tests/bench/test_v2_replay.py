# SPDX-License-Identifier: Apache-2.0
"""The GPU check's V2 drafter replay (``bench/v2_replay.py``) in its CPU form: every step eagerly under the
interpreter, each row held to the same checks a GPU run's replays are."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch


@pytest.mark.interpreter
def test_v2_replay_smoke_steps_pass_every_check():
    from ringkv.bench.gpu_check import SMOKE_SHAPE
    from ringkv.bench.v2_replay import SMOKE_SIZES, v2_replay_rows

    rows = v2_replay_rows(SMOKE_SHAPE, torch.device("cpu"), smoke=True)
    assert all("error" not in row for row in rows), rows
    graph_sizes, steps = SMOKE_SIZES[0], SMOKE_SIZES[1]
    assert [row["graph_reqs"] for row in rows] == [n for n in graph_sizes for _ in range(steps)]
    # padded requests (seq_len 0, query_len 0) in some step of a graph larger than its batch
    assert any(row["active"] < row["graph_reqs"] for row in rows)
    assert all(row["ok"] for row in rows), [row for row in rows if not row["ok"]]


def test_the_gpu_side_imports_no_vllm():
    """The GPU machine has no vLLM: the replay and the kernel calls it shares with the impl must not need it."""
    code = "import sys; sys.modules['vllm'] = None; import ringkv.bench.v2_replay"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
