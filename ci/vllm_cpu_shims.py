# SPDX-License-Identifier: Apache-2.0
"""Every patch that vLLM's GPU wheels (0.33.0, 0.34.0; installed ``--no-deps`` beside CPU torch) need to run on
their own CPU platform (``VLLM_TARGET_DEVICE=cpu``), 0.34's with Model Runner V2's CPU runner: outside CI, for the
0.33/0.34 columns of ``ci/compat.py`` and ``tests/integration/test_vllm_v2_dflash2_engine.py``.

As a pytest plugin (``PYTHONPATH=ci``, ``-p vllm_cpu_shims``) it installs the patches before any test imports
vLLM; an engine process calls ``install()`` first thing. ``SHIMS`` is the table: per shim the vLLM call that
fails on the GPU wheel without it, how it fails, the vLLM versions where it was seen to fail so (and those where
it was not: there it is not installed), and a ``reproduce`` that makes that call;
``tests/integration/test_vllm_cpu_shims.py`` fails when a vLLM version no longer fails that way (the shim is
unnecessary), when the patched target changed, or when a torch replacement's output differs from vLLM's own
torch-native layer. ``ENGINE_ARGS`` is the one engine argument the runs need.

The venv: ``.venv/bin/nox -s "vllm(0.34.0)"`` builds it under ``.nox/`` (``noxfile.py``: the wheel ``--no-deps``
beside CPU torch, with ``GPU_WHEEL_DEPS`` at the wheel's own bounds).
"""

from __future__ import annotations

import importlib.metadata
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# the target's attention on ringkv too: vLLM's CPU_ATTN needs the CPU C++ ops (shim ``target_on_ringkv`` below)
ENGINE_ARGS: dict[str, Any] = {"attention_backend": "RINGKV"}


@dataclass(frozen=True)
class Shim:
    name: str
    # the vLLM call that fails on the GPU wheel on CPU without this shim
    answers: str
    # what that call raises then (a substring of the exception's text)
    failure: str
    # vLLM versions where that call was run unshimmed and failed so
    versions: tuple[str, ...]
    # makes the failing call (run with every other shim installed)
    reproduce: Callable[[], Any]
    # patches vLLM in this process; None when an engine argument (ENGINE_ARGS) answers it
    install: Callable[[], None] | None = None
    # the patched vLLM function's parameters, as checked (None: nothing of vLLM's is replaced)
    parameters: tuple[str, ...] | None = None
    # "module:attribute" of the patched or called vLLM function
    target: str | None = None
    # vLLM versions where that call was run unshimmed and did not fail so: not installed there
    unneeded: tuple[str, ...] = ()


def _nvidia_driver_active() -> None:
    from triton.backends import backends

    backends["nvidia"].driver.is_active = staticmethod(lambda: True)


def _reproduce_no_triton() -> None:
    from vllm.config import VllmConfig
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.check_and_update_config(VllmConfig())


_LIBRARY: list[torch.library.Library] = []  # keeps the registration alive


def _define_init_cpu_memory_env() -> None:
    library = torch.library.Library("_C", "FRAGMENT")
    library.define("init_cpu_memory_env(int[] nodes) -> ()")
    library.impl("init_cpu_memory_env", lambda nodes: None, "CompositeExplicitAutograd")
    _LIBRARY.append(library)


def _reproduce_init_cpu_memory_env() -> None:
    import vllm._custom_ops  # noqa: F401 -- loads whatever vLLM's C++ extension the wheel has

    torch.ops._C.init_cpu_memory_env([0])


def _reproduce_cpu_attention() -> None:
    from vllm import _cpu_ops

    _cpu_ops.cpu_attn_get_scheduler_metadata(*[None] * 12)


def rms_norm(out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor | None, epsilon: float) -> None:
    """``vllm._custom_ops.rms_norm`` in torch (float32 math, like vLLM's ``RMSNorm.forward_native``); a stacked
    weight ``[L, D]`` norms ``input[i]`` with row ``i``, as the CUDA kernel does (DFlash's ``_normalize_context_k``)."""
    x = input.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon)
    if weight is not None:
        # [D], or [L, D] -> [L, 1, ..., 1, D]
        y = y * weight.float().view(*weight.shape[:-1], *[1] * (x.dim() - weight.dim()), weight.shape[-1])
    out.copy_(y.to(out.dtype))


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None, head_size: int,
    cos_sin_cache: torch.Tensor, is_neox: bool, rope_dim_offset: int = 0, inverse: bool = False,
) -> None:  # fmt: skip
    """``vllm._custom_ops.rotary_embedding`` in torch, in place: NeoX style from dimension 0 only."""
    if not is_neox or rope_dim_offset or inverse:
        raise NotImplementedError("vllm_cpu_shims.rotary_embedding: only NeoX rotary embedding from dim 0")
    cos, sin = (part[:, None, :] for part in cos_sin_cache[positions.long()].float().chunk(2, dim=-1))
    half = cos.shape[-1]
    for x in (query, key):
        if x is not None:
            view = x.view(x.shape[0], -1, head_size)
            x1, x2 = view[..., :half].float(), view[..., half : 2 * half].float()
            view[..., :half], view[..., half : 2 * half] = (x1 * cos - x2 * sin), (x2 * cos + x1 * sin)


