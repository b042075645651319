# SPDX-License-Identifier: Apache-2.0
"""``ring_attention`` with its ring write captured once in a CUDA graph at a padded batch size, replayed over other
contents and other context lengths, across ring wraps and back (issue 39, deliverable 5).

The batch is padded as vLLM's ``gpu_model_runner.py`` pads one for a FULL CUDA graph: real requests first, their
varlen draft blocks back to back; padded requests have a zero-length query (``query_start_loc`` repeats its last
entry) and ``seq_len`` 0, here with a zeroed block-table row (block 0, the NaN null block); token rows past
``query_start_loc[-1]`` keep stale, finite contents and slot PAD (-1). Each graph size captures
``ring_attention(..., write_ring=True, slot_mapping=...)`` once on such persistent buffers (vLLM's
``[num_blocks, Hkv, bs, D + Dv]`` cache, compact ring rows, ``table_period = R``). Each replay rewrites every buffer
in place: the ring NaN everywhere but each real request's window history, new q/k/v (padded rows too, so a stray
write of one would show), other requests, other query and context lengths.

Launch: a graph freezes the grid and every value the launcher computed on the host. For draft blocks the tile
config follows the head shape, block size and ring dtype only; the split count and the grid the padded request
count and ``cdiv(max_query_len, BLOCK_Q)`` (``attention.select_config``, ``split_count``, ``attention_grid``);
positions, ``seq_lens`` and contents are device tensors the kernels read at run time; ``ring_write``'s grid follows
the token rows. So a capture at the padded request count with ``max_query_len`` = the lookahead fixes a launch
valid for every replay. Each replay's eager call is built from that replay's own bounds (its longest query and
seq_len) and must choose the captured launch (config, splits, grid): a row whose launch differs fails.

Checks per replay, against the eager call on copies of the same inputs and ring: output and ring bitwise equal;
the real rows finite (their windows read only written slots); output rows past the real tokens still NaN; the
ring changed only at the real rows' slots, which hold those rows, so every NaN-poisoned slot (block 0, which the
padded requests' rows name, included) is still NaN. ``smoke``: the same sequence eagerly (no graph on CPU).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from ringkv.integration.vllm.backend_step import split_kv_cache
from ringkv.kernels import BatchMode, RingPlan, VarlenBatch, ring_attention, ring_write
from ringkv.kernels.attention import SplitWorkspace, attention_grid, select_config, split_count
from ringkv.kernels.configs import AttentionConfig
from ringkv.kernels.ring_geometry import PAD_SLOT
from ringkv.kernels.testing import ISSUE_55800, DrafterShape
from ringkv.kernels.validation import RingCache, validate_attention_inputs

from .v2_replay import bitwise_equal, ring_changes_ok

# (shape, graph request counts, the deepest context length): GPU, and the CPU smoke, whose window is long enough
# that one request splits it in two on the interpreter's one "SM", so the smoke takes the split-and-merge path too
GPU_SIZES = (ISSUE_55800, (1, 8, 32), 262_136)
SMOKE_SIZES = (DrafterShape(window=70, kv_block_size=8, num_q_heads=4, num_kv_heads=1, head_dim=16), (1, 3), 700)


@dataclass
class Buffers:
    """The persistent inputs and outputs of one graph (or their eager copies)."""

    q: torch.Tensor  # [T, Hq, D]
    k_new: torch.Tensor  # [T, Hkv, D]
    v_new: torch.Tensor  # [T, Hkv, D]
    out: torch.Tensor  # [T, Hq, D]
    slot_mapping: torch.Tensor  # [T] int64, PAD past the real rows
    query_start_loc: torch.Tensor  # [n + 1] int32
    seq_lens: torch.Tensor  # [n] int32
    block_table: torch.Tensor  # [n, R] int32
    kv_cache: torch.Tensor  # [num_blocks, Hkv, bs, D + Dv], block 0 the null block

    def clone(self) -> Buffers:
        return Buffers(**{field.name: getattr(self, field.name).clone() for field in fields(self)})

    def batch(self, max_query_len: int, max_seq_len: int, ring_blocks: int) -> VarlenBatch:
        return VarlenBatch(self.query_start_loc, self.seq_lens, self.block_table, max_query_len=max_query_len,
                           max_seq_len=max_seq_len, table_period=ring_blocks, mode=BatchMode.DRAFT_BLOCK)  # fmt: skip

    def caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views ``[num_blocks, bs, Hkv, D]``."""
        return split_kv_cache(self.kv_cache, self.q.shape[-1])


