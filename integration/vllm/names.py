# SPDX-License-Identifier: Apache-2.0
"""Names the plugin's modules share, in a leaf module (no vLLM import, no plugin import), so that no module has to
import another's job to learn a constant: the import graph of ``integration/vllm/`` stays acyclic
(``tests/integration/test_plugin_imports.py``)."""

from __future__ import annotations

# what a selection may name to put layers on the ring: RINGKV is an alias of vLLM's static CUSTOM member
RING_NAMES = ("RINGKV", "CUSTOM")
# vLLM resolves a registered backend from its dotted path, so the path is all selection needs (no backend import)
BACKEND_PATH = "ringkv.integration.vllm.backend.RingKVBackend"
CPU_SLIDING_BACKEND_PATH = "ringkv.integration.vllm.cpu_sliding.RingSlidingCPUBackend"
# a RingSWASpec's lookahead when no vLLM config was in scope (a page-size probe): it has a page size but no ring
UNPLANNED = 0

# the plugin's environment switches (ENVs.md): an engine's behaviour depends on them, so a lab run sets them in its
# own spec and never inherits them (``ringkv.bench.lab.e2e.runner``)
WINDOW_ENV = "RINGKV_DRAFTER_FULL_WINDOW"
SINKS_ENV = "RINGKV_DRAFTER_FULL_SINKS"
RING_PREFIX_CACHE_ENV = "RINGKV_RING_PREFIX_CACHE"
CPU_SLIDING_RING_ENV = "RINGKV_CPU_SLIDING_RING"
PLUGIN_SWITCHES = (WINDOW_ENV, SINKS_ENV, RING_PREFIX_CACHE_ENV, CPU_SLIDING_RING_ENV)
