# SPDX-License-Identifier: Apache-2.0
"""One row of the vLLM version matrix: run, in the current environment (one vLLM version; ``noxfile.py`` builds
it), the test groups that need only vLLM's Python, and write each group's cell to a JSON file
(``ci/compat_table.py`` merges the rows into docs/compatibility.md).

    python ci/compat.py "vllm 0.34.0" ROW.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version as Release
from ringkv.bench.records import git_commit

ROOT = Path(__file__).resolve().parent.parent
# the pytest plugin (a module in ci/) that runs a GPU wheel on vLLM's own CPU platform
CPU_SHIMS_PLUGIN = "vllm_cpu_shims"
DEFAULT_MARKERS = "not slow and not gpu"


@dataclass(frozen=True)
class Version:
    """One row of the matrix: the vLLM this environment holds; vllm-cpu has an engine on CPU, the GPU wheels run
    on their own CPU platform with ``CPU_SHIMS_PLUGIN``."""

    label: str  # "vllm 0.34.0", "vllm-cpu 0.32.0"

    @property
    def engine(self) -> bool:
        return self.label.split()[0] == "vllm-cpu"

    @property
    def release(self) -> tuple[int, ...]:
        return Release(self.label.split()[1]).release

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "RINGKV_"))}
        # before anything imports a kernel: on vLLM's CPU platform the plugin loads ahead of the tests' conftest
        env["TRITON_INTERPRET"] = "1"
        if not self.engine:
            # the GPU wheel's own CPU platform (else the platform is unspecified and vLLM's config has no device)
            env["VLLM_TARGET_DEVICE"] = "cpu"
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "ci"), env.get("PYTHONPATH")]))
        return env

    @property
    def pytest_plugins(self) -> list[str]:
        return [] if self.engine else ["-p", CPU_SHIMS_PLUGIN]


def needs_engine(version: Version) -> str | None:
    """Why a group needing vllm-cpu's engine cannot run on ``version`` (None: it can)."""
    if version.engine:
        return None
    return "not run: needs vllm-cpu's engine (vllm-cpu 0.32.0 only; no vllm-cpu 0.33/0.34 exists)"


def needs_gpu_wheel(version: Version) -> str | None:
    """Why the CPU shims' tests do not run on ``version`` (None: they do): vllm-cpu has its CPU ops built in."""
    if not version.engine:
        return None
    return "not run: vllm-cpu has its CPU ops built in and loads no shim"


def needs_v2_cpu_runner(version: Version) -> str | None:
    """Why a group needing Model Runner V2 on CPU (vLLM 0.34's GPU wheel with the CPU shims) cannot run."""
    if not version.engine and version.release[:2] >= (0, 34):
        return None
    return "not run: needs Model Runner V2 on CPU (vLLM 0.34's GPU wheel with the CPU shims)"


@dataclass(frozen=True)
class Group:
    """A column of the matrix: test files, the marker expression they run under, and which versions can run them."""

    files: tuple[str, ...]
    markers: str = DEFAULT_MARKERS
    cannot_run: Callable[[Version], str | None] | None = None  # why a version cannot run the group; None: all can


GROUPS = {
    "spec / manager / scheduler / admission": Group((
        "tests/integration/test_vllm_kv_cache.py", "tests/integration/test_vllm_scheduler.py",
        "tests/integration/test_vllm_fuzz.py",
    )),
    "backend contract": Group(("tests/integration/test_vllm_backend.py", "tests/integration/test_vllm_patches.py")),
    "bad inputs": Group(("tests/integration/test_vllm_bad_inputs.py",)),
    "V2 DFlash speculator metadata": Group(("tests/integration/test_vllm_v2_drafter.py",)),
    "engine end to end": Group((
        "tests/integration/test_vllm_engine_e2e.py", "tests/integration/test_vllm_cpu_sliding_e2e.py",
    ), cannot_run=needs_engine),
    "CPU shims": Group(("tests/integration/test_vllm_cpu_shims.py",), cannot_run=needs_gpu_wheel),
    # slow: the engine runs a prompt end to end
    "V2 DFlash2 engine": Group(
        ("tests/integration/test_vllm_v2_dflash2_engine.py",), markers="not gpu", cannot_run=needs_v2_cpu_runner,
    ),
}  # fmt: skip


