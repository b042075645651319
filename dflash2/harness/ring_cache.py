# SPDX-License-Identifier: Apache-2.0
"""The drafter's K/V storage: a ring of R blocks per request for each sliding layer (``ring``), or every
position kept (``full``, the reference a ring must match). Full-attention layers always keep every position:
they are not ring-backed. A ring may store fp8 (vLLM ``kv_cache_dtype`` names, per-layer scalar ``k_scale`` /
``v_scale``, ``kernels/kv_quant.py``): rows stored as ``fp8(x / scale)``, read as ``fp8 * scale``."""

from __future__ import annotations

from typing import Literal

import torch
from ringkv.dflash2.config import DFlashConfig, LayerAttention
from ringkv.dflash2.model import DraftBlocks
from ringkv.kernels import BatchMode, ring_attention, ring_attention_reference, ring_write, ring_write_reference
from ringkv.kernels.kv_quant import fp8_dtype_of
from ringkv.kernels.oracle import dense_history_attention
from ringkv.kernels.ring_geometry import UNBOUNDED_WINDOW, RingPlan
from ringkv.kernels.testing import RingPool


class DraftKVCache:
    """K/V for ``num_requests`` requests of one drafter.

    Args:
        mode: ``"ring"`` (sliding layers in rings of ``RingPlan(W, kv_block_size, B).ring_blocks`` blocks) or
            ``"full"`` (every position, the full-history reference).
        attention: ``"triton"`` (``ring_write`` / ``ring_attention``; GPU, or CPU under TRITON_INTERPRET=1)
            or ``"reference"`` (the PyTorch reference on the same ring).
        max_positions: capacity of full caches (full mode, full-attention layers).
        kv_cache_dtype: ``"auto"`` (rings in ``dtype``) or an fp8 name (rings in fp8; full caches stay in
            ``dtype``); ``k_scale`` / ``v_scale`` default to 1.0, vLLM's value when a checkpoint sets none.
    """

    def __init__(
        self,
        config: DFlashConfig,
        num_requests: int,
        *,
        mode: Literal["ring", "full"] = "ring",
        attention: Literal["triton", "reference"] = "triton",
        kv_block_size: int = 16,
        max_positions: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kv_cache_dtype: str = "auto",
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        fp8 = fp8_dtype_of(kv_cache_dtype)
        if fp8 is not None and mode != "ring":
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} quantizes rings: use mode='ring' (the full-history "
                             "reference keeps exact K/V)")  # fmt: skip
        self.config, self.mode, self.attention = config, mode, attention
        self.num_requests, self.device, self.dtype = num_requests, torch.device(device), dtype
        self.scale = config.head_dim**-0.5
        self.scales = {} if fp8 is None else {
            name: torch.full((1,), value, dtype=torch.float32, device=self.device)
            for name, value in (("k_scale", k_scale), ("v_scale", v_scale))}  # fmt: skip
        # never-written slots are NaN (fp8: its NaN byte): a read of one poisons the output
        self.pools: list[RingPool | None] = []
        self.storage: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in config.layers:
            if mode == "ring" and layer.ring_backed:
                pool = RingPool.allocate(
                    RingPlan(layer.window, kv_block_size, config.draft_block), num_requests,
                    num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                    dtype=dtype if fp8 is None else fp8, device=self.device,
                )  # fmt: skip
                self.pools.append(pool)
                self.storage.append((pool.k_cache, pool.v_cache))
                continue
            if max_positions is None:
                raise ValueError("a full cache (mode='full' or a full-attention layer) needs max_positions")
            self.pools.append(None)
            full = (num_requests, max_positions, config.num_kv_heads, config.head_dim)
            self.storage.append(tuple(torch.full(full, float("nan"), dtype=dtype, device=self.device)
                                      for _ in range(2)))  # fmt: skip
        self.plans: list[RingPlan | None] = [None if pool is None else pool.plan for pool in self.pools]

    def nbytes(self) -> int:
        """Bytes of K/V storage."""
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.storage)

    def write(self, layer: int, request: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Context rows at consecutive ``positions``; ring layers drop positions that are dead."""
        pool = self.pools[layer]
        k_store, v_store = self.storage[layer]
        if pool is None:
            k_store[request, positions] = k.to(self.dtype)
            v_store[request, positions] = v.to(self.dtype)
            return
        slots = pool.slot_mapping(positions, request, seq_len=int(positions[-1]) + 1)
        keep = slots >= 0
        # only live rows travel to the kernel (a chunk longer than the ring is mostly dead)
        rows = (k.to(self.dtype)[keep].contiguous(), v.to(self.dtype)[keep].contiguous())
        write = ring_write if self.attention == "triton" else ring_write_reference
        write(*rows, k_store, v_store, slots[keep], **self.scales)

    def attend(
        self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, blocks: DraftBlocks
    ) -> torch.Tensor:
        """``DraftKVStore.attend`` over this cache's ring (or every kept position) of each block's request."""
        context_lens, block, requests = blocks.context_lens, blocks.block, blocks.requests
        for request in requests:
            if not 0 <= request < self.num_requests:
                raise ValueError(f"request {request} is outside this cache's {self.num_requests} requests")
        spec: LayerAttention = self.config.layers[layer]
        window = spec.window or UNBOUNDED_WINDOW
        pool = self.pools[layer]
        k_store, v_store = self.storage[layer]
        if pool is None:
            # the dense oracle over every kept position, in the cache's precision (at least fp32)
            starts = torch.arange(0, block * len(context_lens) + 1, block, dtype=torch.int32, device=self.device)
            seq_lens = torch.tensor([p + block for p in context_lens], dtype=torch.int32, device=self.device)
            histories = [(0, k_store[request], v_store[request]) for request in requests]
            return dense_history_attention(
                q, k_new, v_new, histories, starts, seq_lens,
                window=window, causal=spec.causal, scale=self.scale,
                compute_dtype=torch.promote_types(self.dtype, torch.float32),
            ).to(q.dtype)  # fmt: skip
        batch = pool.batch(context_lens, block, mode=BatchMode.DRAFT_BLOCK, requests=requests)
        args = (q.to(self.dtype), k_new.to(self.dtype), v_new.to(self.dtype), k_store, v_store, batch)
        options = {"window": window, "causal": spec.causal, "scale": self.scale, **self.scales}
        if self.attention == "triton":
            return ring_attention(*args, **options).to(q.dtype)
        return ring_attention_reference(*args, **options).to(q.dtype)
