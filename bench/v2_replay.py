# SPDX-License-Identifier: Apache-2.0
"""vLLM Model Runner V2's DFlash drafter step on the ring backend, without vLLM (issue 13, deliverable 4).

The GPU machine has torch and triton but no vLLM, so this drives the kernel calls ``RingKVImpl`` makes
(``integration/vllm/backend_step.py`` and ``ring_attention``) with the inputs V2's DFlash speculator hands the backend
(as read in vLLM 0.34's ``vllm/v1/worker/gpu/spec_decode/dflash/speculator.py`` and ``cudagraph.py``):

- inputs: persistent ``query_start_loc``, ``seq_lens``, block table and context slots sized for the graph's
  requests; a request's ``1 + N`` queries at ``P .. P + N``, ``seq_len = P + 1 + N``; padded requests repeat the
  last ``query_start_loc`` and get ``seq_len`` 0 and a zeroed block row; ``max_seq_len = max_model_len``.
- context store: the context K/V of the target step's ``1 + N`` rows through ``do_kv_cache_update``, rejected rows and
  rows of padded requests PAD; a request's first chunk stored eagerly past the graph's rows (superseded
  duplicates: ``last_writer_slots``).
- CUDA graph: on CUDA the store and the draft-block attention are captured once in a ``torch.cuda.CUDAGraph`` on
  ``_prepare_dflash_inputs_to_capture``'s dummy inputs (``seq_len = query_len``, zeroed rows, PAD slots); each
  step rewrites the buffers in place, fewer active requests than captured included, and replays.
- block table: rows ``cdiv(max_model_len, bs)`` wide, ``ring[j mod R]`` in column ``j``, the sliding-window
  gather's columns below ``(num_computed_tokens - (W - 1)) // bs`` nulled to block 0.

Each step's replay is compared bitwise with an eager launch on the same inputs and ring, with the fp64 dense
oracle (``kernels/testing.py``'s rule), and the ring must differ from its state before the step only at the
slots of this step's accepted context rows, which hold those rows. ``smoke``: the same steps eagerly on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
from ringkv.integration.vllm.backend_step import split_kv_cache, store_rows, vllm_batch
from ringkv.kernels import ring_attention
from ringkv.kernels.attention import SplitWorkspace
from ringkv.kernels.oracle import oracle_pair
from ringkv.kernels.ring_geometry import (
    PAD_SLOT,
    UNBOUNDED_WINDOW,
    block_column,
    table_slot_mapping,
)
from ringkv.kernels.testing import DrafterShape, attention_error

# (graph request counts, steps per graph, max_model_len, first-chunk rows): GPU, and the CPU smoke
GPU_SIZES = ((1, 8, 32), 4, 262_144, 3000)
SMOKE_SIZES = ((1, 3), 3, 256, 70)


@dataclass
class Request:
    """A request's ring and its dense history (positions ``first .. context_len - 1``)."""

    ring: torch.Tensor  # [R] int32 block ids
    first: int
    k_hist: torch.Tensor  # [L, Hkv, D]
    v_hist: torch.Tensor  # [L, Hkv, D]
    # the last target step's num_computed_tokens: what V2's gather nulls the window against
    step_start: int

    @property
    def context_len(self) -> int:
        return self.first + self.k_hist.shape[0]


