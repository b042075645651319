# SPDX-License-Identifier: Apache-2.0
"""The differential suite's machinery (``test_differential.py``): a case as a pure function of its seed (``draw``),
the ring model of one case (``RingWorld``: rings, the dense history the oracle reads, which row each slot holds),
and one attention launch checked against the oracle and the pool model (``attend``)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import triton
from ringkv.kernels import BatchMode, RingPlan, VarlenBatch, ring_attention, ring_write
from ringkv.kernels.configs import MAX_SPLITS
from ringkv.kernels.kv_quant import dequantize, quantize_fp8
from ringkv.kernels.ring_geometry import PAD_SLOT, UNBOUNDED_WINDOW
from ringkv.kernels.testing import attention_error
from ringkv.kernels.validation import KV_STRIDE_ELEMENTS
from ringkv.kernels.varlen import MAX_QUERY_LEN, MAX_SEQ_LEN

from tests.testing import NAN, assert_attention_close, oracle_pair

HEAD_DIMS = (1, 3, 8, 15, 16, 24, 33, 59, 64, 80, 96, 100, 111, 128, 160, 200, 255, 256)
BLOCK_SIZES = (1, 8, 16, 32)
LAYOUTS = ("separate", "BHN", "BNH")
INDEX_DTYPES = (torch.int32, torch.int64)
# the CI tier's most (launches, attention work, tile height) per case; the slow tier draws without a limit
CI_COST = (10, 100_000, 128)


@dataclass(frozen=True)
class Draw:
    """One case. ``launches[i][r]``: rows of request ``r`` in launch ``i`` (chunk rows for ``write``, the draft
    block for ``attention``, the chunk for ``prefill``); request ``r``'s history is written from ``firsts[r]`` up
    to ``contexts[r]`` before the first launch, in ``ring_write`` launches of up to ``history_chunk`` rows."""

    kernel: str
    dtype: torch.dtype
    seed: int
    fp8_dtype: torch.dtype | None  # the fp8 cache dtype, None: the cache holds ``dtype``
    num_kv_heads: int
    group: int
    head_dim: int
    head_dim_v: int
    kv_block_size: int
    window: int
    causal: bool
    lookahead: int
    firsts: tuple[int, ...]
    contexts: tuple[int, ...]
    launches: tuple[tuple[int, ...], ...]
    history_chunk: int
    full_rows: bool
    index_dtype: torch.dtype
    slot_dtype: torch.dtype
    layout: str
    num_splits: int | None
    vllm_slots: bool
    write_last: bool
    pad_tokens: int
    spare_blocks: int
    sink_tokens: int = 0

    def __str__(self) -> str:
        fields = ", ".join(f"{k}={v}" for k, v in self.__dict__.items() if k not in ("kernel", "seed"))
        return f"{self.kernel} case seed {self.seed}: {fields}"


def draw_rows(rng: random.Random, kernel: str, slots: int) -> int:
    """Rows of one request in one launch (0 = a request without queries in this batch)."""
    if kernel == "attention":
        return rng.choice([0, 1, rng.randint(1, 8), rng.randint(1, 16), rng.randint(1, MAX_QUERY_LEN)])
    return rng.choice([0, 1, rng.randint(1, 24), rng.randint(1, 2 * slots + 3)])


def draw(
    kernel: str, dtype: torch.dtype, seed: int, *, ci: bool, fp8_dtype: torch.dtype | None = None, sinks: bool = False
) -> Draw:
    """The case of ``seed`` (everything random comes from here). The CI tier redraws (from the same stream) until
    the case is cheap under the interpreter: few history launches, little attention work. ``sinks``: a layer with
    attention sinks (its history then starts at position 0)."""
    rng = random.Random(seed)
    while True:
        d = draw_once(rng, kernel, dtype, seed, fp8_dtype, sinks)
        if not ci or within(interpreter_cost(d), CI_COST):
            return d


def interpreter_cost(d: Draw) -> tuple[int, int, int]:
    """(launches, query rows x query heads x (D + Dv), one request's rows x G): what the interpreter's time grows
    with (the last is a draft block's tile height)."""
    history = max(triton.cdiv(c - f, d.history_chunk) for f, c in zip(d.firsts, d.contexts, strict=True))
    rows = sum(sum(step) for step in d.launches)
    tile = max(max(step) for step in d.launches) * d.group
    return history + len(d.launches), rows * d.num_kv_heads * d.group * (d.head_dim + d.head_dim_v), tile


def within(cost: tuple[int, ...], limit: tuple[int, ...]) -> bool:
    return all(c <= m for c, m in zip(cost, limit, strict=True))


def draw_once(
    rng: random.Random, kernel: str, dtype: torch.dtype, seed: int, fp8_dtype: torch.dtype | None, sinks: bool
) -> Draw:
    """One draw from ``rng`` (without sinks, the same draws as before sinks existed)."""
    kv_block_size = rng.choice(BLOCK_SIZES)
    num_reqs = rng.randint(1, 4 if kernel == "write" else 3)
    num_steps = 1 if kernel == "attention" else rng.randint(1, 2 if kernel == "prefill" else 3)
    full_rows = rng.random() < 0.4
    kind = rng.choice(["small", "edge", "mid", "mid", "beyond"])
    window = {
        "small": rng.randint(1, 4),
        "edge": max(
            1, rng.choice([kv_block_size - 1, kv_block_size, kv_block_size + 1, 2 * kv_block_size + 1, 15, 16, 17])
        ),
        "mid": rng.randint(5, 90),
        "beyond": 0,  # set once the positions are known
    }[kind]
    # the ring's slots for a window of this size (an estimate for "beyond": the sequences are short there)
    slots = (triton.cdiv(max(window, 64) + 16, kv_block_size) + 1) * kv_block_size
    launches = tuple(tuple(draw_rows(rng, kernel, slots) for _ in range(num_reqs)) for _ in range(num_steps))
    total = [sum(step[r] for step in launches) for r in range(num_reqs)]
    # near MAX_SEQ_LEN (not with sinks: their history starts at 0)
    deep = kind != "beyond" and not full_rows and rng.random() < 0.15 and not sinks
    contexts, firsts = [], []
    for r in range(num_reqs):
        if kind == "beyond":
            context = rng.choice([0, 1, rng.randint(0, 40), rng.randint(0, 120)])
        elif deep:
            context = MAX_SEQ_LEN - total[r] - rng.choice([0, 0, rng.randint(0, 3 * kv_block_size)])
        else:
            edges = [0, 1, window - 1, window, window + 1, rng.randint(0, 3 * slots)]
            edges.append(rng.randint(1, 3) * slots + rng.choice([-1, 0, 1, rng.randint(0, slots)]))
            context = max(0, rng.choice(edges))
        contexts.append(context)
    if kind == "beyond":
        longest = max(c + t for c, t in zip(contexts, total, strict=True))
        window = rng.choice([UNBOUNDED_WINDOW, 2**31 - 1, 2**31, MAX_SEQ_LEN, longest + rng.randint(0, 20)])
        full_rows = full_rows or window > 4 * 1024
    for context in contexts:
        # the window of the first query, and up to two rings more: history chunks wrap the ring
        extra = 0 if kind == "beyond" else rng.choice([0, rng.randint(0, 2 * slots + 5)])
        firsts.append(max(0, context - (window - 1) - extra) if kind != "beyond" else 0)
    most_rows = max(max(step) for step in launches)
    lookahead = (most_rows if kernel == "attention" else 1) + rng.choice([0, 0, 1, 3])
    sink_tokens = 0
    if sinks:
        # one sink, a whole block of them, or up to three blocks and a bit: within the window; the history from 0
        sink_tokens = min(window, rng.choice([1, kv_block_size, rng.randint(1, 3 * kv_block_size + 2)]))
        firsts = [0] * num_reqs
    return Draw(
        kernel=kernel, dtype=dtype, seed=seed, fp8_dtype=fp8_dtype, num_kv_heads=rng.choice([1, 1, 2, 3]),
        group=rng.choice([1, 2, 3, 4, 5, 8, 16, rng.randint(1, 16)]), head_dim=(d := rng.choice(HEAD_DIMS)),
        head_dim_v=d if rng.random() < 0.5 else rng.choice(HEAD_DIMS), kv_block_size=kv_block_size, window=window,
        causal=rng.random() < 0.5, lookahead=max(1, lookahead), firsts=tuple(firsts), contexts=tuple(contexts),
        launches=launches, history_chunk=rng.choice([1, rng.randint(1, slots), rng.randint(slots, 3 * slots)]),
        full_rows=full_rows, index_dtype=rng.choice(INDEX_DTYPES), slot_dtype=rng.choice(INDEX_DTYPES),
        layout=rng.choice(LAYOUTS), num_splits=rng.choice([None, None, 1, 2, 3, rng.randint(1, MAX_SPLITS)]),
        vllm_slots=rng.random() < 0.5, write_last=rng.random() < 0.7, pad_tokens=rng.choice([0, 1, 3]),
        spare_blocks=rng.randint(0, 3), sink_tokens=sink_tokens,
    )  # fmt: skip


def padded(dim: int) -> int:
    """A head dim padded to the kernels' 16-element strides (the pad is a NaN guard band)."""
    return triton.cdiv(dim, KV_STRIDE_ELEMENTS) * KV_STRIDE_ELEMENTS


def kv_pool(
    layout: str,
    num_blocks: int,
    kv_block_size: int,
    heads: int,
    head_dim: int,
    head_dim_v: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """NaN storage and its K/V ``[num_blocks, bs, H, D|Dv]`` views: ``separate`` tensors, or one vLLM per-layer
    tensor ``[num_blocks, H, N, D' + Dv']`` with heads outer (``BHN``) or slots outer (``BNH``)."""
    dp, dvp = padded(head_dim), padded(head_dim_v)
    if layout == "separate":
        k_store = torch.full((num_blocks, kv_block_size, heads, dp), NAN, dtype=dtype, device=device)
        v_store = torch.full((num_blocks, kv_block_size, heads, dvp), NAN, dtype=dtype, device=device)
        return [k_store, v_store], k_store[..., :head_dim], v_store[..., :head_dim_v]
    if layout == "BHN":
        store = torch.full((num_blocks, heads, kv_block_size, dp + dvp), NAN, dtype=dtype, device=device)
        return [store], store[..., :head_dim].transpose(1, 2), store[..., dp : dp + head_dim_v].transpose(1, 2)
    store = torch.full((num_blocks, kv_block_size, heads, dp + dvp), NAN, dtype=dtype, device=device)
    return [store], store[..., :head_dim], store[..., dp : dp + head_dim_v]


def view_of(storage: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``like``'s view (its shape, strides and offset) into ``storage``, a copy of ``like``'s storage tensor."""
    return storage.as_strided(like.shape, like.stride(), like.storage_offset())


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits (NaN compares equal to the same NaN)."""
    return tensor.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[tensor.element_size()])


class RingWorld:
    """The rings of one case, the dense history the oracle reads, and the model of the pool.

    ``model`` maps a flat slot to the ``(request, position)`` whose row it must hold; every other byte of the pool
    must be NaN. Slots are computed here from the contract, ``table[column(p // bs)] * bs + p mod bs`` with
    ``column(j) = j mod period`` (or, with sinks, ``j`` for the ``ns`` sink blocks and ``ns + (j - ns) mod period``
    after them), and a batch ending at ``end`` stores exactly its positions ``>= end - (W - 1)`` and those of the
    sink blocks: neither comes from ``ring_geometry``.
    """

    def __init__(self, d: Draw, device: torch.device) -> None:
        self.d, self.device = d, device
        generator = torch.Generator().manual_seed(d.seed)
        bs, num_reqs = d.kv_block_size, len(d.contexts)
        self.plan = RingPlan(d.window, bs, d.lookahead, d.sink_tokens)
        self.sink_blocks = triton.cdiv(d.sink_tokens, bs)
        # compact rows hold R columns after the sink blocks; a full row over a window past every position is a
        # plain row (never wraps)
        self.ring_blocks = min(self.plan.ring_blocks, self.span_blocks()) if d.full_rows else self.plan.ring_blocks
        row_blocks = self.sink_blocks + self.ring_blocks
        num_blocks = 1 + num_reqs * row_blocks + d.spare_blocks
        self.cache_dtype = d.fp8_dtype or d.dtype
        self.storage, self.k_cache, self.v_cache = kv_pool(d.layout, num_blocks, bs, d.num_kv_heads, d.head_dim,
                                                           d.head_dim_v, self.cache_dtype, device)  # fmt: skip
        # block 0 is the null block (NaN); rows are random distinct blocks, the spare ones stay NaN
        physical = torch.randperm(num_blocks - 1, generator=generator)[: num_reqs * row_blocks] + 1
        self.rings = physical.view(num_reqs, row_blocks).tolist()
        ends = [c + sum(step[r] for step in d.launches) for r, c in enumerate(d.contexts)]
        self.width = max(triton.cdiv(end, bs) for end in ends) + 2 if d.full_rows else row_blocks
        self.k_hist, self.v_hist = [], []
        for first, end in zip(d.firsts, ends, strict=True):
            shape = (end - first, d.num_kv_heads)
            self.k_hist.append(torch.randn(*shape, d.head_dim, generator=generator).to(d.dtype))
            self.v_hist.append(torch.randn(*shape, d.head_dim_v, generator=generator).to(d.dtype))
        self.model: dict[int, tuple[int, int]] = {}
        # an fp8 ring's per-layer scales: randn rows over most of the fp8 range (a few e4m3 ones saturate)
        self.scales: dict[str, torch.Tensor] = {}
        if d.fp8_dtype is not None:
            self.scales = {name: (torch.rand(1, generator=generator) * 0.05 + 0.005).to(device)
                           for name in ("k_scale", "v_scale")}  # fmt: skip

    def span_blocks(self) -> int:
        """Blocks that hold every position the case reaches (logical blocks 0 .. triton.cdiv(end, bs))."""
        ends = [c + sum(step[r] for step in self.d.launches) for r, c in enumerate(self.d.contexts)]
        return max(triton.cdiv(end, self.d.kv_block_size) for end in ends) + 1

    def row(self, request: int, lowest: int) -> list[int]:
        """The block-table row of ``request`` for a launch whose lowest visible window position is ``lowest``:
        compact ``ns + R`` columns, or a full logical row with the sink blocks first and every other block wholly
        before ``lowest`` on the null block 0."""
        ring, ns = self.rings[request], self.sink_blocks
        if not self.d.full_rows:
            return list(ring)
        dead = lowest // self.d.kv_block_size
        return [ring[j] if j < ns else 0 if j < dead else ring[ns + (j - ns) % self.ring_blocks]
                for j in range(self.width)]  # fmt: skip

    def table(self, rows: list[list[int]]) -> tuple[torch.Tensor, int | None]:
        """The launch's block table, a view into a wider table whose guard columns and row point at block 0."""
        dtype = self.d.index_dtype
        store = torch.zeros(len(rows) + 1, self.width + 3, dtype=dtype)
        store[: len(rows), : self.width] = torch.tensor(rows, dtype=dtype)
        return store.to(self.device)[: len(rows), : self.width], None if self.d.full_rows else self.ring_blocks

    @property
    def period(self) -> int:
        """The block-table column period: R for compact rows, the row width for full rows."""
        return self.width if self.d.full_rows else self.ring_blocks

    def slot(self, row: list[int], position: int) -> int:
        bs, ns = self.d.kv_block_size, self.sink_blocks
        j = position // bs
        return row[j if j < ns else ns + (j - ns) % self.period] * bs + position % bs

    def record(self, request: int, row: list[int], positions: range, end: int) -> None:
        """The model after a write of ``positions`` (in order) by a batch ending at ``end``."""
        for p in positions:
            if p >= end - (self.d.window - 1) or p < self.sink_blocks * self.d.kv_block_size:
                self.model[self.slot(row, p)] = (request, p)

    def rows(self, request: int, positions: range) -> tuple[torch.Tensor, torch.Tensor]:
        first = self.d.firsts[request]
        lo, hi = positions.start - first, positions.stop - first
        return self.k_hist[request][lo:hi], self.v_hist[request][lo:hi]

    def expected_pool(self) -> list[torch.Tensor]:
        d = self.d
        storage, k_cache, v_cache = kv_pool(d.layout, self.k_cache.shape[0], d.kv_block_size, d.num_kv_heads,
                                            d.head_dim, d.head_dim_v, self.cache_dtype,
                                            torch.device("cpu"))  # fmt: skip
        for slot, (request, p) in self.model.items():
            k, v = self.held(request, range(p, p + 1))
            k_cache[slot // d.kv_block_size, slot % d.kv_block_size] = k[0]
            v_cache[slot // d.kv_block_size, slot % d.kv_block_size] = v[0]
        return storage

    def held(self, request: int, positions: range) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows as the ring stores them: the history's, or its ``quantize_fp8`` bytes in an fp8 ring."""
        k, v = self.rows(request, positions)
        if not self.scales:
            return k, v
        scales = (self.scales["k_scale"].cpu(), self.scales["v_scale"].cpu())
        return tuple(quantize_fp8(x, scale, self.cache_dtype) for x, scale in zip((k, v), scales, strict=True))

    def oracle_history(self) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Each request's history as attention reads it from the ring (dequantized in fp64 for an fp8 ring)."""
        histories = []
        for r, first in enumerate(self.d.firsts):
            k, v = self.held(r, range(first, first + len(self.k_hist[r])))
            if self.scales:
                k, v = dequantize(k, self.scales["k_scale"].cpu()), dequantize(v, self.scales["v_scale"].cpu())
            histories.append((first, k, v))
        return histories

    def check_pool(self, after: str) -> None:
        """The whole pool, padding included, byte for byte against the model."""
        for got, want in zip(self.storage, self.expected_pool(), strict=True):
            if torch.equal(bits(got.cpu()), bits(want)):
                continue
            bs = self.d.kv_block_size
            for cache, name in ((self.k_cache, "K"), (self.v_cache, "V")):
                if cache.untyped_storage().data_ptr() != got.untyped_storage().data_ptr():
                    continue
                # [num_blocks, bs] slots whose row differs
                differs = (bits(cache.cpu()) != bits(view_of(want, cache))).flatten(2).any(-1).nonzero()
                if len(differs):
                    blk, off = differs[0].tolist()
                    holder = self.model.get(blk * bs + off)
                    must = f"request {holder[0]} position {holder[1]}" if holder else "NaN (no live position there)"
                    raise AssertionError(
                        f"after {after}: {len(differs)} {name} slots differ from the model; first: slot "
                        f"{blk * bs + off} (block {blk}, row {off}) must hold {must}\n{self.d}"
                    )
            raise AssertionError(f"after {after}: the pool's guard padding changed\n{self.d}")

    def poison(self, reads: list[tuple[range, ...]]) -> None:
        """NaN into every slot whose position no query of the next launch may read (``reads[r]``: its sinks below
        the window, its window)."""
        bs = self.d.kv_block_size
        for slot, (request, p) in list(self.model.items()):
            if not any(p in read for read in reads[request]):
                del self.model[slot]
                self.k_cache[slot // bs, slot % bs] = NAN
                self.v_cache[slot // bs, slot % bs] = NAN

    def write_history(self) -> None:
        """Positions ``firsts[r] .. contexts[r] - 1`` through ``ring_write``, ``history_chunk`` rows of each request
        per launch, slots from ``RingPlan.slot_mapping`` (dead positions PAD); the pool is checked after each."""
        d = self.d
        cursors = list(d.firsts)
        while any(c < end for c, end in zip(cursors, d.contexts, strict=True)):
            spans = [range(c, min(c + d.history_chunk, end)) for c, end in zip(cursors, d.contexts, strict=True)]
            self.write(spans, [s.stop for s in spans], after=f"history rows {spans}")
            cursors = [s.stop for s in spans]

    def write(self, spans: list[range], ends: list[int], *, after: str) -> None:
        """One ``ring_write`` launch of every request's ``spans`` (batch ends ``ends``) plus NaN PAD rows."""
        d = self.d
        rows = [self.row(r, max(0, end - (d.window - 1))) for r, end in enumerate(ends)]
        table, _ = self.table(rows)
        k = torch.cat([self.rows(r, span)[0] for r, span in enumerate(spans)])
        v = torch.cat([self.rows(r, span)[1] for r, span in enumerate(spans)])
        positions = torch.cat([torch.arange(s.start, s.stop) for s in spans])
        request = torch.cat([torch.full((len(s),), r) for r, s in enumerate(spans)])
        ends_per_row = torch.tensor(ends)[request]
        slots = self.plan.slot_mapping(positions.to(self.device), table, request_index=request.to(self.device),
                                       seq_len=ends_per_row.to(self.device), period=self.period)  # fmt: skip
        pad = d.pad_tokens
        k = torch.cat([k, torch.full((pad, *k.shape[1:]), NAN, dtype=d.dtype)])
        v = torch.cat([v, torch.full((pad, *v.shape[1:]), NAN, dtype=d.dtype)])
        slots = torch.cat([slots, torch.full((pad,), PAD_SLOT, device=self.device)]).to(d.slot_dtype)
        ring_write(k.to(self.device), v.to(self.device), self.k_cache, self.v_cache, slots, **self.scales)
        for r, span in enumerate(spans):
            self.record(r, rows[r], span, ends[r])
        self.check_pool(after)

    def batch_inputs(self, lens: tuple[int, ...], contexts: list[int]):
        """q / k_new / v_new (NaN padding rows past the batch) and the per-request spans of a launch."""
        d = self.d
        generator = torch.Generator().manual_seed(d.seed + sum(contexts))
        spans = [range(c, c + n) for c, n in zip(contexts, lens, strict=True)]
        num_tokens = sum(lens)
        q = torch.randn(num_tokens + d.pad_tokens, d.num_kv_heads * d.group, d.head_dim, generator=generator)
        q = q.to(d.dtype)
        q[num_tokens:] = NAN
        k_new = torch.cat([self.rows(r, s)[0] for r, s in enumerate(spans)])
        v_new = torch.cat([self.rows(r, s)[1] for r, s in enumerate(spans)])
        k_new = torch.cat([k_new, torch.full((d.pad_tokens, *k_new.shape[1:]), NAN, dtype=d.dtype)])
        v_new = torch.cat([v_new, torch.full((d.pad_tokens, *v_new.shape[1:]), NAN, dtype=d.dtype)])
        return q, k_new, v_new, spans

    def locate(self, token: int, spans: list[range]) -> str:
        """Request, absolute position and (for context keys) ring slot of an output row."""
        start = 0
        for r, span in enumerate(spans):
            if token < start + len(span):
                p = span.start + token - start
                return f"request {r}, query {token - start}, position {p}"
            start += len(span)
        return f"padding row {token}"


def attend(world: RingWorld, lens: tuple[int, ...], contexts: list[int], *, prefill: bool, write: bool) -> None:
    """One attention launch over the world's rings, checked against the oracle and the pool model."""
    d = world.d
    windows = [range(max(0, c - (d.window - 1)), c) for c in contexts]
    world.poison([(range(min(d.sink_tokens, read.start)), read) for read in windows])
    q, k_new, v_new, spans = world.batch_inputs(lens, contexts)
    rows = [world.row(r, read.start) for r, read in enumerate(windows)]
    table, period = world.table(rows)
    idx = d.index_dtype
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=idx)
    seq_lens = torch.tensor([s.stop for s in spans], dtype=idx)
    mode = BatchMode.PREFILL_CHUNK if prefill else BatchMode.DRAFT_BLOCK
    batch = VarlenBatch.build(starts.to(world.device), seq_lens.to(world.device), table, mode=mode,
                              max_query_len=max(1, *lens), table_period=period)  # fmt: skip
    out = torch.full((q.shape[0], q.shape[1], d.head_dim_v), NAN, dtype=d.dtype, device=world.device)
    args = {"q": q.to(world.device), "k_new": k_new.to(world.device), "v_new": v_new.to(world.device),
            "k_cache": world.k_cache, "v_cache": world.v_cache, "batch": batch, "window": d.window,
            "causal": d.causal, "sink_tokens": d.sink_tokens, "out": out, **world.scales}  # fmt: skip
    launch = f"ring_attention ({mode.value}) of {lens} at {contexts}"
    if prefill:
        slot_mapping = None
        if write and d.vllm_slots:
            # vLLM's own mapping: every row through the launch's row (a chunk longer than the ring repeats slots)
            slots = [world.slot(rows[r], p) for r, span in enumerate(spans) for p in span] + [PAD_SLOT] * d.pad_tokens
            slot_mapping = torch.tensor(slots, dtype=d.slot_dtype, device=world.device)
        ring_attention(**args, write_ring=write, slot_mapping=slot_mapping)
    else:
        ring_attention(**args, num_splits=d.num_splits)
    num_tokens = sum(lens)
    ref_hi, ref_lo = oracle_pair(q, k_new, v_new, world.oracle_history(), starts, seq_lens, window=d.window,
                                 causal=d.causal, sink_tokens=d.sink_tokens)  # fmt: skip
    got = out.cpu()
    try:
        assert_attention_close(got[:num_tokens], ref_hi[:num_tokens], ref_lo[:num_tokens], name=launch)
    except AssertionError as error:
        report = attention_error(got[:num_tokens], ref_hi[:num_tokens], ref_lo[:num_tokens])
        where = world.locate(report.worst_index[0], spans) if report.worst_index else ""
        raise AssertionError(f"{error}\nworst at {where}\n{d}") from None
    assert bits(got[num_tokens:]).eq(bits(torch.full_like(got[num_tokens:], NAN))).all(), (
        f"{launch} wrote padding rows past query_start_loc[-1]\n{d}"
    )
    if write:
        for r, span in enumerate(spans):
            world.record(r, rows[r], span, span.stop)
    world.check_pool(after=launch)
