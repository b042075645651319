# SPDX-License-Identifier: Apache-2.0
"""Tile selection is a pure, total, deterministic function of shapes."""

from __future__ import annotations

import itertools

import pytest
from ringkv.kernels.configs import (
    MAX_BLOCK_M,
    MAX_SPLITS,
    WriteConfig,
    select_attention_config,
    select_write_config,
)


def _select(**overrides):
    shape = {"num_reqs": 1, "num_kv_heads": 8, "group_size": 4, "max_query_len": 8, "head_dim": 128,
             "head_dim_v": 128, "window": 2048, "num_sms": 132}  # fmt: skip
    return select_attention_config(**{**shape, **overrides})


@pytest.mark.parametrize(
    ("num_reqs", "group_size", "max_query_len", "head_dim", "window"),
    list(itertools.product([1, 8, 64, 256], [1, 4, 5, 8], [1, 8, 16, 33], [59, 64, 128, 256], [1, 16, 2048])),
)
def test_select_attention_config_is_total_and_consistent(num_reqs, group_size, max_query_len, head_dim, window):
    config = _select(num_reqs=num_reqs, group_size=group_size, max_query_len=max_query_len, head_dim=head_dim,
                     head_dim_v=head_dim, window=window)  # fmt: skip
    assert config == _select(num_reqs=num_reqs, group_size=group_size, max_query_len=max_query_len,
                             head_dim=head_dim, head_dim_v=head_dim, window=window)  # fmt: skip
    assert config.queries_per_block * group_size <= config.BLOCK_M
    assert config.queries_per_block * config.num_m_blocks >= max_query_len
    assert max_query_len <= config.BLOCK_KB and head_dim <= config.BLOCK_D
    assert min(config.BLOCK_M, config.BLOCK_KB, config.TILE_N, config.BLOCK_D) >= 16
    assert 1 <= config.num_splits <= MAX_SPLITS
    if group_size * max_query_len <= MAX_BLOCK_M:
        assert config.num_m_blocks == 1, "all G x B rows of a KV head belong in one program"


def test_split_kv_only_when_the_grid_is_small():
    assert _select(num_reqs=1).num_splits > 1
    assert _select(num_reqs=256).num_splits == 1
    assert _select(window=16).num_splits == 1, "a window of one tile is not split"
    assert _select(num_reqs=1, num_splits=3).num_splits == 3


def test_select_config_ignores_positions():
    """Only shapes go in: nothing in the signature depends on a request's position (CUDA-graph safe)."""
    import inspect

    params = set(inspect.signature(select_attention_config).parameters)
    assert not params & {"seq_lens", "positions", "max_seq_len", "committed"}


def test_select_write_config():
    assert select_write_config(num_kv_heads=8, head_dim=128) == WriteConfig(BLOCK_T=8, BLOCK_H=8, num_warps=4)
    assert select_write_config(num_kv_heads=64, head_dim=256) == WriteConfig(BLOCK_T=1, BLOCK_H=32, num_warps=4)
    assert select_write_config(num_kv_heads=1, head_dim=59) == WriteConfig(BLOCK_T=128, BLOCK_H=1, num_warps=4)


def test_long_chunks_take_tall_tiles_only_under_the_interpreter():
    from ringkv.kernels.configs import INTERPRETED_LONG_CHUNK, select_prefill_config

    shape = {"group_size": 2, "head_dim": 32, "head_dim_v": 32}
    native = select_prefill_config(**shape, max_query_len=1 << 16)
    short = select_prefill_config(**shape, max_query_len=INTERPRETED_LONG_CHUNK - 1, interpreted=True)
    long = select_prefill_config(**shape, max_query_len=INTERPRETED_LONG_CHUNK, interpreted=True)
    assert native == short and native.BLOCK_M == 64
    assert (long.BLOCK_M, long.BLOCK_Q, long.TILE_N) == (512, 256, 128)
