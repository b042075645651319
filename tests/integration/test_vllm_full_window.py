# SPDX-License-Identifier: Apache-2.0
"""``RINGKV_DRAFTER_FULL_WINDOW`` (``full_window.py``): which layers it windows, and every configuration where it
cannot take effect as asked refused with the value and the fix (the engine runs: ``test_vllm_engine_full_window``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from ringkv.integration.vllm import full_window
from ringkv.integration.vllm._compat import FullAttentionSpec, SlidingWindowSpec
from ringkv.integration.vllm.errors import RingConfigError
from ringkv.integration.vllm.names import BACKEND_PATH
from ringkv.integration.vllm.ring_spec import RingSWASpec, ring_sink_tokens, ring_window, to_ring_spec

pytestmark = pytest.mark.vllm

SHAPE = {"block_size": 32, "num_kv_heads": 2, "head_size": 32, "dtype": torch.float32}
TARGET, DRAFT_FULL, DRAFT_SLIDING = "model.layers.0.attn", "model.layers.4.attn", "model.layers.5.attn"


def worker(drafter: set[str]) -> SimpleNamespace:
    """A worker whose V1 proposer names ``drafter`` (vLLM 0.32's ``_draft_attn_layer_names``)."""
    return SimpleNamespace(vllm_config=None, model_runner=SimpleNamespace(drafter=SimpleNamespace(
        _draft_attn_layer_names=drafter)))  # fmt: skip


@pytest.fixture
def on_ring(monkeypatch):
    """Every layer on the RINGKV backend, unless the test says otherwise; neither variable set."""
    for name in (full_window.WINDOW_ENV, full_window.SINKS_ENV):
        monkeypatch.delenv(name, raising=False)
    backends = {}
    monkeypatch.setattr(full_window, "layer_backend_paths", lambda config, names: {n: backends.get(n, BACKEND_PATH)
                                                                                    for n in names})  # fmt: skip
    return backends


def specs(draft_sliding_window: int | None = 32) -> dict:
    layers = {TARGET: FullAttentionSpec(**SHAPE), DRAFT_FULL: FullAttentionSpec(**SHAPE, non_causal=True)}
    if draft_sliding_window:
        layers[DRAFT_SLIDING] = SlidingWindowSpec(**SHAPE, sliding_window=draft_sliding_window)
    return layers


def test_unset_windows_nothing(on_ring):
    assert full_window.windowed_drafter_full_layers(worker({DRAFT_FULL}), specs()) == ({}, 0)


def test_only_the_drafters_full_layers_are_windowed(monkeypatch, on_ring):
    monkeypatch.setenv(full_window.WINDOW_ENV, "64")
    drafter = {DRAFT_FULL, DRAFT_SLIDING}
    windowed, sink_tokens = full_window.windowed_drafter_full_layers(worker(drafter), specs())
    assert list(windowed) == [DRAFT_FULL] and sink_tokens == 0
    spec = windowed[DRAFT_FULL]
    assert type(spec) is SlidingWindowSpec and spec.sliding_window == 64
    assert (spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype) == tuple(SHAPE.values())
    assert ring_window(RingSWASpec(**SHAPE, sliding_window=64, lookahead=8)) == 64
    assert ring_window(FullAttentionSpec(**SHAPE)) is None


@pytest.mark.parametrize(
    ("environment", "drafter", "sliding", "message"),
    [
        ({"RINGKV_DRAFTER_FULL_WINDOW": "0"}, {DRAFT_FULL}, 32, r"RINGKV_DRAFTER_FULL_WINDOW='0'; set an integer >= 1"),
        ({"RINGKV_DRAFTER_FULL_WINDOW": "2k"}, {DRAFT_FULL}, 32, r"'2k'; set an integer >= 1"),
        ({"RINGKV_DRAFTER_FULL_SINKS": "4"}, {DRAFT_FULL}, 32, "without RINGKV_DRAFTER_FULL_WINDOW"),
        ({"RINGKV_DRAFTER_FULL_WINDOW": "64", "RINGKV_DRAFTER_FULL_SINKS": "-1"}, {DRAFT_FULL}, 32, ">= 0"),
        ({"RINGKV_DRAFTER_FULL_WINDOW": "64", "RINGKV_DRAFTER_FULL_SINKS": "65"}, {DRAFT_FULL}, 32,
         "SINKS=65 with RINGKV_DRAFTER_FULL_WINDOW=64: sink_tokens=65 exceeds window=64.*"
         "set RINGKV_DRAFTER_FULL_SINKS <= RINGKV_DRAFTER_FULL_WINDOW"),
        ({"RINGKV_DRAFTER_FULL_WINDOW": "64"}, set(), 32, "runs no drafter"),
        ({"RINGKV_DRAFTER_FULL_WINDOW": "64"}, {DRAFT_SLIDING}, 32, "has no full-attention layer"),
        ({"RINGKV_DRAFTER_FULL_WINDOW": "16"}, {DRAFT_FULL, DRAFT_SLIDING}, 32,
         "16 is below the drafter's own sliding window W=32.*set RINGKV_DRAFTER_FULL_WINDOW >= 32"),
    ],
)  # fmt: skip
def test_refused_where_it_cannot_take_effect(monkeypatch, on_ring, environment, drafter, sliding, message):
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RingConfigError, match=message):
        full_window.windowed_drafter_full_layers(worker(drafter), specs(sliding))


