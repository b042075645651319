# SPDX-License-Identifier: Apache-2.0
"""Executable spec of the ring kernels: windowed attention of a varlen batch over the ring, and the ring write.

Same arguments as the Triton launchers (``ring_attention`` / ``ring_prefill_attention``, ``ring_write``);
loops over requests, resolves every key through ``ring_geometry``, then attends with the dense oracle's
masked softmax (``oracle.attention_by_position``, the formula's one home) in fp32 (or fp64). CPU-friendly,
not fast.
"""

from __future__ import annotations

import torch

from .kv_quant import FP8_DTYPES, dequantize, quantize_fp8
from .oracle import attention_by_position
from .ring_geometry import first_visible_position, table_slot_mapping
from .varlen import VarlenBatch


def gather_ring(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows of a ``[num_blocks, bs, H, D]`` cache view at flat ``slots`` ([n]) -> ``[n, H, D]``."""
    block_size = cache.shape[1]
    return cache[torch.div(slots, block_size, rounding_mode="floor"), torch.remainder(slots, block_size)]


def ring_attention_reference(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: VarlenBatch,
    *,
    window: int,
    causal: bool,
    scale: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
    **_launch_options: object,
) -> torch.Tensor:
    """Attention of a varlen batch (draft blocks or prefill chunks) over ring context plus its own K/V.

    Request ``r``'s ``query_len`` queries sit at absolute positions ``context_len .. seq_len - 1``
    (``varlen``); its keys are the ring history (positions ``< context_len``, read through
    ``batch.block_table[r]``) and its own ``k_new/v_new`` rows. Visibility per ``ring_geometry.visible``
    (window ``W``: ``q - k < W``, ``k >= 0``, causal ``k <= q`` else ``k - q < W``).

    Args:
        q: [T, Hq, D]; k_new: [T, Hkv, D]; v_new: [T, Hkv, Dv].
        k_cache: [num_blocks, bs, Hkv, D]; v_cache: [num_blocks, bs, Hkv, Dv] (any strides); fp8 caches are
            read as ``fp8 * k_scale`` / ``fp8 * v_scale`` (exactly, in fp64).
        batch: the ``VarlenBatch`` the kernels take (either mode).
        window: W. causal: causality among the batch's own keys. scale: default ``D ** -0.5``.
        compute_dtype: float64, float32, or the kernel's own dtype (``ref_lo`` of the tolerance rule).
        _launch_options: kernel-only options (``out``, ``num_splits``, ...), ignored here.

    Returns:
        [T, Hq, Dv] in ``q.dtype``.
    """
    out = torch.zeros(q.shape[0], q.shape[1], v_new.shape[-1], dtype=q.dtype, device=q.device)
    block_size = k_cache.shape[1]
    starts = batch.query_start_loc.tolist()
    for request, seq_len in enumerate(batch.seq_lens.tolist()):
        begin, end = starts[request], starts[request + 1]
        query_len = end - begin
        if query_len == 0:
            continue
        context_len = seq_len - query_len
        ctx_pos = torch.arange(first_visible_position(context_len, window), context_len, device=q.device)
        slots = table_slot_mapping(
            ctx_pos, batch.block_table[request], block_size=block_size, window=window, period=batch.period
        )
        query_pos = torch.arange(context_len, seq_len, device=q.device)
        out[begin:end] = attention_by_position(
            q[begin:end], query_pos,
            torch.cat([dequantize(gather_ring(k_cache, slots), k_scale), k_new[begin:end].to(torch.float64)]),
            torch.cat([dequantize(gather_ring(v_cache, slots), v_scale), v_new[begin:end].to(torch.float64)]),
            torch.cat([ctx_pos, query_pos]),
            window=window, causal=causal, scale=scale, compute_dtype=compute_dtype,
        ).to(q.dtype)  # fmt: skip
    return out


def ring_write_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store row ``t`` of ``k``/``v`` ([T, Hkv, D]) at ring slot ``slot_mapping[t]``; slot < 0 is skipped. An fp8
    cache stores ``quantize_fp8(row, scale)``."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(torch.int64)
    if torch.unique(slots).numel() != slots.numel():
        raise ValueError("slot_mapping writes one slot twice; drop dead positions (RingPlan.slot_mapping)")
    block_size = k_cache.shape[1]
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = torch.remainder(slots, block_size)
    for rows, cache, scale in ((k[keep], k_cache, k_scale), (v[keep], v_cache, v_scale)):
        fp8 = cache.dtype in FP8_DTYPES
        cache[blocks, offsets] = quantize_fp8(rows, scale, cache.dtype) if fp8 else rows.to(cache.dtype)
