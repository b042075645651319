# SPDX-License-Identifier: Apache-2.0
"""Triton scatter of K/V rows into the ring through a slot mapping (``ring_write``); must match
``reference.ring_write_reference`` byte for byte. Slots come from ``RingPlan.slot_mapping`` (dead positions are
PAD). An fp8 ring stores ``fp8(x / scale)`` (``kv_quant``: saturating, round to nearest even)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import is_interpreter
from .configs import select_write_config
from .kv_quant import FP8_FORMATS, quantize_fp8_bits
from .validation import (
    SUPPORTED_DTYPES,
    RingCache,
    check_inner_contiguous,
    check_ring_cache,
    check_same_device,
    check_slot_mapping,
)


@triton.jit
def scatter_tile(
    src_ptr, stride_t: tl.int64, stride_h: tl.int64,  # rows [T, HKV, D] of K or of V
    cache_ptr, stride_b: tl.int64, stride_s: tl.int64, stride_hc: tl.int64,  # its ring view [blocks, BS, HKV, D]
    scale_ptr,  # [1] fp32 when KV_FP8: stores fp8(x / scale)
    o_t, m_t, o_blk, o_off,  # [BLOCK_T] token rows, which to store, their block and in-block row
    HKV: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr,
    EXP_BIAS: tl.constexpr, MANTISSA: tl.constexpr, MAX_FINITE: tl.constexpr,
):  # fmt: skip
    # rows [BLOCK_T] x (head, dim) columns [BLOCK_H * BLOCK_D], stored as the cache holds them: quantized bytes
    # (reinterpreted as the cache's fp8 type), or a plain cast
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H * BLOCK_D) // BLOCK_D
    o_d = tl.arange(0, BLOCK_H * BLOCK_D) % BLOCK_D
    m_x = m_t[:, None] & ((o_h < HKV) & (o_d < D))[None, :]
    b_x = tl.load(src_ptr + o_t[:, None] * stride_t + (o_h * stride_h + o_d)[None, :], mask=m_x)
    if KV_FP8:
        bits = quantize_fp8_bits(b_x, tl.load(scale_ptr), EXP_BIAS, MANTISSA, MAX_FINITE)
        b_x = bits.to(cache_ptr.dtype.element_ty, bitcast=True)
    p_c = cache_ptr + (o_blk * stride_b + o_off * stride_s)[:, None] + (o_h * stride_hc + o_d)[None, :]
    tl.store(p_c, b_x.to(cache_ptr.dtype.element_ty), mask=m_x)


@triton.jit
def _ring_write_kernel(
    # inputs
    k_ptr,  # [T, HKV, D]
    v_ptr,  # [T, HKV, DV]
    slot_mapping_ptr,  # [T]   flat slot block_id * BS + offset, < 0 = PAD
    # outputs
    kc_ptr,  # [num_blocks, BS, HKV, D]   any strides
    vc_ptr,  # [num_blocks, BS, HKV, DV]
    k_scale_ptr,  # [1] fp32 when KV_FP8: stores fp8(K / k_scale)
    v_scale_ptr,  # [1] fp32 when KV_FP8
    # scalars
    num_tokens,
    # strides
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
    # constexprs
    HKV: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    # fp8 caches: the format's exponent bias, mantissa bits and largest finite value (kv_quant.FP8_FORMATS)
    KV_FP8: tl.constexpr,
    EXP_BIAS: tl.constexpr,
    MANTISSA: tl.constexpr,
    MAX_FINITE: tl.constexpr,
):
    o_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    b_slot = tl.load(slot_mapping_ptr + o_t, mask=o_t < num_tokens, other=-1).to(tl.int64)
    m_t = b_slot >= 0
    o_blk = b_slot // BS
    o_off = b_slot % BS
    scatter_tile(
        k_ptr, stride_k_t, stride_k_h, kc_ptr, stride_kc_b, stride_kc_s, stride_kc_h, k_scale_ptr,
        o_t, m_t, o_blk, o_off, HKV, D, BLOCK_H, BLOCK_D, KV_FP8, EXP_BIAS, MANTISSA, MAX_FINITE,
    )  # fmt: skip
    scatter_tile(
        v_ptr, stride_v_t, stride_v_h, vc_ptr, stride_vc_b, stride_vc_s, stride_vc_h, v_scale_ptr,
        o_t, m_t, o_blk, o_off, HKV, DV, BLOCK_H, BLOCK_DV, KV_FP8, EXP_BIAS, MANTISSA, MAX_FINITE,
    )  # fmt: skip


def ring_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store K/V row ``t`` at flat ring slot ``slot_mapping[t]`` (``block_id * bs + offset``); ``< 0`` skips.

    Rows are written in parallel, so two rows with one slot race: build the mapping with
    ``RingPlan.slot_mapping(..., seq_len=...)``, which PADs dead positions and keeps live slots distinct.

    Args:
        k: [T, Hkv, D]; v: [T, Hkv, Dv], fp16/bf16/fp32.
        k_cache: [num_blocks, bs, Hkv, D]; v_cache: [num_blocks, bs, Hkv, Dv] views with any strides
            (vLLM's ``kv_cache[..., :D].transpose(1, 2)`` works as it is), of the rows' dtype, or both
            float8_e4m3fn / float8_e5m2: then row ``x`` is stored as ``fp8(x / scale)`` (``kv_quant``).
        slot_mapping: [>= T] int32/int64.
        k_scale, v_scale: [1] float tensors for fp8 caches only (vLLM ``layer._k_scale`` / ``_v_scale``).
    """
    for name, tensor in (("k", k), ("v", v)):
        if tensor.dim() != 3:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected [num_tokens, num_kv_heads, head_dim]")
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape[:2] != (num_tokens, num_kv_heads):
        raise ValueError(f"v {tuple(v.shape)} must match k {tuple(k.shape)} in tokens and heads")
    if k.dtype not in SUPPORTED_DTYPES or v.dtype != k.dtype:
        raise ValueError(
            f"k/v dtypes {k.dtype}/{v.dtype} must be one of float16, bfloat16, float32 (fp8 caches are written from "
            "the compute dtype, quantized here); cast the rows first"
        )
    cache = check_ring_cache(RingCache(k_cache, v_cache, k_scale, v_scale), dtype=k.dtype, num_kv_heads=num_kv_heads,
                             head_dim=head_dim, head_dim_v=v.shape[2])  # fmt: skip
    check_slot_mapping(slot_mapping, num_tokens)
    check_inner_contiguous("k", k)
    check_inner_contiguous("v", v)
    check_same_device({"k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache, "slot_mapping": slot_mapping})
    launch_ring_write(k, v, cache, slot_mapping)


def launch_ring_write(k: torch.Tensor, v: torch.Tensor, cache: RingCache, slot_mapping: torch.Tensor) -> None:
    """The write kernel on inputs ``ring_write`` (or ``ring_attention``'s validation) has already checked."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k_cache = cache.k_cache
    config = select_write_config(
        num_kv_heads=num_kv_heads, head_dim=max(head_dim, v.shape[2]), interpreted=is_interpreter()
    )
    exp_bias, mantissa = FP8_FORMATS.get(k_cache.dtype, (0, 0))
    max_finite = torch.finfo(k_cache.dtype).max if cache.fp8 else 0.0
    grid = (triton.cdiv(num_tokens, config.BLOCK_T), triton.cdiv(num_kv_heads, config.BLOCK_H))
    _ring_write_kernel[grid](
        k, v, slot_mapping, *cache.pointers(), num_tokens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *cache.strides(),
        HKV=num_kv_heads, D=head_dim, DV=v.shape[2], BS=k_cache.shape[1],
        BLOCK_T=config.BLOCK_T, BLOCK_H=config.BLOCK_H,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_DV=triton.next_power_of_2(v.shape[2]),
        KV_FP8=cache.fp8, EXP_BIAS=exp_bias, MANTISSA=mantissa, MAX_FINITE=max_finite,
        num_warps=config.num_warps,
    )  # fmt: skip
