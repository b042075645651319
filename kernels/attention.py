# SPDX-License-Identifier: Apache-2.0
"""Triton attention of a varlen batch over the ring (``ring_attention``), draft blocks and prefill chunks alike;
must match ``reference.ring_attention_reference``. Ring arithmetic: ``ring_geometry`` (column = (p // bs) mod
period, after the sink blocks when there are sinks).

A query at position ``q`` reads two sources: its history ``[q - W + 1, context_len)`` from the ring (with attention
sinks, also the sinks below it, ``[0, min(sink_tokens, q - W + 1))``, from the row's sink blocks: extra tiles ahead
of the window's, in the same launch and the same split ranges), and the batch's own keys straight from
``k_new``/``v_new``, so a chunk may be far longer than the ring. One program owns
``BLOCK_Q`` queries x all ``G`` heads of one KV head of one request (query-major rows ``i * G + g``, padded to the
MMA tile), so each context K/V byte is read once per step; it walks the ring one KV block per step (one scalar
block-table load, 16-byte K/V loads). When a batch of draft blocks leaves SMs idle the window is split
(``num_splits``, a runtime argument like every batch-dependent value: one compiled kernel serves every batch)
and the partial results are merged by log-sum-exp in ``_combine_splits_kernel``.

With ``write_ring`` the batch's live rows are stored in the ring after the attention (write-after-read):
writing first would overwrite history a chunk's first queries still need.
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
from .configs import (
    MAX_SPLITS,
    AttentionConfig,
    select_attention_config,
    select_num_splits,
    select_prefill_config,
)
from .ring_geometry import batch_live_slots
from .validation import (
    AttentionInputs,
    RingCache,
    check_same_device,
    check_slot_mapping,
    validate_attention_inputs,
)
from .varlen import MAX_QUERY_LEN, BatchMode, VarlenBatch
from .write import launch_ring_write

LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["sink_tokens", "num_splits", "num_tokens"])
def _ring_attention_kernel(
    # outputs
    o_ptr,  # [T, HQ, DV] out when num_splits == 1, else the partial outputs [num_splits, T, HQ, DV] (same dtype)
    lse_ptr,  # [num_splits, T, HQ] fp32 (log2 domain) when num_splits > 1
    # inputs
    q_ptr,  # [T, HQ, D]
    kn_ptr,  # [T, HKV, D]   the batch's own keys
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
    sink_tokens,  # SINKS: keys 0 .. sink_tokens - 1 every query sees; rows [cdiv(sink_tokens, BS) sink blocks | ring]
    table_period,
    num_splits,  # context splits per query block (grid x = query blocks * num_splits); 1 for prefill chunks
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
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    TILE_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr,
    PREFILL: tl.constexpr,  # BatchMode.PREFILL_CHUNK: chunks of any length, so the own-key scan follows the window
    # the interpreter computes bf16 on raw bits: upcast right after every load
    UPCAST: tl.constexpr,
    FP32_IEEE: tl.constexpr,
    KV_FP8: tl.constexpr,  # the ring caches are fp8 (e4m3fn or e5m2), dequantized on load
    SINKS: tl.constexpr,  # sink_tokens > 0: a layer with attention sinks (without, the kernel is the sinkless one)
):
    # query blocks x splits on grid x (the long dimension: grid y and z stop at 65,535); prefill runs unsplit
    if PREFILL:
        splits = 1
        i_qb = tl.program_id(0)
        i_s = 0
    else:
        splits = num_splits
        i_qb = tl.program_id(0) // num_splits
        i_s = tl.program_id(0) % num_splits
    i_h = tl.program_id(1).to(tl.int64)
    i_r = tl.program_id(2).to(tl.int64)
    bos, q_len, context_len = request_span(query_start_loc_ptr, seq_lens_ptr, i_r)
    q0 = i_qb * BLOCK_Q
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

    # context keys [ctx_lo, context_len): the union of this query block's windows, in tiles of TILE_N keys split
    # num_splits ways; a runtime span, so no constant grows with the window (full attention: window = 2^40).
    # With sinks, the sinks' tiles come first ([0, sink_hi) and the window's keys they hold: attend_ring_range),
    # then the window's: split s reads a contiguous run of the joint tiles, so the LSE merge sees every key once,
    # whichever split read it
    ctx_lo = tl.maximum(context_len + q0 - (window - 1), 0)
    if SINKS:
        sink_hi = tl.minimum(sink_tokens, context_len)
        sink_blocks = tl.cdiv(sink_tokens, BS)
        num_sink_tiles = ring_tile_count(0, sink_hi, TILE_N)
        num_tiles = num_sink_tiles + ring_tile_count(tl.maximum(ctx_lo, num_sink_tiles * TILE_N), context_len, TILE_N)
    else:
        sink_hi = 0
        sink_blocks = 0
        num_sink_tiles = 0
        num_tiles = ring_tile_count(ctx_lo, context_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, splits)
    tile_lo = i_s * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    m_i, l_i, acc = attend_ring_range(
        m_i, l_i, acc, b_q, q_pos, ctx_lo, context_len, tile_lo, tile_hi,
        kc_ptr + i_h * stride_kc_h, vc_ptr + i_h * stride_vc_h, block_table_ptr + i_r * stride_bt_r, table_period,
        sink_hi, sink_blocks, num_sink_tiles, k_scale, v_scale, stride_kc_b, stride_kc_s, stride_vc_b, stride_vc_s,
        stride_bt_c, o_d, o_dv, qk_scale, window, D, DV, BLOCK_D, BLOCK_DV, BS, TILE_N, UPCAST, FP32_IEEE, KV_FP8,
        SINKS,
    )  # fmt: skip

    # the batch's own keys (last split only): a draft block's few rows whole; a prefill chunk's from the lowest
    # any row of this block sees to the highest (non-causal: min(P + q_len, P + q_last + W), summed so that no
    # term passes int32 for any W up to 2^31 - 1); with sinks, a chunk that starts among them from its first row
    # (its sink rows and window in one scan: the rows between are masked, a cost of a request's first chunks only)
    if i_s == splits - 1:
        new_lo = context_len
        new_hi = context_len + q_len
        if PREFILL:
            q_last = tl.minimum(q0 + BLOCK_Q, q_len) - 1
            new_lo = tl.maximum(context_len + q0 - (window - 1), context_len)
            if SINKS:
                new_lo = tl.where(context_len < sink_tokens, context_len, new_lo)
            if CAUSAL:
                new_hi = context_len + q_last + 1
            else:
                new_hi = context_len + q_last + tl.minimum(q_len - q_last, window)
        m_i, l_i, acc = attend_rows_range(
            m_i, l_i, acc, b_q, q_pos, new_lo, new_hi, kn_ptr + i_h * stride_kn_h, vn_ptr + i_h * stride_vn_h,
            bos + (new_lo - context_len).to(tl.int64), stride_kn_t, stride_vn_t, o_d, o_dv, qk_scale, window,
            sink_tokens, D, DV, BLOCK_D, BLOCK_DV, TILE_C, CAUSAL, UPCAST, FP32_IEEE, SINKS,
        )  # fmt: skip

    # a row that saw no key outputs 0 (l = 0)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    b_o = acc / l_safe[:, None]
    # one store path for every split count (a second, fp32 one costs ~20 registers): out, or split i_s's rows
    o_row = i_s * num_tokens + bos + o_i.to(tl.int64)
    p_o = o_ptr + o_row[:, None] * stride_o_t + o_head[:, None] * stride_o_h + o_dv[None, :]
    tl.store(p_o, b_o.to(o_ptr.dtype.element_ty), mask=m_row[:, None] & (o_dv < DV)[None, :])
    if splits > 1:
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


# grid y and z stop at 65,535 (CUDA); grid x at 2^31 - 1
MAX_GRID_YZ = 65_535


def attention_grid(batch: VarlenBatch, num_kv_heads: int, block_q: int, num_splits: int) -> tuple[int, int, int]:
    """(query blocks x splits, KV heads, requests): the long dimension on grid x."""
    if num_kv_heads > MAX_GRID_YZ or batch.num_reqs > MAX_GRID_YZ:
        raise ValueError(
            f"num_kv_heads={num_kv_heads} / num_reqs={batch.num_reqs} exceed the grid's {MAX_GRID_YZ}; split the batch"
        )
    return (triton.cdiv(batch.max_query_len, block_q) * num_splits, num_kv_heads, batch.num_reqs)


def select_config(batch: VarlenBatch, inputs: AttentionInputs) -> AttentionConfig:
    """The launch shape for the batch's mode: draft blocks from the head shape only (CUDA-graph safe), prefill
    chunks also from the longest chunk."""
    _, kv_block_size, _, head_dim = inputs.cache.k_cache.shape
    shape = {"group_size": inputs.group_size, "head_dim": head_dim, "head_dim_v": inputs.cache.v_cache.shape[3],
             "kv_block_size": kv_block_size}  # fmt: skip
    if batch.mode is BatchMode.DRAFT_BLOCK:
        return select_attention_config(**shape, kv_fp8=inputs.cache.fp8)
    return select_prefill_config(**shape, max_query_len=batch.max_query_len, interpreted=is_interpreter())


def split_count(
    num_splits: int | None, batch: VarlenBatch, config: AttentionConfig, *, num_kv_heads: int, window: int,
    device: torch.device,
) -> int:  # fmt: skip
    """The split-KV count: ``num_splits`` when forced (draft blocks only), else chosen from the SMs left idle."""
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits={num_splits!r} must be an int >= 1 or None")
    if batch.mode is BatchMode.PREFILL_CHUNK:
        if num_splits not in (None, 1):
            raise ValueError(
                f"num_splits={num_splits} applies to draft blocks; a prefill chunk's queries already fill the GPU: "
                "drop num_splits"
            )
        return 1
    if num_splits is None:
        num_splits = select_num_splits(
            num_reqs=batch.num_reqs, num_kv_heads=num_kv_heads,
            num_m_blocks=triton.cdiv(batch.max_query_len, config.BLOCK_Q), window=window, tile_n=config.TILE_N,
            num_sms=device_sms(device),
        )  # fmt: skip
    if num_splits > MAX_SPLITS:
        raise ValueError(f"num_splits={num_splits} exceeds MAX_SPLITS={MAX_SPLITS}")
    return num_splits


def split_rows_bound(*, num_kv_heads: int, block_q: int, window: int, tile_n: int, num_sms: int) -> int:
    """Most partial-output rows (splits x query rows) a draft-block launch of this head shape can need when
    ``select_num_splits`` chooses the split count: it splits only while the programs leave SMs idle, so the bound
    follows from the GPU, not from the batch. A batch of ``n`` requests of ``m`` query blocks holds at most
    ``n * min(m * block_q, MAX_QUERY_LEN)`` rows; the split count never grows with ``n``."""
    rows = 0
    for num_m_blocks in range(1, triton.cdiv(MAX_QUERY_LEN, block_q) + 1):
        query_len = min(num_m_blocks * block_q, MAX_QUERY_LEN)
        num_reqs = 1
        while True:
            splits = select_num_splits(num_reqs=num_reqs, num_kv_heads=num_kv_heads, num_m_blocks=num_m_blocks,
                                       window=window, tile_n=tile_n, num_sms=num_sms)  # fmt: skip
            if splits == 1:
                break
            rows = max(rows, splits * num_reqs * query_len)
            num_reqs += 1
    return rows


class SplitWorkspace:
    """Persistent scratch of ``ring_attention`` launches: the split partial outputs and their log-sum-exps (or the
    one-split stand-in), taken as views instead of allocated per launch.

    Hold one per stream of launches (the vLLM backend: one per metadata builder, so micro-batches never share
    one): launches on one stream run in order, so a KV-cache group's layers reuse it one after another. The first
    draft-block launch of a head shape allocates room for every split count ``select_num_splits`` can choose
    (``split_rows_bound``); the buffers are never freed or replaced, so a CUDA graph captured on them stays
    valid. A launch that needs more (a forced ``num_splits``, more query rows than its requests hold) allocates
    as without a workspace; the views have a fresh allocation's shape and strides, so the kernels' output is the
    same either way.
    """

    def __init__(self) -> None:
        # (Hq, Dv, out dtype, device, Hkv, BLOCK_Q, TILE_N, window) -> flat fp32 LSEs, flat partial outputs
        self._splits: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        # (Hq, device) -> the one-split LSE stand-in [1, 1, Hq]
        self._stand_ins: dict[tuple, torch.Tensor] = {}

    def scratch(
        self, batch: VarlenBatch, config: AttentionConfig, num_splits: int, *, num_tokens: int, num_kv_heads: int,
        window: int, out: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
        """``(lse, target)`` for a launch of ``num_splits`` over ``num_tokens`` rows into ``out`` [T, Hq, Dv]:
        ``target`` is ``out`` itself for one split; None when the buffers cannot hold the launch."""
        _, num_q_heads, head_dim_v = out.shape
        if num_splits == 1:
            key = (num_q_heads, out.device)
            if key not in self._stand_ins:
                self._stand_ins[key] = torch.empty(1, 1, num_q_heads, dtype=torch.float32, device=out.device)
            return self._stand_ins[key], out
        if batch.mode is not BatchMode.DRAFT_BLOCK:
            return None
        key = (num_q_heads, head_dim_v, out.dtype, out.device, num_kv_heads, config.BLOCK_Q, config.TILE_N, window)
        if key not in self._splits:
            rows = split_rows_bound(num_kv_heads=num_kv_heads, block_q=config.BLOCK_Q, window=window,
                                    tile_n=config.TILE_N, num_sms=device_sms(out.device))  # fmt: skip
            self._splits[key] = (
                torch.empty(rows * num_q_heads, dtype=torch.float32, device=out.device),
                out.new_empty(rows * num_q_heads * head_dim_v),
            )
        lse_flat, part_flat = self._splits[key]
        rows = num_splits * num_tokens
        if rows * num_q_heads > lse_flat.numel():
            return None
        lse = lse_flat[: rows * num_q_heads].view(num_splits, num_tokens, num_q_heads)
        return lse, part_flat[: rows * num_q_heads * head_dim_v].view(num_splits, num_tokens, num_q_heads, head_dim_v)


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
    sink_tokens: int = 0,
    scale: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    write_ring: bool = False,
    slot_mapping: torch.Tensor | None = None,
    workspace: SplitWorkspace | None = None,
) -> torch.Tensor:
    """Attend a varlen batch (draft blocks or prefill chunks, ``batch.mode``) over its ring history and its own
    K/V; with ``write_ring``, then store its live rows in the ring.

    Window convention (``window = W``): a query at absolute position ``q`` sees key ``k`` iff ``q - k < W``
    and ``k >= 0``; causal adds ``k <= q``, non-causal adds ``k - q < W`` (vLLM ``sliding_window``;
    FlashAttention ``(W-1, 0)`` / ``(W-1, W-1)``). Request ``r``'s ``query_len`` queries sit at positions
    ``context_len .. seq_len - 1`` (``varlen``); context keys ``< context_len`` come from the ring, the
    batch's own keys from ``k_new``/``v_new``. Attention sinks (``sink_tokens`` > 0) widen ``q - k < W`` to
    ``q - k < W or k < sink_tokens``; each block-table row is then ``[sink blocks | ring]``
    (``ring_geometry``): the sinks' ``cdiv(sink_tokens, bs)`` blocks first, then the ring's ``table_period``
    columns (a full logical row reads the same).

    Args:
        q: [T, Hq, D] fp16/bf16/fp32. k_new: [T, Hkv, D]. v_new: [T, Hkv, Dv].
        k_cache: [num_blocks, bs, Hkv, D] view, v_cache: [num_blocks, bs, Hkv, Dv]: any strides that are
            multiples of 16 elements, 16-byte aligned base (``check_kv_alignment``); ``q.dtype``, or both
            float8_e4m3fn / float8_e5m2 (``kv_quant``: the ring holds ``fp8(K / k_scale)``, written quantized).
        batch: a ``VarlenBatch``; ``BatchMode.DRAFT_BLOCK`` (blocks of up to ``MAX_QUERY_LEN`` rows, split-KV)
            or ``BatchMode.PREFILL_CHUNK`` (chunks of any length).
        window: W >= 1. causal: causality among the batch's own keys.
        sink_tokens: keys ``0 .. sink_tokens - 1`` every query also sees, an int in ``0 .. W`` (0: none, the
            sinkless kernel); read in the same launch as the window, each key once.
        scale: softmax scale, default ``D ** -0.5``.
        k_scale, v_scale: [1] float tensors on the caches' device, for fp8 caches only (vLLM ``layer._k_scale``).
        out: optional [T, Hq, Dv] output. num_splits: force the split-KV count of draft blocks (tests, benchmarks).
        write_ring: after the attention, store the live rows (positions ``>= seq_lens[r] - (W - 1)`` or in a sink
            block; of rows sharing a slot only the last) through ``slot_mapping`` when given (vLLM's, [>= T]),
            else through ``batch.block_table``.
        workspace: a ``SplitWorkspace`` the launch takes its scratch from instead of allocating it (the serving
            path: one per stream of launches, kept for the process).

    Returns:
        [T, Hq, Dv] in ``q.dtype``; rows past ``query_start_loc[-1]`` are left as they were.
    """
    inputs = validate_attention_inputs(
        q, k_new, v_new, RingCache(k_cache, v_cache, k_scale, v_scale), batch, window=window, scale=scale, out=out,
        sink_tokens=sink_tokens,
    )  # fmt: skip
    num_tokens = q.shape[0]
    if slot_mapping is not None:
        if not write_ring:
            raise ValueError("slot_mapping was given with write_ring=False; pass write_ring=True to store the rows")
        check_slot_mapping(slot_mapping, num_tokens)
        check_same_device({"q": q, "slot_mapping": slot_mapping})
    config = select_config(batch, inputs)
    num_splits = split_count(num_splits, batch, config, num_kv_heads=k_new.shape[1], window=window, device=q.device)
    if batch.num_reqs and num_tokens:
        launch_attention(
            q, k_new, v_new, batch, inputs, config, num_splits, window=window, causal=causal, sink_tokens=sink_tokens,
            workspace=workspace,
        )  # fmt: skip
    if write_ring and num_tokens:
        slots = batch_live_slots(
            batch.query_start_loc, batch.seq_lens, batch.block_table, num_tokens, kv_block_size=k_cache.shape[1],
            window=window, period=batch.period, slot_mapping=slot_mapping, sink_tokens=sink_tokens,
        )  # fmt: skip
        launch_ring_write(k_new, v_new, inputs.cache, slots)
    return inputs.out


def launch_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    batch: VarlenBatch,
    inputs: AttentionInputs,
    config: AttentionConfig,
    num_splits: int,
    *,
    window: int,
    causal: bool,
    sink_tokens: int = 0,
    workspace: SplitWorkspace | None = None,
) -> None:
    """The attention kernel on validated inputs, and with splits the log-sum-exp merge into ``inputs.out``."""
    num_tokens, num_q_heads, head_dim = q.shape
    head_dim_v = v_new.shape[-1]
    out = inputs.out
    # with splits: partial outputs [num_splits, T, Hq, Dv] in out's dtype (the output rounding, once per split)
    # and fp32 LSEs [num_splits, T, Hq]; with one split the kernel writes out (a one-token LSE stand-in)
    scratch = None
    if workspace is not None:
        scratch = workspace.scratch(batch, config, num_splits, num_tokens=num_tokens, num_kv_heads=k_new.shape[1],
                                    window=window, out=out)  # fmt: skip
    if scratch is None:
        lse = torch.empty(num_splits, num_tokens if num_splits > 1 else 1, num_q_heads, dtype=torch.float32,
                          device=q.device)  # fmt: skip
        target = out if num_splits == 1 else out.new_empty(num_splits, num_tokens, num_q_heads, head_dim_v)
    else:
        lse, target = scratch
    _ring_attention_kernel[attention_grid(batch, k_new.shape[1], config.BLOCK_Q, num_splits)](
        target, lse, q, k_new, v_new, *inputs.cache.pointers(), batch.block_table, batch.query_start_loc,
        batch.seq_lens, inputs.scale * LOG2E, window, sink_tokens, batch.period, num_splits, num_tokens,
        target.stride(-3), target.stride(-2), lse.stride(1),
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        *inputs.cache.strides(), batch.block_table.stride(0), batch.block_table.stride(1),
        G=inputs.group_size, D=head_dim, DV=head_dim_v, BS=inputs.cache.k_cache.shape[1], BLOCK_Q=config.BLOCK_Q,
        BLOCK_M=config.BLOCK_M, TILE_N=config.TILE_N, TILE_C=config.TILE_C, BLOCK_D=config.BLOCK_D,
        BLOCK_DV=config.BLOCK_DV, CAUSAL=causal, PREFILL=batch.mode is BatchMode.PREFILL_CHUNK,
        UPCAST=is_interpreter(), FP32_IEEE=q.dtype == torch.float32, KV_FP8=inputs.cache.fp8, SINKS=sink_tokens > 0,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _combine_splits_kernel[(num_tokens, num_q_heads)](
            out, target, lse, batch.query_start_loc, batch.num_reqs, num_splits, num_tokens,
            out.stride(0), out.stride(1), target.stride(1), target.stride(2), lse.stride(1),
            DV=head_dim_v, BLOCK_DV=config.BLOCK_DV, BLOCK_S=triton.next_power_of_2(MAX_SPLITS),
        )  # fmt: skip
