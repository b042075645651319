# SPDX-License-Identifier: Apache-2.0
"""Triton draft-block attention over the ring (``ring_attention``); must match
``reference.ring_attention_reference``. Ring arithmetic: ``ring_geometry`` (column = (p // bs) mod period).

One program owns all ``G x B`` query rows of one KV head of one request (query-major rows ``i * G + g``),
so each context K/V byte is read once per step; when requests x KV heads leave SMs idle the window is split
(``NUM_SPLITS``) and the partial results are merged by log-sum-exp in ``_combine_splits_kernel``.
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
from ._triton_utils import device_sms, is_interpreter
from .attention_inputs import AttentionInputs, validate_attention_inputs
from .configs import AttentionConfig, select_attention_config
from .varlen import BatchMode, VarlenBatch

LOG2E = 1.4426950408889634


@triton.jit
def _ring_attention_kernel(
    # outputs
    o_ptr,  # [T, HQ, DV] when NUM_SPLITS == 1, else fp32 partials [NUM_SPLITS, T, HQ, DV]
    lse_ptr,  # [NUM_SPLITS, T, HQ] fp32 (log2 domain), only when NUM_SPLITS > 1
    # inputs
    q_ptr,  # [T, HQ, D]
    kn_ptr,  # [T, HKV, D]   the block's own keys
    vn_ptr,  # [T, HKV, DV]
    kc_ptr,  # [num_blocks, BS, HKV, D]   ring keys (any strides)
    vc_ptr,  # [num_blocks, BS, HKV, DV]
    block_table_ptr,  # [num_reqs, width] int32/int64
    query_start_loc_ptr,  # [num_reqs + 1]
    seq_lens_ptr,  # [num_reqs]   context + block
    # scalars
    qk_scale,  # softmax scale * log2(e)
    window,
    table_period,
    # strides
    stride_o_s: tl.int64,
    stride_o_t: tl.int64,
    stride_o_h: tl.int64,
    stride_lse_s: tl.int64,
    stride_lse_t: tl.int64,
    stride_q_t: tl.int64,
    stride_q_h: tl.int64,
    stride_kn_t: tl.int64,
    stride_kn_h: tl.int64,
    stride_vn_t: tl.int64,
    stride_vn_h: tl.int64,
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
    QUERIES_PER_BLOCK: tl.constexpr,
    NUM_M_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_KB: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    CAUSAL: tl.constexpr,
    # the interpreter computes bf16 on raw bits: upcast right after every load
    UPCAST: tl.constexpr,
    FP32_IEEE: tl.constexpr,
):
    i_r = tl.program_id(0).to(tl.int64)
    i_h = (tl.program_id(1) // NUM_M_BLOCKS).to(tl.int64)
    i_mb = tl.program_id(1) % NUM_M_BLOCKS
    i_s = tl.program_id(2)
    bos, q_len, committed = request_span(query_start_loc_ptr, seq_lens_ptr, i_r)
    q0 = i_mb * QUERIES_PER_BLOCK
    if q0 >= q_len:
        return

    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    m_d = o_d < D
    m_dv = o_dv < DV
    o_i, o_head, m_row, q_pos, b_q = load_query_rows(
        q_ptr, bos, q0, q_len, committed, i_h, stride_q_t, stride_q_h, o_d, m_d, G, QUERIES_PER_BLOCK, BLOCK_M, UPCAST
    )
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # context keys [ctx_lo, committed): the union of this row block's windows, split NUM_SPLITS ways in
    # whole tiles; a runtime span, so no constant grows with the window (full attention: window = 2^40)
    ctx_lo = tl.maximum(committed + q0 - (window - 1), 0)
    keys_per_split = tl.cdiv(tl.cdiv(tl.maximum(committed - ctx_lo, 0), NUM_SPLITS), TILE_N) * TILE_N
    split_lo = ctx_lo + i_s * keys_per_split
    split_hi = tl.minimum(split_lo + keys_per_split, committed)
    m_i, l_i, acc = attend_ring_range(
        m_i, l_i, acc, b_q, q_pos, m_row, split_lo, split_hi,
        kc_ptr, vc_ptr, block_table_ptr + i_r * stride_bt_r, table_period, i_h * stride_kc_h, i_h * stride_vc_h,
        stride_kc_b, stride_kc_s, stride_vc_b, stride_vc_s, stride_bt_c, o_d, o_dv, m_d, m_dv, qk_scale, window,
        BS, TILE_N, UPCAST, FP32_IEEE,
    )  # fmt: skip

    # the block's own keys at positions committed .. committed + q_len - 1 (last split only)
    if i_s == NUM_SPLITS - 1:
        o_j = tl.arange(0, BLOCK_KB)
        m_j = o_j < q_len
        b_k, b_v = load_row_tile(
            kn_ptr, vn_ptr, bos + o_j.to(tl.int64), m_j, i_h * stride_kn_h, i_h * stride_vn_h, stride_kn_t,
            stride_vn_t, o_d, o_dv, m_d, m_dv, UPCAST,
        )  # fmt: skip
        b_s = tl.where(visible_mask(q_pos, committed + o_j, m_row, m_j, window, CAUSAL),
                       scores(b_q, b_k, qk_scale, FP32_IEEE), float("-inf"))  # fmt: skip
        m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, b_s, b_v, FP32_IEEE)

    # a row that saw no key outputs 0 (l = 0)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    b_o = acc / l_safe[:, None]
    o_tok = (bos + o_i.to(tl.int64))[:, None]
    m_out = m_row[:, None] & m_dv[None, :]
    if NUM_SPLITS == 1:
        p_o = o_ptr + o_tok * stride_o_t + o_head[:, None] * stride_o_h + o_dv[None, :]
        tl.store(p_o, b_o.to(o_ptr.dtype.element_ty), mask=m_out)
    else:
        p_o = o_ptr + i_s * stride_o_s + o_tok * stride_o_t + o_head[:, None] * stride_o_h + o_dv[None, :]
        tl.store(p_o, b_o, mask=m_out)
        b_lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        p_lse = lse_ptr + i_s * stride_lse_s + (bos + o_i.to(tl.int64)) * stride_lse_t + o_head
        tl.store(p_lse, b_lse, mask=m_row)


@triton.jit
def _combine_splits_kernel(
    # outputs
    o_ptr,  # [T, HQ, DV]
    # inputs
    part_ptr,  # [NUM_SPLITS, T, HQ, DV] fp32
    lse_ptr,  # [NUM_SPLITS, T, HQ] fp32 (log2 domain)
    query_start_loc_ptr,  # [num_reqs + 1]
    num_reqs,
    # strides
    stride_o_t: tl.int64,
    stride_o_h: tl.int64,
    stride_part_s: tl.int64,
    stride_part_t: tl.int64,
    stride_part_h: tl.int64,
    stride_lse_s: tl.int64,
    stride_lse_t: tl.int64,
    # constexprs
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    # rows past the batch's last query (padding) are left untouched
    if i_t >= tl.load(query_start_loc_ptr + num_reqs):
        return
    o_s = tl.arange(0, BLOCK_S)
    m_s = o_s < NUM_SPLITS
    o_dv = tl.arange(0, BLOCK_DV)
    b_lse = tl.load(lse_ptr + o_s * stride_lse_s + i_t * stride_lse_t + i_h, mask=m_s, other=float("-inf"))
    b_max = tl.max(b_lse, 0)
    b_w = tl.math.exp2(b_lse - tl.where(b_max == float("-inf"), 0.0, b_max))
    p_part = part_ptr + o_s[:, None] * stride_part_s + i_t * stride_part_t + i_h * stride_part_h + o_dv[None, :]
    b_part = tl.load(p_part, mask=m_s[:, None] & (o_dv < DV)[None, :], other=0.0)
    b_sum = tl.sum(b_w, 0)
    b_o = tl.sum(b_w[:, None] * b_part, 0) / tl.where(b_sum == 0.0, 1.0, b_sum)
    tl.store(o_ptr + i_t * stride_o_t + i_h * stride_o_h + o_dv, b_o.to(o_ptr.dtype.element_ty), mask=o_dv < DV)


def ring_attention(
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
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attend each request's draft block over its ring context and its own K/V.

    Window convention (``window = W``): a query at absolute position ``q`` sees key ``k`` iff ``q - k < W``
    and ``k >= 0``; causal adds ``k <= q``, non-causal adds ``k - q < W`` (vLLM ``sliding_window``;
    FlashAttention ``(W-1, 0)`` / ``(W-1, W-1)``). Request ``r``'s ``query_len`` queries sit at positions
    ``context_len .. seq_len - 1`` (``varlen``); context keys ``< context_len`` come from the ring, the
    block's own keys from ``k_new``/``v_new``.

    Args:
        q: [T, Hq, D] fp16/bf16/fp32. k_new: [T, Hkv, D]. v_new: [T, Hkv, Dv].
        k_cache: [num_blocks, bs, Hkv, D] view, v_cache: [num_blocks, bs, Hkv, Dv]: any strides that are
            multiples of 16 elements, 16-byte aligned base (``check_kv_alignment``).
        batch: a ``VarlenBatch`` in ``BatchMode.DRAFT_BLOCK``.
        window: W >= 1. causal: causality among the block's own keys.
        scale: softmax scale, default ``D ** -0.5``.
        out: optional [T, Hq, Dv] output. num_splits: force the split-KV count (tests, benchmarks).

    Returns:
        [T, Hq, Dv] in ``q.dtype``; rows past ``query_start_loc[-1]`` are left as they were.
    """
    inputs: AttentionInputs = validate_attention_inputs(
        q, k_new, v_new, k_cache, v_cache, batch, mode=BatchMode.DRAFT_BLOCK, window=window, scale=scale, out=out,
    )  # fmt: skip
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits={num_splits!r} must be an int >= 1 or None")
    num_tokens, num_q_heads, _ = q.shape
    num_kv_heads = k_new.shape[1]
    head_dim_v = v_new.shape[-1]
    out = inputs.out
    if batch.num_reqs == 0 or num_tokens == 0:
        return out
    config: AttentionConfig = select_attention_config(
        num_reqs=batch.num_reqs, num_kv_heads=num_kv_heads, group_size=inputs.group_size,
        max_query_len=batch.max_query_len, head_dim=q.shape[-1], head_dim_v=head_dim_v, window=window,
        num_sms=device_sms(q.device), num_splits=num_splits,
    )  # fmt: skip
    if config.num_splits == 1:
        target, lse = out, out.new_empty(1, 1, 1, dtype=torch.float32)
        o_strides = (0, out.stride(0), out.stride(1))
    else:
        target = torch.empty(config.num_splits, num_tokens, num_q_heads, head_dim_v, device=q.device)
        lse = torch.empty(config.num_splits, num_tokens, num_q_heads, device=q.device)
        o_strides = (target.stride(0), target.stride(1), target.stride(2))
    grid = (batch.num_reqs, num_kv_heads * config.num_m_blocks, config.num_splits)
    _ring_attention_kernel[grid](
        target, lse, q, k_new, v_new, k_cache, v_cache, batch.block_table, batch.query_start_loc, batch.seq_lens,
        inputs.scale * LOG2E, window, batch.period,
        *o_strides, lse.stride(0), lse.stride(1),
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        batch.block_table.stride(0), batch.block_table.stride(1),
        G=inputs.group_size, D=q.shape[-1], DV=head_dim_v, BS=k_cache.shape[1],
        QUERIES_PER_BLOCK=config.queries_per_block, NUM_M_BLOCKS=config.num_m_blocks,
        BLOCK_M=config.BLOCK_M, BLOCK_KB=config.BLOCK_KB, TILE_N=config.TILE_N,
        BLOCK_D=config.BLOCK_D, BLOCK_DV=config.BLOCK_DV,
        NUM_SPLITS=config.num_splits, CAUSAL=causal,
        UPCAST=is_interpreter(), FP32_IEEE=q.dtype == torch.float32,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if config.num_splits > 1:
        _combine_splits_kernel[(num_tokens, num_q_heads)](
            out, target, lse, batch.query_start_loc, batch.num_reqs,
            out.stride(0), out.stride(1), target.stride(0), target.stride(1), target.stride(2),
            lse.stride(0), lse.stride(1),
            DV=head_dim_v, BLOCK_DV=config.BLOCK_DV, NUM_SPLITS=config.num_splits,
            BLOCK_S=max(2, 1 << (config.num_splits - 1).bit_length()),
        )  # fmt: skip
    return out
