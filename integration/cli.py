# SPDX-License-Identifier: Apache-2.0
"""The ``ringkv`` command line (the script's ``app``): the product's commands (``smoke``, ``plan``), then every
installed command set (entry point group ``ringkv.commands``: the lab's, ``ringkv.bench.cli.add_lab_commands``,
adds ``demo``, ``admission``, ``e2e`` and the ``bench`` group), and the option types and helpers every command
shares. Nothing here imports the lab: the layers run kernels < dflash2 < integration < bench."""

from __future__ import annotations

import os
from collections.abc import Callable
from importlib.metadata import entry_points
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


def kernel_device() -> torch.device:
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
    device = kernel_device()
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


# entry points of installed packages, each a callable that adds its commands to the ``ringkv`` app
COMMAND_SETS = "ringkv.commands"


def build_app() -> typer.Typer:
    """The ``ringkv`` app: the product's commands, then each installed command set's, in entry-point name order."""
    app = typer.Typer(help=HELP, no_args_is_help=True)
    app.callback()(main)
    add_commands(app, smoke, plan)
    for entry_point in sorted(entry_points(group=COMMAND_SETS), key=lambda entry: entry.name):
        entry_point.load()(app)
    return app


def add_commands(app: typer.Typer, *commands: Callable[..., None]) -> None:
    """Register ``commands`` on ``app`` in this order, each refusing its renamed flags (``RENAMED_FLAGS``)."""
    for command in commands:
        app.command(cls=RenamedFlagsCommand)(command)


app = build_app()


if __name__ == "__main__":
    app()
