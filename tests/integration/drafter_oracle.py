# SPDX-License-Identifier: Apache-2.0
"""The dense oracle of a recorded drafter run (``run_engine(..., record_inputs=True)``, one request): each ring
forward of a drafter layer against fp64 attention over the context K/V vLLM stored before it, kept by position
(a row vLLM handed over unstored, PAD, only where no stored row holds its position), masked by the window and sinks
asked for. Shared by the engine tests of the full-attention window (V1 and V2)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from ringkv.bench.lab.e2e.probe import ContextRows, ForwardInputs
from ringkv.bench.lab.e2e.runner import EngineRun
from ringkv.kernels.oracle import dense_history_attention

History = dict[int, tuple[torch.Tensor, torch.Tensor]]


def stored_history_oracle(forward: ForwardInputs, history: History, window: int, sink_tokens: int = 0) -> torch.Tensor:
    """fp64 attention of one recorded forward (one request) over the context K/V stored before it, by position."""
    context_len = int(forward.seq_lens[0]) - forward.q.shape[0]
    k_hist = torch.stack([history[p][0] for p in range(context_len)]) if context_len else forward.k[:0]
    v_hist = torch.stack([history[p][1] for p in range(context_len)]) if context_len else forward.v[:0]
    return dense_history_attention(
        forward.q, forward.k, forward.v, [(0, k_hist, v_hist)], forward.query_start_loc, forward.seq_lens,
        window=window, causal=forward.causal, scale=forward.scale, sink_tokens=sink_tokens,
    )  # fmt: skip


def drafter_forwards(run: EngineRun) -> Iterator[tuple[str, ForwardInputs, torch.Tensor, History]]:
    """Every ring forward of every recorded drafter layer, in order: (layer, its inputs, its output as
    ``[n, Hq, Dv]`` fp64, the context K/V stored before it by position). Each layer's outputs and forwards pair
    one to one (asserted)."""
    outputs = {layer: calls for (_, layer), calls in run.outputs().items()}
    for layer, events in run.drafter_events().items():
        history: History = {}
        forwards = iter(outputs[layer])
        for event in events:
            if isinstance(event, ContextRows):
                for p, k, v, stored in zip(event.positions.tolist(), event.k, event.v, event.stored, strict=True):
                    if stored:
                        # a later store of a position (the verified token after a rejected draft's row) replaces it
                        history[p] = (k, v)
                    else:
                        # an unstored row never replaces a stored one: on Model Runner V2 a rejected row's position
                        # is a placeholder 0 (a sink's); a dead block's row is the K/V of its real position
                        history.setdefault(p, (k, v))
                continue
            got = next(forwards).reshape(event.q.shape[0], event.q.shape[1], -1).double()
            yield layer, event, got, history
        assert next(forwards, None) is None, f"{layer}: more outputs than recorded forwards"
