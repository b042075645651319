# SPDX-License-Identifier: Apache-2.0
"""Plan step of the ring backend: per-batch metadata from vLLM's ``CommonAttentionMetadata``.

Runs outside CUDA graphs; host work is allowed here and nowhere on the per-layer path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ._compat import AttentionCGSupport, AttentionMetadataBuilder, CommonAttentionMetadata


@dataclass
class RingAttentionMetadata:
    """What ``RingKVImpl.forward`` needs: varlen layout, absolute seq lengths, full logical block rows."""

    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1]
    seq_lens: torch.Tensor  # [num_reqs]   context + this step's queries
    block_table: torch.Tensor  # [num_reqs, width]   logical rows, entry j = ring[j % R] or null
    slot_mapping: torch.Tensor  # [num_tokens]
    causal: bool
    # target sliding layers store their new rows after attending; a drafter's block rows are never context
    persist_new_rows: bool


def resolve_causal(causal: bool | torch.Tensor) -> bool:
    """vLLM's per-group ``causal`` flag (a bool, or a per-request tensor that must agree)."""
    if isinstance(causal, bool):
        return causal
    values = causal.flatten().tolist()
    if values and any(bool(v) != bool(values[0]) for v in values):
        raise ValueError("ringkv: a batch mixes causal and non-causal requests in one KV group")
    return bool(values[0]) if values else True


class RingKVMetadataBuilder(AttentionMetadataBuilder[RingAttentionMetadata]):
    # the kernel's shapes depend only on the batch shape, never on positions
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.persist_new_rows = not getattr(kv_cache_spec, "is_draft", False)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> RingAttentionMetadata:
        del common_prefix_len, fast_build
        cm = common_attn_metadata
        return RingAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            num_reqs=cm.num_reqs,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            query_start_loc=cm.query_start_loc[: cm.num_reqs + 1],
            seq_lens=cm.seq_lens[: cm.num_reqs],
            block_table=cm.block_table_tensor[: cm.num_reqs],
            slot_mapping=cm.slot_mapping,
            causal=resolve_causal(cm.causal),
            persist_new_rows=self.persist_new_rows,
        )

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> RingAttentionMetadata:
        return self.build(0, common_attn_metadata)
