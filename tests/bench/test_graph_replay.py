# SPDX-License-Identifier: Apache-2.0
"""The GPU check's CUDA-graph case (``bench/graph_replay.py``) in its CPU form: the replay sequence eagerly under the
interpreter, each row held to the checks a GPU run's replays are, and each check seen failing on a wrong replay."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from ringkv.bench import graph_replay

CPU = torch.device("cpu")


@pytest.mark.interpreter
def test_the_smoke_replays_are_bitwise_eager_across_wraps_and_padding():
    rows = graph_replay.graph_replay_rows(CPU, smoke=True)
    assert all("error" not in row for row in rows), rows
    assert all(row["ok"] for row in rows), [row for row in rows if not row["ok"]]
    assert all(row["bitwise_out"] and row["bitwise_ring"] and row["launch_as_captured"] for row in rows)
    shape, graph_sizes, _ = graph_replay.SMOKE_SIZES
    slots, la = shape.plan.num_slots, shape.lookahead
    assert sorted({row["graph_reqs"] for row in rows}) == sorted(graph_sizes)
    # padded requests (zero-length queries) and padded token rows (slot PAD)
    assert any(row["active"] < row["graph_reqs"] for row in rows)
    assert any(sum(row["query_lens"]) < row["graph_reqs"] * la for row in rows)
    # a draft block across the ring's wrap; seven wraps deep, then back before the first wrap
    spans = [(p, p + q - 1) for row in rows for p, q in zip(row["context_lens"], row["query_lens"], strict=True)]
    assert any(lo // slots != hi // slots for lo, hi in spans)
    wraps = [row["ring_wraps"] for row in rows if row["graph_reqs"] == graph_sizes[0]]
    assert max(wraps) >= 7 and wraps[wraps.index(max(wraps)) + 1] == 0
    # the split-and-merge path and the one-split path
    assert {tuple(row["num_splits"]) for row in rows} == {(2, 2), (1, 1)}


def wrong_replay(monkeypatch, damage: Callable[[graph_replay.Buffers], None]) -> None:
    """Every "replay" runs the captured call, then ``damage`` on the graph's buffers (never on the eager copy)."""
    attended = []
    attend = graph_replay.attend

    def recording_attend(buffers, *args):
        attended.append(buffers)
        attend(buffers, *args)

    def capture(call, device):
        def replay():
            call()
            damage(attended[-1])

        return replay

    monkeypatch.setattr(graph_replay, "attend", recording_attend)
    monkeypatch.setattr(graph_replay, "capture", capture)


def smoke_rows(graph_reqs: int = 3) -> list[dict]:
    shape, _, deepest = graph_replay.SMOKE_SIZES
    return graph_replay.graph_rows(shape, graph_reqs, deepest, torch.bfloat16, CPU, seed=graph_reqs)


@pytest.mark.interpreter
def test_a_corrupted_output_fails_the_bitwise_check(monkeypatch):
    def corrupt(buffers):
        buffers.out[0, 0, 0] += 1

    wrong_replay(monkeypatch, corrupt)
    rows = smoke_rows()
    assert not any(row["bitwise_out"] or row["ok"] for row in rows), rows
    assert all(row["bitwise_ring"] and row["ring_changed_only_at_real_rows"] for row in rows)


@pytest.mark.interpreter
def test_a_stray_write_into_a_poisoned_slot_fails(monkeypatch):
    def write_null_block(buffers):
        # what a padded request (block-table row 0) or a padded token row writing slot 0 would do
        buffers.kv_cache[0, 0, 0] = 1.0

    wrong_replay(monkeypatch, write_null_block)
    rows = smoke_rows()
    assert not any(row["ring_changed_only_at_real_rows"] or row["bitwise_ring"] or row["ok"] for row in rows), rows
    assert all(row["bitwise_out"] for row in rows)


@pytest.mark.interpreter
def test_a_replay_whose_eager_launch_differs_from_the_captured_one_fails(monkeypatch):
    """After the capture the GPU grows from the interpreter's one SM to 64: the eager launch of a 3-request graph
    splits the window, the captured one did not."""
    capture = graph_replay.capture

    def capture_then_grow(call, device):
        replay = capture(call, device)
        monkeypatch.setattr("ringkv.kernels.attention.device_sms", lambda device: 64)
        return replay

    monkeypatch.setattr(graph_replay, "capture", capture_then_grow)
    rows = smoke_rows()
    assert all(row["num_splits"] == [1, 2] for row in rows), rows
    assert not any(row["launch_as_captured"] or row["ok"] for row in rows)


def test_the_gpu_script_imports_no_vllm():
    """The GPU machine has no vLLM: the script and this case must not need it."""
    code = "import sys; sys.modules['vllm'] = None; import ringkv.bench.gpu_check, ringkv.bench.graph_replay"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
