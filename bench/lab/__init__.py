# SPDX-License-Identifier: Apache-2.0
"""The lab: what measures and demonstrates the product without serving anything. ``simulation/`` vLLM #55800 on
vLLM's Scheduler / KVCacheManager (no model), ``e2e/`` engine-level runs, ``kernel_demo.py`` one drafter
attention step against the reference, ``plots.py`` their figures. The product (``ringkv.integration``) never
imports it; ``tests/test_layering.py`` checks."""
