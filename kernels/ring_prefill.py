# SPDX-License-Identifier: Apache-2.0
"""Two-source sliding-window attention for prefill chunks over the ring (``ring_prefill_attention``); must
match ``reference.ring_attention_reference`` (the same contract, any number of queries).

A chunk of C queries at positions ``P..P+C-1`` reads its history ``[q - W + 1, P)`` from the ring and its own
keys straight from the chunk's K/V tensor, so the chunk may be far longer than the ring. Only afterwards are
the chunk's live rows (positions ``>= P + C - (W - 1)``) written to the ring (write-after-read): writing first
would overwrite history the chunk's first queries still need.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._tiles import (
    attend_ring_range,
    attend_rows_range,
    load_kv_scales,
    load_query_rows,
    request_span,
    ring_tile_count,
)
from ._triton_utils import is_interpreter
from .attention_inputs import RingCache, validate_attention_inputs
from .configs import PrefillConfig, select_prefill_config
from .ring_attention import LOG2E
from .ring_geometry import last_writer_slots, live_write_slots, table_slot_mapping, varlen_positions
from .ring_write import ring_write
from .varlen import BatchMode, VarlenBatch


@triton.jit
def _ring_prefill_kernel(
    # outputs
    o_ptr,  # [T, HQ, DV]
    # inputs
    q_ptr,  # [T, HQ, D]
    k_ptr,  # [T, HKV, D]   the chunk's own keys
    v_ptr,  # [T, HKV, DV]
    kc_ptr,  # [num_blocks, BS, HKV, D]   ring history (16-element strides, 16-byte aligned base)
    vc_ptr,  # [num_blocks, BS, HKV, DV]
    k_scale_ptr,  # [1] fp32 when KV_FP8: the ring holds fp8(K / k_scale)
    v_scale_ptr,  # [1] fp32 when KV_FP8
    block_table_ptr,  # [num_reqs, width]
    query_start_loc_ptr,  # [num_reqs + 1]
    seq_lens_ptr,  # [num_reqs]   context_len + query_len
    # scalars
    qk_scale,
    window,
    table_period,
    # strides
    stride_o_t: tl.int64,
    stride_o_h: tl.int64,
    stride_q_t: tl.int64,
    stride_q_h: tl.int64,
    stride_k_t: tl.int64,
    stride_k_h: tl.int64,
    stride_v_t: tl.int64,
    stride_v_h: tl.int64,
    stride_kc_b: tl.int64,
    stride_kc_s: tl.int64,
    stride_kc_h: tl.int64,
    stride_vc_b: tl.int64,
    stride_vc_s: tl.int64,
    stride_vc_h: tl.int64,
    stride_bt_r: tl.int64,
    stride_bt_c: tl.int64,
    # constexprs
    G: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    TILE_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    FP32_IEEE: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    # query tiles on grid x (the long dimension: grid y and z stop at 65,535)
    i_qt = tl.program_id(0)
    i_h = tl.program_id(1).to(tl.int64)
    i_r = tl.program_id(2).to(tl.int64)
    bos, q_len, context_len = request_span(query_start_loc_ptr, seq_lens_ptr, i_r)
    q0 = i_qt * BLOCK_Q
    if q0 >= q_len:
        return

    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    o_i, o_head, m_row, q_pos, b_q = load_query_rows(
        q_ptr, bos, q0, q_len, context_len, i_h, stride_q_t, stride_q_h, o_d, o_d < D, G, BLOCK_Q, BLOCK_M, UPCAST
    )
    k_scale, v_scale = load_kv_scales(k_scale_ptr, v_scale_ptr, KV_FP8)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    q_last = tl.minimum(q0 + BLOCK_Q, q_len) - 1

    # source 1: history [max(0, P + q0 - W + 1), P) from the ring (P = context_len)
    hist_lo = tl.maximum(context_len + q0 - (window - 1), 0)
    m_i, l_i, acc = attend_ring_range(
        m_i, l_i, acc, b_q, q_pos, hist_lo, context_len, 0, ring_tile_count(hist_lo, context_len, TILE_N),
        kc_ptr + i_h * stride_kc_h, vc_ptr + i_h * stride_vc_h, block_table_ptr + i_r * stride_bt_r, table_period,
        k_scale, v_scale, stride_kc_b, stride_kc_s, stride_vc_b, stride_vc_s, stride_bt_c, o_d, o_dv, qk_scale, window,
        D, DV, BLOCK_D, BLOCK_DV, BS, TILE_N, UPCAST, FP32_IEEE, KV_FP8,
    )  # fmt: skip

    # source 2: the chunk's own keys, from the lowest any row of this tile sees to the highest (non-causal:
    # min(P + q_len, P + q_last + W), summed so that no term passes int32 for any window up to 2^31 - 1)
    new_lo = tl.maximum(context_len + q0 - (window - 1), context_len)
    if CAUSAL:
        new_hi = context_len + q_last + 1
    else:
        new_hi = context_len + q_last + tl.minimum(q_len - q_last, window)
    m_i, l_i, acc = attend_rows_range(
        m_i, l_i, acc, b_q, q_pos, new_lo, new_hi, k_ptr + i_h * stride_k_h, v_ptr + i_h * stride_v_h,
        bos + (new_lo - context_len).to(tl.int64), stride_k_t, stride_v_t, o_d, o_dv, qk_scale, window,
        D, DV, BLOCK_D, BLOCK_DV, TILE_C, CAUSAL, UPCAST, FP32_IEEE,
    )  # fmt: skip

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    b_o = acc / l_safe[:, None]
    p_o = o_ptr + (bos + o_i.to(tl.int64))[:, None] * stride_o_t + o_head[:, None] * stride_o_h + o_dv[None, :]
    tl.store(p_o, b_o.to(o_ptr.dtype.element_ty), mask=m_row[:, None] & (o_dv < DV)[None, :])


# grid y and z stop at 65,535 (CUDA); grid x at 2^31 - 1
MAX_GRID_YZ = 65_535


def prefill_grid(batch: VarlenBatch, num_kv_heads: int, config: PrefillConfig) -> tuple[int, int, int]:
    """(query tiles, KV heads, requests): the long dimension on grid x."""
    if num_kv_heads > MAX_GRID_YZ or batch.num_reqs > MAX_GRID_YZ:
        raise ValueError(
            f"num_kv_heads={num_kv_heads} / num_reqs={batch.num_reqs} exceed the grid's {MAX_GRID_YZ}; split the batch"
        )
    return (triton.cdiv(batch.max_query_len, config.BLOCK_Q), num_kv_heads, batch.num_reqs)


def ring_prefill_attention(
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
    out: torch.Tensor | None = None,
    write_ring: bool = True,
    slot_mapping: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attend a varlen batch of prefill chunks and decode rows, then store its live rows in the ring.

    Window convention (``window = W``): a query at position ``q`` sees ``k`` iff ``q - k < W``, ``k >= 0``;
    causal adds ``k <= q`` (FlashAttention ``(W-1, 0)``), non-causal ``k - q < W``. Request ``r``'s
    ``query_len`` rows sit at ``context_len .. seq_len - 1`` (``varlen``); history ``< context_len`` is read from
    the ring through ``batch.block_table``, the rest from ``k_new``/``v_new``.

    With ``write_ring`` the rows are written after the attention (write-after-read): through ``slot_mapping``
    when given (vLLM's), else through ``block_table``; positions before ``seq_lens[r] - (W - 1)`` are dead
    and never written, and of rows sharing a slot only the last is kept.

    Args:
        q: [T, Hq, D]; k: [T, Hkv, D]; v: [T, Hkv, Dv]. Caches: [num_blocks, bs, Hkv, D|Dv] views (strides that
            are multiples of 16 elements, 16-byte aligned base) of ``q.dtype``, or fp8 with ``k_scale`` /
            ``v_scale`` ([1] float tensors): read as ``fp8 * scale``, written quantized (``kv_quant``).
        batch: a ``VarlenBatch`` in ``BatchMode.PREFILL_CHUNK``.

    Returns:
        [T, Hq, Dv] in ``q.dtype``.
    """
    inputs = validate_attention_inputs(
        q, k_new, v_new, RingCache(k_cache, v_cache, k_scale, v_scale), batch, mode=BatchMode.PREFILL_CHUNK,
        window=window, scale=scale, out=out,
    )  # fmt: skip
    out = inputs.out
    num_tokens, _, head_dim = q.shape
    if batch.num_reqs and num_tokens:
        config = select_prefill_config(
            group_size=inputs.group_size, head_dim=head_dim, head_dim_v=v_new.shape[-1], block_size=k_cache.shape[1],
            max_query_len=batch.max_query_len, interpreted=is_interpreter(),
        )  # fmt: skip
        _ring_prefill_kernel[prefill_grid(batch, k_new.shape[1], config)](
            out, q, k_new, v_new, *inputs.cache.pointers(), batch.block_table, batch.query_start_loc,
            batch.seq_lens, inputs.scale * LOG2E, window, batch.period,
            out.stride(0), out.stride(1), q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1),
            v_new.stride(0), v_new.stride(1), *inputs.cache.strides(),
            batch.block_table.stride(0), batch.block_table.stride(1),
            G=inputs.group_size, D=head_dim, DV=v_new.shape[-1], BS=k_cache.shape[1], BLOCK_Q=config.BLOCK_Q,
            BLOCK_M=config.BLOCK_M, TILE_N=config.TILE_N, TILE_C=config.TILE_C, BLOCK_D=config.BLOCK_D,
            BLOCK_DV=config.BLOCK_DV, CAUSAL=causal, UPCAST=is_interpreter(), FP32_IEEE=q.dtype == torch.float32,
            KV_FP8=inputs.cache.fp8, num_warps=config.num_warps, num_stages=config.num_stages,
        )  # fmt: skip
    if write_ring and num_tokens:
        if slot_mapping is None:
            request, positions, ends = varlen_positions(batch.query_start_loc, batch.seq_lens, num_tokens)
            slots = last_writer_slots(table_slot_mapping(
                positions, batch.block_table, block_size=k_cache.shape[1], window=window,
                period=batch.period, request_index=request, seq_len=ends,
            ))  # fmt: skip
        else:
            slots = live_write_slots(slot_mapping, batch.query_start_loc, batch.seq_lens, num_tokens, window)
        ring_write(k_new, v_new, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    return out
