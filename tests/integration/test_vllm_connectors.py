# SPDX-License-Identifier: Apache-2.0
"""KV connectors beside a ring, without an engine (``integration/vllm/connectors.py``): which connectors start, the
cap inside ``OffloadingConnector``'s answer, the ring group hidden from it, and the ring's row after an external
hit under vLLM's own KVCacheManager. The engine runs are test_vllm_engine_connectors.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch
from ringkv.bench.lab.simulation.scheduler_run import write_model_config
from ringkv.integration.vllm import patches, register
from ringkv.integration.vllm.connectors import external_hit_cap, wrap_max_loadable_tokens
from ringkv.integration.vllm.errors import RingConfigError
from ringkv.integration.vllm.planning import check_ring_config
from ringkv.integration.vllm.ring_spec import RingSWASpec
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import get_offloading_group_ids
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

pytestmark = pytest.mark.vllm

BLOCK, WINDOW, LOOKAHEAD = 16, 64, 8
SHAPE = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 32, "dtype": torch.float32}
HOST = {"kv_connector": "HostKVConnector", "kv_connector_module_path": "ringkv.bench.lab.e2e.kv_transfer"}


def kv_cache_config(pool_blocks: int = 256, cache_ring: bool = False) -> KVCacheConfig:
    """A full-attention group and a ring group, made after ``register()`` (its ``KVCacheGroupSpec`` wrap)."""
    register()
    groups = [
        KVCacheGroupSpec(["model.layers.0.self_attn.attn"], FullAttentionSpec(**SHAPE)),
        KVCacheGroupSpec(["model.layers.1.self_attn.attn"],
                         RingSWASpec(**SHAPE, sliding_window=WINDOW, lookahead=LOOKAHEAD, cache_ring=cache_ring)),
    ]  # fmt: skip
    return KVCacheConfig(num_blocks=pool_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def connector_config(**transfer) -> SimpleNamespace:
    return SimpleNamespace(kv_transfer_config=KVTransferConfig(kv_role="kv_both", **transfer), num_lookahead_tokens=8)


def offloading(**extra) -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": extra}


@pytest.mark.parametrize(
    "transfer",
    [offloading(), HOST, {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [
        {**offloading(), "kv_role": "kv_both"}, {**HOST, "kv_role": "kv_both"}]}}],
    ids=["OffloadingConnector", "a connector declaring ringkv_ring_safe", "MultiConnector of both"],
)  # fmt: skip
def test_connectors_made_safe_start(transfer):
    check_ring_config(connector_config(**transfer))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_config(tmp_path_factory.mktemp("model"), 4096)


def test_kv_offloading_size_selects_offloading_connector_and_starts(model_dir):
    """vLLM's own config for ``--kv-offloading-size 1`` (the native backend; ``--kv-offloading-backend lmcache``
    fails inside vLLM's config without the lmcache package, and its connector lacks SupportsHMA)."""
    config = EngineArgs(model=str(model_dir), skip_tokenizer_init=True, max_model_len=4096, enforce_eager=True,
                        kv_offloading_size=1.0).create_engine_config()  # fmt: skip
    assert config.kv_transfer_config.kv_connector == "OffloadingConnector"
    assert config.kv_transfer_config.kv_connector_extra_config["cpu_bytes_to_use"] == 1 << 30
    check_ring_config(config)


@pytest.mark.parametrize(
    ("transfer", "message"),
    [
        ({"kv_connector": "ExampleConnector"}, "ExampleConnector does not implement vLLM's SupportsHMA"),
        ({"kv_connector": "NixlConnector"}, "NixlConnector: ringkv has not made it safe"),
        ({"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [
            {**offloading(), "kv_role": "kv_both"}, {"kv_connector": "NixlConnector", "kv_role": "kv_both"}]}},
         "NixlConnector: ringkv has not made it safe"),
    ],
    ids=["without SupportsHMA", "not made safe", "MultiConnector with one unsafe child"],
)  # fmt: skip
def test_other_connectors_are_refused_naming_the_fix(transfer, message):
    with pytest.raises(RingConfigError, match=message) as error:
        check_ring_config(connector_config(**transfer))
    assert "Use OffloadingConnector" in str(error.value) and "external_hit_cap" in str(error.value)