class Step:
    """One drafter layer's persistent inputs for a graph of ``num_reqs`` requests (V2's ``InputBuffers`` and
    ``BlockTables``) and the captured call on them."""

    def __init__(self, shape: DrafterShape, num_reqs: int, max_model_len: int, dtype: torch.dtype, device) -> None:
        self.shape, self.num_reqs, self.max_model_len = shape, num_reqs, max_model_len
        la, hq, hkv, d = shape.lookahead, shape.num_q_heads, shape.num_kv_heads, shape.head_dim
        tokens = num_reqs * la
        self.query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(num_reqs, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(num_reqs, triton.cdiv(max_model_len, shape.kv_block_size), dtype=torch.int32,
                                       device=device)  # fmt: skip
        # the target step's rows (context K/V and slots), then the draft block's q/k/v and output
        self.ctx_slots = torch.full((tokens,), PAD_SLOT, dtype=torch.int64, device=device)
        self.ctx_k, self.ctx_v, self.k, self.v = (torch.zeros(tokens, hkv, d, dtype=dtype, device=device)
                                                  for _ in range(4))  # fmt: skip
        self.q, self.out = (torch.zeros(tokens, hq, d, dtype=dtype, device=device) for _ in range(2))
        # the builder's scratch (RingAttentionMetadata.workspace): the captured launch allocates nothing
        self.workspace = SplitWorkspace()

    def run(self, kv_cache: torch.Tensor, out: torch.Tensor) -> None:
        """``_prepare_graph_forward``'s context store, then the draft layer's ``forward``."""
        k_cache, v_cache = split_kv_cache(kv_cache, self.shape.head_dim)
        store_rows(self.ctx_k, self.ctx_v, k_cache, v_cache, self.ctx_slots)
        batch = vllm_batch(self.query_start_loc, self.seq_lens, self.block_table, self.shape.lookahead,
                           self.max_model_len)  # fmt: skip
        ring_attention(self.q, self.k, self.v, k_cache, v_cache, batch, window=self.shape.window, causal=False,
                       scale=self.shape.head_dim**-0.5, out=out, workspace=self.workspace)  # fmt: skip

    def capture(self, kv_cache: torch.Tensor) -> Callable[[], None]:
        """The FULL draft graph on the capture-time dummy inputs (one eager warm-up first, as V2's capture)."""
        self.query_start_loc.copy_(torch.arange(self.num_reqs + 1, device=self.q.device) * self.shape.lookahead)
        self.seq_lens.fill_(self.shape.lookahead)
        self.block_table.zero_()
        self.ctx_slots.fill_(PAD_SLOT)
        self.run(kv_cache, self.out)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.run(kv_cache, self.out)
        return graph.replay


def gathered_row(request: Request, shape: DrafterShape, width: int, context_len: int) -> torch.Tensor:
    """V2's gathered block-table row ``[width]``: ``ring[j mod R]`` for the columns the manager appended (context
    and lookahead), 0 past them and below the sliding-window gather's ``num_null``."""
    columns = torch.arange(width, device=request.ring.device)
    num_null = shape.plan.first_visible_block(request.step_start)
    allocated = triton.cdiv(context_len + shape.lookahead, shape.kv_block_size)
    row = request.ring[block_column(columns, len(request.ring))]
    return torch.where((columns >= num_null) & (columns < allocated), row, torch.zeros_like(row))


def prepared_slots(row: torch.Tensor, positions: torch.Tensor, kv_block_size: int) -> torch.Tensor:
    """The prepare kernel's slots over a full logical row (``table_slot_mapping``, period = the row's width), PAD
    for a null block (id 0)."""
    slots = table_slot_mapping(
        positions, row, kv_block_size=kv_block_size, window=UNBOUNDED_WINDOW, period=row.shape[-1]
    )
    return torch.where((slots >= 0) & (slots < kv_block_size), PAD_SLOT, slots)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (NaN included)."""
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(bits), b.view(bits))


def ring_changes_ok(before: torch.Tensor, after: torch.Tensor, slots: torch.Tensor, k_rows, v_rows) -> bool:
    """The ring changed exactly where ``slots`` (the accepted context rows) point, and holds those rows there."""
    head_size = k_rows.shape[-1]
    # [num_blocks * bs, Hkv, D + Dv]
    flat_before, flat_after = (c.transpose(1, 2).reshape(-1, *c.shape[1:2], c.shape[-1]) for c in (before, after))
    bits = {2: torch.int16, 4: torch.int32}[before.element_size()]
    changed = (flat_before.view(bits) != flat_after.view(bits)).flatten(1).any(1).nonzero()[:, 0]
    if not torch.equal(changed.sort().values, slots.sort().values):
        return False
    stored = flat_after[slots]
    return bitwise_equal(stored[..., :head_size], k_rows) and bitwise_equal(stored[..., head_size:], v_rows)


def replay_graph(shape: DrafterShape, num_reqs: int, sizes: tuple, dtype: torch.dtype, device, seed: int) -> list:
    """Rows of one graph size: the first chunks, the capture, then ``steps`` rewritten-and-replayed steps."""
    _, steps, max_model_len, first_chunk = sizes
    generator = torch.Generator(device=device).manual_seed(seed)
    la, bs, hkv, d = shape.lookahead, shape.kv_block_size, shape.num_kv_heads, shape.head_dim

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator, device=device).to(dtype)

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (1,), generator=generator, device=device))

    step = Step(shape, num_reqs, max_model_len, dtype, device)
    width = step.block_table.shape[1]
    num_blocks_per_ring = shape.plan.ring_blocks
    pool = num_reqs + 1
    # [blocks, Hkv, bs, D + Dv] (vLLM's layout), block 0 the null block; NaN where nothing was stored
    kv_cache = torch.full((1 + pool * num_blocks_per_ring, hkv, bs, 2 * d), float("nan"), dtype=dtype, device=device)
    rings = (torch.randperm(pool * num_blocks_per_ring, generator=generator, device=device) + 1).to(torch.int32)
    requests = []
    for ring in rings.view(pool, num_blocks_per_ring):
        # a first chunk longer than the ring: its early rows alias live slots and are superseded
        context_len = randint(first_chunk, max_model_len - (steps + 2) * la)
        first = context_len - first_chunk
        request = Request(ring, first, randn(first_chunk, hkv, d), randn(first_chunk, hkv, d), step_start=first)
        slots = prepared_slots(gathered_row(request, shape, width, context_len),
                               torch.arange(first, context_len, device=device), bs)  # fmt: skip
        store_rows(request.k_hist, request.v_hist, *split_kv_cache(kv_cache, request.k_hist.shape[-1]), slots)
        requests.append(request)
    replay = step.capture(kv_cache) if device.type == "cuda" else (lambda: step.run(kv_cache, step.out))
    rows = []
    for index in range(steps):
        active = (num_reqs, 1, max(1, num_reqs - 1))[index % 3]
        batch = [requests[i] for i in torch.randperm(pool, generator=generator, device=device)[:active].tolist()]
        for buffer in (step.ctx_k, step.ctx_v, step.q, step.k, step.v, step.out):
            buffer.fill_(float("nan"))
        step.ctx_slots.fill_(PAD_SLOT)
        step.seq_lens.zero_()
        step.block_table.zero_()
        step.query_start_loc.copy_(torch.arange(num_reqs + 1, device=device).clamp(max=active) * la)
        accepted_rows = []
        for r, request in enumerate(batch):
            # the verify step: 1 + N target rows at P .. P + N, the first `accepted` kept, the rest PAD
            start, accepted = request.context_len, randint(1, la + 1)
            rows_k, rows_v = randn(la, hkv, d), randn(la, hkv, d)
            request.step_start = start
            request.k_hist = torch.cat([request.k_hist, rows_k[:accepted]])
            request.v_hist = torch.cat([request.v_hist, rows_v[:accepted]])
            row = gathered_row(request, shape, width, request.context_len)
            tokens = slice(r * la, (r + 1) * la)
            slots = prepared_slots(row, torch.arange(start, start + la, device=device), bs)
            step.ctx_slots[tokens] = torch.where(torch.arange(la, device=device) < accepted, slots, PAD_SLOT)
            step.ctx_k[tokens], step.ctx_v[tokens] = rows_k, rows_v
            accepted_rows.append((slots[:accepted], rows_k[:accepted], rows_v[:accepted]))
            # the draft block: 1 + N queries at the new context length
            step.seq_lens[r] = request.context_len + la
            step.block_table[r] = row
            step.q[tokens] = randn(la, *step.q.shape[1:])
            step.k[tokens], step.v[tokens] = randn(la, hkv, d), randn(la, hkv, d)
        written_slots, k_rows, v_rows = (torch.cat(parts) for parts in zip(*accepted_rows, strict=True))
        before = kv_cache.clone()
        eager_cache, eager_out = kv_cache.clone(), step.out.clone()
        step.run(eager_cache, eager_out)
        replay()
        tokens = active * la
        ref_hi, ref_lo = oracle_pair(
            step.q[:tokens], step.k[:tokens], step.v[:tokens], [(r.first, r.k_hist, r.v_hist) for r in batch],
            step.query_start_loc[: active + 1], step.seq_lens[:active], window=shape.window, causal=False,
        )  # fmt: skip
        report = attention_error(step.out[:tokens], ref_hi, ref_lo)
        checks = {
            "bitwise_eager": bitwise_equal(step.out, eager_out) and bitwise_equal(kv_cache, eager_cache),
            "oracle_ok": report.ok,
            "padded_rows_untouched": bool(torch.isnan(step.out[tokens:]).all()),
            "ring_untouched_elsewhere": ring_changes_ok(before, kv_cache, written_slots, k_rows, v_rows),
        }
        rows.append({"graph_reqs": num_reqs, "step": index, "active": active, "max_model_len": max_model_len,
                     "context_lens": [r.context_len for r in batch], "max_error": report.max_error,
                     "bound": report.bound, **checks, "ok": all(checks.values())})  # fmt: skip
    return rows


def v2_replay_rows(shape: DrafterShape, device, smoke: bool) -> list[dict]:
    """Every graph size's rows (``replay_graph``); a size that raises gives one row with its error, not ok."""
    sizes = SMOKE_SIZES if smoke else GPU_SIZES
    rows = []
    for num_reqs in sizes[0]:
        try:
            rows += replay_graph(shape, num_reqs, sizes, torch.bfloat16, device, seed=num_reqs)
        except Exception as error:  # recorded: the JSON says which size failed and why
            rows.append({"graph_reqs": num_reqs, "error": repr(error)[:500], "ok": False})
    return rows