def _torch_rms_norm() -> None:
    from vllm import _custom_ops

    _custom_ops.rms_norm = rms_norm


def _torch_rotary_embedding() -> None:
    from vllm import _custom_ops

    _custom_ops.rotary_embedding = rotary_embedding


def _reproduce_rms_norm() -> None:
    from vllm import _custom_ops

    x = torch.ones(2, 8)
    _custom_ops.rms_norm(torch.empty_like(x), x, torch.ones(8), 1e-6)


def _reproduce_rotary_embedding() -> None:
    from vllm import _custom_ops

    q = torch.ones(2, 8)
    _custom_ops.rotary_embedding(torch.arange(2), q, q.clone(), 8, torch.ones(4, 8), True)


SHIMS: dict[str, Shim] = {shim.name: shim for shim in (
    Shim("nvidia_driver_active",
         answers="vllm.triton_utils.importing (HAS_TRITON: one active GPU driver) -> "
                 "CpuPlatform.check_and_update_config and Worker.__init__; vLLM's triton.jit kernels then run in "
                 "Triton's interpreter (TRITON_INTERPRET=1)",
         failure="vLLM on x86 CPUs requires Triton (triton-cpu)", versions=("0.34.0",), unneeded=("0.33.0",),
         reproduce=_reproduce_no_triton, install=_nvidia_driver_active,
         target="vllm.platforms.cpu:CpuPlatform.check_and_update_config"),
    Shim("init_cpu_memory_env",
         answers="CPUWorker.__init__ -> torch.ops._C.init_cpu_memory_env (the wheel has no CPU C++ ops): a no-op",
         failure="init_cpu_memory_env", versions=("0.33.0", "0.34.0"),
         reproduce=_reproduce_init_cpu_memory_env, install=_define_init_cpu_memory_env,
         target="vllm.v1.worker.cpu_worker:CPUWorker.__init__"),
    Shim("target_on_ringkv",
         answers="the target's CPU_ATTN metadata build -> vllm._cpu_ops.cpu_attn_get_scheduler_metadata -> "
                 "torch.ops._C: the target's layers on RINGKV too (ENGINE_ARGS)",
         failure="get_scheduler_metadata", versions=("0.34.0",), unneeded=("0.33.0",),
         reproduce=_reproduce_cpu_attention,
         target="vllm._cpu_ops:cpu_attn_get_scheduler_metadata"),
    Shim("torch_rms_norm",
         answers="vllm._custom_ops.rms_norm (DFlashQwen3Model.precompute_and_store_context_kv calls it itself) -> "
                 "torch.ops._C.rms_norm: the torch rms_norm above",
         failure="rms_norm", versions=("0.33.0", "0.34.0"), reproduce=_reproduce_rms_norm, install=_torch_rms_norm,
         parameters=("out", "input", "weight", "epsilon"), target="vllm._custom_ops:rms_norm"),
    Shim("torch_rotary_embedding",
         answers="vllm._custom_ops.rotary_embedding (RotaryEmbedding.forward_cpu; DFlashQwen3Model."
                 "precompute_and_store_context_kv) -> torch.ops._C.rotary_embedding: the torch rotary above",
         failure="rotary_embedding", versions=("0.33.0", "0.34.0"), reproduce=_reproduce_rotary_embedding,
         install=_torch_rotary_embedding,
         parameters=("positions", "query", "key", "head_size", "cos_sin_cache", "is_neox", "rope_dim_offset",
                     "inverse"),
         target="vllm._custom_ops:rotary_embedding"),
)}  # fmt: skip


def resolve(target: str) -> Any:
    """The object ``"module:attribute.path"`` names."""
    import importlib

    module, path = target.split(":")
    found: Any = importlib.import_module(module)
    for part in path.split("."):
        found = getattr(found, part)
    return found


def parameters_of(target: str) -> tuple[str, ...]:
    return tuple(inspect.signature(resolve(target)).parameters)


_installed: set[str] = set()  # shim names


def install(without: tuple[str, ...] = ()) -> None:
    """Install every shim but those named in ``without`` and those this vLLM does not need (the nvidia driver
    first: before ``vllm.triton_utils`` is imported)."""
    unknown = set(without) - SHIMS.keys()
    if unknown:
        raise ValueError(f"unknown shims {sorted(unknown)}; known: {sorted(SHIMS)}")
    installed_vllm = importlib.metadata.version("vllm")  # without importing vLLM
    for shim in SHIMS.values():
        skipped = shim.name in without or installed_vllm in shim.unneeded
        if shim.install is not None and not skipped and shim.name not in _installed:
            shim.install()
            _installed.add(shim.name)


def pytest_configure(config: Any) -> None:
    install()
