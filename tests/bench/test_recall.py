# SPDX-License-Identifier: Apache-2.0
"""``ringkv bench recall-acceptance`` without an engine: the grid it runs, and the table it writes from rows (each
cell's tokens compared with its context's no-speculation run; cells without a row listed as not run)."""

from __future__ import annotations

import json

from ringkv.bench.recall_grid import NO_SPECULATION, grid
from ringkv.bench.recall_report import write_report
from ringkv.dflash2.harness.recall_models import ACCURACY_RECORD


def test_the_grid_runs_every_context_with_no_speculation_full_and_every_window_and_sink_count():
    cells = grid()
    assert len(cells) == 3 * (2 + 3 * 3)
    assert [cell.context for cell in cells[::11]] == [256, 1024, 4096]
    assert [cell.label for cell in cells[:6]] == [NO_SPECULATION, "full", "Wf 64", "Wf 256", "Wf 1024", "Wf 64 S 16"]
    assert cells[-1].label == "Wf 1024 S 64" and cells[-1].variant.sinks == 64


def row(context: int, label: str, tokens: list[list[int]], window=None, sinks=0) -> dict:
    figures = {"acceptance": 0.5, "accepted": 6, "draft_tokens": 12, "acceptance_per_position": [0.75, 0.5, 0.25],
               "mean_accepted_length": 2.5, "blocks_max": 4, "blocks_end": 4, "keys_read_per_step": 262.0,
               "window": window, "sinks": sinks}  # fmt: skip
    return {"context": context, "context_windows": context // 64, "label": label, "tokens": tokens,
            "wall_seconds": 20.0, "target_recalled": True, **({} if label == NO_SPECULATION else figures)}  # fmt: skip


def test_the_report_compares_with_no_speculation_and_lists_the_cells_not_run(tmp_path):
    (tmp_path / ACCURACY_RECORD).write_text(
        json.dumps({"accuracy_per_position": [0.9, 0.8, 0.7], "sequences": 16, "seconds": 60.0})
    )
    rows = [row(256, NO_SPECULATION, [[5, 6]]), row(256, "full", [[5, 6]]), row(256, "Wf 64", [[5, 7]], 64)]
    md, data, png = write_report(rows, grid((4,)), tmp_path, tmp_path)
    text = md.read_text()
    assert "| 256 (4 W) | full | 50.0% (6 / 12) | 0.75 0.50 0.25 | 2.50 | 4 / 4 | 262 | yes |" in text
    assert "| 256 (4 W) | Wf 64 |" in text and "| **NO** |" in text
    assert "Not run" in text and "256 tokens: Wf 256;" in text and "256 tokens: Wf 1024 S 64." in text
    record = json.loads(data.read_text())
    assert [r["tokens_equal_no_speculation"] for r in record["rows"]] == [True, True, False]
    assert len(record["missing"]) == 11 - 3 and png.stat().st_size > 0
