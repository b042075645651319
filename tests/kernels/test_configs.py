# SPDX-License-Identifier: Apache-2.0
"""Tile selection is a pure, total, deterministic function of shapes (that no batch-dependent value specialises a
kernel is checked on the JIT's own keys in tests/bench/test_compile_report.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ringkv.kernels.configs import (
    ATTENTION_BLOCK_M,
    MAX_SPLITS,
    WriteConfig,
    ring_tile_keys,
    select_attention_config,
    select_num_splits,
    select_prefill_config,
    select_write_config,
)


@settings(max_examples=300, deadline=None)
@given(group_size=st.integers(1, 128), head_dim=st.integers(1, 256), head_dim_v=st.integers(1, 256),
       kv_block_size=st.integers(1, 4096))  # fmt: skip
def test_select_attention_config_is_total_and_consistent(group_size, head_dim, head_dim_v, kv_block_size):
    shape = {"group_size": group_size, "head_dim": head_dim, "head_dim_v": head_dim_v, "kv_block_size": kv_block_size}
    config = select_attention_config(**shape)
    assert config == select_attention_config(**shape)
    # the G x B rows of a KV head padded to the 64-row MMA tile; a query's G heads never straddle two programs
    assert config.BLOCK_M >= ATTENTION_BLOCK_M and group_size <= config.BLOCK_M
    assert config.BLOCK_Q >= 1 and config.BLOCK_Q * group_size <= config.BLOCK_M
    assert head_dim <= config.BLOCK_D and head_dim_v <= config.BLOCK_DV and min(config.TILE_N, config.BLOCK_D) >= 16
    # one KV block (or a part of one) per loop step whenever the block size allows it
    assert kv_block_size % config.TILE_N == 0 or config.TILE_N == 16


@pytest.mark.parametrize(("kv_block_size", "tile"), [(4, 16), (8, 16), (16, 16), (24, 16), (32, 32), (64, 64),
                                                  (128, 64), (48, 16), (2304, 64)])  # fmt: skip
def test_ring_tile_keys(kv_block_size, tile):
    assert ring_tile_keys(kv_block_size) == tile


def _splits(**overrides):
    shape = {"num_reqs": 1, "num_kv_heads": 8, "num_m_blocks": 1, "window": 2048, "tile_n": 16, "num_sms": 132}
    return select_num_splits(**{**shape, **overrides})


def test_split_kv_only_when_the_grid_is_small():
    assert _splits(num_reqs=1) == MAX_SPLITS
    assert 1 < _splits(num_reqs=8) < MAX_SPLITS
    assert _splits(num_reqs=256) == 1
    assert _splits(window=16) == 1, "a window of one tile is not split"
    assert all(1 <= _splits(num_reqs=n) <= MAX_SPLITS for n in range(1, 300))


def test_select_prefill_config_splits_wide_heads_over_two_warp_groups():
    narrow = select_prefill_config(group_size=4, head_dim=128, head_dim_v=128, kv_block_size=16)
    wide = select_prefill_config(group_size=4, head_dim=256, head_dim_v=256, kv_block_size=16)
    assert (narrow.num_warps, narrow.TILE_C, narrow.TILE_N, narrow.BLOCK_M) == (4, 64, 16, 64)
    assert (wide.num_warps, wide.TILE_C) == (8, 32)


def test_select_write_config():
    assert select_write_config(num_kv_heads=8, head_dim=128) == WriteConfig(BLOCK_T=8, BLOCK_H=8, num_warps=4)
    assert select_write_config(num_kv_heads=64, head_dim=256) == WriteConfig(BLOCK_T=1, BLOCK_H=32, num_warps=4)
    assert select_write_config(num_kv_heads=1, head_dim=59) == WriteConfig(BLOCK_T=128, BLOCK_H=1, num_warps=4)


def test_long_chunks_take_tall_tiles_only_under_the_interpreter():
    from ringkv.kernels.configs import INTERPRETED_LONG_CHUNK

    shape = {"group_size": 2, "head_dim": 32, "head_dim_v": 32, "kv_block_size": 16}
    native = select_prefill_config(**shape, max_query_len=1 << 16)
    short = select_prefill_config(**shape, max_query_len=INTERPRETED_LONG_CHUNK - 1, interpreted=True)
    long = select_prefill_config(**shape, max_query_len=INTERPRETED_LONG_CHUNK, interpreted=True)
    assert native == short and native.BLOCK_M == 64
    # the chunk's keys take the tall tile; the ring's stay one KV block per step (the native kernel's structure)
    assert (long.BLOCK_M, long.BLOCK_Q, long.TILE_C, long.TILE_N) == (512, 256, 128, 16)
