# SPDX-License-Identifier: Apache-2.0
"""DFlash2 config.json parsing and per-layer (window, causal) resolution in vLLM's order."""

from __future__ import annotations

import json

import pytest
from ringkv.dflash2.config import DFlashConfigError, LayerAttention, load_config, parse_config, resolve_layer


def raw(**changes):
    base = {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100, "sliding_window": 2048,
        "layer_types": ["sliding_attention"] * 3,
        "dflash_config": {"block_size": 8, "target_layer_ids": [1, 13], "mask_token_id": 99},
    }  # fmt: skip
    dflash = {**base["dflash_config"], **changes.pop("dflash_config", {})}
    return {**base, **changes, "dflash_config": dflash}


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        # sliding layers default to causal, full layers to non-causal
        ({"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
         [LayerAttention(2048, True), LayerAttention(None, False), LayerAttention(2048, True)]),
        # is_causal wins for every layer (DFlash2 checkpoints: all sliding, is_causal false)
        ({"is_causal": False}, [LayerAttention(2048, False)] * 3),
        # dflash_config.causal when is_causal is absent
        ({"layer_types": ["full_attention"] * 3, "dflash_config": {"causal": True}}, [LayerAttention(None, True)] * 3),
        # use_swa makes an all-full layer_types sliding, with swa_window_size (MiMo style)
        ({"layer_types": ["full_attention"] * 3, "dflash_config": {"use_swa": True, "swa_window_size": 512}},
         [LayerAttention(512, False)] * 3),
        # no layer_types: sliding iff use_swa, non-causal
        ({"layer_types": None, "dflash_config": {"use_swa": True}}, [LayerAttention(2048, False)] * 3),
        ({"layer_types": None}, [LayerAttention(None, False)] * 3),
    ],
)  # fmt: skip
def test_layer_resolution_follows_vllm(changes, expected):
    config = raw(**changes)
    assert [resolve_layer(config, i) for i in range(3)] == expected


def test_sliding_window_is_read_even_without_use_sliding_window():
    """transformers' Qwen3Config would drop it (use_sliding_window unset); the raw field is what counts."""
    config = parse_config(raw(use_sliding_window=False))
    assert all(layer.window == 2048 for layer in config.layers)


def test_ring_backed_layers_are_the_sliding_ones():
    config = parse_config(raw(layer_types=["sliding_attention", "full_attention", "sliding_attention"]))
    assert [layer.ring_backed for layer in config.layers] == [True, False, True]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"sliding_window": 4}, "window 4 is smaller than the draft block size 8"),
        ({"head_dim": None}, "'head_dim' is missing"),
        ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "unknown entries"),
        ({"sliding_window": None}, "needs dflash_config.swa_window_size"),
        ({"dflash_config": {"target_layer_ids": None}}, "'target_layer_ids' is missing"),
        ({"layer_types": ["sliding_attention"]}, "1 entries for num_hidden_layers=3"),
    ],
)
def test_bad_configs_name_the_field(changes, message):
    with pytest.raises(DFlashConfigError, match=message):
        parse_config(raw(**changes))


def test_load_config_from_a_checkpoint_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(raw(is_causal=False)))
    config = load_config(tmp_path)
    assert config.num_layers == 3 and config.target_layer_ids == (1, 13) and config.mask_token_id == 99
    assert parse_config(config.to_dict()) == config
