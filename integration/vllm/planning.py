# SPDX-License-Identifier: Apache-2.0
"""Planning the ring from vLLM's configuration: the lookahead every ring spec is sized with, the checks a
configuration must pass, and the config scope ``customize_spec`` needs.

vLLM calls a backend's ``customize_spec`` several times per layer. One call (the worker collecting the
specs the scheduler will use: ``GPUModelRunner.get_kv_cache_spec`` in 0.32) runs outside any
``set_current_vllm_config`` scope, so the backend cannot see ``num_lookahead_tokens`` there and a ring would
be planned with the wrong lookahead (R = 129 instead of 130 on the vLLM #55800 shape).
``collect_specs_in_config_scope`` runs that collection inside the worker's own config; a spec built with
no config in scope stays *unplanned* (``lookahead = 0``) and is refused wherever a ring size is needed.
"""

from __future__ import annotations

import functools
from typing import Any

from ringkv.kernels.attention_inputs import MAX_QUERY_LEN

from ._compat import VllmConfig, kv_spec_collectors, set_current_vllm_config

UNPLANNED = 0


class RingConfigError(ValueError):
    """A vLLM configuration the ring cannot serve correctly; the message names the fix."""


def lookahead_from_config(vllm_config: VllmConfig | None) -> int:
    """vLLM's ``num_lookahead_tokens`` (>= 1: the verify step's own token); ``UNPLANNED`` without a config."""
    if vllm_config is None:
        return UNPLANNED
    return max(1, int(vllm_config.num_lookahead_tokens))


def check_ring_config(vllm_config: VllmConfig) -> None:
    """Refuse configurations that would silently lose the ring or its contents."""
    scheduler = getattr(vllm_config, "scheduler_config", None)
    if scheduler is not None and getattr(scheduler, "disable_hybrid_kv_cache_manager", False):
        raise RingConfigError(
            "ringkv: the hybrid KV-cache manager is disabled, so vLLM would turn the ring's sliding-window spec "
            "into full attention (every token kept). Remove --disable-hybrid-kv-cache-manager (and KV connectors "
            "without hybrid support)."
        )
    cache = getattr(vllm_config, "cache_config", None)
    if cache is not None and getattr(cache, "enable_prefix_caching", False):
        raise RingConfigError(
            "ringkv: prefix caching is on, but a target prefix hit carries no drafter ring K/V (the drafter would "
            "attend garbage, vLLM #47930). Start vLLM with --no-enable-prefix-caching."
        )
    lookahead = lookahead_from_config(vllm_config)
    if lookahead > MAX_QUERY_LEN:
        raise RingConfigError(
            f"ringkv: num_lookahead_tokens={lookahead} exceeds the {MAX_QUERY_LEN} draft-block rows ring_attention "
            "handles; lower num_speculative_tokens"
        )


def collect_specs_in_config_scope() -> None:
    """Run each worker-side spec collection inside the worker's ``vllm_config`` (idempotent)."""
    for owner, name in kv_spec_collectors():
        original = getattr(owner, name)
        if getattr(original, "_ringkv_wrapped", False):
            continue

        @functools.wraps(original)
        def collect(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            with set_current_vllm_config(self.vllm_config):
                return _original(self, *args, **kwargs)

        collect._ringkv_wrapped = True  # type: ignore[attr-defined]
        setattr(owner, name, collect)
