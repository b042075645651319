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
