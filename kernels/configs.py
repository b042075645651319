# SPDX-License-Identifier: Apache-2.0
"""Tile configurations chosen by pure functions (no runtime autotune: it crashes without a GPU)."""

from __future__ import annotations

from dataclasses import dataclass

import triton

# Query rows of one ring_attention program on draft blocks: the G x B rows of one KV head, padded to the 64-row
# tile one Hopper warp group's wgmma takes (a 32-row tile takes mma.sync with every warp holding all of Q and P).
ATTENTION_BLOCK_M = 64
# Split-KV aims for this many programs per SM before it stops splitting the window.
PROGRAMS_PER_SM = 2
MAX_SPLITS = 16
# tl.dot needs every tile dimension >= 16.
MIN_DOT_DIM = 16


def dot_dim(size: int) -> int:
    """A tile dimension (head dim, query rows) padded for ``tl.dot``: a power of two, at least ``MIN_DOT_DIM``."""
    return max(MIN_DOT_DIM, triton.next_power_of_2(size))


@dataclass(frozen=True)
class AttentionConfig:
    """Launch shape of ``ring_attention``: every field is a kernel constexpr, so one config = one compiled kernel.

    BLOCK_Q queries x G heads per program (``BLOCK_M`` rows, query-major ``row = i * G + g``, padded to the MMA
    tile); TILE_N ring keys per loop step (a whole KV block, or part of one, when it divides ``bs``); TILE_C of the
    batch's own keys per step; BLOCK_D / BLOCK_DV: padded head dims.
    """

    BLOCK_Q: int
    BLOCK_M: int
    TILE_N: int
    TILE_C: int
    BLOCK_D: int
    BLOCK_DV: int
    num_warps: int
    num_stages: int


def ring_tile_keys(kv_block_size: int) -> int:
    """Keys per step over the ring: ``bs`` itself when it is a power of two in 16..64 (one KV block, one scalar
    block id), the largest such power dividing ``bs`` for bigger blocks, else 16 (rows from several blocks)."""
    tile = MIN_DOT_DIM
    while tile < 64 and kv_block_size % (2 * tile) == 0:
        tile *= 2
    return tile


def select_attention_config(
    *, group_size: int, head_dim: int, head_dim_v: int, kv_block_size: int, kv_fp8: bool = False
) -> AttentionConfig:
    """Draft blocks (``BatchMode.DRAFT_BLOCK``): tiles from the head shape, block size and ring dtype only, never
    the number of requests, the draft-block length or a position, so one compiled kernel serves every batch (and
    a CUDA graph replays for any position)."""
    block_m = max(ATTENTION_BLOCK_M, triton.next_power_of_2(group_size))
    tile_n = ring_tile_keys(kv_block_size)
    return AttentionConfig(
        BLOCK_Q=block_m // group_size,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        TILE_C=tile_n,
        BLOCK_D=dot_dim(head_dim),
        BLOCK_DV=dot_dim(head_dim_v),
        num_warps=4,
        # three K/V tiles in flight per program: at the DFlash2 shape also the fewest registers (sm_90 128,
        # sm_100 128; two stages: 118 / 158), so 4 CTAs per SM on both (bench/README.md). An fp8 ring converts
        # each tile to the compute dtype: three stages take sm_100 to 146 registers (3 CTAs per SM), two hold
        # 128 / 121 (4 per SM); two fp8 tiles are the bytes of one bf16 tile (untimed: no GPU lent)
        num_stages=2 if kv_fp8 else 3,
    )


def select_num_splits(
    *, num_reqs: int, num_kv_heads: int, num_m_blocks: int, window: int, tile_n: int, num_sms: int
) -> int:
    """Split-KV count, a runtime kernel argument: while ``num_reqs * num_kv_heads * num_m_blocks`` programs
    leave SMs idle, split the window's ``W - 1`` context keys into up to ``MAX_SPLITS`` parts of >= 2 tiles."""
    base = max(num_reqs * num_kv_heads * num_m_blocks, 1)
    wanted = triton.cdiv(PROGRAMS_PER_SM * num_sms, base)
    most = max(1, min(MAX_SPLITS, (window - 1) // (2 * tile_n)))
    return max(1, min(wanted, most))


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
    block_d = triton.next_power_of_2(head_dim)
    block_h = max(1, min(triton.next_power_of_2(num_kv_heads), elements // block_d))
    block_t = max(1, elements // (block_h * block_d))
    return WriteConfig(BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4)


# query rows per prefill program: a 64-row tile keeps register pressure moderate for head_dim 256
PREFILL_BLOCK_M = 64
# Triton's CPU interpreter costs per program, not per FLOP: long chunks take far taller tiles there
INTERPRETED_LONG_CHUNK = 2048
INTERPRETED_PREFILL_BLOCK_M = 512
INTERPRETED_PREFILL_TILE_C = 128


def select_prefill_config(
    *,
    group_size: int,
    head_dim: int,
    head_dim_v: int,
    kv_block_size: int,
    max_query_len: int = 0,
    interpreted: bool = False,
) -> AttentionConfig:
    """Prefill chunks (``BatchMode.PREFILL_CHUNK``): all G heads of a query in one program; as many queries as
    fill ``PREFILL_BLOCK_M`` rows (under the interpreter, ``INTERPRETED_PREFILL_BLOCK_M`` rows and
    ``INTERPRETED_PREFILL_TILE_C`` chunk keys per step for chunks of ``INTERPRETED_LONG_CHUNK`` queries or more)."""
    tall = interpreted and max_query_len >= INTERPRETED_LONG_CHUNK
    block_q = max(1, (INTERPRETED_PREFILL_BLOCK_M if tall else PREFILL_BLOCK_M) // group_size)
    block_d = dot_dim(head_dim)
    block_dv = dot_dim(head_dim_v)
    # head_dim 256: a 64 x 256 fp32 accumulator is 128 registers a thread at 4 warps (spills with 32-key tiles);
    # 8 warps split it over two warp groups (sm_90: 177 registers, no spills; bench/README.md)
    wide = max(block_d, block_dv) > 128
    return AttentionConfig(
        BLOCK_Q=block_q,
        BLOCK_M=dot_dim(block_q * group_size),
        TILE_N=ring_tile_keys(kv_block_size),
        TILE_C=INTERPRETED_PREFILL_TILE_C if tall else 32 if wide else 64,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        num_warps=8 if wide else 4,
        num_stages=2,
    )
