# SPDX-License-Identifier: Apache-2.0
"""The dense oracle of the ring kernels: attention over a request's history kept densely by absolute position,
masked by ``ring_geometry.visible``, computed in fp64 by default.

This module holds the masked-softmax formula once, in ``dense_history_attention``: the ring reference
(``reference.py``) gathers each request's window through the ring and calls it; the harness's full-history cache
calls it on dense histories, and ``oracle_pair`` gives the tolerance rule's (fp64, same-dtype) pair (tests,
``bench/gpu_check.py``, ``bench/v2_replay.py``).
Needs only torch (``gpu_check`` imports it on a GPU machine without vLLM).

Semantics of an empty row (a query that sees no key; impossible for a drafter, defined anyway): output 0, as
flash-attention's ``attention_ref`` fills fully masked rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .ring_geometry import first_visible_position, visible


def masked_softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """``q [B, Hq, D]``, ``k [L, Hkv, D]``, ``v [L, Hkv, Dv]``, ``mask [B, L]`` -> ``[B, Hq, Dv]`` in the inputs'
    dtype; GQA by repeating each KV head over its ``Hq / Hkv`` query heads; a row without keys gives 0."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    # scores: [Hq, B, L]
    scores = torch.einsum("bhd,lhd->hbl", q, k) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    # a row of -inf softmaxes to NaN: it saw no key, so it weighs nothing
    weights = torch.where(mask[None], weights, torch.zeros_like(weights))
    return torch.einsum("hbl,lhd->bhd", weights, v)


def dense_history_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    histories: Sequence[tuple[int, torch.Tensor, torch.Tensor]],
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    window: int,
    causal: bool,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float64,
    sink_tokens: int = 0,
    sink_history: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """The oracle of a varlen batch (``varlen``: request ``r``'s queries at ``context_len .. seq_len - 1``) whose
    context is a dense history per request, masked by the contract (``ring_geometry.visible``: ``k >= 0`` and
    ``q - k < W`` or ``k < sink_tokens``, causal ``k <= q`` else ``k - q < W``). Only the keys some query sees are
    computed, so a long history costs its window (and sinks), not its length; K/V of positions no query sees may
    hold anything, NaN included.

    Args:
        q: [T, Hq, D]; k_new: [T, Hkv, D]; v_new: [T, Hkv, Dv]: the batch's own rows.
        histories: per request ``(first, k_hist [n, Hkv, D], v_hist [n, Hkv, Dv])``, the K/V of positions
            ``first .. first + n - 1`` (any device, any float dtype); rows at or past ``context_len`` are ignored
            (the batch's own rows are those positions). ``first`` must not exceed the window start
            ``max(0, context_len - (W - 1))``; a request without queries needs no history.
        query_start_loc: [num_reqs + 1]; seq_lens: [num_reqs] (any int dtype, any device).
        window: W. causal: see above. scale: default ``D ** -0.5``.
        compute_dtype: the dtype of the whole computation (fp64: the oracle; the kernel's dtype: ``ref_lo``).
        sink_tokens: keys every query sees besides its window (0: none).
        sink_history: per request ``(k [m, Hkv, D], v [m, Hkv, Dv])`` of positions ``0 .. m - 1``, read for the
            sinks below its history's ``first`` (``min(sink_tokens, first)`` rows needed); None: no such rows.

    Returns:
        [T, Hq, Dv] in ``compute_dtype``; rows of no request (past ``query_start_loc[-1]``) are 0.
    """
    device = q.device
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.zeros(q.shape[0], q.shape[1], v_new.shape[-1], dtype=compute_dtype, device=device)
    starts = query_start_loc.tolist()
    for request, (seq_len, (first, k_hist, v_hist)) in enumerate(zip(seq_lens.tolist(), histories, strict=True)):
        begin, end = starts[request], starts[request + 1]
        context_len = seq_len - (end - begin)
        if begin == end:
            continue  # no queries: nothing to attend, no history needed
        if first > first_visible_position(context_len, window) or first + k_hist.shape[0] < context_len:
            raise ValueError(
                f"request {request}: its history holds positions {first}..{first + k_hist.shape[0] - 1}, but its "
                f"queries see {first_visible_position(context_len, window)}..{context_len - 1}; keep that history"
            )
        q_pos = torch.arange(context_len, seq_len, device=device)
        # every query sees the sinks below the history's first position (k < sink_tokens, k < first <= q)
        below = min(sink_tokens, first)
        # key sources in position order: those sinks, the history, the batch's own rows
        sources = [
            (*sink_rows(sink_history, request, below, k_hist, v_hist), torch.arange(below)),
            (k_hist, v_hist, torch.arange(first, max(first, context_len))),
            (k_new[begin:end], v_new[begin:end], q_pos),
        ]
        keys, values, masks = [], [], []
        for k_source, v_source, positions in sources:
            # [B, n]: which rows of this source each query sees; only the rows some query sees travel on
            mask = visible(q_pos[:, None], positions.to(device)[None, :], window, causal, sink_tokens)
            rows = mask.any(0).nonzero()[:, 0]
            keys.append(k_source[rows.to(k_source.device)].to(device, compute_dtype))
            values.append(v_source[rows.to(v_source.device)].to(device, compute_dtype))
            masks.append(mask[:, rows])
        out[begin:end] = masked_softmax_attention(
            q[begin:end].to(compute_dtype), torch.cat(keys), torch.cat(values), torch.cat(masks, 1), scale
        )
    return out


def sink_rows(
    sink_history: Sequence[tuple[torch.Tensor, torch.Tensor]] | None,
    request: int,
    needed: int,
    k_hist: torch.Tensor,
    v_hist: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Request ``request``'s K/V of the sink positions ``0 .. needed - 1`` (empty rows shaped like its history when
    none are needed)."""
    if not needed:
        return k_hist[:0], v_hist[:0]
    held = 0 if sink_history is None else sink_history[request][0].shape[0]
    if held < needed:
        raise ValueError(
            f"request {request}: its queries see the sinks 0..{needed - 1} below its history, but sink_history holds "
            f"{held} of them; pass the K/V of positions 0..{needed - 1} in sink_history"
        )
    k_sink, v_sink = sink_history[request]
    return k_sink[:needed], v_sink[:needed]


def oracle_pair(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    histories: list[tuple[int, torch.Tensor, torch.Tensor]],
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    window: int,
    causal: bool,
    sink_tokens: int = 0,
    sink_history: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ref_hi, ref_lo) of the tolerance rule from the dense oracle (``dense_history_attention``): fp64, and the
    batch's own dtype with the ops reordered (flash-attention's ``reorder_ops``: Q scaled in its dtype before the
    dot, as the kernels do, not the scores after it)."""
    rest = (k_new, v_new, histories, query_start_loc, seq_lens)
    rule = {"window": window, "causal": causal, "sink_tokens": sink_tokens, "sink_history": sink_history}
    ref_hi = dense_history_attention(q, *rest, **rule, compute_dtype=torch.float64)
    scaled_q = q * q.shape[-1] ** -0.5
    ref_lo = dense_history_attention(scaled_q, *rest, **rule, scale=1.0, compute_dtype=q.dtype)
    return ref_hi, ref_lo
