# SPDX-License-Identifier: Apache-2.0
"""Test configuration: kernel tests run under the Triton interpreter on machines without a GPU."""

from __future__ import annotations

import os

import pytest
import torch

# The interpreter must be chosen before triton compiles anything; on a GPU machine the kernels run natively.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# RINGKV_REQUIRE (CI): groups that must run rather than skip (tests/requirements_plugin.py, ENVs.md)
pytest_plugins = ["tests.requirements_plugin"]


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    parser.addoption(
        "--seed-offset", type=int, default=0,
        help="shift the seeds of the randomized tests (tests/kernels/test_differential.py) to draw other cases",
    )  # fmt: skip
    if not pluginmanager.has_plugin("xdist"):
        # pyproject's addopts ask pytest-xdist for two workers; without it (-p no:xdist, or an environment that
        # lacks it) its two options are accepted and ignored: the suite runs serially in this process
        group = parser.getgroup("xdist", "pytest-xdist not loaded: -n and --dist are ignored")
        # (pytest reserves lowercase short options for its own plugins; xdist registers -n the same way)
        group._addoption("-n", "--numprocesses", dest="numprocesses", default=None, help="ignored")
        group.addoption("--dist", dest="dist", default="no", help="ignored")


def pytest_report_header(config: pytest.Config) -> str | None:
    """Say so when the ``-n`` of pyproject's addopts cannot take effect (pytest-xdist not loaded)."""
    workers = config.getoption("numprocesses", None)
    if workers is not None and not config.pluginmanager.has_plugin("xdist"):
        return f"pytest-xdist not loaded: -n {workers} ignored, the tests run in this one process"
    return None


@pytest.fixture
def device() -> torch.device:
    """Where kernel tests put tensors: the GPU if there is one, else the CPU (interpreter)."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def session_engine_models(tmp_path_factory, pytestconfig, name: str, **spec: object):
    """Tiny engine models of ``EngineModelSpec(**spec)``, built once per session in ``name``: under pytest-xdist
    the workers share one build in the run's own temporary root (the first builds it, the others wait on
    ``build_engine_models``'s lock and reuse it)."""
    from ringkv.dflash2.harness.engine_models import EngineModelSpec, build_engine_models

    if hasattr(pytestconfig, "workerinput"):  # an xdist worker: its basetemp is <the run's root>/<worker id>
        folder = tmp_path_factory.getbasetemp().parent / name
    else:
        folder = tmp_path_factory.mktemp(name, numbered=False)
    return build_engine_models(folder, EngineModelSpec(**spec))


@pytest.fixture(scope="session")
def chain_models(tmp_path_factory, pytestconfig):
    """The tiny target and the trained DFlash drafter vLLM's engine serves (W 64, all sliding; ~20 s)."""
    return session_engine_models(tmp_path_factory, pytestconfig, "chain-models")


@pytest.fixture(scope="session")
def full_chain_models(tmp_path_factory, pytestconfig):
    """The same target with a DFlash drafter whose layers are all full attention (``drafter_window=None``)."""
    return session_engine_models(tmp_path_factory, pytestconfig, "full-chain-models", drafter_window=None)
