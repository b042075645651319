# SPDX-License-Identifier: Apache-2.0
"""Plan step of the ring backend: per-batch metadata from vLLM's ``CommonAttentionMetadata``.

Runs outside CUDA graphs; host work is allowed here and nowhere on the per-layer path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from ringkv.kernels.ring_geometry import UNBOUNDED_WINDOW, last_writer_slots, pad_unwritten, varlen_positions

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
    # [num_actual_tokens] where the batch's rows go after attending (dead rows and superseded duplicates PAD);
    # None for draft layers: a drafter's block rows are never context
    live_slots: torch.Tensor | None


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
        # a spec marked as a drafter's (vLLM >= 0.34); on 0.32 the drafter builds through build_for_drafting
        self.draft_layers = bool(getattr(kv_cache_spec, "is_draft", False))
        self.window = getattr(kv_cache_spec, "sliding_window", None) or UNBOUNDED_WINDOW
        scheduler = getattr(vllm_config, "scheduler_config", None)
        self.max_tokens = getattr(scheduler, "max_num_batched_tokens", 0) or 0
        # persistent, so a captured graph keeps reading the same address
        self._live_slots: torch.Tensor | None = None

    def live_slots(self, cm: CommonAttentionMetadata) -> torch.Tensor:
        """Once per batch for every layer of the group: vLLM's slots with unwritten rows PAD, last writers only."""
        n = cm.num_actual_tokens
        _, positions, ends = varlen_positions(cm.query_start_loc[: cm.num_reqs + 1], cm.seq_lens[: cm.num_reqs], n)
        slots = last_writer_slots(pad_unwritten(cm.slot_mapping[:n], positions, ends, self.window))
        if self._live_slots is None or self._live_slots.numel() < n:
            self._live_slots = torch.empty(max(n, self.max_tokens), dtype=slots.dtype, device=slots.device)
        self._live_slots[:n].copy_(slots)
        return self._live_slots[:n]

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> RingAttentionMetadata:
        del common_prefix_len, fast_build
        return self._build(common_attn_metadata, persist_new_rows=not self.draft_layers)

    def build_for_drafting(
        self, common_attn_metadata: CommonAttentionMetadata, draft_index: int
    ) -> RingAttentionMetadata:
        """The drafter's query blocks: never context, so ``forward`` stores none of their rows (the drafter's
        context K/V arrive through ``do_kv_cache_update``)."""
        del draft_index
        return self._build(common_attn_metadata, persist_new_rows=False)

    def _build(self, cm: CommonAttentionMetadata, persist_new_rows: bool) -> RingAttentionMetadata:
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
            live_slots=self.live_slots(cm) if persist_new_rows else None,
        )

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> RingAttentionMetadata:
        return self.build(0, common_attn_metadata)