def attend(buffers: Buffers, batch: VarlenBatch, window: int, workspace: SplitWorkspace | None) -> None:
    """The draft block over the ring, then its live rows stored through ``slot_mapping`` (the captured call)."""
    ring_attention(
        buffers.q, buffers.k_new, buffers.v_new, *buffers.caches(), batch, window=window, causal=False,
        out=buffers.out, write_ring=True, slot_mapping=buffers.slot_mapping, workspace=workspace,
    )  # fmt: skip


def launch(buffers: Buffers, batch: VarlenBatch, window: int) -> tuple[AttentionConfig, int, tuple[int, int, int]]:
    """What ``ring_attention`` fixes on the host for these inputs: (tile config, split count, grid)."""
    num_kv_heads = buffers.k_new.shape[1]
    cache = RingCache(*buffers.caches(), None, None)
    inputs = validate_attention_inputs(buffers.q, buffers.k_new, buffers.v_new, cache, batch, window=window, scale=None,
                                       out=buffers.out)  # fmt: skip
    config = select_config(batch, inputs)
    splits = split_count(None, batch, config, num_kv_heads=num_kv_heads, window=window, device=buffers.q.device)
    return config, splits, attention_grid(batch, num_kv_heads, config.BLOCK_Q, splits)


def capture(call: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """``call`` captured once in a CUDA graph, after one eager warm-up (it compiles the kernels and sizes the split
    workspace); returns the graph's replay. Off CUDA (the smoke) there is no graph: ``call`` itself."""
    if device.type != "cuda":
        return call
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph.replay


def context_lens(plan: RingPlan, deepest: int) -> list[int]:
    """One context length per replay: the window clipped at 0, the draft block across the ring's wrap, the window
    across it, seven wraps deep, back before the first wrap, and the deepest."""
    slots = plan.num_slots
    return [3, slots - 2, slots + plan.window // 2, 7 * slots + 5, plan.window + 1, deepest]


def replay_checks(graph: Buffers, eager: Buffers, before: torch.Tensor, num_real: int) -> dict[str, bool]:
    """A replay's outputs and ring (``graph``) against the eager call's on copies (``eager``); ``before``: the ring
    as both found it; ``num_real``: the real token rows."""
    real = slice(0, num_real)
    stored = ring_changes_ok(before, graph.kv_cache, graph.slot_mapping[real], graph.k_new[real], graph.v_new[real])
    return {
        "bitwise_out": bitwise_equal(graph.out, eager.out),
        "bitwise_ring": bitwise_equal(graph.kv_cache, eager.kv_cache),
        "real_rows_finite": bool(torch.isfinite(graph.out[real]).all()),
        "padded_rows_untouched": bool(torch.isnan(graph.out[num_real:]).all()),
        "ring_changed_only_at_real_rows": stored,
    }


def graph_rows(shape: DrafterShape, graph_reqs: int, deepest: int, dtype: torch.dtype, device, seed: int) -> list[dict]:
    """One graph of ``graph_reqs`` requests: captured once, then a replay per ``context_lens`` entry."""
    generator = torch.Generator(device=device).manual_seed(seed)
    plan, la, hq, hkv, d = shape.plan, shape.lookahead, shape.num_q_heads, shape.num_kv_heads, shape.head_dim
    ring_blocks, bs, tokens = plan.ring_blocks, shape.kv_block_size, graph_reqs * la

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator, device=device).to(dtype)

    def zeros(*size: int) -> torch.Tensor:
        return torch.zeros(*size, dtype=dtype, device=device)

    # one ring more than the graph holds, so the real requests are a different subset each replay
    pool = graph_reqs + 1
    rings = (torch.randperm(pool * ring_blocks, generator=generator, device=device) + 1).to(torch.int32)
    rings = rings.view(pool, ring_blocks)
    buffers = Buffers(
        q=zeros(tokens, hq, d), k_new=zeros(tokens, hkv, d), v_new=zeros(tokens, hkv, d), out=zeros(tokens, hq, d),
        slot_mapping=torch.full((tokens,), PAD_SLOT, dtype=torch.int64, device=device),
        query_start_loc=torch.arange(graph_reqs + 1, dtype=torch.int32, device=device) * la,
        seq_lens=torch.full((graph_reqs,), la, dtype=torch.int32, device=device),
        block_table=torch.zeros(graph_reqs, ring_blocks, dtype=torch.int32, device=device),
        kv_cache=torch.full((1 + pool * ring_blocks, hkv, bs, 2 * d), float("nan"), dtype=dtype, device=device),
    )  # fmt: skip
    # captured on dummy inputs (every request a whole block at context 0, slots PAD), as vLLM captures
    captured_batch = buffers.batch(la, deepest + graph_reqs + la, ring_blocks)
    workspace = SplitWorkspace()
    captured = launch(buffers, captured_batch, shape.window)
    replay = capture(lambda: attend(buffers, captured_batch, shape.window, workspace), device)
    rows = []
    for index, base in enumerate(context_lens(plan, deepest)):
        active = (graph_reqs, 1, max(1, graph_reqs - 1))[index % 3]
        chosen = torch.randperm(pool, generator=generator, device=device)[:active]
        query_lens = [la - (r + index) % la for r in range(active)]
        contexts = [base + r for r in range(active)]
        num_real = sum(query_lens)
        # the ring: NaN but each real request's window history
        buffers.kv_cache.fill_(float("nan"))
        real_slots = []
        for ring, context_len, query_len in zip(rings[chosen], contexts, query_lens, strict=True):
            history = torch.arange(max(0, context_len - (shape.window - 1)), context_len, device=device)
            ring_write(randn(len(history), hkv, d), randn(len(history), hkv, d), *buffers.caches(),
                       plan.slot_mapping(history, ring))  # fmt: skip
            block = torch.arange(context_len, context_len + query_len, device=device)
            real_slots.append(plan.slot_mapping(block, ring))
        for tensor in (buffers.q, buffers.k_new, buffers.v_new):
            tensor.copy_(randn(*tensor.shape))
        buffers.out.fill_(float("nan"))
        buffers.slot_mapping.fill_(PAD_SLOT)
        buffers.slot_mapping[:num_real] = torch.cat(real_slots)
        starts = list(itertools.accumulate(query_lens, initial=0))
        buffers.query_start_loc.copy_(torch.tensor(starts + [num_real] * (graph_reqs - active)))
        seq_lens = [p + n for p, n in zip(contexts, query_lens, strict=True)]
        buffers.seq_lens.copy_(torch.tensor(seq_lens + [0] * (graph_reqs - active)))
        buffers.block_table.zero_()
        buffers.block_table[:active] = rings[chosen]
        before, eager = buffers.kv_cache.clone(), buffers.clone()
        eager_batch = eager.batch(max(query_lens), max(seq_lens), ring_blocks)
        eager_launch = launch(eager, eager_batch, shape.window)
        attend(eager, eager_batch, shape.window, None)
        replay()
        checks = {"launch_as_captured": eager_launch == captured,
                  **replay_checks(buffers, eager, before, num_real)}  # fmt: skip
        rows.append({"graph_reqs": graph_reqs, "replay": index, "active": active, "query_lens": query_lens,
                     "context_lens": contexts, "ring_wraps": max(contexts) // plan.num_slots,
                     "num_splits": [captured[1], eager_launch[1]], **checks, "ok": all(checks.values())})  # fmt: skip
    return rows


def graph_replay_rows(device, smoke: bool) -> list[dict]:
    """Every graph size's rows (``graph_rows``); a size that raises gives one row with its error, not ok."""
    shape, graph_sizes, deepest = SMOKE_SIZES if smoke else GPU_SIZES
    rows = []
    for graph_reqs in graph_sizes:
        try:
            rows += graph_rows(shape, graph_reqs, deepest, torch.bfloat16, device, seed=graph_reqs)
        except Exception as error:  # recorded: the JSON says which size failed and why
            rows.append({"graph_reqs": graph_reqs, "error": repr(error)[:500], "ok": False})
    return rows
