# SPDX-License-Identifier: Apache-2.0
"""Ring geometry: the single source of truth for the drafter ring's slot arithmetic.

A request's sliding-window K/V live in a fixed ring of ``R`` physical blocks of ``bs`` slots.
Token position ``p`` lives in logical block ``j = p // bs``, which maps to ring column ``j mod period``
of the request's block-table row (``period = R`` for a compact ring row; for a full logical row, as vLLM
keeps it, any period ``>= row width`` makes the column ``j`` itself).

Attention sinks (StreamingLLM; a full-attention layer served on a bounded ring): with ``sink_tokens`` > 0 a query
also sees every key ``k < sink_tokens``, and the row is ``[sink blocks | ring columns]``: the first
``ns = cdiv(sink_tokens, bs)`` logical blocks keep columns ``0 .. ns-1`` for the request's life, and block
``j >= ns`` maps to column ``ns + (j - ns) mod period`` (``block_column``; ``ns = 0`` is the rule above)::

    row:   | sink 0 | ... | sink ns-1 | ring 0 | ring 1 | ... | ring R-1 |      (ns + R columns)
    block:   0        ...   ns-1        ns, ns+R, ...   ns+1, ns+1+R, ...

Positions ``sink_tokens <= p < ns * bs`` sit in the last sink block too (one slot per token, one write), and
only the window rule shows them.

Window convention (``window = W``): a query at absolute position ``q`` sees key ``k`` iff ``q - k < W``
and ``k >= 0``; causal adds ``k <= q``, non-causal adds ``k - q < W``. This equals vLLM ``sliding_window``
and fla ``window_size``; FlashAttention ``(W-1, 0)`` / ``(W-1, W-1)``; FlashInfer ``window_left = W-1``.
Sinks widen the first clause to ``q - k < W or k < sink_tokens`` (``visible``).

Why ``R = cdiv(W + la - 2, bs) + 1`` blocks suffice::

    one drafter step at context length P (context K/V exist for 0..P-1) reads and writes
        context  [P-(W-1), P-1]   (W-1 positions: what query P, the lowest query, can still see)
        block    [P, P+la-1]      (la = most tokens one step writes past the context)
    live span = W + la - 1 contiguous positions
    L contiguous positions touch at most cdiv(L-1, bs) + 1 blocks (the +1: a span that does not
    start on a block boundary), so the live span touches at most cdiv(W+la-2, bs) + 1 = R blocks.
    Consecutive logical blocks j..j+R-1 have distinct residues mod R, hence distinct physical blocks:
    no live position ever shares a slot with another live position.

For W=2048, bs=16, la=8 (DFlash2, 7 speculative tokens) this gives R = cdiv(2054, 16) + 1 = 130.

With sinks the same R suffices for the ring columns: sink blocks never share a column with anything, and the
live span's positions at or past ``ns * bs`` are a contiguous run of at most ``W + la - 1`` positions in blocks
``>= ns``, so at most R of them, whose ``(j - ns) mod R`` are distinct. A sink's own keys need no ring slot.

Writes of a batch that ends at ``P_end`` (exclusive) never store positions ``< P_end - (W-1)``: they are
dead (no later query can see them) and, in a chunk longer than the ring, would alias live slots. Positions in
sink blocks (``p < ns * bs``) are never dead: each owns its slot for the request's life.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

PAD_SLOT = -1
# Positions are int32 inside the kernels, and a tile of keys or query rows may reach past a request's last
# position by less than POSITION_HEADROOM (configs keeps every tile within it), so no int32 position overflows:
# every absolute position is < MAX_POSITION (checked before launch through varlen.MAX_SEQ_LEN).
POSITION_HEADROOM = 1 << 12
MAX_POSITION = (1 << 31) - POSITION_HEADROOM
# The window of a full-attention layer served by the ring kernels, and the largest window they take (a window
# >= MAX_POSITION already sees every position).
UNBOUNDED_WINDOW = 1 << 40


def _require_positive_int(name: str, value: object, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r} must be an int; {hint}")
    if value < 1:
        raise ValueError(f"{name}={value} must be >= 1; {hint}")
    return value


def check_sink_tokens(sink_tokens: object, window: int) -> int:
    """``sink_tokens`` as the ring takes it: an int in ``0 .. window`` (0: no sinks)."""
    if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, int):
        raise ValueError(f"sink_tokens={sink_tokens!r} must be an int; pass the number of sink tokens, 0 for none")
    if sink_tokens < 0:
        raise ValueError(f"sink_tokens={sink_tokens} must be >= 0; pass 0 for no sinks")
    if sink_tokens > window:
        raise ValueError(
            f"sink_tokens={sink_tokens} exceeds window={window}; pass sink_tokens <= window (sinks are the first "
            "tokens kept beside the window; a longer prefix needs a larger window)"
        )
    return sink_tokens


def sink_block_count(sink_tokens: int, kv_block_size: int) -> int:
    """``ns``, the logical blocks that hold the sink tokens: ``cdiv(sink_tokens, bs)`` (0 without sinks)."""
    return triton.cdiv(sink_tokens, kv_block_size)


def first_ring_position(sink_tokens: int, kv_block_size: int) -> int:
    """The first position past the sink blocks, ``ns * bs``: every position below it owns its slot for life, the
    ring holds those at or past it."""
    return sink_block_count(sink_tokens, kv_block_size) * kv_block_size


def ring_blocks_needed(window: int, kv_block_size: int, lookahead: int) -> int:
    """Blocks ``R`` a ring needs so that one step's live span never aliases (see module docstring)."""
    _require_positive_int("window", window, "pass the drafter's sliding window W (keys per query, incl. itself)")
    _require_positive_int("kv_block_size", kv_block_size, "pass the KV block size in tokens")
    _require_positive_int("lookahead", lookahead, "pass num_speculative_tokens + 1 for DFlash")
    return triton.cdiv(window + lookahead - 2, kv_block_size) + 1


