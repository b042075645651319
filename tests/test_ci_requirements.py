# SPDX-License-Identifier: Apache-2.0
"""RINGKV_REQUIRE (tests/requirements_plugin.py): under it a required group that cannot run, or a skipped test of
it, fails the session; without it the same skips pass."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest

from tests import requirements_plugin

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[1]
PLUGIN = ("-p", "tests.requirements_plugin", "-p", "no:cacheprovider")

# an inner suite: a vllm module that importorskips at collection (as tests/integration/ does), a vllm test that
# skips itself, an interpreter test that runs, an unmarked test that skips (no group: allowed)
SUITE = {
    "test_engine": """
        import pytest
        pytest.importorskip("vllm")
        pytestmark = pytest.mark.vllm
        def test_engine():
            pass
    """,
    "test_other": """
        import pytest
        @pytest.mark.vllm
        def test_backend():
            pytest.skip("no vllm here")
        @pytest.mark.interpreter
        def test_kernel():
            pass
        def test_unmarked_skip():
            pytest.skip("unrelated")
    """,
}


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(**SUITE)
    pytester.makeini("[pytest]\nmarkers =\n    vllm: v\n    interpreter: i\n")
    return pytester


@pytest.fixture
def checks_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every group's start check passes, so the run reaches the tests (the skip tracking is what is under test)."""
    groups = {name: dataclasses.replace(g, check=lambda: None) for name, g in requirements_plugin.GROUPS.items()}
    monkeypatch.setattr(requirements_plugin, "GROUPS", groups)
    monkeypatch.setitem(sys.modules, "vllm", None)  # importorskip("vllm") skips: ModuleNotFoundError


def test_required_group_that_cannot_import_fails_the_session(suite, tmp_path, monkeypatch):
    broken = tmp_path / "broken" / "vllm"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("import simulated_missing_vllm_dependency\n")  # ModuleNotFoundError
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(broken.parent), str(REPO)]))
    monkeypatch.setenv("RINGKV_REQUIRE", "vllm")
    result = suite.runpytest_subprocess(*PLUGIN)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([
        "ERROR: RINGKV_REQUIRE=vllm: required test group 'vllm' cannot run: `import vllm` failed: "
        "ModuleNotFoundError: No module named 'simulated_missing_vllm_dependency' (raised at *vllm*__init__.py:1)",
        "  fix: bash ci/setup.sh *",
    ])  # fmt: skip
    # without the variable the broken vllm only skips the module
    monkeypatch.delenv("RINGKV_REQUIRE")
    result = suite.runpytest_subprocess(*PLUGIN)
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(passed=1, skipped=3)


def assert_the_vllm_skips_fail_the_session(result: pytest.RunResult) -> None:
    """The suite's two vllm skips (a module at collection, a test) reported under the vllm group, nothing else."""
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=1, skipped=3)
    result.stdout.fnmatch_lines([
        "*RINGKV_REQUIRE=vllm,interpreter: required tests did not run*",
        "group 'vllm': 2 skipped",
        "    test_engine.py (whole module): Skipped: could not import 'vllm': *",
        "    test_other.py::test_backend: Skipped: no vllm here",
        "  fix: bash ci/setup.sh *",
    ])  # fmt: skip
    section = result.stdout.str().split("required tests did not run")[1]
    assert "group 'interpreter'" not in section and "test_unmarked_skip" not in section


def test_skipped_test_of_a_required_group_fails_the_session(suite, checks_pass, monkeypatch):
    monkeypatch.setenv("RINGKV_REQUIRE", "vllm,interpreter")
    result = suite.runpytest_inprocess(*PLUGIN)
    assert_the_vllm_skips_fail_the_session(result)


def test_without_the_variable_the_same_skips_pass(suite, checks_pass, monkeypatch):
    monkeypatch.delenv("RINGKV_REQUIRE", raising=False)
    result = suite.runpytest_inprocess(*PLUGIN)
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(passed=1, skipped=3)


