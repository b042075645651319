# SPDX-License-Identifier: Apache-2.0
"""Run step of the ring backend: attention and KV writes through ringkv's kernels.

``forward`` reads the batch's own K/V straight from ``key``/``value`` (``ring_attention``: draft blocks and
longer chunks alike) and only then stores the live new rows in the ring (write-after-read), for target sliding
layers. A drafter's block rows are never context (the next step's
verified rows take those positions), so draft layers store nothing in ``forward``; their context K/V
(vLLM's ``precompute_and_store_context_kv``) arrive through ``do_kv_cache_update``.
"""

from __future__ import annotations

from typing import Any

import torch
from ringkv.kernels import ring_attention
from ringkv.kernels.kv_quant import fp8_dtype_of
from ringkv.kernels.ring_geometry import UNBOUNDED_WINDOW

from ._compat import AttentionImpl, AttentionLayer, AttentionType
from .backend_step import ContextSlots, split_kv_cache, store_rows
from .errors import RingConfigError
from .metadata import RingAttentionMetadata

# the context slots a KV-cache group's layers share in one step (do_kv_cache_update), for every ring layer
CONTEXT_SLOTS = ContextSlots()


def layer_scales(layer: AttentionLayer | None, fp8_dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The kernels' ``k_scale`` / ``v_scale`` for an fp8 cache: the layer's ``_k_scale`` / ``_v_scale`` (vLLM's
    Attention layer carries them, 1.0 unless a checkpoint sets them); nothing for an unquantized cache."""
    if fp8_dtype is None:
        return {}
    scales = {name: getattr(layer, f"_{name}", None) for name in ("k_scale", "v_scale")}
    missing = [name for name, scale in scales.items() if scale is None]
    if missing:
        raise ValueError(
            f"an fp8 KV cache needs the layer's {' and '.join('_' + name for name in missing)} (vLLM's Attention "
            f"layer sets them); got {type(layer).__name__}"
        )
    return scales


class RingKVImpl(AttentionImpl[RingAttentionMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **unsupported: Any,
    ) -> None:
        if alibi_slopes is not None:
            raise NotImplementedError("ringkv: ALiBi is not supported")
        if logits_soft_cap not in (None, 0, 0.0):
            raise NotImplementedError(f"ringkv: logits_soft_cap={logits_soft_cap} is not supported")
        try:
            self.fp8_dtype = fp8_dtype_of(kv_cache_dtype)
        except ValueError as error:
            raise NotImplementedError(f"ringkv: {error}") from None
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"ringkv: attn_type={attn_type} is not supported (decoder attention only)")
        if unsupported.get("sinks") is not None:
            raise NotImplementedError(
                "ringkv: this layer declares learned attention sinks (a sink logit per head, from its checkpoint), "
                "which RINGKV does not serve and will not drop; run the layer on another attention backend "
                "(speculative_config attention_backend for a drafter). RINGKV_DRAFTER_FULL_SINKS keeps sink tokens, "
                "not learned sinks"
            )
        if kv_sharing_target_layer_name is not None:
            raise NotImplementedError(
                f"ringkv: kv_sharing_target_layer_name={kv_sharing_target_layer_name!r} (cross-layer KV sharing) is "
                "not supported: the ring would write the shared cache; select another backend for this model"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        # vLLM passes the window in its own convention: W keys including the query (q - k < W)
        self.window = int(sliding_window) if sliding_window else UNBOUNDED_WINDOW

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: RingAttentionMetadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("ringkv: fused output quantization is not supported")
        if attn_metadata is None:
            # profiling run
            return output.fill_(0)
        md = attn_metadata
        n = md.num_actual_tokens
        k_cache, v_cache = split_kv_cache(kv_cache, self.head_size, self.fp8_dtype)
        scales = layer_scales(layer, self.fp8_dtype)
        q = query[:n].view(n, self.num_heads, self.head_size)
        k = key[:n].view(n, self.num_kv_heads, self.head_size)
        v = value[:n].view(n, self.num_kv_heads, -1)
        # write-after-read: the chunk's first queries need the history its rows may replace
        ring_attention(
            q, k, v, k_cache, v_cache, md.batch, window=self.served_window(md), causal=md.causal, scale=self.scale,
            sink_tokens=md.sink_tokens, out=output[:n].view(n, self.num_heads, -1), write_ring=md.write_ring,
            slot_mapping=md.slot_mapping if md.write_ring else None, workspace=md.workspace, **scales,
        )  # fmt: skip
        return output

    def served_window(self, md: RingAttentionMetadata) -> int:
        """The layer's own window, or its ring group's where the plugin windowed a full-attention drafter layer
        (``full_window.py``); a sliding layer in a group of another window is refused."""
        if md.window is None or md.window == self.window:
            return self.window
        if self.window != UNBOUNDED_WINDOW:
            raise RingConfigError(
                f"ringkv: a layer of sliding window {self.window} sits in a ring group of window {md.window}; vLLM "
                "groups layers by spec, so this is a bug: report it with the model's layer types"
            )
        return md.window

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store context K/V rows at their ring slots; PAD (< 0) and superseded duplicates are skipped (the last
        writers computed once per step for the group's layers: ``ContextSlots``)."""
        n = key.shape[0]
        k_cache, v_cache = split_kv_cache(kv_cache, self.head_size, self.fp8_dtype)
        k, v = key.view(n, self.num_kv_heads, self.head_size), value.view(n, self.num_kv_heads, -1)
        store_rows(k, v, k_cache, v_cache, slot_mapping, context_slots=CONTEXT_SLOTS, layer=self,
                   **layer_scales(layer, self.fp8_dtype))  # fmt: skip
