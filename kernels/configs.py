# SPDX-License-Identifier: Apache-2.0
"""Tile configurations chosen by pure functions (no runtime autotune: it crashes without a GPU)."""

from __future__ import annotations

from dataclasses import dataclass

from ._triton_utils import next_pow2
from .ring_geometry import cdiv

# Largest query-row tile: G*B rows of one KV head beyond this are split over row blocks.
MAX_BLOCK_M = 128
# Split-KV aims for this many programs per SM before it stops splitting the window.
PROGRAMS_PER_SM = 2
MAX_SPLITS = 16
# tl.dot needs every tile dimension >= 16.
MIN_DOT_DIM = 16


@dataclass(frozen=True)
class AttentionConfig:
    """Launch shape of ``ring_attention``.

    BLOCK_M: query rows (query-major, ``row = i * G + g``) per program; BLOCK_KB: the block's own keys;
    TILE_N: context keys per loop iteration; BLOCK_D / BLOCK_DV: padded head dims;
    queries_per_block / num_m_blocks: queries per row block, row blocks per KV head;
    num_splits: window splits (LSE-combined when > 1).
    """

    BLOCK_M: int
    BLOCK_KB: int
    TILE_N: int
    BLOCK_D: int
    BLOCK_DV: int
    queries_per_block: int
    num_m_blocks: int
    num_splits: int
    num_warps: int
    num_stages: int


def select_attention_config(
    *,
    num_reqs: int,
    num_kv_heads: int,
    group_size: int,
    max_query_len: int,
    head_dim: int,
    head_dim_v: int,
    window: int,
    num_sms: int,
    num_splits: int | None = None,
) -> AttentionConfig:
    """Pick tiles from shapes only (never positions), so a CUDA graph replays for any position.

    Split-KV: while ``num_reqs * num_kv_heads * row_blocks`` programs leave SMs idle, split the window's
    ``W - 1`` context keys into up to ``MAX_SPLITS`` parts of at least two tiles each.
    """
    if max_query_len < 1:
        raise ValueError(f"max_query_len={max_query_len} must be >= 1")
    queries_per_block = max(1, min(max_query_len, MAX_BLOCK_M // group_size))
    num_m_blocks = cdiv(max_query_len, queries_per_block)
    block_m = max(MIN_DOT_DIM, next_pow2(queries_per_block * group_size))
    block_kb = max(MIN_DOT_DIM, next_pow2(max_query_len))
    block_d = max(MIN_DOT_DIM, next_pow2(head_dim))
    block_dv = max(MIN_DOT_DIM, next_pow2(head_dim_v))
    tile_n = 32 if max(block_d, block_dv) > 128 else 64
    if num_splits is None:
        base = num_reqs * num_kv_heads * num_m_blocks
        wanted = cdiv(PROGRAMS_PER_SM * num_sms, max(base, 1))
        most = max(1, min(MAX_SPLITS, (window - 1) // (2 * tile_n)))
        num_splits = max(1, min(wanted, most))
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    num_warps = 8 if block_m * max(block_d, block_dv) >= 128 * 128 else 4
    return AttentionConfig(
        BLOCK_M=block_m,
        BLOCK_KB=block_kb,
        TILE_N=tile_n,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        queries_per_block=queries_per_block,
        num_m_blocks=num_m_blocks,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=2,
    )


@dataclass(frozen=True)
class WriteConfig:
    """Launch shape of ``ring_write``: ``BLOCK_T`` tokens x ``BLOCK_H`` heads per program."""

    BLOCK_T: int
    BLOCK_H: int
    num_warps: int


# elements of K (and of V) one ring_write program moves
WRITE_TILE_ELEMENTS = 8192
# the interpreter costs per program: eight times the rows per program there
INTERPRETED_WRITE_TILE_ELEMENTS = 65536


def select_write_config(*, num_kv_heads: int, head_dim: int, interpreted: bool = False) -> WriteConfig:
    """All heads of a row in one program when they fit, and as many rows as fill the tile."""
    elements = INTERPRETED_WRITE_TILE_ELEMENTS if interpreted else WRITE_TILE_ELEMENTS
    block_d = next_pow2(head_dim)
    block_h = max(1, min(next_pow2(num_kv_heads), elements // block_d))
    block_t = max(1, elements // (block_h * block_d))
    return WriteConfig(BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4)


@dataclass(frozen=True)
class PrefillConfig:
    """Launch shape of ``ring_prefill_attention``: ``BLOCK_Q`` queries x G heads (``BLOCK_M`` rows) per program."""

    BLOCK_Q: int
    BLOCK_M: int
    TILE_N: int
    BLOCK_D: int
    BLOCK_DV: int
    num_warps: int
    num_stages: int


# query rows per prefill program: a 64-row tile keeps register pressure moderate for head_dim 256
PREFILL_BLOCK_M = 64
# Triton's CPU interpreter costs per program, not per FLOP: long chunks take far taller tiles there
INTERPRETED_LONG_CHUNK = 2048
INTERPRETED_PREFILL_BLOCK_M = 512
INTERPRETED_PREFILL_TILE_N = 128


def select_prefill_config(
    *, group_size: int, head_dim: int, head_dim_v: int, max_query_len: int = 0, interpreted: bool = False
) -> PrefillConfig:
    """All G heads of a query in one program; as many queries as fill ``PREFILL_BLOCK_M`` rows (under the
    interpreter, ``INTERPRETED_PREFILL_BLOCK_M`` for chunks of ``INTERPRETED_LONG_CHUNK`` queries or more)."""
    tall = interpreted and max_query_len >= INTERPRETED_LONG_CHUNK
    block_q = max(1, (INTERPRETED_PREFILL_BLOCK_M if tall else PREFILL_BLOCK_M) // group_size)
    block_d = max(MIN_DOT_DIM, next_pow2(head_dim))
    block_dv = max(MIN_DOT_DIM, next_pow2(head_dim_v))
    tile_n = 32 if max(block_d, block_dv) > 128 else 64
    return PrefillConfig(
        BLOCK_Q=block_q,
        BLOCK_M=max(MIN_DOT_DIM, next_pow2(block_q * group_size)),
        TILE_N=INTERPRETED_PREFILL_TILE_N if tall else tile_n,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        num_warps=4,
        num_stages=2,
    )
