# SPDX-License-Identifier: Apache-2.0
"""Plan step of the ring backend: per-batch metadata from vLLM's ``CommonAttentionMetadata``.

Every ``build()`` returns a fresh object holding vLLM's own tensors for the step and host values; nothing is
cached between builds, so two builds before their forwards (micro-batching) never see each other's data and a
captured CUDA graph reads the addresses vLLM's persistent buffers give it. What persists is scratch: the builder's
``SplitWorkspace``, which every launch of its metadata takes its split partials and LSEs from.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from ringkv.kernels.attention import SplitWorkspace
from ringkv.kernels.varlen import VarlenBatch

from ._compat import (
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    is_draft_spec,
    marked_draft_layers,
)
from .backend_step import vllm_batch
from .host_sync import forbid_during_capture
from .ring_spec import ring_sink_tokens, ring_window


@dataclass(frozen=True)
class RingAttentionMetadata:
    """What ``RingKVImpl.forward`` needs: varlen layout, absolute seq lengths, full logical block rows."""

    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1]
    seq_lens: torch.Tensor  # [num_reqs]   context + this step's queries
    block_table: torch.Tensor  # [num_reqs, width]   logical rows, entry j = ring[j % R] or null
    slot_mapping: torch.Tensor  # [>= num_actual_tokens]   vLLM's slots of this step's rows
    causal: bool
    # the write flag: store this step's new rows in the ring after attending (target layers); never a drafter's blocks
    write_ring: bool
    # the builder's persistent scratch of ring_attention launches (split partials, LSEs): none allocated per launch
    workspace: SplitWorkspace | None = None
    # the ring group's window (its spec's): a full-attention drafter layer windowed by the plugin attends over it
    window: int | None = None
    # the ring group's sink tokens (its spec's): keys 0 .. sink_tokens - 1 its layers see besides the window
    sink_tokens: int = 0

    @functools.cached_property
    def batch(self) -> VarlenBatch:
        """The step's varlen batch for ``ring_attention``: built and validated once, shared by every layer of the
        KV-cache group (they share this metadata)."""
        return vllm_batch(self.query_start_loc, self.seq_lens, self.block_table, self.max_query_len, self.max_seq_len)


def resolve_causal(causal: bool | torch.Tensor) -> bool:
    """vLLM's per-group ``causal`` flag: a bool, or a per-request tensor whose values must agree (read on the
    host: a device tensor synchronises, which is refused during CUDA-graph capture)."""
    if isinstance(causal, bool):
        return causal
    if causal.device.type != "cpu":
        forbid_during_capture("reading a per-request causal tensor", "pass vLLM's per-group causal flag as a bool")
    values = causal.flatten().tolist()
    if values and any(bool(v) != bool(values[0]) for v in values):
        raise ValueError("ringkv: a batch mixes causal and non-causal requests in one KV group")
    return bool(values[0]) if values else True


class RingKVMetadataBuilder(AttentionMetadataBuilder[RingAttentionMetadata]):
    # the kernel's shapes depend only on the batch shape, never on positions
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # a drafter's layers: the spec says so from 0.33, the layers themselves on 0.32's Model Runner V2
        self.draft_layers = is_draft_spec(kv_cache_spec) or marked_draft_layers(vllm_config, layer_names)
        # one per builder: vLLM gives each micro-batch builders of its own, and the group's layers run in order
        self.workspace = SplitWorkspace()
        self.window = ring_window(kv_cache_spec)
        self.sink_tokens = ring_sink_tokens(kv_cache_spec)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> RingAttentionMetadata:
        del common_prefix_len, fast_build
        return self._build(common_attn_metadata, write_ring=not self.draft_layers)

    def build_for_drafting(
        self, common_attn_metadata: CommonAttentionMetadata, draft_index: int
    ) -> RingAttentionMetadata:
        """The drafter's query blocks (vLLM's V1 proposers, 0.32 and 0.33; 0.34 has no V1 runner and no such
        hook): never context, so ``forward`` stores none of their rows (the drafter's context K/V arrive through
        ``do_kv_cache_update``)."""
        del draft_index
        return self._build(common_attn_metadata, write_ring=False)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> RingAttentionMetadata:
        """What a captured graph replays (V2 DFlash: padded requests, ``max_seq_len = max_model_len``): the same
        views of vLLM's persistent buffers as ``build``, which is all a replay needs."""
        return self.build(0, common_attn_metadata)

    def _build(self, cm: CommonAttentionMetadata, write_ring: bool) -> RingAttentionMetadata:
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
            write_ring=write_ring,
            workspace=self.workspace,
            window=self.window,
            sink_tokens=self.sink_tokens,
        )