def block_column(logical_block: torch.Tensor | int, period: int, sink_blocks: int = 0) -> torch.Tensor | int:
    """The row column of logical block ``j >= 0``: ``j`` for a sink block (``j < ns``), else
    ``ns + (j - ns) mod period``; ``j mod period`` without sinks (in vLLM's full logical row, entry ``j`` names the
    block of this column)."""
    ring = sink_blocks + (logical_block - sink_blocks) % period
    if isinstance(logical_block, int):
        return logical_block if logical_block < sink_blocks else ring
    return torch.where(logical_block < sink_blocks, logical_block, ring)


def position_column(position: torch.Tensor, kv_block_size: int, period: int, sink_tokens: int = 0) -> torch.Tensor:
    """The row column of ``position``: ``block_column`` of its logical block ``position // bs``."""
    logical_block = torch.div(position, kv_block_size, rounding_mode="floor")
    return block_column(logical_block, period, sink_block_count(sink_tokens, kv_block_size))


def first_visible_position(query_position: torch.Tensor | int, window: int) -> torch.Tensor | int:
    """Lowest key position the window shows a query at ``query_position``: ``max(0, q - (W - 1))`` (sinks below
    it: ``sinks_below_window``)."""
    if isinstance(query_position, int):
        return max(0, query_position - (window - 1))
    return torch.clamp(query_position - (window - 1), min=0)


def sinks_below_window(query_position: int, window: int, sink_tokens: int) -> int:
    """End of the sinks a query at ``query_position`` sees below its window: keys ``0 .. min(sink_tokens,
    first_visible_position(q)) - 1``; the sinks at or past that position are in the window already."""
    return min(sink_tokens, first_visible_position(query_position, window))


def longest_rebuilding_prefix_hit(num_tokens: int, window: int, sink_tokens: int = 0) -> int:
    """The longest prefix-cache hit (tokens) after which a ring is rebuilt by recomputing the rest.

    A ring keeps no K/V across requests, so after a hit of ``h`` tokens it holds only what the recompute of
    ``h .. num_tokens - 1`` writes. The first query the ring then serves sits at ``num_tokens`` (a drafter's
    first draft position: the target's last computed position + 1; later queries only move right), and sees
    keys from ``first_visible_position(num_tokens)``: every one of them must be recomputed, so
    ``h <= num_tokens - (W - 1)``. vLLM aligns the hit down to its block from there. With sinks every query
    also sees keys ``0 .. sink_tokens - 1``: only ``h = 0`` recomputes them.
    """
    return 0 if sink_tokens else first_visible_position(num_tokens, window)


