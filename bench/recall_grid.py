# SPDX-License-Identifier: Apache-2.0
"""The grid of ``ringkv bench recall-acceptance`` (``recall.py`` runs it, ``recall_report.py`` tables it): contexts
of 4, 16 and 64 windows of W tokens; per context no speculation, the drafter full, and ``Wf`` in {W, 4W, 16W} with
S in {0, 16, 64} sinks; the prompts' shape."""

from __future__ import annotations

from dataclasses import dataclass

from .acceptance import FULL, Variant, variant_label

W = 64
CONTEXT_WINDOWS = (4, 16, 64)
WINDOW_MULTIPLES = (1, 4, 16)
SINKS = (0, 16, 64)
PROMPTS = 2
MAX_TOKENS = 32
KV_BLOCK = 32
NO_SPECULATION = "no speculation"
MAX_MODEL_LEN = max(CONTEXT_WINDOWS) * W + 256


@dataclass(frozen=True)
class Cell:
    """One engine run: a context (tokens) and a variant (None: no speculation)."""

    context: int
    variant: Variant | None

    @property
    def label(self) -> str:
        return NO_SPECULATION if self.variant is None else self.variant.label

    @property
    def key(self) -> tuple[int, str]:
        return self.context, self.label


def grid(context_windows: tuple[int, ...] = CONTEXT_WINDOWS) -> list[Cell]:
    """Every cell, in the order they run: context by context (shortest first), no speculation, full, the windows
    without sinks, then with sinks."""
    cells = []
    for context in sorted(n * W for n in context_windows):
        windowed = [Variant(variant_label(m * W, s), m * W, s) for s in SINKS for m in WINDOW_MULTIPLES]
        cells += [Cell(context, None), Cell(context, Variant(FULL, None)), *(Cell(context, v) for v in windowed)]
    return cells
