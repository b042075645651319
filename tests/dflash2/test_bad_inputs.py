# SPDX-License-Identifier: Apache-2.0
"""The drafter side's bad inputs: clear errors naming the value."""

from __future__ import annotations

import json

import pytest
from ringkv.dflash2.harness.ring_cache import DraftKVCache
from ringkv.dflash2.harness.tiny import random_drafter, tiny_config
from ringkv.dflash2.model import DFlash2Drafter, GroupedBlockConv


def test_conv_group_size_must_divide_hidden():
    with pytest.raises(ValueError, match="conv_group_size=24 must divide hidden_size=64"):
        GroupedBlockConv(hidden_size=64, taps=2, group_size=24, draft_block=4)


def test_full_layers_need_a_capacity():
    config = tiny_config(layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ValueError, match="needs max_positions"):
        DraftKVCache(config, 1)
    assert DraftKVCache(config, 1, max_positions=64).plans[1] is None


def test_checkpoint_mismatch_names_the_tensors(tmp_path):
    random_drafter(tiny_config(num_layers=2)).save_pretrained(tmp_path)
    config_path = tmp_path / "config.json"
    raw = json.loads(config_path.read_text())
    raw.update(num_hidden_layers=3, layer_types=raw["layer_types"] + ["sliding_attention"])
    config_path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"checkpoint mismatch, missing \['layers\.2"):
        DFlash2Drafter.from_pretrained(tmp_path)