def visible(
    query_position: torch.Tensor, key_position: torch.Tensor, window: int, causal: bool, sink_tokens: int = 0
) -> torch.Tensor:
    """The attention contract: ``k >= 0`` and (``q - k < W`` or ``k < sink_tokens``), plus ``k <= q`` (causal) or
    ``k - q < W``."""
    seen = ((query_position - key_position < window) | (key_position < sink_tokens)) & (key_position >= 0)
    if causal:
        return seen & (key_position <= query_position)
    return seen & (key_position - query_position < window)


@dataclass(frozen=True)
class RingPlan:
    """A per-request ring for one sliding-window layer group (or a full-attention group served on a bounded ring:
    a window plus sink tokens).

    Args:
        window: W, keys a query sees including itself.
        kv_block_size: bs, tokens per KV block.
        lookahead: la, the most positions one step writes at or past the context length
            (``num_speculative_tokens + 1`` for DFlash).
        sink_tokens: keys ``0 .. sink_tokens - 1`` every query sees besides its window (``0 .. W``; 0: none),
            held in ``sink_blocks`` blocks before the ring's R columns (module docstring).
    """

    window: int
    kv_block_size: int
    lookahead: int
    sink_tokens: int = 0

    def __post_init__(self) -> None:
        ring_blocks_needed(self.window, self.kv_block_size, self.lookahead)
        check_sink_tokens(self.sink_tokens, self.window)

    @classmethod
    def for_dflash(cls, window: int, kv_block_size: int, num_speculative_tokens: int) -> RingPlan:
        """The plan of a DFlash drafter: lookahead = ``num_speculative_tokens + 1``."""
        if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int):
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens!r} must be an int")
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} must be >= 0")
        return cls(window=window, kv_block_size=kv_block_size, lookahead=num_speculative_tokens + 1)

    @property
    def ring_blocks(self) -> int:
        """R, the ring's physical blocks per request."""
        return ring_blocks_needed(self.window, self.kv_block_size, self.lookahead)

    @property
    def num_slots(self) -> int:
        """The ring's slots, R * bs (the sink blocks apart)."""
        return self.ring_blocks * self.kv_block_size

    @property
    def sink_blocks(self) -> int:
        """ns, the blocks before the ring's columns that hold the sink tokens (0 without sinks)."""
        return sink_block_count(self.sink_tokens, self.kv_block_size)

    @property
    def row_blocks(self) -> int:
        """Columns of a compact row, ``[sink blocks | ring]``: ns + R."""
        return self.sink_blocks + self.ring_blocks

    def logical_blocks(self, num_tokens: int) -> int:
        """Logical blocks the positions ``0 .. num_tokens - 1`` span: ``cdiv(N, bs)``."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens} must be >= 0")
        return triton.cdiv(num_tokens, self.kv_block_size)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Physical blocks a request of ``num_tokens`` tokens holds: ``min(cdiv(N, bs), ns + R)``."""
        return min(self.logical_blocks(num_tokens), self.row_blocks)

    def first_visible_block(self, query_position: int) -> int:
        """The logical block of the lowest key the window shows a query at ``query_position``: blocks below it,
        the sink blocks aside, are dead to that query and to every later one."""
        return first_visible_position(query_position, self.window) // self.kv_block_size

    def hit_needs_block(self, logical_block: int, num_tokens: int) -> bool:
        """Whether a prefix hit reaching past ``logical_block`` on a request of ``num_tokens`` tokens must bring that
        block's K/V (the recompute of the rest does not write it, and the first query, at ``num_tokens``, or a later
        one sees it): a sink block, or one at or past ``first_visible_block(num_tokens)``. The blocks between are dead
        to every query the request makes."""
        return logical_block < self.sink_blocks or logical_block >= self.first_visible_block(num_tokens)

    def live_span(self, context_len: int) -> tuple[int, int]:
        """Half-open positions ``[max(0, P-(W-1)), P+la)`` one step at context_len ``P`` reads or writes."""
        if context_len < 0:
            raise ValueError(f"context_len={context_len} must be >= 0")
        return first_visible_position(context_len, self.window), context_len + self.lookahead

    def live_blocks(self, context_len: int) -> range:
        """Logical blocks the live span of a step at context_len ``P`` touches (at most R of them)."""
        lo, hi = self.live_span(context_len)
        return range(lo // self.kv_block_size, triton.cdiv(hi, self.kv_block_size))

    def check_step(self, query_len: int) -> None:
        """Raise if a step of ``query_len`` block tokens does not fit the ring's lookahead."""
        if query_len > self.lookahead:
            raise ValueError(
                f"query_len={query_len} exceeds the ring's lookahead la={self.lookahead} "
                f"(window={self.window}, kv_block_size={self.kv_block_size}, R={self.ring_blocks}); "
                f"plan the ring with lookahead >= {query_len}"
            )

    def slot_mapping(
        self,
        positions: torch.Tensor,
        block_table: torch.Tensor,
        *,
        request_index: torch.Tensor | None = None,
        seq_len: torch.Tensor | int | None = None,
        period: int | None = None,
    ) -> torch.Tensor:
        """Ring slot of every written position; ``PAD_SLOT`` (-1) for negative or dead positions.

        Args:
            positions: [T] absolute positions (int).
            block_table: [num_reqs, width] or [width] physical block ids; column = ``block_column(p // bs)``.
            request_index: [T] row of ``block_table`` per token (default row 0).
            seq_len: the batch's end (exclusive) per token ([T]) or for all; positions before
                ``seq_len - (W - 1)`` are dead and get PAD, but for the sink blocks' (``written``). ``None`` keeps
                every position.
            period: the ring's column period, default R (a compact row, ``[sink blocks | ring]``).

        Returns:
            [T] int64 slots ``block_id * bs + p mod bs``.
        """
        return table_slot_mapping(
            positions, block_table, kv_block_size=self.kv_block_size, window=self.window,
            period=self.ring_blocks if period is None else period,
            request_index=request_index, seq_len=seq_len, sink_tokens=self.sink_tokens,
        )  # fmt: skip


def slot_coordinates(slots: torch.Tensor, kv_block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat slots (``block_id * bs + offset``, >= 0) -> (block ids, in-block offsets)."""
    return torch.div(slots, kv_block_size, rounding_mode="floor"), torch.remainder(slots, kv_block_size)


def written(positions: torch.Tensor, seq_len: torch.Tensor | int, window: int, sink_end: int = 0) -> torch.Tensor:
    """Which rows of a write batch ending at ``seq_len`` (exclusive) are stored: ``p >= 0`` and not dead, i.e.
    ``p >= seq_len - (W - 1)`` (a later query may still see them) or ``p < sink_end`` (a sink block's position,
    which owns its slot for life: ``first_ring_position(sink_tokens, bs)``)."""
    return (positions >= 0) & ((positions >= seq_len - (window - 1)) | (positions < sink_end))


def pad_unwritten(
    slots: torch.Tensor, positions: torch.Tensor, seq_len: torch.Tensor | int, window: int, sink_end: int = 0
) -> torch.Tensor:
    """A caller's slot mapping (vLLM's) with PAD for the rows ``written`` rejects."""
    return torch.where(written(positions, seq_len, window, sink_end), slots, torch.full_like(slots, PAD_SLOT))


def table_slot_mapping(
    positions: torch.Tensor,
    block_table: torch.Tensor,
    *,
    kv_block_size: int,
    window: int,
    period: int,
    request_index: torch.Tensor | None = None,
    seq_len: torch.Tensor | int | None = None,
    sink_tokens: int = 0,
) -> torch.Tensor:
    """``block_table[row, position_column(p)] * bs + p mod bs``; PAD for ``p < 0`` and, given ``seq_len``, for dead
    positions (``written``; see ``RingPlan.slot_mapping``)."""
    table = block_table.reshape(-1, block_table.shape[-1]).to(torch.int64)
    rows = torch.zeros_like(positions) if request_index is None else request_index
    positions = positions.to(torch.int64)
    keep = positions >= 0
    if seq_len is not None:
        keep = written(positions, seq_len, window, first_ring_position(sink_tokens, kv_block_size))
    safe = torch.where(keep, positions, torch.zeros_like(positions))
    block_ids = table[rows.to(torch.int64), position_column(safe, kv_block_size, period, sink_tokens)]
    slots = block_ids * kv_block_size + torch.remainder(safe, kv_block_size)
    return torch.where(keep, slots, torch.full_like(slots, PAD_SLOT))


def varlen_positions(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token of a varlen batch: (request index, absolute position, the request's seq_len).

    Request ``r``'s tokens ``query_start_loc[r] .. query_start_loc[r+1]-1`` sit at positions
    ``seq_lens[r] - query_len .. seq_lens[r] - 1``. Tokens past ``query_start_loc[-1]`` get position -1.
    No host sync.
    """
    tokens = torch.arange(num_tokens, device=query_start_loc.device)
    request = torch.searchsorted(query_start_loc[1:].to(torch.int64), tokens, right=True)
    inside = tokens < query_start_loc[-1]
    request = torch.where(inside, request, torch.zeros_like(request)).clamp(max=seq_lens.shape[0] - 1)
    starts = query_start_loc[:-1].to(torch.int64)[request]
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int64)[request]
    ends = seq_lens.to(torch.int64)[request]
    positions = ends - query_lens + (tokens - starts)
    return request, torch.where(inside, positions, torch.full_like(positions, -1)), ends


