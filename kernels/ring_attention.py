# SPDX-License-Identifier: Apache-2.0
"""Triton draft-block attention over the ring (``ring_attention``); must match
``reference.ring_attention_reference``. Ring arithmetic: ``ring_geometry`` (column = (p // bs) mod period).

One program owns all ``G x B`` query rows of one KV head of one request (query-major rows ``i * G + g``,
padded to a 64-row MMA tile), so each context K/V byte is read once per step; it walks the ring one KV block
per step (one scalar block-table load, 16-byte K/V loads). When requests x KV heads leave SMs idle the window
is split (``num_splits``, a runtime argument like every batch-dependent value: one compiled kernel serves every
batch) and the partial results are merged by log-sum-exp in ``_combine_splits_kernel``.
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
from ._triton_utils import device_sms, is_interpreter
from .attention_inputs import AttentionInputs, RingCache, validate_attention_inputs
from .configs import MAX_SPLITS, AttentionConfig, select_attention_config, select_num_splits
from .varlen import BatchMode, VarlenBatch

LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["num_m_blocks", "num_splits", "num_tokens"])
def _ring_attention_kernel(
    # outputs
    o_ptr,  # [T, HQ, DV] out when num_splits == 1, else the partial outputs [num_splits, T, HQ, DV] (same dtype)
    lse_ptr,  # [num_splits, T, HQ] fp32 (log2 domain) when num_splits > 1
    # inputs
    q_ptr,  # [T, HQ, D]
    kn_ptr,  # [T, HKV, D]   the block's own keys
    vn_ptr,  # [T, HKV, DV]
    kc_ptr,  # [num_blocks, BS, HKV, D]   ring keys (16-element strides, 16-byte aligned base)
    vc_ptr,  # [num_blocks, BS, HKV, DV]
    k_scale_ptr,  # [1] fp32 when KV_FP8: the ring holds fp8(K / k_scale)
    v_scale_ptr,  # [1] fp32 when KV_FP8
    block_table_ptr,  # [num_reqs, width] int32/int64
    query_start_loc_ptr,  # [num_reqs + 1]
    seq_lens_ptr,  # [num_reqs]   context_len + query_len
    # scalars: runtime, so one compiled kernel serves every batch
    qk_scale,  # softmax scale * log2(e)
    window,
    table_period,
    num_m_blocks,  # row blocks per KV head: cdiv(max_query_len, QUERIES_PER_BLOCK)
    num_splits,  # context splits per row block (grid z = num_m_blocks * num_splits)
    num_tokens,  # T: split s of the partial buffers starts at token row s * T
    # strides
    stride_o_t: tl.int64,
    stride_o_h: tl.int64,
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
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr,
    # the interpreter computes bf16 on raw bits: upcast right after every load
    UPCAST: tl.constexpr,
    FP32_IEEE: tl.constexpr,
    KV_FP8: tl.constexpr,  # the ring caches are fp8 (e4m3fn or e5m2), dequantized on load
):
    i_r = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_mb = tl.program_id(2) // num_splits
    i_s = tl.program_id(2) % num_splits
    bos, q_len, context_len = request_span(query_start_loc_ptr, seq_lens_ptr, i_r)
    q0 = i_mb * QUERIES_PER_BLOCK
    if q0 >= q_len:
        return

    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    o_i, o_head, m_row, q_pos, b_q = load_query_rows(
        q_ptr, bos, q0, q_len, context_len, i_h, stride_q_t, stride_q_h, o_d, o_d < D, G, QUERIES_PER_BLOCK,
        BLOCK_M, UPCAST,
    )  # fmt: skip
    k_scale, v_scale = load_kv_scales(k_scale_ptr, v_scale_ptr, KV_FP8)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # context keys [ctx_lo, context_len): the union of this row block's windows, in tiles of TILE_N keys split
    # num_splits ways; a runtime span, so no constant grows with the window (full attention: window = 2^40)
    ctx_lo = tl.maximum(context_len + q0 - (window - 1), 0)
    num_tiles = ring_tile_count(ctx_lo, context_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = i_s * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    m_i, l_i, acc = attend_ring_range(
        m_i, l_i, acc, b_q, q_pos, ctx_lo, context_len, tile_lo, tile_hi,
        kc_ptr + i_h * stride_kc_h, vc_ptr + i_h * stride_vc_h, block_table_ptr + i_r * stride_bt_r, table_period,
        k_scale, v_scale, stride_kc_b, stride_kc_s, stride_vc_b, stride_vc_s, stride_bt_c, o_d, o_dv, qk_scale, window,
        D, DV, BLOCK_D, BLOCK_DV, BS, TILE_N, UPCAST, FP32_IEEE, KV_FP8,
    )  # fmt: skip

    # the block's own keys at positions context_len .. context_len + q_len - 1 (last split only)
    if i_s == num_splits - 1:
        m_i, l_i, acc = attend_rows_range(
            m_i, l_i, acc, b_q, q_pos, context_len, context_len + q_len,
            kn_ptr + i_h * stride_kn_h, vn_ptr + i_h * stride_vn_h, bos, stride_kn_t, stride_vn_t,
            o_d, o_dv, qk_scale, window, D, DV, BLOCK_D, BLOCK_DV, TILE_N, CAUSAL, UPCAST, FP32_IEEE,
        )  # fmt: skip

    # a row that saw no key outputs 0 (l = 0)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    b_o = acc / l_safe[:, None]
    # one store path for every split count (a second, fp32 one costs ~20 registers): out, or split i_s's rows
    o_row = i_s * num_tokens + bos + o_i.to(tl.int64)
    p_o = o_ptr + o_row[:, None] * stride_o_t + o_head[:, None] * stride_o_h + o_dv[None, :]
    tl.store(p_o, b_o.to(o_ptr.dtype.element_ty), mask=m_row[:, None] & (o_dv < DV)[None, :])
    if num_splits > 1:
        b_lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        tl.store(lse_ptr + o_row * stride_lse_t + o_head, b_lse, mask=m_row)


@triton.jit(do_not_specialize=["num_reqs", "num_splits", "num_tokens"])
def _combine_splits_kernel(
    # outputs
    o_ptr,  # [T, HQ, DV]
    # inputs
    part_ptr,  # [num_splits, T, HQ, DV] partial outputs (out's dtype), contiguous
    lse_ptr,  # [num_splits, T, HQ] fp32 (log2 domain), contiguous
    query_start_loc_ptr,  # [num_reqs + 1]
    num_reqs,
    num_splits,
    num_tokens,
    # strides
    stride_o_t: tl.int64,
    stride_o_h: tl.int64,
    stride_part_t: tl.int64,
    stride_part_h: tl.int64,
    stride_lse_t: tl.int64,
    # constexprs
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= num_splits
):
    i_t = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    # rows past the batch's last query (padding) are left untouched
    if i_t >= tl.load(query_start_loc_ptr + num_reqs):
        return
    o_s = tl.arange(0, BLOCK_S)
    m_s = o_s < num_splits
    o_dv = tl.arange(0, BLOCK_DV)
    o_row = o_s.to(tl.int64) * num_tokens + i_t  # [BLOCK_S] row of token i_t in each split
    b_lse = tl.load(lse_ptr + o_row * stride_lse_t + i_h, mask=m_s, other=float("-inf"))
    b_max = tl.max(b_lse, 0)
    b_w = tl.math.exp2(b_lse - tl.where(b_max == float("-inf"), 0.0, b_max))
    p_part = part_ptr + o_row[:, None] * stride_part_t + i_h * stride_part_h + o_dv[None, :]
    b_part = tl.load(p_part, mask=m_s[:, None] & (o_dv < DV)[None, :], other=0.0).to(tl.float32)
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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
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
            multiples of 16 elements, 16-byte aligned base (``check_kv_alignment``); ``q.dtype``, or both
            float8_e4m3fn / float8_e5m2 (``kv_quant``: the ring holds ``fp8(K / k_scale)``).
        batch: a ``VarlenBatch`` in ``BatchMode.DRAFT_BLOCK``.
        window: W >= 1. causal: causality among the block's own keys.
        scale: softmax scale, default ``D ** -0.5``.
        k_scale, v_scale: [1] float tensors on the caches' device, for fp8 caches only (vLLM ``layer._k_scale``).
        out: optional [T, Hq, Dv] output. num_splits: force the split-KV count (tests, benchmarks).

    Returns:
        [T, Hq, Dv] in ``q.dtype``; rows past ``query_start_loc[-1]`` are left as they were.
    """
    inputs: AttentionInputs = validate_attention_inputs(
        q, k_new, v_new, RingCache(k_cache, v_cache, k_scale, v_scale), batch, mode=BatchMode.DRAFT_BLOCK,
        window=window, scale=scale, out=out,
    )  # fmt: skip
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits={num_splits!r} must be an int >= 1 or None")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, head_dim_v = k_new.shape[1], v_new.shape[-1]
    out = inputs.out
    if batch.num_reqs == 0 or num_tokens == 0:
        return out
    config: AttentionConfig = select_attention_config(
        group_size=inputs.group_size,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        block_size=k_cache.shape[1],
        kv_fp8=inputs.cache.fp8,
    )
    num_m_blocks = triton.cdiv(batch.max_query_len, config.queries_per_block)
    if num_splits is None:
        num_splits = select_num_splits(
            num_reqs=batch.num_reqs, num_kv_heads=num_kv_heads, num_m_blocks=num_m_blocks, window=window,
            tile_n=config.TILE_N, num_sms=device_sms(q.device),
        )  # fmt: skip
    if num_splits > MAX_SPLITS:
        raise ValueError(f"num_splits={num_splits} exceeds MAX_SPLITS={MAX_SPLITS}")
    # with splits: partial outputs [num_splits, T, Hq, Dv] in out's dtype (the output rounding, once per split)
    # and fp32 LSEs [num_splits, T, Hq]; with one split the kernel writes out (a one-token LSE stand-in)
    lse = torch.empty(num_splits, num_tokens if num_splits > 1 else 1, num_q_heads, dtype=torch.float32,
                      device=q.device)  # fmt: skip
    target = out if num_splits == 1 else out.new_empty(num_splits, num_tokens, num_q_heads, head_dim_v)
    _ring_attention_kernel[(batch.num_reqs, num_kv_heads, num_m_blocks * num_splits)](
        target, lse, q, k_new, v_new, *inputs.cache.pointers(), batch.block_table, batch.query_start_loc,
        batch.seq_lens, inputs.scale * LOG2E, window, batch.period, num_m_blocks, num_splits, num_tokens,
        target.stride(-3), target.stride(-2), lse.stride(1),
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        *inputs.cache.strides(), batch.block_table.stride(0), batch.block_table.stride(1),
        G=inputs.group_size, D=head_dim, DV=head_dim_v, BS=k_cache.shape[1],
        QUERIES_PER_BLOCK=config.queries_per_block, BLOCK_M=config.BLOCK_M, TILE_N=config.TILE_N,
        BLOCK_D=config.BLOCK_D, BLOCK_DV=config.BLOCK_DV, CAUSAL=causal,
        UPCAST=is_interpreter(), FP32_IEEE=q.dtype == torch.float32, KV_FP8=inputs.cache.fp8,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _combine_splits_kernel[(num_tokens, num_q_heads)](
            out, target, lse, batch.query_start_loc, batch.num_reqs, num_splits, num_tokens,
            out.stride(0), out.stride(1), target.stride(1), target.stride(2), lse.stride(1),
            DV=head_dim_v, BLOCK_DV=config.BLOCK_DV, BLOCK_S=triton.next_power_of_2(MAX_SPLITS),
        )  # fmt: skip
    return out
