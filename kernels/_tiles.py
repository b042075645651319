# SPDX-License-Identifier: Apache-2.0
"""Triton building blocks shared by ``ring_attention`` and ``ring_prefill_attention``: loading a tile of
keys from the ring (the in-kernel form of ``ring_geometry``'s slot formula) or from the batch's own rows,
scoring it, masking it by absolute position, and the online-softmax update."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_ring_tile(
    kc_ptr,  # [num_blocks, BS, HKV, D]
    vc_ptr,  # [num_blocks, BS, HKV, DV]
    table_row_ptr,  # [width]   this request's block-table row
    k_pos,  # [TILE_N] absolute positions
    m_k,  # [TILE_N] which positions to load
    table_period,
    off_kh,  # head offset into kc (i_h * stride_kc_h)
    off_vh,
    stride_kc_b: tl.int64,
    stride_kc_s: tl.int64,
    stride_vc_b: tl.int64,
    stride_vc_s: tl.int64,
    stride_bt_c: tl.int64,
    o_d,
    o_dv,
    m_d,
    m_dv,
    BS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # slot of position p: table[(p // bs) mod period] * bs + p mod bs  (ring_geometry.table_slot_mapping)
    col = (k_pos // BS) % table_period
    b_blk = tl.load(table_row_ptr + col.to(tl.int64) * stride_bt_c, mask=m_k, other=0).to(tl.int64)
    o_in = (k_pos % BS).to(tl.int64)
    o_k = b_blk * stride_kc_b + o_in * stride_kc_s + off_kh
    o_v = b_blk * stride_vc_b + o_in * stride_vc_s + off_vh
    b_k = tl.load(kc_ptr + o_k[:, None] + o_d[None, :], mask=m_k[:, None] & m_d[None, :], other=0.0)
    b_v = tl.load(vc_ptr + o_v[:, None] + o_dv[None, :], mask=m_k[:, None] & m_dv[None, :], other=0.0)
    if UPCAST:
        b_k = b_k.to(tl.float32)
        b_v = b_v.to(tl.float32)
    return b_k, b_v


@triton.jit
def load_row_tile(
    k_ptr,  # [T, HKV, D]
    v_ptr,  # [T, HKV, DV]
    o_tok,  # [N] int64 token rows
    m_k,
    off_kh,  # i_h * stride_k_h
    off_vh,
    stride_k_t: tl.int64,
    stride_v_t: tl.int64,
    o_d,
    o_dv,
    m_d,
    m_dv,
    UPCAST: tl.constexpr,
):
    p_k = k_ptr + o_tok[:, None] * stride_k_t + off_kh + o_d[None, :]
    p_v = v_ptr + o_tok[:, None] * stride_v_t + off_vh + o_dv[None, :]
    b_k = tl.load(p_k, mask=m_k[:, None] & m_d[None, :], other=0.0)
    b_v = tl.load(p_v, mask=m_k[:, None] & m_dv[None, :], other=0.0)
    if UPCAST:
        b_k = b_k.to(tl.float32)
        b_v = b_v.to(tl.float32)
    return b_k, b_v


@triton.jit
def scores(b_q, b_k, qk_scale, FP32_IEEE: tl.constexpr):
    # [BLOCK_M, N] log2-domain scores
    if FP32_IEEE:
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision="ieee")
    else:
        b_s = tl.dot(b_q, tl.trans(b_k))
    return b_s * qk_scale


@triton.jit
def visible_mask(q_pos, k_pos, m_row, m_k, window, CAUSAL: tl.constexpr):
    # the contract (ring_geometry.visible): q - k < W, plus k <= q (causal) or k - q < W
    delta = q_pos[:, None] - k_pos[None, :]
    m_vis = m_row[:, None] & m_k[None, :] & (delta < window) & (k_pos[None, :] >= 0)
    if CAUSAL:
        m_vis = m_vis & (delta >= 0)
    else:
        m_vis = m_vis & (-delta < window)
    return m_vis


@triton.jit
def online_softmax_update(m_i, l_i, acc, s, v, FP32_IEEE: tl.constexpr):
    # s: [BLOCK_M, N] log2-domain scores with -inf where invisible; v: [N, BLOCK_DV]
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # rows that have seen no key yet keep m = -inf; pivot on 0 so exp2 gives 0, never NaN
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP32_IEEE:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def load_query_rows(
    q_ptr,  # [T, HQ, D]
    bos,  # first token of the request (int64)
    q0,  # first query index of this program
    q_len,
    committed,
    i_h,
    stride_q_t: tl.int64,
    stride_q_h: tl.int64,
    o_d,
    m_d,
    G: tl.constexpr,
    QUERIES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # rows: [BLOCK_M] -> (query i, head g) query-major, QUERIES queries x G heads of KV head i_h
    o_m = tl.arange(0, BLOCK_M)
    o_i = q0 + o_m // G
    o_head = i_h * G + (o_m % G)
    m_row = (o_m < QUERIES * G) & (o_i < q_len)
    p_q = q_ptr + (bos + o_i.to(tl.int64))[:, None] * stride_q_t + o_head[:, None] * stride_q_h + o_d[None, :]
    b_q = tl.load(p_q, mask=m_row[:, None] & m_d[None, :], other=0.0)
    if UPCAST:
        b_q = b_q.to(tl.float32)
    return o_i, o_head, m_row, committed + o_i, b_q


@triton.jit
def request_span(query_start_loc_ptr, seq_lens_ptr, i_r):
    # request i_r's first token, its query count, and P: the positions before its queries
    bos = tl.load(query_start_loc_ptr + i_r).to(tl.int64)
    q_len = (tl.load(query_start_loc_ptr + i_r + 1) - bos).to(tl.int32)
    return bos, q_len, tl.load(seq_lens_ptr + i_r).to(tl.int32) - q_len


@triton.jit
def attend_ring_range(
    m_i, l_i, acc, b_q, q_pos, m_row,
    lo, hi,  # ring history positions [lo, hi), all below every query
    kc_ptr, vc_ptr, table_row_ptr, table_period, off_kh, off_vh,
    stride_kc_b: tl.int64, stride_kc_s: tl.int64, stride_vc_b: tl.int64, stride_vc_s: tl.int64,
    stride_bt_c: tl.int64,
    o_d, o_dv, m_d, m_dv, qk_scale, window,
    BS: tl.constexpr, TILE_N: tl.constexpr, UPCAST: tl.constexpr, FP32_IEEE: tl.constexpr,
):  # fmt: skip
    for start in range(lo, hi, TILE_N):
        k_pos = start + tl.arange(0, TILE_N)
        m_k = k_pos < hi
        b_k, b_v = load_ring_tile(
            kc_ptr, vc_ptr, table_row_ptr, k_pos, m_k, table_period, off_kh, off_vh,
            stride_kc_b, stride_kc_s, stride_vc_b, stride_vc_s, stride_bt_c, o_d, o_dv, m_d, m_dv, BS, UPCAST,
        )  # fmt: skip
        # history keys are below every query: only the left window edge can hide them
        b_s = tl.where(visible_mask(q_pos, k_pos, m_row, m_k, window, True), scores(b_q, b_k, qk_scale, FP32_IEEE),
                       float("-inf"))  # fmt: skip
        m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, b_s, b_v, FP32_IEEE)
    return m_i, l_i, acc
