# SPDX-License-Identifier: Apache-2.0
"""What ``ringkv e2e`` runs: vLLM's engine serving one long prompt with the DFlash drafter on the ring (and the
target's sliding layers on the ring too, so the target's cost stays linear), optionally beside vLLM's stock
drafter attention; the figures it reports."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ringkv.dflash2.harness.engine_models import FIRST_TOKEN, EngineModels, EngineModelSpec, build_engine_models

from .runner import EngineRun, drafter_layer_names, held_blocks, run_engine
from .worker import EngineRunSpec


@dataclass(frozen=True)
class E2EOptions:
    context: int
    decode_tokens: int
    drafter_window: int
    target_window: int
    kv_block_size: int
    chunk: int
    stock: bool
    seed: int
    # the drafter's KV cache dtype (vLLM speculative_config.kv_cache_dtype); None inherits the target's
    drafter_kv_cache_dtype: str | None = None


@dataclass(frozen=True)
class E2EResult:
    run: EngineRun
    label: str
    # per scheduler step: (tokens computed before it, drafter blocks held after it)
    trace: list[tuple[int, int]]

    @property
    def blocks_once_full(self) -> list[int]:
        """Drafter blocks held at the steps where the drafter's window is full."""
        ring = self.run.scheduler["ring_blocks"]
        full = self.run.scheduler["drafter_kv_block_size"] * (ring or 1)
        return [held for computed, held in self.trace if computed >= full] or [held for _, held in self.trace]


def models_for(options: E2EOptions, folder: Path) -> EngineModels:
    spec = EngineModelSpec(
        drafter_window=options.drafter_window, target_window=options.target_window, seed=options.seed,
        target_layers=3, target_layer_ids=(0, 1),
        max_positions=max(1 << 20, options.context + options.decode_tokens + 1024),
    )  # fmt: skip
    return build_engine_models(folder / f"w{options.drafter_window}-t{options.target_window}-s{options.seed}", spec)


def run_e2e(
    options: E2EOptions, models_dir: Path, on_progress: Callable[[str, int], None] | None = None
) -> list[E2EResult]:
    """The ring run (and the stock one with ``options.stock``) on one ``options.context``-token prompt."""
    models = models_for(options, models_dir)
    generator = random.Random(options.seed)
    prompt = [generator.randrange(FIRST_TOKEN, models.spec.vocab_size - 1) for _ in range(options.context)]
    layers = drafter_layer_names(models.spec.target_layers, models.spec.drafter_layers)
    results = []
    for backend in ("ring", "stock") if options.stock else ("ring",):
        spec = EngineRunSpec(
            target=str(models.target), drafter=str(models.drafter), drafter_backend=backend, prompts=[prompt],
            max_tokens=options.decode_tokens, kv_block_size=options.kv_block_size, max_num_seqs=1,
            max_model_len=options.context + options.decode_tokens + 2 * options.kv_block_size,
            max_num_batched_tokens=options.chunk, target_on_ring=backend == "ring",
            drafter_kv_cache_dtype=options.drafter_kv_cache_dtype,
        )  # fmt: skip
        label = "ringkv ring" if backend == "ring" else "stock vLLM"

        def progress(tokens: int, label: str = label) -> None:
            if on_progress is not None:
                on_progress(label, tokens)

        run = run_engine(spec, drafter_layers=layers, record_outputs=False, on_progress=progress)
        trace = [held for step in held_blocks(run) for held in step.values()]
        results.append(E2EResult(run, label, trace))
    return results