def test_a_connector_without_supports_hma_is_named_before_the_hybrid_manager_it_turned_off():
    config = connector_config(kv_connector="ExampleConnector")
    config.scheduler_config = SimpleNamespace(disable_hybrid_kv_cache_manager=True)
    with pytest.raises(RingConfigError, match="ExampleConnector does not implement vLLM's SupportsHMA"):
        check_ring_config(config)


def test_any_connector_is_refused_with_the_targets_sliding_layers_on_the_ring():
    config = connector_config(**offloading())
    config.attention_config = SimpleNamespace(backend_per_kind={"sliding_window": "RINGKV"})
    with pytest.raises(RingConfigError, match="recomputing cannot rebuild"):
        check_ring_config(config)


@pytest.mark.parametrize("switch", [None, "1", "0"])
def test_connectors_are_served_beside_the_rings_windows_in_the_prefix_cache_or_without(monkeypatch, switch):
    """RINGKV_RING_PREFIX_CACHE keeps its default (1) with a connector: no ring group takes part in KV transfer, so
    no connector moves a cached ring's windows either; its hits are capped all the same."""
    from ringkv.integration.vllm.ring_spec import to_ring_spec
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    if switch is None:
        monkeypatch.delenv("RINGKV_RING_PREFIX_CACHE", raising=False)
    else:
        monkeypatch.setenv("RINGKV_RING_PREFIX_CACHE", switch)
    check_ring_config(connector_config(**offloading()))
    cached = to_ring_spec(SlidingWindowSpec(**SHAPE, sliding_window=WINDOW), LOOKAHEAD).cache_ring
    assert cached == (switch != "0")
    ring_group = KVCacheGroupSpec(["l"], RingSWASpec(**SHAPE, sliding_window=WINDOW, lookahead=LOOKAHEAD,
                                                     cache_ring=cached))  # fmt: skip
    assert external_hit_cap([ring_group], 400, 0) == 337


@pytest.mark.parametrize("cache_ring", [False, True], ids=["ring", "cached ring"])
def test_no_ring_group_takes_part_in_kv_transfer(cache_ring):
    """Every ring group leaves vLLM's transfer set (``enable_kv_transfer``), so vLLM's OffloadingConnector offloads
    the target's group alone and never a ring's row (entries for positions overwritten since); a cached ring stays
    prefix-cacheable for the local cache."""
    config = kv_cache_config(cache_ring=cache_ring)
    full, ring = config.kv_cache_groups
    assert full.enable_kv_transfer and not ring.enable_kv_transfer
    assert ring.kv_cache_spec.prefix_cacheable == cache_ring
    assert config.transfer_group_ids == config.prefix_cacheable_group_ids == get_offloading_group_ids(config) == (0,)
    assert patches.entry("KVCacheGroupSpec.__init__").installs() == 1


