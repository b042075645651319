# SPDX-License-Identifier: Apache-2.0
"""vLLM #55800 simulated on vLLM's own scheduling code (no model): ``KVCacheManager`` and ``Scheduler`` driven
step by step with the stock sliding-window drafter group and with the ring. Used by ``ringkv admission``, the
benchmarks and the tests; a serving process never imports it (the plugin is ``ringkv.integration.vllm``)."""