def test_sinks_ride_with_the_windowed_layers(monkeypatch, on_ring):
    monkeypatch.setenv(full_window.WINDOW_ENV, "64")
    monkeypatch.setenv(full_window.SINKS_ENV, "5")
    windowed, sink_tokens = full_window.windowed_drafter_full_layers(worker({DRAFT_FULL, DRAFT_SLIDING}), specs())
    assert list(windowed) == [DRAFT_FULL] and sink_tokens == 5
    ring = to_ring_spec(windowed[DRAFT_FULL], lookahead=8, sink_tokens=sink_tokens)
    assert (ring.sink_tokens, ring_sink_tokens(ring), ring_window(ring)) == (5, 5, 64)
    assert to_ring_spec(ring, lookahead=8) is ring
    assert ring_sink_tokens(FullAttentionSpec(**SHAPE)) == 0


def test_sink_blocks_are_counted_beside_the_ring_at_admission():
    """One sink block (S = 5, bs 32) beside R = 4 ring blocks, for admission and pool sizing alike."""
    ring = RingSWASpec(**SHAPE, sliding_window=64, lookahead=8, sink_tokens=5)
    assert (ring.plan.sink_blocks, ring.ring_blocks) == (1, 4)
    assert ring.max_admission_blocks_per_request(1 << 20, 100_000) == 5
    assert ring.max_admission_blocks_per_request(0, 40) == 2  # a request shorter than the ring
    config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=100_000))
    assert ring.max_memory_usage_bytes(config) == 5 * ring.page_size_bytes


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "model-runner-v2"])
def test_sinks_refused_beside_a_connector_on_either_model_runner(v2):
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector="OffloadingConnector"),
                             use_v2_model_runner=v2)  # fmt: skip
    with pytest.raises(RingConfigError, match=r"SINKS=5 with the KV connector OffloadingConnector.*Remove --kv"):
        full_window.check_sinks_config(full_window.DrafterFullWindow(window=64, sinks=5), config)


def test_sinks_are_served_on_model_runner_v2():
    """The engine runs: ``test_vllm_v2_sinks_engine.py`` (slow)."""
    for caching in (False, True):
        config = SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=caching), use_v2_model_runner=True)
        full_window.check_sinks_config(full_window.DrafterFullWindow(window=64, sinks=5), config)


def test_sinks_refused_with_prefix_caching_on_and_the_cached_ring_off(monkeypatch):
    """Every hit, the target's included, would be 0: prefix caching could not take effect."""
    monkeypatch.setenv("RINGKV_RING_PREFIX_CACHE", "0")
    config = SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=True), use_v2_model_runner=False)
    with pytest.raises(RingConfigError, match=r"SINKS=5 with prefix caching on and RINGKV_RING_PREFIX_CACHE=0.*Unset"):
        full_window.check_sinks_config(full_window.DrafterFullWindow(window=64, sinks=5), config)
    config.cache_config.enable_prefix_caching = False
    full_window.check_sinks_config(full_window.DrafterFullWindow(window=64, sinks=5), config)


def test_sinks_are_served_with_prefix_caching_on():
    """The sink blocks join the prefix cache (test_vllm_cached_ring.py, test_vllm_engine_full_window.py)."""
    config = SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=True), use_v2_model_runner=False)
    full_window.check_sinks_config(full_window.DrafterFullWindow(window=64, sinks=5), config)


def test_model_runner_v2_keeps_the_sink_columns_of_the_row():
    """0.34's V2 worker nulls a sliding group's block-table columns wholly below ``num_retained_tokens`` each step:
    the sink columns would go with them, so a ring with sinks retains nothing (0 turns it off); one without keeps
    vLLM's ``W - 1``."""
    assert RingSWASpec(**SHAPE, sliding_window=64, lookahead=8, sink_tokens=5).num_retained_tokens == 0
    assert RingSWASpec(**SHAPE, sliding_window=64, lookahead=8).num_retained_tokens == 63


def test_refused_when_the_drafters_full_layers_are_not_on_the_ring(monkeypatch, on_ring):
    monkeypatch.setenv(full_window.WINDOW_ENV, "64")
    on_ring[DRAFT_FULL] = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
    with pytest.raises(RingConfigError, match=r"\['model.layers.4.attn'\] are not on the RINGKV backend"):
        full_window.windowed_drafter_full_layers(worker({DRAFT_FULL}), specs())