def probe(version: Version) -> tuple[str | None, str]:
    """(error, installed): the plugin's vLLM surface imports, the environment's ringkv is this checkout, and which
    vLLM (distribution and version) it runs."""
    code = (
        "import pathlib\n"
        "import ringkv.integration\n"
        "print(pathlib.Path(ringkv.integration.__file__).resolve().parent.parent)\n"
        "from ringkv.integration.vllm._compat import VLLM_DIST, VLLM_VERSION\n"
        "print(VLLM_DIST, VLLM_VERSION)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=version.env, cwd=ROOT)
    if done.returncode:
        return last_error_line(done.stderr), ""
    root, vllm = done.stdout.split("\n")[:2]
    if Path(root) != ROOT:
        return f"its ringkv is {root}, not this checkout: pip install --no-deps -e {ROOT}", vllm
    return None, vllm


def cell_text(line: str) -> str:
    """``line`` as it can stand in a backticked table cell: at most 300 characters, no backtick, pipes escaped."""
    return line[:300].replace("`", "'").replace("|", "\\|")


def last_error_line(text: str) -> str:
    """The exception line of a traceback (pytest's ``E   `` lines first)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    marked = [line[1:].strip() for line in lines if line.startswith("E ") and "Error" in line]
    errors = [line for line in lines if "Error" in line or "Exception" in line]
    return cell_text((marked or errors or lines or ["(no output)"])[-1])


def failure_line(problem: ET.Element) -> str:
    """A failed test's error: the first line of pytest's message (the exception and its text), else the
    traceback's exception line."""
    message = (problem.get("message") or "").strip()
    return cell_text(message.splitlines()[0]) if message else last_error_line(problem.text or "")


def run_group(version: Version, group: Group) -> str:
    """One cell: ``passed (n)``, ``failed (k of n): ids; first error``, ``could not import: error``, or ``not run:
    why``."""
    why_not = group.cannot_run(version) if group.cannot_run else None
    if why_not is not None:
        return why_not
    missing = [name for name in group.files if not (ROOT / name).exists()]
    if missing:
        return f"not run: {', '.join(missing)} is not in this checkout"
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *version.pytest_plugins,
                   "-m", group.markers, "--benchmark-disable", f"--junitxml={report}", *group.files]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, env=version.env, cwd=ROOT)
        if not report.exists():
            return f"could not run: `{last_error_line(done.stderr + done.stdout)}`"
        cases = ET.parse(report).getroot().iter("testcase")
    passed, failed, skipped, broken = 0, [], 0, []
    for case in cases:
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if case.find("skipped") is not None:
            skipped += 1
        elif problem is None:
            passed += 1
        elif problem.get("message") == "collection failure":
            broken.append((case.get("name"), last_error_line(problem.text or "")))
        else:
            failed.append((case.get("name"), failure_line(problem)))
    if broken:
        return "could not import: " + "; ".join(f"{name}: `{error}`" for name, error in broken)
    total = passed + len(failed)
    skipped_text = f", {skipped} skipped" if skipped else ""
    if failed:
        names = ", ".join(name for name, _ in failed[:4]) + (", ..." if len(failed) > 4 else "")
        return f"**failed** ({len(failed)} of {total}{skipped_text}): {names}; first: `{failed[0][1]}`"
    if not total:
        return f"nothing ran (exit code {done.returncode}{skipped_text})"
    return f"passed ({total}{skipped_text})"


def row(version: Version) -> dict[str, object]:
    """The version's cells, with the vLLM it runs and the commit they were run from."""
    error, installed = probe(version)
    cells = {}
    for name, group in GROUPS.items():
        cells[name] = f"could not import: `{error}`" if error is not None else run_group(version, group)
        sys.stderr.write(f"{version.label} | {name}: {cells[name]}\n")
    return {"version": version.label, "installed": installed or version.label, "commit": git_commit(),
            "cells": cells}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("version", help='the vLLM this environment holds, as "DIST VERSION"')
    parser.add_argument("out", type=Path, help="the JSON file to write the row to")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(row(Version(args.version)), indent=1) + "\n")


if __name__ == "__main__":
    main()
