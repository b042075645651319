# SPDX-License-Identifier: Apache-2.0
"""Input validation for the ring kernels: every bad input is a ``ValueError`` naming the value and the fix,
raised before any launch."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from ._triton_utils import debug_checks_enabled, is_interpreter
from .kv_quant import FP8_DTYPES, check_scale
from .ring_geometry import UNBOUNDED_WINDOW, check_sink_tokens, ring_blocks_needed, sink_block_count
from .varlen import INDEX_DTYPES, BatchMode, VarlenBatch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
# the ring kernels' K/V loads: 16-byte vectors, provable only from 16-element strides (Triton's divisibility)
KV_ALIGN_BYTES = 16
KV_STRIDE_ELEMENTS = 16


@dataclass(frozen=True)
class RingCache:
    """The ring's K/V cache views and, for an fp8 cache, its dequantization scales ([1] fp32): one run of kernel
    arguments, ``pointers()`` and ``strides()``, the same in every ring kernel (``check_ring_cache`` builds it)."""

    k_cache: torch.Tensor  # [num_blocks, bs, Hkv, D]
    v_cache: torch.Tensor  # [num_blocks, bs, Hkv, Dv]
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None

    @property
    def fp8(self) -> bool:
        return self.k_scale is not None

    def pointers(self) -> tuple[torch.Tensor, ...]:
        """K cache, V cache, K scale, V scale (an unquantized cache stands in for its scale: never read)."""
        k_scale = self.k_cache if self.k_scale is None else self.k_scale
        v_scale = self.v_cache if self.v_scale is None else self.v_scale
        return self.k_cache, self.v_cache, k_scale, v_scale

    def strides(self) -> tuple[int, ...]:
        """Block, slot and head strides of the K cache, then of the V cache."""
        return (*self.k_cache.stride()[:3], *self.v_cache.stride()[:3])


@dataclass(frozen=True)
class AttentionInputs:
    """What validation derived: the GQA group, the softmax scale, the output tensor, and the ring cache."""

    group_size: int
    scale: float
    out: torch.Tensor
    cache: RingCache


def _check_rank(name: str, tensor: torch.Tensor, rank: int, layout: str) -> None:
    if tensor.dim() != rank:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected {rank} dims {layout}")


def check_inner_contiguous(name: str, tensor: torch.Tensor) -> None:
    """The head dim must be contiguous (stride 1)."""
    if tensor.numel() > 0 and tensor.stride(-1) != 1:
        raise ValueError(f"{name} has last-dim stride {tensor.stride(-1)}; the head dim must be contiguous")


def check_same_device(named: dict[str, torch.Tensor]) -> torch.device:
    """All tensors on one device; a CPU tensor is accepted only under the Triton interpreter."""
    devices = {name: t.device for name, t in named.items()}
    first = next(iter(devices.values()))
    for name, device in devices.items():
        if device != first:
            raise ValueError(f"{name} is on {device} but {next(iter(devices))} is on {first}; move all to one device")
    if first.type != "cuda" and not is_interpreter():
        raise ValueError(f"tensors are on {first}; the Triton kernels need CUDA (or TRITON_INTERPRET=1 on CPU)")
    return first


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor, num_kv_heads: int, head_dim: int, head_dim_v: int):
    """K/V cache views ``[num_blocks, bs, Hkv, D]`` consistent with the new rows."""
    _check_rank("k_cache", k_cache, 4, "[num_blocks, kv_block_size, num_kv_heads, head_dim]")
    _check_rank("v_cache", v_cache, 4, "[num_blocks, kv_block_size, num_kv_heads, head_dim_v]")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in blocks/heads")
    if k_cache.shape[2] != num_kv_heads or k_cache.shape[3] != head_dim or v_cache.shape[3] != head_dim_v:
        raise ValueError(
            f"cache views {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not match num_kv_heads={num_kv_heads}, "
            f"head_dim={head_dim}, head_dim_v={head_dim_v}; pass [num_blocks, kv_block_size, Hkv, D] views"
        )
    check_inner_contiguous("k_cache", k_cache)
    check_inner_contiguous("v_cache", v_cache)
    check_kv_alignment("k_cache", k_cache)
    check_kv_alignment("v_cache", v_cache)


def check_ring_cache(
    cache: RingCache, *, dtype: torch.dtype, num_kv_heads: int, head_dim: int, head_dim_v: int
) -> RingCache:
    """Cache views for rows of compute ``dtype`` (one of ``SUPPORTED_DTYPES``, checked by the caller): the same
    dtype, or one fp8 dtype for both with both scales (returned as [1] fp32)."""
    k_cache, v_cache, k_scale, v_scale = cache.k_cache, cache.v_cache, cache.k_scale, cache.v_scale
    check_cache_pair(k_cache, v_cache, num_kv_heads, head_dim, head_dim_v)
    if k_cache.dtype not in FP8_DTYPES and v_cache.dtype not in FP8_DTYPES:
        if k_cache.dtype != dtype or v_cache.dtype != dtype:
            raise ValueError(
                f"k_cache/v_cache have dtypes {k_cache.dtype}/{v_cache.dtype} but the rows are {dtype}; use caches of "
                "the rows' dtype, or fp8 caches (torch.float8_e4m3fn / float8_e5m2) with k_scale and v_scale"
            )
        if k_scale is not None or v_scale is not None:
            raise ValueError(
                f"k_scale/v_scale were given for a {k_cache.dtype} cache; scales apply to fp8 caches only: drop them"
            )
        return cache
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}; view both as one fp8 dtype")
    return RingCache(k_cache, v_cache, check_scale("k_scale", k_scale, k_cache.device),
                     check_scale("v_scale", v_scale, v_cache.device))  # fmt: skip


def check_slot_mapping(slot_mapping: torch.Tensor, num_tokens: int) -> None:
    """A flat slot per row (``block_id * bs + offset``, < 0 = PAD): int32/int64 ``[>= num_tokens]``."""
    expected = f"expected int32/int64 [>= {num_tokens}]"
    if not isinstance(slot_mapping, torch.Tensor):
        raise ValueError(f"slot_mapping is {type(slot_mapping).__name__}; {expected}")
    if slot_mapping.dtype not in INDEX_DTYPES or slot_mapping.dim() != 1 or slot_mapping.shape[0] < num_tokens:
        raise ValueError(f"slot_mapping is {slot_mapping.dtype} {tuple(slot_mapping.shape)}; {expected}")


def check_kv_alignment(name: str, cache: torch.Tensor) -> None:
    """The fast kernels load K/V rows 16 bytes at a time; Triton proves that only for a cache whose base is
    16-byte aligned and whose block / slot / head strides are multiples of 16 elements (what a launch
    specialises on). Anything else would silently compile a kernel with 2-byte loads: refuse it."""
    if cache.numel() == 0:
        return
    if cache.data_ptr() % KV_ALIGN_BYTES:
        raise ValueError(
            f"{name} starts at address {cache.data_ptr():#x} (storage offset {cache.storage_offset()} elements), "
            f"not a multiple of {KV_ALIGN_BYTES} bytes; slice cache views at multiples of "
            f"{KV_ALIGN_BYTES // cache.element_size()} elements"
        )
    for dim, label in ((0, "block"), (1, "slot"), (2, "head")):
        if cache.stride(dim) % KV_STRIDE_ELEMENTS:
            raise ValueError(
                f"{name} has {label} stride {cache.stride(dim)} elements (dim {dim} of {tuple(cache.shape)}), not a "
                f"multiple of {KV_STRIDE_ELEMENTS}; allocate the cache with the head dim padded to a multiple of "
                f"{KV_STRIDE_ELEMENTS} and pass the [..., :head_dim] view (docs/kernels.md: the launchers)"
            )


def validate_attention_inputs(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache: RingCache,
    batch: VarlenBatch,
    *,
    window: int,
    scale: float | None,
    out: torch.Tensor | None,
    sink_tokens: int = 0,
) -> AttentionInputs:
    """Check ``ring_attention``'s tensors against each other and against ``batch`` (validated when it was built).
    Allocates ``out``."""
    if not isinstance(batch, VarlenBatch):
        raise ValueError(f"batch is {type(batch).__name__}; build one with VarlenBatch.build(...)")
    _check_rank("q", q, 3, "[num_tokens, num_q_heads, head_dim]")
    _check_rank("k_new", k_new, 3, "[num_tokens, num_kv_heads, head_dim]")
    _check_rank("v_new", v_new, 3, "[num_tokens, num_kv_heads, head_dim_v]")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, head_dim_v = k_new.shape[1], v_new.shape[2]
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q has dtype {q.dtype}; supported: float16, bfloat16, float32")
    for name, tensor in (("k_new", k_new), ("v_new", v_new)):
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
        check_inner_contiguous(name, tensor)
    cache = check_ring_cache(cache, dtype=q.dtype, num_kv_heads=num_kv_heads, head_dim=head_dim,
                             head_dim_v=head_dim_v)  # fmt: skip
    k_cache = cache.k_cache
    check_same_device({"q": q, "k_new": k_new, "v_new": v_new, "k_cache": k_cache, "v_cache": cache.v_cache,
                       **batch.tensors()})  # fmt: skip
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= UNBOUNDED_WINDOW:
        raise ValueError(
            f"window={window!r} must be an int in 1..{UNBOUNDED_WINDOW} (keys a query sees, itself included); "
            "pass UNBOUNDED_WINDOW for full attention"
        )
    check_sink_tokens(sink_tokens, window)
    scale = head_dim**-0.5 if scale is None else float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale={scale} must be a finite positive number (default head_dim ** -0.5)")
    kv_block_size = k_cache.shape[1]
    width = batch.block_table.shape[1]
    if batch.table_period is None:
        if triton.cdiv(batch.max_seq_len, kv_block_size) > width:
            raise ValueError(
                f"block_table width {width} is too short for max_seq_len={batch.max_seq_len} at kv_block_size="
                f"{kv_block_size} (needs {triton.cdiv(batch.max_seq_len, kv_block_size)} columns); pass full rows or "
                "table_period=R for ring rows"
            )
    else:
        # a draft block's own K/V sit in the ring's slack; a prefill writes after reading (needs the window only)
        lookahead = batch.max_query_len if batch.mode is BatchMode.DRAFT_BLOCK else 1
        needed = ring_blocks_needed(window, kv_block_size, lookahead)
        if batch.table_period < needed:
            raise ValueError(
                f"a ring of table_period={batch.table_period} blocks cannot hold window={window} plus a block of "
                f"max_query_len={lookahead} at kv_block_size={kv_block_size}; it needs R >= {needed} "
                "(plan the ring with RingPlan(window, kv_block_size, lookahead >= query_len))"
            )
        check_sink_columns(batch, sink_tokens, kv_block_size)
    out_shape = (num_tokens, num_q_heads, head_dim_v)
    if out is None:
        out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
    elif out.shape != out_shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"out is {tuple(out.shape)} {out.dtype} on {out.device}; expected {out_shape} {q.dtype} on {q.device}"
        )
    else:
        check_inner_contiguous("out", out)
    if debug_checks_enabled():
        check_metadata_ranges(batch, num_tokens, k_cache.shape[0])
    return AttentionInputs(group_size=num_q_heads // num_kv_heads, scale=scale, out=out, cache=cache)


def check_sink_columns(batch: VarlenBatch, sink_tokens: int, kv_block_size: int) -> None:
    """A compact row with sinks is ``[sink blocks | ring]``: room for the sink blocks before ``table_period``."""
    width = batch.block_table.shape[1]
    sink_blocks = sink_block_count(sink_tokens, kv_block_size)
    if sink_blocks + batch.table_period > width:
        raise ValueError(
            f"block_table width {width} cannot hold the {sink_blocks} sink blocks of sink_tokens={sink_tokens} "
            f"(kv_block_size={kv_block_size}) before a ring of table_period={batch.table_period} columns; rows are "
            f"[sink blocks | ring]: give each request {sink_blocks + batch.table_period} columns "
            "(RingPlan(..., sink_tokens=...).row_blocks) or pass full logical rows (table_period=None)"
        )


def check_metadata_ranges(batch: VarlenBatch, num_tokens: int, num_blocks: int) -> None:
    """Device-syncing checks (``RINGKV_DEBUG_CHECKS=1``): metadata inside the tensors it indexes and its bounds."""
    query_start_loc, seq_lens, block_table = batch.query_start_loc, batch.seq_lens, batch.block_table
    max_query_len = batch.max_query_len
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    if bool((query_lens < 0).any()) or int(query_start_loc[-1]) > num_tokens or int(query_start_loc[0]) < 0:
        raise ValueError(f"query_start_loc {query_start_loc.tolist()} is not monotone within {num_tokens} tokens")
    if bool((query_lens > max_query_len).any()):
        raise ValueError(f"a query length exceeds max_query_len={max_query_len}: {query_lens.tolist()}")
    if bool((seq_lens < query_lens).any()):
        raise ValueError("seq_lens must include the block: seq_lens >= query length for every request")
    if seq_lens.numel() and int(seq_lens.max()) > batch.max_seq_len:
        raise ValueError(f"a seq_len exceeds max_seq_len={batch.max_seq_len}: {seq_lens.tolist()}")
    if bool(((block_table < 0) | (block_table >= num_blocks)).any()):
        raise ValueError(f"block_table holds ids outside [0, {num_blocks}); check the ring's physical block ids")
