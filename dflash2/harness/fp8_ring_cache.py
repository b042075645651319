# SPDX-License-Identifier: Apache-2.0
"""A ring ``DraftKVCache`` whose ring-backed layers store fp8 (vLLM ``kv_cache_dtype`` names, per-layer scalar
``k_scale`` / ``v_scale``, ``kernels/kv_quant.py``); the drafter computes in the cache's ``dtype`` as before, and
full-attention layers keep every position unquantized."""

from __future__ import annotations

from typing import Any

import torch
from ringkv.dflash2.config import DFlashConfig
from ringkv.dflash2.model import DraftBlocks
from ringkv.kernels import (
    BatchMode,
    VarlenBatch,
    ring_attention,
    ring_attention_reference,
    ring_write,
    ring_write_reference,
)
from ringkv.kernels.kv_quant import fp8_dtype_of
from ringkv.kernels.ring_geometry import UNBOUNDED_WINDOW

from .ring_cache import DraftKVCache


class Fp8DraftKVCache(DraftKVCache):
    """``DraftKVCache(mode="ring")`` with fp8 rings: rows are stored as ``fp8(x / scale)`` and read as
    ``fp8 * scale``. ``k_scale`` / ``v_scale`` default to 1.0, vLLM's value when a checkpoint sets none."""

    def __init__(
        self,
        config: DFlashConfig,
        num_requests: int,
        *,
        kv_cache_dtype: str,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        **options: Any,
    ) -> None:
        super().__init__(config, num_requests, mode="ring", **options)
        fp8 = fp8_dtype_of(kv_cache_dtype)
        if fp8 is None:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not fp8; use DraftKVCache for unquantized rings")
        self.kv_cache_dtype = kv_cache_dtype
        self.scales = {name: torch.full((1,), value, dtype=torch.float32, device=self.device)
                       for name, value in (("k_scale", k_scale), ("v_scale", v_scale))}  # fmt: skip
        # never-written ring slots hold the fp8 NaN byte
        self.storage = [(k.to(fp8), v.to(fp8)) if plan is not None else (k, v)
                        for (k, v), plan in zip(self.storage, self.plans, strict=True)]  # fmt: skip

    def write(self, layer: int, request: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        plan, ring = self.plans[layer], self.rings[layer]
        if plan is None:
            super().write(layer, request, positions, k, v)
            return
        k_store, v_store = self.storage[layer]
        slots = plan.slot_mapping(positions.to(self.device), ring[request], seq_len=int(positions[-1]) + 1)
        keep = slots >= 0
        rows = (k.to(self.dtype)[keep].contiguous(), v.to(self.dtype)[keep].contiguous())
        write = ring_write if self.attention == "triton" else ring_write_reference
        write(*rows, k_store, v_store, slots[keep], **self.scales)

    def attend(
        self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, blocks: DraftBlocks
    ) -> torch.Tensor:
        plan, ring = self.plans[layer], self.rings[layer]
        if plan is None:
            return super().attend(layer, q, k_new, v_new, blocks)
        context_lens, block = blocks.context_lens, blocks.block
        spec = self.config.layers[layer]
        k_store, v_store = self.storage[layer]
        starts = torch.arange(0, block * len(context_lens) + 1, block, dtype=torch.int32, device=self.device)
        seq_lens = torch.tensor([p + block for p in context_lens], dtype=torch.int32, device=self.device)
        rows = ring[torch.tensor(list(blocks.requests), device=self.device)]
        batch = VarlenBatch(starts, seq_lens, rows, max_query_len=block, max_seq_len=max(context_lens) + block,
                            table_period=plan.num_blocks, mode=BatchMode.DRAFT_BLOCK)  # fmt: skip
        attend = ring_attention if self.attention == "triton" else ring_attention_reference
        return attend(
            q.to(self.dtype), k_new.to(self.dtype), v_new.to(self.dtype), k_store, v_store, batch,
            window=spec.window or UNBOUNDED_WINDOW, causal=spec.causal, scale=self.scale, **self.scales,
        ).to(q.dtype)  # fmt: skip
