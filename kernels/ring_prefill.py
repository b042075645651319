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
    load_query_rows,
    load_row_tile,
    online_softmax_update,
    request_span,
    scores,
    visible_mask,
)
from ._triton_utils import is_interpreter
from .attention_inputs import validate_attention_inputs
from .configs import select_prefill_config
from .ring_attention import LOG2E
from .ring_geometry import last_writer_slots, live_write_slots, table_slot_mapping, varlen_positions
from .ring_write import ring_write

MAX_PREFILL_QUERY_LEN = 1 << 20


@triton.jit
def _ring_prefill_kernel(
    # outputs
    o_ptr,  # [T, HQ, DV]
    # inputs
    q_ptr,  # [T, HQ, D]
    k_ptr,  # [T, HKV, D]   the chunk's own keys
    v_ptr,  # [T, HKV, DV]
    kc_ptr,  # [num_blocks, BS, HKV, D]   ring history (any strides)
    vc_ptr,  # [num_blocks, BS, HKV, DV]
    block_table_ptr,  # [num_reqs, width]
    query_start_loc_ptr,  # [num_reqs + 1]
    seq_lens_ptr,  # [num_reqs]
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
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    FP32_IEEE: tl.constexpr,
):
    i_r = tl.program_id(0).to(tl.int64)
    i_qt = tl.program_id(1)
    i_h = tl.program_id(2).to(tl.int64)
    bos, q_len, committed = request_span(query_start_loc_ptr, seq_lens_ptr, i_r)
    q0 = i_qt * BLOCK_Q
    if q0 >= q_len:
        return

    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    m_d = o_d < D
    m_dv = o_dv < DV
    o_i, o_head, m_row, q_pos, b_q = load_query_rows(
        q_ptr, bos, q0, q_len, committed, i_h, stride_q_t, stride_q_h, o_d, m_d, G, BLOCK_Q, BLOCK_M, UPCAST
    )
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    q_last = tl.minimum(q0 + BLOCK_Q, q_len) - 1

    # source 1: history [max(0, P + q0 - W + 1), P) from the ring
    m_i, l_i, acc = attend_ring_range(
        m_i, l_i, acc, b_q, q_pos, m_row, tl.maximum(committed + q0 - (window - 1), 0), committed,
        kc_ptr, vc_ptr, block_table_ptr + i_r * stride_bt_r, table_period, i_h * stride_kc_h, i_h * stride_vc_h,
        stride_kc_b, stride_kc_s, stride_vc_b, stride_vc_s, stride_bt_c, o_d, o_dv, m_d, m_dv, qk_scale, window,
        BS, TILE_N, UPCAST, FP32_IEEE,
    )  # fmt: skip

    # source 2: the chunk's own keys, from the lowest any row of this tile sees to the highest
    new_lo = tl.maximum(committed + q0 - (window - 1), committed)
    if CAUSAL:
        new_hi = committed + q_last + 1
    else:
        new_hi = tl.minimum(committed + q_len, committed + q_last + window)
    for start in range(new_lo, new_hi, TILE_N):
        k_pos = start + tl.arange(0, TILE_N)
        m_k = k_pos < new_hi
        b_k, b_v = load_row_tile(
            k_ptr, v_ptr, bos + (k_pos - committed).to(tl.int64), m_k, i_h * stride_k_h, i_h * stride_v_h,
            stride_k_t, stride_v_t, o_d, o_dv, m_d, m_dv, UPCAST,
        )  # fmt: skip
        b_s = tl.where(visible_mask(q_pos, k_pos, m_row, m_k, window, CAUSAL),
                       scores(b_q, b_k, qk_scale, FP32_IEEE), float("-inf"))  # fmt: skip
        m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, b_s, b_v, FP32_IEEE)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    b_o = acc / l_safe[:, None]
    p_o = o_ptr + (bos + o_i.to(tl.int64))[:, None] * stride_o_t + o_head[:, None] * stride_o_h + o_dv[None, :]
    tl.store(p_o, b_o.to(o_ptr.dtype.element_ty), mask=m_row[:, None] & m_dv[None, :])


