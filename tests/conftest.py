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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--seed-offset", type=int, default=0,
        help="shift the seeds of the randomized tests (tests/kernels/test_differential.py) to draw other cases",
    )  # fmt: skip


@pytest.fixture
def device() -> torch.device:
    """Where kernel tests put tensors: the GPU if there is one, else the CPU (interpreter)."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@pytest.fixture(scope="session")
def chain_models(tmp_path_factory):
    """The tiny target and the trained DFlash drafter vLLM's engine serves (built once per session, ~20 s)."""
    from ringkv.dflash2.harness.engine_models import EngineModelSpec, build_engine_models

    return build_engine_models(tmp_path_factory.mktemp("chain-models"), EngineModelSpec())
