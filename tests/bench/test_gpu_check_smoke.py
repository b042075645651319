# SPDX-License-Identifier: Apache-2.0
"""The prepared GPU script runs end to end in its tiny CPU form, so a GPU lease never meets a broken script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.interpreter
def test_gpu_check_smoke(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env={"TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check_smoke.json").read_text())
    assert all(row["ok"] and row["bitwise_repeats"] for row in report["bf16"])
    providers = {row["provider"] for row in report["timing"]}
    assert providers == {"ringkv", "torch-sdpa", "torch-flex"}
    assert all("error" not in row for row in report["timing"]), report["timing"]
