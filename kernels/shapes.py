# SPDX-License-Identifier: Apache-2.0
"""The drafter shapes ringkv is built for, named once: vLLM #55800's DFlash2 drafter (the default everywhere:
the demo, the #55800 simulation, the GPU check) and the head shapes the benchmarks sweep beside it."""

from __future__ import annotations

from dataclasses import dataclass

from .ring_geometry import RingPlan


@dataclass(frozen=True)
class DrafterShape:
    """A sliding-window drafter's attention geometry: window W, KV block bs, N speculative tokens, heads."""

    window: int = 2048
    kv_block_size: int = 16
    num_speculative_tokens: int = 7
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128

    @property
    def lookahead(self) -> int:
        """vLLM's ``num_lookahead_tokens`` for DFlash: ``N + 1`` (the draft block)."""
        return self.num_speculative_tokens + 1

    @property
    def plan(self) -> RingPlan:
        return RingPlan.for_dflash(self.window, self.kv_block_size, self.num_speculative_tokens)

    def token_bytes(self, element_bytes: int = 2) -> int:
        """K and V bytes of one position in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * element_bytes


# vLLM #55800: GLM-5.3-class target, DFlash2 drafter with W 2048, KV block 16, 7 speculative tokens, 32/8 x 128
ISSUE_55800 = DrafterShape()