def test_a_cached_ring_bounds_offloading_no_lower_than_the_cap():
    """OffloadingConnector bounds its load by every prefix-cacheable group it does not offload, a cached ring's
    hit through ``find_longest_cache_hit_per_group``: the ring's finder answers there (the request's length comes
    from ringkv's wrap) with at least the rebuild cap, so the cap stays the bound."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    kv = KVCacheManager(kv_cache_config(cache_ring=True), max_model_len=4096, scheduler_block_size=BLOCK,
                        hash_block_size=BLOCK, max_in_flight_tokens=4096, enable_caching=True)  # fmt: skip
    init_none_hash(sha256)
    req = Request("r", list(range(3, 403)), SamplingParams(max_tokens=16), None,
                  block_hasher=get_request_block_hasher(BLOCK, sha256))  # fmt: skip
    _, hits = kv.coordinator.find_longest_cache_hit_per_group(req.block_hashes, req.num_tokens - 1)
    assert hits[0] == 0 and hits[1] >= 337 // BLOCK * BLOCK, hits


# N = 400: the cap is N - (W - 1) = 337 tokens in all
@pytest.mark.parametrize(("computed", "bound", "expected"), [(0, None, 337), (96, None, 241), (96, 100, 100),
                                                              (96, 500, 241), (352, None, 0)])  # fmt: skip
def test_offloadings_answer_is_capped_inside_the_connector(computed, bound, expected):
    """``_max_loadable_tokens`` is the bound OffloadingConnector hands its own lookup (``max_num_new_tokens``): the
    hit it offers, remembers and asserts in ``update_state_after_alloc`` is already capped."""
    register()
    connector = SimpleNamespace(_kv_cache_config=kv_cache_config())
    capped = wrap_max_loadable_tokens(lambda self, request, num_computed: bound)
    assert capped(connector, SimpleNamespace(num_tokens=400), computed) == expected


def test_without_a_ring_the_bound_is_vllms():
    full_only = SimpleNamespace(kv_cache_groups=kv_cache_config().kv_cache_groups[:1])
    assert external_hit_cap(full_only.kv_cache_groups, 400, 0) is None
    capped = wrap_max_loadable_tokens(lambda self, request, num_computed: 7)
    assert capped(SimpleNamespace(_kv_cache_config=full_only), SimpleNamespace(num_tokens=400), 0) == 7


def test_the_cap_is_installed_on_offloading_connector():
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    register()
    assert patches.entry("OffloadingConnector._max_loadable_tokens").installs() == 1
    assert getattr(OffloadingConnector._max_loadable_tokens, "_ringkv_wrapped", False)


def test_an_external_hit_leaves_the_ring_row_position_indexed_and_holding_r_blocks():
    """vLLM's KVCacheManager admitting a request with 320 tokens from a connector (no local hit): the full group
    gets a block per position, the ring null entries up to the hit and its R blocks after; freeing returns all."""
    register()
    config = kv_cache_config()
    kv = KVCacheManager(config, max_model_len=4096, scheduler_block_size=BLOCK, hash_block_size=BLOCK,
                        max_in_flight_tokens=4096, enable_caching=False)  # fmt: skip
    free = kv.block_pool.get_num_free_blocks()
    req = Request("r", list(range(3, 403)), SamplingParams(max_tokens=16), None)
    external = 320
    blocks = kv.allocate_slots(req, 400 - external, 0, kv.empty_kv_cache_blocks, num_lookahead_tokens=LOOKAHEAD,
                               num_external_computed_tokens=external)  # fmt: skip
    assert blocks is not None
    full, ring = kv.coordinator.single_type_managers
    ring_spec = config.kv_cache_groups[1].kv_cache_spec
    row = ring.req_to_blocks["r"]
    assert len(full.req_to_blocks["r"]) == len(row) == (400 + LOOKAHEAD + BLOCK - 1) // BLOCK
    assert all(block.is_null for block in row[: external // BLOCK])
    live = {block.block_id for block in row if not block.is_null}
    assert len(live) == len(ring.rings["r"].blocks) == ring_spec.ring_blocks
    kv.free(req)
    assert kv.block_pool.get_num_free_blocks() == free


def test_the_reservation_for_a_prefill_waiting_on_an_async_load_counts_the_ring():
    """vLLM reserves, for a prefill waiting on a connector's async load, what it still needs at ``N + 1 +
    num_spec_tokens + num_lookahead_tokens`` slots (``Scheduler._request_remaining_blocks``, a capped count): past
    the ring's planned lookahead, yet only a count; the ring answers R less what it holds."""
    register()
    kv = KVCacheManager(kv_cache_config(), max_model_len=4096, scheduler_block_size=BLOCK, hash_block_size=BLOCK,
                        max_in_flight_tokens=4096, enable_caching=False)  # fmt: skip
    ring = kv.coordinator.single_type_managers[1]
    need = ring.get_num_blocks_to_allocate("r", 400 + 1 + 7 + LOOKAHEAD, (), 0, 0, 400, apply_admission_cap=True)
    assert need == ring.ring_blocks
