# SPDX-License-Identifier: Apache-2.0
"""Triton building blocks of ``ring_attention``'s kernel: locating a tile of ring keys (the in-kernel form of
``ring_geometry``'s slot formula, here and nowhere else), loading it or a tile of the batch's own rows, scoring
it, masking it by absolute position, and the online-softmax update.

Window convention (``window = W``): a query at absolute position ``q`` sees key ``k`` iff ``q - k < W`` and
``k >= 0``; causal adds ``k <= q``, non-causal adds ``k - q < W`` (``ring_geometry.visible``). Sinks (the
``SINKS`` constexpr) widen the first clause to ``q - k < W or k < sink_tokens``; without them every sink argument
is unused and the kernels compile as if sinks did not exist.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kv_quant import upcast_interpreted


@triton.jit
def table_column(j, table_period, sink_blocks, SINKS: tl.constexpr):
    # ring_geometry.block_column of logical block j >= 0: a sink block keeps column j, the others cycle over the
    # ring's columns after the sink blocks; without sinks (sink_blocks = 0) that is j mod period
    if SINKS:
        return tl.where(j < sink_blocks, j, sink_blocks + (j - sink_blocks) % table_period)
    else:
        return j % table_period


@triton.jit
def ring_tile_rows(table_row_ptr, start, k_pos, m_k, table_period, sink_blocks, stride_bt_c: tl.int64,
                   BS: tl.constexpr, TILE_N: tl.constexpr, SINKS: tl.constexpr):  # fmt: skip
    """Physical block and in-block row of the tile's positions ``k_pos = start + arange(TILE_N)``:
    ``table[table_column(p // bs)]`` and ``p mod bs`` (``ring_geometry.table_slot_mapping``).

    ``start`` is a multiple of ``TILE_N``. When ``TILE_N`` divides ``BS`` the tile lies in one KV block: one
    scalar table load, and the rows are ``start mod bs + arange``, so the per-row offsets stay loop-invariant
    and the loads vectorise; otherwise (``bs`` below 16 or not a multiple of the tile) one id per row.
    """
    if BS % TILE_N == 0:
        col = table_column(start // BS, table_period, sink_blocks, SINKS)
        b_blk = tl.load(table_row_ptr + col.to(tl.int64) * stride_bt_c).to(tl.int64)
        o_in = (start % BS + tl.arange(0, TILE_N)).to(tl.int64)
    else:
        col = table_column(k_pos // BS, table_period, sink_blocks, SINKS)
        b_blk = tl.load(table_row_ptr + col.to(tl.int64) * stride_bt_c, mask=m_k, other=0).to(tl.int64)
        o_in = (k_pos % BS).to(tl.int64)
    return b_blk, o_in


@triton.jit
def load_kv_tile(
    k_ptr,  # K rows base (head offset applied)
    v_ptr,
    o_k,  # [TILE_N] int64 element offsets of the K rows
    o_v,  # [TILE_N] int64 element offsets of the V rows
    m_k,  # [TILE_N] which rows to load; the others read as 0 (so 0 * NaN never reaches the output)
    o_d,
    o_dv,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr = False,  # the rows are fp8 (ring history of an fp8 cache)
):
    # the head-dim mask only where the tile is padded: a row-uniform mask keeps 16-byte vector loads
    if BLOCK_D == D:
        m_kd = m_k[:, None]
    else:
        m_kd = m_k[:, None] & (o_d < D)[None, :]
    if BLOCK_DV == DV:
        m_vd = m_k[:, None]
    else:
        m_vd = m_k[:, None] & (o_dv < DV)[None, :]
    b_k = tl.load(k_ptr + o_k[:, None] + o_d[None, :], mask=m_kd, other=0.0)
    b_v = tl.load(v_ptr + o_v[:, None] + o_dv[None, :], mask=m_vd, other=0.0)
    if UPCAST:
        b_k = upcast_interpreted(b_k, KV_FP8)
        b_v = upcast_interpreted(b_v, KV_FP8)
    return b_k, b_v


@triton.jit
def load_kv_scales(k_scale_ptr, v_scale_ptr, KV_FP8: tl.constexpr):
    # the per-layer dequantization scales of an fp8 ring ([1] fp32 each); 1 (folded away) otherwise
    if KV_FP8:
        return tl.load(k_scale_ptr), tl.load(v_scale_ptr)
    else:
        return 1.0, 1.0


@triton.jit
def scores(b_q, b_k, qk_scale, FP32_IEEE: tl.constexpr):
    # [BLOCK_M, TILE_N] log2-domain scores
    if FP32_IEEE:
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision="ieee")
    else:
        b_s = tl.dot(b_q, tl.trans(b_k))
    return b_s * qk_scale


@triton.jit
def visible_mask(q_pos, k_pos, m_k, window, sink_tokens, CAUSAL: tl.constexpr, SINKS: tl.constexpr):
    # the contract (ring_geometry.visible) for keys at or after the queries' context (k >= 0 holds): q - k < W
    # (or k a sink), plus k <= q (causal) or k - q < W; m_k drops the tile's padding keys. Padding query rows need
    # no mask: their Q is 0, their scores finite, and their output is never stored.
    delta = q_pos[:, None] - k_pos[None, :]
    if SINKS:
        m_vis = m_k[None, :] & ((delta < window) | (k_pos < sink_tokens)[None, :])
    else:
        m_vis = m_k[None, :] & (delta < window)
    if CAUSAL:
        m_vis = m_vis & (delta >= 0)
    else:
        m_vis = m_vis & (-delta < window)
    return m_vis


@triton.jit
def online_softmax_update(m_i, l_i, acc, s, v, v_scale, FP32_IEEE: tl.constexpr):
    # s: [BLOCK_M, TILE_N] log2-domain scores with -inf where invisible; v: [TILE_N, BLOCK_DV], whose values are
    # v_scale * v (an fp8 ring's dequantization, applied to the probabilities: fewer products than V has)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # rows that have seen no key yet keep m = -inf; pivot on 0 so exp2 gives 0, never NaN
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    p_v = p * v_scale
    if FP32_IEEE:
        pv = tl.dot(p_v, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p_v.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def attend_tile(m_i, l_i, acc, b_q, b_k, b_v, m_vis, qk_scale, v_scale, FP32_IEEE: tl.constexpr):
    """Score one K/V tile, hide the invisible keys (``m_vis`` [BLOCK_M, TILE_N]), fold it into the online softmax
    (``v_scale`` multiplies the tile's V)."""
    b_s = tl.where(m_vis, scores(b_q, b_k, qk_scale, FP32_IEEE), float("-inf"))
    return online_softmax_update(m_i, l_i, acc, b_s, b_v, v_scale, FP32_IEEE)


@triton.jit
def load_query_rows(
    q_ptr,  # [T, HQ, D]
    bos,  # first token of the request (int64)
    q0,  # first query index of this program
    q_len,
    context_len,
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
    # rows: [BLOCK_M] -> (query i, head g) query-major, QUERIES queries x G heads of KV head i_h; rows past
    # QUERIES * G pad the tile to the MMA size and stay masked
    o_m = tl.arange(0, BLOCK_M)
    o_i = q0 + o_m // G
    o_head = i_h * G + (o_m % G)
    m_row = (o_m < QUERIES * G) & (o_i < q_len)
    p_q = q_ptr + (bos + o_i.to(tl.int64))[:, None] * stride_q_t + o_head[:, None] * stride_q_h + o_d[None, :]
    b_q = tl.load(p_q, mask=m_row[:, None] & m_d[None, :], other=0.0)
    if UPCAST:
        b_q = b_q.to(tl.float32)
    return o_i, o_head, m_row, context_len + o_i, b_q


@triton.jit
def request_span(query_start_loc_ptr, seq_lens_ptr, i_r):
    # request i_r's first token, its query count, and its context length (vLLM's context_len: the positions
    # before this step's queries, seq_len - query_len)
    bos = tl.load(query_start_loc_ptr + i_r).to(tl.int64)
    q_len = (tl.load(query_start_loc_ptr + i_r + 1) - bos).to(tl.int32)
    return bos, q_len, tl.load(seq_lens_ptr + i_r).to(tl.int32) - q_len


@triton.jit
def ring_tile_count(lo, hi, TILE_N: tl.constexpr):
    # tiles of TILE_N positions, aligned to multiples of TILE_N, that cover [lo, hi); 0 when empty
    return tl.where(hi > lo, tl.cdiv(hi - (lo - lo % TILE_N), TILE_N), 0)


@triton.jit
def attend_ring_range(
    m_i, l_i, acc, b_q, q_pos,
    lo, hi,  # ring history positions [lo, hi), all below every query, lo >= 0
    tile_lo, tile_hi,  # which tiles this program reads, counted from lo rounded down to TILE_N (SINKS: below)
    kc_ptr, vc_ptr, table_row_ptr, table_period,
    sink_hi, sink_blocks, num_sink_tiles,  # SINKS: the sinks [0, sink_hi) (<= hi) and where they live (below)
    k_scale, v_scale,  # dequantization of an fp8 ring (load_kv_scales)
    stride_kc_b: tl.int64, stride_kc_s: tl.int64, stride_vc_b: tl.int64, stride_vc_s: tl.int64,
    stride_bt_c: tl.int64,
    o_d, o_dv, qk_scale, window,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BS: tl.constexpr, TILE_N: tl.constexpr, UPCAST: tl.constexpr, FP32_IEEE: tl.constexpr, KV_FP8: tl.constexpr,
    SINKS: tl.constexpr,
):  # fmt: skip
    """Ring history keys, one tile (= one KV block, or part of one, when ``TILE_N`` divides ``bs``) per step.
    An fp8 ring is dequantized exactly: fp8 converts to the compute dtype without rounding, ``k_scale`` joins
    the score scale and ``v_scale`` the probabilities.

    With sinks (rows ``[sink blocks | ring]``) tiles ``0 .. num_sink_tiles - 1`` are the sinks', from position 0:
    each key of ``[0, sink_hi)`` seen by every query, the window's keys among them as the window shows them, the
    keys between (which may hold anything, NaN) never loaded. The window's tiles follow, from the first tile edge
    at or past both ``lo`` and the sinks' tiles: no key in two tiles."""
    o_n = tl.arange(0, TILE_N)
    ring_qk_scale = qk_scale * k_scale
    base = lo - lo % TILE_N
    if SINKS:
        # the sinks' few tiles unpipelined: pipelined, this second loop costs the window's loop registers
        for i_t in tl.range(tile_lo, tl.minimum(tile_hi, num_sink_tiles), num_stages=1):
            k_pos = i_t * TILE_N + o_n
            m_k = (k_pos < sink_hi) | ((k_pos >= lo) & (k_pos < hi))
            # a sink is seen whatever the window
            m_vis = (((q_pos[:, None] - k_pos[None, :]) < window) & (k_pos < hi)[None, :]) | (k_pos < sink_hi)[None, :]
            b_k, b_v = load_ring_tile(
                b_q, i_t * TILE_N, k_pos, m_k, kc_ptr, vc_ptr, table_row_ptr, table_period, sink_blocks, stride_kc_b,
                stride_kc_s, stride_vc_b, stride_vc_s, stride_bt_c, o_d, o_dv,
                D, DV, BLOCK_D, BLOCK_DV, BS, TILE_N, UPCAST, KV_FP8, SINKS,
            )  # fmt: skip
            m_i, l_i, acc = attend_tile(m_i, l_i, acc, b_q, b_k, b_v, m_vis, ring_qk_scale, v_scale, FP32_IEEE)
        # window tile i_t (>= num_sink_tiles) starts at base + i_t * TILE_N
        base = tl.maximum(base, num_sink_tiles * TILE_N) - num_sink_tiles * TILE_N
        tile_lo = tl.maximum(tile_lo, num_sink_tiles)
    for i_t in range(tile_lo, tile_hi):
        start = base + i_t * TILE_N
        k_pos = start + o_n
        m_k = (k_pos >= lo) & (k_pos < hi)
        b_k, b_v = load_ring_tile(
            b_q, start, k_pos, m_k, kc_ptr, vc_ptr, table_row_ptr, table_period, sink_blocks, stride_kc_b,
            stride_kc_s, stride_vc_b, stride_vc_s, stride_bt_c, o_d, o_dv,
            D, DV, BLOCK_D, BLOCK_DV, BS, TILE_N, UPCAST, KV_FP8, SINKS,
        )  # fmt: skip
        # history keys lie below every query: only the left window edge and the range's end can hide them (keys
        # below lo are left of every row's window, and past every sink; they and the keys past hi were loaded as 0)
        m_vis = ((q_pos[:, None] - k_pos[None, :]) < window) & (k_pos < hi)[None, :]
        m_i, l_i, acc = attend_tile(m_i, l_i, acc, b_q, b_k, b_v, m_vis, ring_qk_scale, v_scale, FP32_IEEE)
    return m_i, l_i, acc


@triton.jit
def load_ring_tile(
    b_q,
    start, k_pos, m_k,  # the tile's first position, its [TILE_N] positions, which of them to load
    kc_ptr, vc_ptr, table_row_ptr, table_period, sink_blocks,
    stride_kc_b: tl.int64, stride_kc_s: tl.int64, stride_vc_b: tl.int64, stride_vc_s: tl.int64,
    stride_bt_c: tl.int64,
    o_d, o_dv,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BS: tl.constexpr, TILE_N: tl.constexpr, UPCAST: tl.constexpr, KV_FP8: tl.constexpr, SINKS: tl.constexpr,
):  # fmt: skip
    # one tile of ring K/V, located through the block table: [TILE_N, BLOCK_D] / [TILE_N, BLOCK_DV], an fp8 tile
    # converted to the compute dtype (exactly)
    b_blk, o_in = ring_tile_rows(table_row_ptr, start, k_pos, m_k, table_period, sink_blocks, stride_bt_c, BS,
                                 TILE_N, SINKS)  # fmt: skip
    b_k, b_v = load_kv_tile(
        kc_ptr, vc_ptr, b_blk * stride_kc_b + o_in * stride_kc_s, b_blk * stride_vc_b + o_in * stride_vc_s,
        m_k, o_d, o_dv, D, DV, BLOCK_D, BLOCK_DV, UPCAST, KV_FP8,
    )  # fmt: skip
    if KV_FP8:
        b_k = b_k.to(b_q.dtype)
        b_v = b_v.to(b_q.dtype)
    return b_k, b_v


@triton.jit
def attend_rows_range(
    m_i, l_i, acc, b_q, q_pos,
    lo, hi,  # positions [lo, hi) of the batch's own rows
    k_ptr, v_ptr,  # K/V rows with the head offset applied
    row0,  # token row of position lo (int64)
    stride_k_t: tl.int64, stride_v_t: tl.int64,
    o_d, o_dv, qk_scale, window, sink_tokens,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    TILE_N: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, FP32_IEEE: tl.constexpr, SINKS: tl.constexpr,
):  # fmt: skip
    """The batch's own keys (``k_new`` / ``v_new`` rows), ``TILE_N`` contiguous rows per step."""
    o_n = tl.arange(0, TILE_N)
    for start in range(lo, hi, TILE_N):
        k_pos = start + o_n
        m_k = k_pos < hi
        o_tok = row0 + (start - lo + o_n).to(tl.int64)
        b_k, b_v = load_kv_tile(k_ptr, v_ptr, o_tok * stride_k_t, o_tok * stride_v_t, m_k, o_d, o_dv, D, DV,
                                BLOCK_D, BLOCK_DV, UPCAST)  # fmt: skip
        m_vis = visible_mask(q_pos, k_pos, m_k, window, sink_tokens, CAUSAL, SINKS)
        m_i, l_i, acc = attend_tile(m_i, l_i, acc, b_q, b_k, b_v, m_vis, qk_scale, 1.0, FP32_IEEE)
    return m_i, l_i, acc
