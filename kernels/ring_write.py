# SPDX-License-Identifier: Apache-2.0
"""Triton scatter of K/V rows into the ring through a slot mapping (``ring_write``); must match
``reference.ring_write_reference``. Slots come from ``RingPlan.slot_mapping`` (dead positions are PAD)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import is_interpreter
from .attention_inputs import SUPPORTED_DTYPES, check_cache_pair, check_same_device
from .configs import select_write_config
from .varlen import INDEX_DTYPES


@triton.jit
def _ring_write_kernel(
    # inputs
    k_ptr,  # [T, HKV, D]
    v_ptr,  # [T, HKV, DV]
    slot_mapping_ptr,  # [T]   flat slot block_id * BS + offset, < 0 = PAD
    # outputs
    kc_ptr,  # [num_blocks, BS, HKV, D]   any strides
    vc_ptr,  # [num_blocks, BS, HKV, DV]
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
):
    # rows [BLOCK_T] x (head, dim) columns [BLOCK_H * BLOCK_D]
    o_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    b_slot = tl.load(slot_mapping_ptr + o_t, mask=o_t < num_tokens, other=-1).to(tl.int64)
    m_t = b_slot >= 0
    o_blk = b_slot // BS
    o_off = b_slot % BS
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H * BLOCK_D) // BLOCK_D
    o_d = tl.arange(0, BLOCK_H * BLOCK_D) % BLOCK_D
    m_k = m_t[:, None] & ((o_h < HKV) & (o_d < D))[None, :]
    b_k = tl.load(k_ptr + o_t[:, None] * stride_k_t + (o_h * stride_k_h + o_d)[None, :], mask=m_k)
    p_kc = kc_ptr + (o_blk * stride_kc_b + o_off * stride_kc_s)[:, None] + (o_h * stride_kc_h + o_d)[None, :]
    tl.store(p_kc, b_k.to(kc_ptr.dtype.element_ty), mask=m_k)
    o_hv = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H * BLOCK_DV) // BLOCK_DV
    o_dv = tl.arange(0, BLOCK_H * BLOCK_DV) % BLOCK_DV
    m_v = m_t[:, None] & ((o_hv < HKV) & (o_dv < DV))[None, :]
    b_v = tl.load(v_ptr + o_t[:, None] * stride_v_t + (o_hv * stride_v_h + o_dv)[None, :], mask=m_v)
    p_vc = vc_ptr + (o_blk * stride_vc_b + o_off * stride_vc_s)[:, None] + (o_hv * stride_vc_h + o_dv)[None, :]
    tl.store(p_vc, b_v.to(vc_ptr.dtype.element_ty), mask=m_v)


def ring_write(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store K/V row ``t`` at flat ring slot ``slot_mapping[t]`` (``block_id * bs + offset``); ``< 0`` skips.

    Rows are written in parallel, so two rows with one slot race: build the mapping with
    ``RingPlan.slot_mapping(..., seq_len=...)``, which PADs dead positions and keeps live slots distinct.

    Args:
        k: [T, Hkv, D]; v: [T, Hkv, Dv], the dtype of the caches (fp16/bf16/fp32).
        k_cache: [num_blocks, bs, Hkv, D]; v_cache: [num_blocks, bs, Hkv, Dv] views with any strides
            (vLLM's ``kv_cache[..., :D].transpose(1, 2)`` works as it is).
        slot_mapping: [>= T] int32/int64.
    """
    for name, tensor in (("k", k), ("v", v)):
        if tensor.dim() != 3:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected [num_tokens, num_kv_heads, head_dim]")
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape[:2] != (num_tokens, num_kv_heads):
        raise ValueError(f"v {tuple(v.shape)} must match k {tuple(k.shape)} in tokens and heads")
    check_cache_pair(k_cache, v_cache, num_kv_heads, head_dim, v.shape[2])
    if k.dtype not in SUPPORTED_DTYPES or k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise ValueError(
            f"k/v dtypes {k.dtype}/{v.dtype} must equal the cache dtypes {k_cache.dtype}/{v_cache.dtype} "
            "(float16, bfloat16 or float32); cast the rows first"
        )
    if slot_mapping.dtype not in INDEX_DTYPES or slot_mapping.dim() != 1 or slot_mapping.shape[0] < num_tokens:
        raise ValueError(
            f"slot_mapping is {slot_mapping.dtype} {tuple(slot_mapping.shape)}; expected int32/int64 [>= {num_tokens}]"
        )
    for name, tensor in (("k", k), ("v", v)):
        if tensor.numel() and tensor.stride(-1) != 1:
            raise ValueError(f"{name} has last-dim stride {tensor.stride(-1)}; the head dim must be contiguous")
    check_same_device({"k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache, "slot_mapping": slot_mapping})
    if num_tokens == 0:
        return
    config = select_write_config(
        num_kv_heads=num_kv_heads, head_dim=max(head_dim, v.shape[2]), interpreted=is_interpreter()
    )
    grid = (triton.cdiv(num_tokens, config.BLOCK_T), triton.cdiv(num_kv_heads, config.BLOCK_H))
    _ring_write_kernel[grid](
        k, v, slot_mapping, k_cache, v_cache, num_tokens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HKV=num_kv_heads, D=head_dim, DV=v.shape[2], BS=k_cache.shape[1],
        BLOCK_T=config.BLOCK_T, BLOCK_H=config.BLOCK_H,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_DV=triton.next_power_of_2(v.shape[2]),
        num_warps=config.num_warps,
    )  # fmt: skip