def batch_live_slots(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    num_tokens: int,
    *,
    kv_block_size: int,
    window: int,
    period: int,
    slot_mapping: torch.Tensor | None = None,
    sink_tokens: int = 0,
) -> torch.Tensor:
    """Where a varlen batch's rows are stored after its attention (write-after-read): vLLM's ``slot_mapping`` when
    given, else the ring slots of ``block_table`` (``table_slot_mapping``); dead positions (``written``: before
    ``seq_lens[r] - (W - 1)`` and past the sink blocks) and all but the last writer of each slot PAD. No host
    sync."""
    request, positions, ends = varlen_positions(query_start_loc, seq_lens, num_tokens)
    if slot_mapping is not None:
        slots = pad_unwritten(
            slot_mapping[:num_tokens], positions, ends, window, first_ring_position(sink_tokens, kv_block_size)
        )
    else:
        slots = table_slot_mapping(
            positions, block_table, kv_block_size=kv_block_size, window=window, period=period, request_index=request,
            seq_len=ends, sink_tokens=sink_tokens,
        )  # fmt: skip
    return last_writer_slots(slots)


def last_writer_slots(slot_mapping: torch.Tensor) -> torch.Tensor:
    """PAD every row whose slot a later row of the same batch also writes; keep the last writer.

    A request's rows arrive in position order, so of two rows sharing a ring slot (positions ``p`` and
    ``p + k*S``) the later one is the live one. ``ring_write`` stores rows in parallel; without this, a
    block-table entry made before a long prefill chunk (the previous step's partial or lookahead block)
    could let a dead row race a live one. Sort-based, no host sync.

    Args:
        slot_mapping: [T] int slots, ``< 0`` = PAD.

    Returns:
        [T] the same dtype, duplicates but the last PADded.
    """
    if slot_mapping.numel() <= 1:
        return slot_mapping
    order = torch.argsort(slot_mapping, stable=True)
    ordered = slot_mapping[order]
    last = torch.ones_like(ordered, dtype=torch.bool)
    last[:-1] = ordered[1:] != ordered[:-1]
    keep = torch.empty_like(last)
    keep[order] = last
    return torch.where(keep, slot_mapping, torch.full_like(slot_mapping, PAD_SLOT))