def test_a_required_group_none_of_whose_tests_ran_fails_the_session(suite, checks_pass, monkeypatch):
    monkeypatch.setenv("RINGKV_REQUIRE", "interpreter")
    result = suite.runpytest_inprocess(*PLUGIN, "-m", "not interpreter")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["group 'interpreter': no test of it ran (deselected or not collected)"])


def test_unknown_group_is_a_usage_error(suite, monkeypatch):
    monkeypatch.setenv("RINGKV_REQUIRE", "vllm,gpu")
    result = suite.runpytest_inprocess(*PLUGIN)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: RINGKV_REQUIRE: unknown group(s) 'gpu'; valid: vllm, interpreter, compile"])


def test_compile_check_names_the_missing_ptxas(monkeypatch):
    from triton.knobs import NvidiaTool

    monkeypatch.setattr(NvidiaTool, "from_path", staticmethod(lambda path: None))
    problem = requirements_plugin.check_compile()
    assert problem is not None and problem.startswith("the sm_90 ptxas: RuntimeError: Cannot find ptxas"), problem


# pytest-xdist (the suite's default, -n 2): only the controller decides, from the workers' reports. The inner runs
# are subprocesses, so the conftest below passes the group checks and hides vllm in the controller and each worker.
XDIST = ("-n", "2")
CHECKS_PASS_CONFTEST = """
import dataclasses, sys
from tests import requirements_plugin
requirements_plugin.GROUPS = {
    name: dataclasses.replace(group, check=lambda: None) for name, group in requirements_plugin.GROUPS.items()
}
sys.modules["vllm"] = None
"""


@pytest.fixture
def xdist_suite(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    suite.makeconftest(CHECKS_PASS_CONFTEST)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        monkeypatch.delenv(name, raising=False)  # set when this test itself runs in a worker
    return suite


def run_on_two_workers(suite: pytest.Pytester, *args: str) -> pytest.RunResult:
    result = suite.runpytest_subprocess(*PLUGIN, *XDIST, *args)
    result.stdout.fnmatch_lines(["*2 workers*"])
    return result


def test_under_xdist_a_skipped_test_of_a_required_group_fails_the_session(xdist_suite, monkeypatch):
    monkeypatch.setenv("RINGKV_REQUIRE", "vllm,interpreter")
    result = run_on_two_workers(xdist_suite)
    assert_the_vllm_skips_fail_the_session(result)


def test_under_xdist_modules_skipped_at_collection_fail_the_session(xdist_suite, monkeypatch):
    """Every other vllm test passes: the two modules importorskip skipped are the whole problem."""
    xdist_suite.makepyfile(
        test_engine_two="import pytest\npytest.importorskip('vllm')\ndef test_engine_two():\n    pass\n",
        test_backend_runs="import pytest\n@pytest.mark.vllm\ndef test_backend_runs():\n    pass\n",
    )
    monkeypatch.setenv("RINGKV_REQUIRE", "vllm")
    result = run_on_two_workers(xdist_suite, "-k", "not test_backend or test_backend_runs")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=2, skipped=3)  # (xdist's summary leaves the deselected test_backend out)
    result.stdout.fnmatch_lines(["group 'vllm': 2 skipped"])
    lines = result.stdout.str().split("group 'vllm': 2 skipped")[1].splitlines()[1:3]
    modules = sorted(line.split(" (whole module): Skipped: could not import 'vllm'")[0] for line in lines)
    assert modules == ["    test_engine.py", "    test_engine_two.py"], lines


def test_under_xdist_a_required_group_none_of_whose_tests_ran_fails_the_session(xdist_suite, monkeypatch):
    monkeypatch.setenv("RINGKV_REQUIRE", "interpreter")
    result = run_on_two_workers(xdist_suite, "-m", "not interpreter")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["group 'interpreter': no test of it ran (deselected or not collected)"])


def test_under_xdist_a_required_group_that_ran_passes(xdist_suite, monkeypatch):
    """The interpreter group is its marker only: the controller, which collects nothing, reads it off the reports."""
    monkeypatch.setenv("RINGKV_REQUIRE", "interpreter")
    result = run_on_two_workers(xdist_suite)
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    result.assert_outcomes(passed=1, skipped=3)
    assert "required tests did not run" not in result.stdout.str()
