# SPDX-License-Identifier: Apache-2.0
"""Prefix caching with the ring under vLLM's own KVCacheManager (hybrid coordinator, BlockPool with hashing):
the hit stops where the ring's first query can still see, the full-attention group keeps its hit up to there,
and the ring's row stays position-indexed. The engine-level runs are test_vllm_engine_prefix_cache.py."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch
from ringkv.integration.vllm import register
from ringkv.integration.vllm.prefix_cache import ring_hit_cap
from ringkv.integration.vllm.ring_spec import RingSWASpec
from ringkv.kernels.ring_geometry import block_column
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

pytestmark = pytest.mark.vllm

BLOCK = 16
WINDOW = 64
LOOKAHEAD = 8  # DFlash: 7 speculative tokens + 1
SHAPE = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 32, "dtype": torch.float32}


def manager(pool_blocks: int = 256) -> KVCacheManager:
    register()
    groups = [
        KVCacheGroupSpec(["model.layers.0.self_attn.attn"], FullAttentionSpec(**SHAPE)),
        KVCacheGroupSpec(["model.layers.1.self_attn.attn"],
                         RingSWASpec(**SHAPE, sliding_window=WINDOW, lookahead=LOOKAHEAD)),
    ]  # fmt: skip
    config = KVCacheConfig(num_blocks=pool_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    return KVCacheManager(config, max_model_len=4096, scheduler_block_size=BLOCK, hash_block_size=BLOCK,
                          max_in_flight_tokens=4096, enable_caching=True)  # fmt: skip


def request(request_id: str, tokens: list[int]) -> Request:
    init_none_hash(sha256)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    return Request(request_id, tokens, params, None, block_hasher=get_request_block_hasher(BLOCK, sha256))


def prefill(kv: KVCacheManager, req: Request) -> int:
    """Admit ``req`` (prefix lookup, then one allocation for the rest of its prompt) and compute it; returns
    the prefix hit in tokens."""
    blocks, hit, _ = kv.get_computed_blocks(req)
    new = req.num_tokens - hit
    assert kv.allocate_slots(req, new, hit, blocks, num_lookahead_tokens=LOOKAHEAD) is not None
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req, req.num_computed_tokens)
    return hit


def ring_row(kv: KVCacheManager, request_id: str) -> list:
    return kv.coordinator.single_type_managers[1].req_to_blocks[request_id]


PREFIX = list(range(3, 3 + 400))


# N - (W - 1) = 337 + tail: one token before a block edge (tail 14, 46), at it (15, 47), one after (16, 48); a
# tail of 3 W leaves the cached prefix (400 tokens: 25 blocks) as the bound
@pytest.mark.parametrize("tail", [14, 15, 16, 46, 47, 48, 3 * WINDOW])
def test_a_hit_stops_where_the_first_query_still_sees(tail):
    """A second request sharing a 400-token prefix: its hit is the last block boundary at or below
    N - (W - 1), one token before, at and after a block edge: one block more and the first draft query at N
    would read a key nobody recomputed."""
    kv = manager()
    first = request("first", PREFIX)
    prefill(kv, first)
    kv.free(first)
    second = request("second", PREFIX + list(range(600, 600 + tail)))
    hit = prefill(kv, second)
    num_tokens = second.num_tokens
    cached = len(PREFIX) // BLOCK * BLOCK
    assert hit == min(cached, (num_tokens - (WINDOW - 1)) // BLOCK * BLOCK)
    assert hit + (WINDOW - 1) <= num_tokens, "the first query's window reaches into the cached prefix"
    assert num_tokens - hit <= WINDOW - 1 + BLOCK or hit == cached, "the hit is not the longest allowed"


def test_the_ring_row_is_position_indexed_after_a_hit_and_holds_at_most_r_blocks():
    kv = manager()
    first = request("first", PREFIX)
    prefill(kv, first)
    kv.free(first)
    second = request("second", [*PREFIX, 7, 8, 9])
    hit = prefill(kv, second)
    assert hit > 0
    row = ring_row(kv, "second")
    ring_manager = kv.coordinator.single_type_managers[1]
    ring = ring_manager.rings["second"].blocks
    assert len(row) == -(-second.num_tokens // BLOCK) and len(ring) <= ring_manager.ring_blocks
    assert all(block.is_null for block in row[: hit // BLOCK]), "the hit's blocks are dead to the ring"
    first_query_sees = second.num_tokens - (WINDOW - 1)
    for j in range(first_query_sees // BLOCK, len(row)):
        assert row[j] is ring[block_column(j, ring_manager.ring_blocks)], j
    kv.free(second)
    assert kv.block_pool.get_num_free_blocks() == 255, "a block leaked"


def test_a_request_with_no_ring_group_keeps_vllms_hit():
    groups = [KVCacheGroupSpec(["a"], FullAttentionSpec(**SHAPE))]
    assert ring_hit_cap(groups, 1000) == 1000
    ring = KVCacheGroupSpec(["b"], RingSWASpec(**SHAPE, sliding_window=WINDOW, lookahead=LOOKAHEAD))
    assert ring_hit_cap([*groups, ring], 1000) == 1000 - (WINDOW - 1)
    assert ring_hit_cap([*groups, ring], 10) == 0
