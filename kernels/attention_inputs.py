# SPDX-License-Identifier: Apache-2.0
"""Input validation for the ring kernels: every bad input is a ``ValueError`` naming the value and the fix,
raised before any launch."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from .ring_geometry import cdiv, ring_blocks_needed

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_HEAD_DIM = 256
MAX_QUERY_LEN = 64


@dataclass(frozen=True)
class AttentionInputs:
    """What validation derived: sizes the launcher needs, and the output tensor."""

    num_reqs: int
    group_size: int
    max_query_len: int
    scale: float
    table_period: int
    out: torch.Tensor


def debug_checks_enabled() -> bool:
    """``RINGKV_DEBUG_CHECKS=1`` adds metadata range checks that synchronise with the device."""
    return os.environ.get("RINGKV_DEBUG_CHECKS") == "1"


def _check_rank(name: str, tensor: torch.Tensor, rank: int, layout: str) -> None:
    if tensor.dim() != rank:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected {rank} dims {layout}")


def _check_inner_contiguous(name: str, tensor: torch.Tensor) -> None:
    if tensor.numel() > 0 and tensor.stride(-1) != 1:
        raise ValueError(f"{name} has last-dim stride {tensor.stride(-1)}; the head dim must be contiguous")


def _check_index(name: str, tensor: torch.Tensor, rank: int) -> None:
    if tensor.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} has dtype {tensor.dtype}; use torch.int32 or torch.int64")
    _check_rank(name, tensor, rank, "")


def check_same_device(named: dict[str, torch.Tensor]) -> torch.device:
    """All tensors on one device; a CPU tensor is accepted only under the Triton interpreter."""
    devices = {name: t.device for name, t in named.items()}
    first = next(iter(devices.values()))
    for name, device in devices.items():
        if device != first:
            raise ValueError(f"{name} is on {device} but {next(iter(devices))} is on {first}; move all to one device")
    if first.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"tensors are on {first}; the Triton kernels need CUDA (or TRITON_INTERPRET=1 on CPU)")
    return first


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor, num_kv_heads: int, head_dim: int, head_dim_v: int):
    """K/V cache views ``[num_blocks, bs, Hkv, D]`` consistent with the new rows."""
    _check_rank("k_cache", k_cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]")
    _check_rank("v_cache", v_cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim_v]")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in blocks/heads")
    if k_cache.shape[2] != num_kv_heads or k_cache.shape[3] != head_dim or v_cache.shape[3] != head_dim_v:
        raise ValueError(
            f"cache views {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not match num_kv_heads={num_kv_heads}, "
            f"head_dim={head_dim}, head_dim_v={head_dim_v}; pass [num_blocks, block_size, Hkv, D] views"
        )
    _check_inner_contiguous("k_cache", k_cache)
    _check_inner_contiguous("v_cache", v_cache)


def validate_attention_inputs(
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
    max_query_len: int | None,
    max_seq_len: int | None,
    scale: float | None,
    table_period: int | None,
    out: torch.Tensor | None,
    num_splits: int | None,
    query_len_limit: int = MAX_QUERY_LEN,
) -> AttentionInputs:
    """Check shapes, dtypes, devices and ring capacity of a ``ring_attention`` call; allocate ``out``.

    ``query_len_limit``: the most queries per request the kernel takes (draft blocks: ``MAX_QUERY_LEN``).
    """
    _check_rank("q", q, 3, "[num_tokens, num_q_heads, head_dim]")
    _check_rank("k_new", k_new, 3, "[num_tokens, num_kv_heads, head_dim]")
    _check_rank("v_new", v_new, 3, "[num_tokens, num_kv_heads, head_dim_v]")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, head_dim_v = k_new.shape[1], v_new.shape[2]
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q has dtype {q.dtype}; supported: float16, bfloat16, float32")
    for name, tensor in (("k_new", k_new), ("v_new", v_new), ("k_cache", k_cache), ("v_cache", v_cache)):
        if tensor.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {tensor.dtype} but q has {q.dtype}; cast them to one dtype")
    if k_new.shape != (num_tokens, num_kv_heads, head_dim) or v_new.shape[:2] != (num_tokens, num_kv_heads):
        raise ValueError(
            f"k_new {tuple(k_new.shape)} / v_new {tuple(v_new.shape)} must be [num_tokens={num_tokens}, Hkv, D] "
            f"with D = q's head_dim {head_dim}"
        )
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads} (GQA)")
    for name, dim in (("head_dim", head_dim), ("head_dim_v", head_dim_v)):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"{name}={dim} is not supported; ring_attention handles 1..{MAX_HEAD_DIM}")
    for name, tensor in (("q", q), ("k_new", k_new), ("v_new", v_new)):
        _check_inner_contiguous(name, tensor)
    check_cache_pair(k_cache, v_cache, num_kv_heads, head_dim, head_dim_v)
    _check_index("block_table", block_table, 2)
    _check_index("query_start_loc", query_start_loc, 1)
    _check_index("seq_lens", seq_lens, 1)
    check_same_device(
        {"q": q, "k_new": k_new, "v_new": v_new, "k_cache": k_cache, "v_cache": v_cache,
         "block_table": block_table, "query_start_loc": query_start_loc, "seq_lens": seq_lens}
    )  # fmt: skip
    num_reqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_reqs + 1:
        raise ValueError(
            f"query_start_loc has {query_start_loc.shape[0]} entries; expected num_reqs + 1 = {num_reqs + 1}"
        )
    if block_table.shape[0] < num_reqs:
        raise ValueError(f"block_table has {block_table.shape[0]} rows for {num_reqs} requests; give one row each")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window={window!r} must be an int >= 1 (keys a query sees, itself included)")
    scale = head_dim**-0.5 if scale is None else float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale={scale} must be a finite positive number (default head_dim ** -0.5)")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits={num_splits!r} must be an int >= 1 or None")
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if num_reqs else 1
    if not 1 <= max_query_len <= query_len_limit:
        hint = "a draft block; use ring_prefill_attention for chunks" if query_len_limit == MAX_QUERY_LEN else ""
        raise ValueError(f"max_query_len={max_query_len} must be in 1..{query_len_limit} {hint}".rstrip())
    block_size = k_cache.shape[1]
    width = block_table.shape[1]
    if table_period is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max()) if num_reqs else 0
        if cdiv(max_seq_len, block_size) > width:
            raise ValueError(
                f"block_table width {width} is too short for max_seq_len={max_seq_len} at block_size={block_size} "
                f"(needs {cdiv(max_seq_len, block_size)} columns); pass full rows or table_period=R for ring rows"
            )
        table_period = max(width, 1)
    else:
        # a draft block's own K/V sit in the ring's slack; a prefill writes after reading (needs the window only)
        needed = ring_blocks_needed(window, block_size, max_query_len if query_len_limit == MAX_QUERY_LEN else 1)
        if table_period < needed:
            raise ValueError(
                f"a ring of table_period={table_period} blocks cannot hold window={window} plus a block of "
                f"max_query_len={max_query_len} at block_size={block_size}; it needs R >= {needed} "
                "(plan the ring with RingPlan(window, block_size, lookahead >= query_len))"
            )
        if width < table_period:
            raise ValueError(f"block_table width {width} is shorter than table_period={table_period}; give R columns")
    out_shape = (num_tokens, num_q_heads, head_dim_v)
    if out is None:
        out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
    elif out.shape != out_shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"out is {tuple(out.shape)} {out.dtype} on {out.device}; expected {out_shape} {q.dtype} on {q.device}"
        )
    else:
        _check_inner_contiguous("out", out)
    if debug_checks_enabled():
        check_metadata_ranges(block_table, query_start_loc, seq_lens, num_tokens, k_cache.shape[0], max_query_len)
    return AttentionInputs(
        num_reqs=num_reqs,
        group_size=num_q_heads // num_kv_heads,
        max_query_len=max_query_len,
        scale=scale,
        table_period=table_period,
        out=out,
    )


def check_metadata_ranges(
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    num_tokens: int,
    num_blocks: int,
    max_query_len: int,
) -> None:
    """Device-syncing checks (``RINGKV_DEBUG_CHECKS=1``): metadata inside the tensors it indexes."""
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    if bool((query_lens < 0).any()) or int(query_start_loc[-1]) > num_tokens or int(query_start_loc[0]) < 0:
        raise ValueError(f"query_start_loc {query_start_loc.tolist()} is not monotone within {num_tokens} tokens")
    if bool((query_lens > max_query_len).any()):
        raise ValueError(f"a query length exceeds max_query_len={max_query_len}: {query_lens.tolist()}")
    if bool((seq_lens < query_lens).any()):
        raise ValueError("seq_lens must include the block: seq_lens >= query length for every request")
    if bool(((block_table < 0) | (block_table >= num_blocks)).any()):
        raise ValueError(f"block_table holds ids outside [0, {num_blocks}); check the ring's physical block ids")
