# SPDX-License-Identifier: Apache-2.0
"""Executable spec of the ring kernels: windowed attention of a varlen batch over the ring, and the ring write.

Same arguments as the Triton launchers (``ring_attention``, ``ring_write``); gathers each request's window
through ``ring_geometry``'s slot formula, then attends with the dense oracle (``oracle.dense_history_attention``,
the masked softmax's one home) in fp32 (or fp64). CPU-friendly, not fast.
"""

from __future__ import annotations

import torch

from .kv_quant import FP8_DTYPES, dequantize, quantize_fp8
from .oracle import dense_history_attention
from .ring_geometry import (
    batch_live_slots,
    first_visible_position,
    sinks_below_window,
    slot_coordinates,
    table_slot_mapping,
)
from .validation import RingCache
from .varlen import VarlenBatch


def gather_ring(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows of a ``[num_blocks, bs, H, D]`` cache view at flat ``slots`` ([n]) -> ``[n, H, D]``."""
    return cache[slot_coordinates(slots, cache.shape[1])]


def read_ring(positions: range, row: torch.Tensor, cache: RingCache, **layout: int) -> tuple[torch.Tensor, ...]:
    """K/V ``[n, Hkv, D|Dv]`` of ``positions`` read through one block-table row (``table_slot_mapping`` with
    ``layout``: window, period, sink_tokens), an fp8 cache dequantized."""
    positions = torch.arange(positions.start, positions.stop, device=row.device)
    slots = table_slot_mapping(positions, row, kv_block_size=cache.k_cache.shape[1], **layout)
    return (dequantize(gather_ring(cache.k_cache, slots), cache.k_scale),
            dequantize(gather_ring(cache.v_cache, slots), cache.v_scale))  # fmt: skip


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
    sink_tokens: int = 0,
    scale: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    write_ring: bool = False,
    slot_mapping: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Attention of a varlen batch (draft blocks or prefill chunks) over ring context plus its own K/V; with
    ``write_ring``, then its live rows stored in the ring (``ring_geometry.batch_live_slots``).

    Request ``r``'s ``query_len`` queries sit at absolute positions ``context_len .. seq_len - 1``
    (``varlen``); its keys are the ring history (positions ``< context_len``, read through
    ``batch.block_table[r]``: the window's and the sinks below it) and its own ``k_new/v_new`` rows. Visibility
    per ``ring_geometry.visible`` (window ``W``: ``k >= 0`` and ``q - k < W`` or ``k < sink_tokens``, causal
    ``k <= q`` else ``k - q < W``).

    Args:
        q: [T, Hq, D]; k_new: [T, Hkv, D]; v_new: [T, Hkv, Dv].
        k_cache: [num_blocks, bs, Hkv, D]; v_cache: [num_blocks, bs, Hkv, Dv] (any strides); fp8 caches are
            read as ``fp8 * k_scale`` / ``fp8 * v_scale`` (exactly, in fp64).
        batch: the ``VarlenBatch`` the kernels take (either mode).
        window: W. causal: causality among the batch's own keys. sink_tokens: as ``ring_attention`` (rows
            ``[sink blocks | ring]``). scale: default ``D ** -0.5``.
        write_ring, slot_mapping: as ``ring_attention``.
        compute_dtype: float64, float32, or the kernel's own dtype (``ref_lo`` of the tolerance rule).
        out, num_splits: the launcher's, accepted so one argument dict serves both; they do not change the result
            (the reference always returns a new tensor).

    Returns:
        [T, Hq, Dv] in ``q.dtype``.
    """
    starts = batch.query_start_loc.tolist()
    cache = RingCache(k_cache, v_cache, k_scale, v_scale)
    layout = {"window": window, "period": batch.period, "sink_tokens": sink_tokens}
    histories, sinks = [], []
    for request, seq_len in enumerate(batch.seq_lens.tolist()):
        query_len = starts[request + 1] - starts[request]
        context_len = seq_len - query_len
        first = first_visible_position(context_len, window)
        row = batch.block_table[request]
        # the window's history and the sinks below it; a request without queries reads nothing (its row may be
        # anything)
        window_end = context_len if query_len else first
        sinks_end = sinks_below_window(context_len, window, sink_tokens) if query_len else 0
        histories.append((first, *read_ring(range(first, window_end), row, cache, **layout)))
        sinks.append(read_ring(range(sinks_end), row, cache, **layout))
    out = dense_history_attention(
        q, k_new, v_new, histories, batch.query_start_loc, batch.seq_lens, window=window, causal=causal, scale=scale,
        compute_dtype=compute_dtype, sink_tokens=sink_tokens, sink_history=sinks,
    ).to(q.dtype)  # fmt: skip
    if write_ring:
        slots = batch_live_slots(
            batch.query_start_loc, batch.seq_lens, batch.block_table, q.shape[0], kv_block_size=k_cache.shape[1],
            window=window, period=batch.period, slot_mapping=slot_mapping, sink_tokens=sink_tokens,
        )  # fmt: skip
        ring_write_reference(k_new, v_new, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
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
    blocks, offsets = slot_coordinates(slots, k_cache.shape[1])
    for rows, cache, scale in ((k[keep], k_cache, k_scale), (v[keep], v_cache, v_scale)):
        fp8 = cache.dtype in FP8_DTYPES
        cache[blocks, offsets] = quantize_fp8(rows, scale, cache.dtype) if fp8 else rows.to(cache.dtype)