def ring_prefill_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    window: int,
    causal: bool,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    scale: float | None = None,
    table_period: int | None = None,
    out: torch.Tensor | None = None,
    write_ring: bool = True,
    slot_mapping: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attend a varlen batch of prefill chunks and decode rows, then store its live rows in the ring.

    Window convention (``window = W``): a query at position ``q`` sees ``k`` iff ``q - k < W``, ``k >= 0``;
    causal adds ``k <= q`` (FlashAttention ``(W-1, 0)``), non-causal ``k - q < W``. Request ``r``'s
    ``C = query_start_loc[r+1] - query_start_loc[r]`` rows sit at ``P..P+C-1`` with ``P = seq_lens[r] - C``;
    history ``< P`` is read from the ring through ``block_table`` (column ``(p // bs) mod table_period``,
    ``None``: full logical rows), the rest from ``k_new``/``v_new``.

    With ``write_ring`` the rows are written after the attention (write-after-read): through ``slot_mapping``
    when given (vLLM's), else through ``block_table``; positions before ``seq_lens[r] - (W - 1)`` are dead
    and never written, and of rows sharing a slot only the last is kept.

    Args:
        q: [T, Hq, D]; k: [T, Hkv, D]; v: [T, Hkv, Dv]. Caches: [num_blocks, bs, Hkv, D|Dv] views.
        block_table: [num_reqs, width]; query_start_loc: [num_reqs + 1]; seq_lens: [num_reqs].

    Returns:
        [T, Hq, Dv] in ``q.dtype``.
    """
    inputs = validate_attention_inputs(
        q, k_new, v_new, k_cache, v_cache, block_table, query_start_loc, seq_lens, window=window,
        max_query_len=max_query_len, max_seq_len=max_seq_len, scale=scale, table_period=table_period, out=out,
        num_splits=None, query_len_limit=MAX_PREFILL_QUERY_LEN,
    )  # fmt: skip
    out = inputs.out
    num_tokens, _, head_dim = q.shape
    if inputs.num_reqs and num_tokens:
        config = select_prefill_config(
            group_size=inputs.group_size, head_dim=head_dim, head_dim_v=v_new.shape[-1],
            max_query_len=inputs.max_query_len, interpreted=is_interpreter(),
        )  # fmt: skip
        grid = (inputs.num_reqs, triton.cdiv(inputs.max_query_len, config.BLOCK_Q), k_new.shape[1])
        _ring_prefill_kernel[grid](
            out, q, k_new, v_new, k_cache, v_cache, block_table, query_start_loc, seq_lens,
            inputs.scale * LOG2E, window, inputs.table_period,
            out.stride(0), out.stride(1), q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1),
            v_new.stride(0), v_new.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0), block_table.stride(1),
            G=inputs.group_size, D=head_dim, DV=v_new.shape[-1], BS=k_cache.shape[1], BLOCK_Q=config.BLOCK_Q,
            BLOCK_M=config.BLOCK_M, TILE_N=config.TILE_N, BLOCK_D=config.BLOCK_D, BLOCK_DV=config.BLOCK_DV,
            CAUSAL=causal, UPCAST=is_interpreter(), FP32_IEEE=q.dtype == torch.float32,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )  # fmt: skip
    if write_ring and num_tokens:
        if slot_mapping is None:
            request, positions, ends = varlen_positions(query_start_loc, seq_lens, num_tokens)
            slots = last_writer_slots(table_slot_mapping(
                positions, block_table, block_size=k_cache.shape[1], window=window,
                period=inputs.table_period, request_index=request, committed_end=ends,
            ))  # fmt: skip
        else:
            slots = live_write_slots(slot_mapping, query_start_loc, seq_lens, num_tokens, window)
        ring_write(k_new, v_new, k_cache, v_cache, slots)
    return out
