# SPDX-License-Identifier: Apache-2.0
"""The varlen batch contract of the ring kernels: one definition of a batch's tensors and host-side bounds,
validated once, shared by ``ring_attention`` and the reference; its ``mode`` picks the launch.

Names follow vLLM / FlashAttention varlen: request ``r`` owns query rows
``query_start_loc[r] .. query_start_loc[r+1] - 1`` (``query_len``); ``seq_lens[r]`` counts its positions up to
and including those queries, so the queries sit at absolute positions ``context_len .. seq_len - 1`` with
``context_len = seq_len - query_len`` (vLLM's ``context_len``: positions before this step's queries, whose
K/V are in the ring). Position ``p`` lives in block ``block_table[r, (p // bs) mod table_period]``
(``ring_geometry``); ``table_period=None`` means full logical rows (vLLM's own block table).

Window convention of every kernel that takes a batch (``window = W``): a query at absolute position ``q`` sees
key ``k`` iff ``q - k < W`` and ``k >= 0``; causal adds ``k <= q``, non-causal adds ``k - q < W``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from .ring_geometry import MAX_POSITION

INDEX_DTYPES = (torch.int32, torch.int64)
# most queries per request in a draft block (rows one ring_attention program set holds)
MAX_QUERY_LEN = 64
# a request's positions 0 .. seq_len - 1 stay below MAX_POSITION (ring_geometry: int32 positions plus a tile)
MAX_SEQ_LEN = MAX_POSITION


class BatchMode(enum.Enum):
    """What the queries of a batch are; it decides how ``ring_attention`` launches and how much ring it needs.

    ``DRAFT_BLOCK``: each request's queries are one draft block of at most ``MAX_QUERY_LEN`` rows whose K/V
    may sit in the ring's slack past ``context_len`` (the ring needs ``RingPlan(W, bs, lookahead >=
    max_query_len)``); split-KV over the window.
    ``PREFILL_CHUNK``: chunks of any length; the ring is read before the chunk's rows are written, so it needs
    only the window (lookahead 1).
    """

    DRAFT_BLOCK = "draft_block"
    PREFILL_CHUNK = "prefill_chunk"


def _check_index(name: str, tensor: object, rank: int, layout: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} is {type(tensor).__name__}; pass a torch int32/int64 tensor {layout}")
    if tensor.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} has dtype {tensor.dtype}; use torch.int32 or torch.int64")
    if tensor.dim() != rank:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected {rank} dims {layout}")


def _check_int(name: str, value: object, lo: int, hi: int, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name}={value!r} must be an int in {lo}..{hi}; {hint}")


@dataclass(frozen=True)
class VarlenBatch:
    """A varlen batch of requests over ring KV. Construct with ``VarlenBatch.build`` (computes missing bounds);
    construction validates everything that does not need the K/V tensors.

    Attributes:
        query_start_loc: [num_reqs + 1] int32/int64, cumulative query rows (vLLM ``query_start_loc``).
        seq_lens: [num_reqs] int32/int64, ``context_len + query_len`` per request (vLLM ``seq_lens``).
        block_table: [>= num_reqs, width] int32/int64 physical block ids.
        max_query_len: host bound on ``query_len`` (>= 1; <= ``MAX_QUERY_LEN`` for draft blocks).
        max_seq_len: host bound on ``seq_lens``.
        table_period: ring column period (``R`` for a compact ring row); ``None``: full logical rows.
        mode: ``BatchMode.DRAFT_BLOCK`` or ``BatchMode.PREFILL_CHUNK``.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    max_query_len: int
    max_seq_len: int
    table_period: int | None
    mode: BatchMode

    def __post_init__(self) -> None:
        if not isinstance(self.mode, BatchMode):
            raise ValueError(f"mode={self.mode!r} must be BatchMode.DRAFT_BLOCK or BatchMode.PREFILL_CHUNK")
        _check_index("query_start_loc", self.query_start_loc, 1, "[num_reqs + 1]")
        _check_index("seq_lens", self.seq_lens, 1, "[num_reqs]")
        _check_index("block_table", self.block_table, 2, "[num_reqs, width]")
        num_reqs = self.seq_lens.shape[0]
        if self.query_start_loc.shape[0] != num_reqs + 1:
            raise ValueError(
                f"query_start_loc has {self.query_start_loc.shape[0]} entries; expected num_reqs + 1 = {num_reqs + 1}"
            )
        if self.block_table.shape[0] < num_reqs:
            raise ValueError(f"block_table has {self.block_table.shape[0]} rows for {num_reqs} requests; give one each")
        if self.mode is BatchMode.DRAFT_BLOCK:
            _check_int("max_query_len", self.max_query_len, 1, MAX_QUERY_LEN,
                       "a draft block; use BatchMode.PREFILL_CHUNK for chunks")  # fmt: skip
        else:
            _check_int("max_query_len", self.max_query_len, 1, MAX_SEQ_LEN, "the longest chunk")
        _check_int("max_seq_len", self.max_seq_len, 0, MAX_SEQ_LEN,
                   "the longest seq_len (context + queries); positions stay below ring_geometry.MAX_POSITION "
                   "(int32 in the kernels, plus a tile)")  # fmt: skip
        width = self.block_table.shape[1]
        if self.table_period is not None:
            _check_int("table_period", self.table_period, 1, max(width, 1), f"R columns of a block_table {width} wide")

    @classmethod
    def build(
        cls,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        *,
        mode: BatchMode,
        max_query_len: int | None = None,
        max_seq_len: int | None = None,
        table_period: int | None = None,
    ) -> VarlenBatch:
        """A validated batch; ``None`` bounds are read from the tensors (a device sync: pass them on the hot path)."""
        _check_index("query_start_loc", query_start_loc, 1, "[num_reqs + 1]")
        _check_index("seq_lens", seq_lens, 1, "[num_reqs]")
        if max_query_len is None:
            lens = query_start_loc[1:] - query_start_loc[:-1]
            max_query_len = max(1, int(lens.max())) if lens.numel() else 1
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max()) if seq_lens.numel() else 0
        return cls(query_start_loc, seq_lens, block_table, max_query_len, max_seq_len, table_period, mode)

    @property
    def num_reqs(self) -> int:
        """Requests in the batch (rows of ``seq_lens``)."""
        return self.seq_lens.shape[0]

    @property
    def period(self) -> int:
        """The block-table column period the kernels use: ``table_period``, or the row width for full rows."""
        return self.table_period if self.table_period is not None else max(self.block_table.shape[1], 1)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The batch's tensors by name (device checks)."""
        return {"query_start_loc": self.query_start_loc, "seq_lens": self.seq_lens, "block_table": self.block_table}
