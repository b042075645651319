# SPDX-License-Identifier: Apache-2.0
"""One stream of requests, stock drafter (vLLM's ``SlidingWindowSpec``) vs ring (``RingSWASpec``), through vLLM's
real Scheduler and KVCacheManager at several pool sizes, prefix caching off and on
(``ringkv.bench.lab.simulation.load``).

The workload: conversations that share a system prompt and whose turns re-send the whole history (a turn
arrives when the one before finishes), beside independent long prompts. Rows go to ``load.jsonl``, the table to
``load_cpu.txt`` (with the command), the plot to ``load.png``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from .records import environment, write_jsonl

if TYPE_CHECKING:
    from ringkv.bench.lab.simulation.admission import Deployment
    from ringkv.bench.lab.simulation.load import Conversation

Row = dict[str, Any]

DRAFTERS = ("stock", "ring")
# (row key, column title, format) of the table, after pool / prefix caching / drafter
COLUMNS = (
    ("preemptions", "preemptions", ","),
    ("recomputed_tokens", "recomputed tokens", ","),
    ("steps", "scheduler steps", ","),
    ("peak_running", "peak running", ","),
    ("mean_running", "mean running", ".1f"),
    ("peak_drafter_blocks", "peak drafter blocks", ","),
    ("prefix_hit_tokens", "prefix-cache hit tokens", ","),
)


@dataclass(frozen=True)
class LoadOptions:
    """The run: pool sizes, the deployment's shape and the workload (each a ``ringkv bench load`` flag)."""

    pool_blocks: tuple[int, ...] = (500, 600, 800, 1000, 1200, 1600, 2400)
    # vLLM #55800's deployment at a quarter of its sizes: W 2048 -> 512, chunk 8192 -> 2048, target block 2304 -> 576
    window: int = 512
    drafter_kv_block_size: int = 16
    num_speculative_tokens: int = 7
    target_groups: int = 6
    target_kv_block_size: int = 576
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 32
    conversations: int = 24
    turns: int = 6
    system_tokens: int = 2048
    turn_tokens: int = 128
    output_tokens: int = 128
    long_prompts: int = 8
    long_prompt_tokens: int = 16_384
    seed: int = 0

    def command(self, out: Path) -> str:
        """The ``ringkv`` command line that makes this run."""
        flags = []
        for field in fields(self):
            values = getattr(self, field.name)
            for value in values if isinstance(values, tuple) else (values,):
                flags.append(f"--{field.name.replace('_', '-')} {value}")
        return " ".join(["ringkv bench load", *flags, f"--out {out}"])


def workload(options: LoadOptions) -> list[Conversation]:
    """The conversations (first turn: the shared system prompt plus ``turn_tokens``) and the long prompts (one
    turn each), random token ids from ``seed``."""
    from ringkv.bench.lab.simulation.load import Conversation

    rng = random.Random(options.seed)

    def tokens(n: int) -> tuple[int, ...]:
        # ids 3 and up: 1 is the fake model's sampled token, 2 the tail of the admission demo
        return tuple(rng.randrange(3, 1000) for _ in range(n))

    system = tokens(options.system_tokens)
    chats = [Conversation((system + tokens(options.turn_tokens), *(tokens(options.turn_tokens)
                                                                   for _ in range(options.turns - 1))),
                          options.output_tokens) for _ in range(options.conversations)]  # fmt: skip
    singles = [Conversation((tokens(options.long_prompt_tokens),), options.output_tokens)
               for _ in range(options.long_prompts)]  # fmt: skip
    return chats + singles


def longest_request(options: LoadOptions) -> int:
    """Tokens of the longest request (prompt and output), the last turn's or a long prompt's."""
    chat = options.system_tokens + options.turns * (options.turn_tokens + options.output_tokens)
    single = options.long_prompt_tokens + options.output_tokens if options.long_prompts else 0
    return max(chat if options.conversations else 0, single)


def deployment(options: LoadOptions, pool_blocks: int, prefix_caching: bool) -> Deployment:
    from ringkv.bench.lab.simulation.admission import Deployment
    from ringkv.kernels.testing import ISSUE_55800

    drafter = replace(ISSUE_55800, window=options.window, kv_block_size=options.drafter_kv_block_size,
                      num_speculative_tokens=options.num_speculative_tokens)  # fmt: skip
    # room for the drafts verified past the last token
    max_model_len = longest_request(options) + 2 * drafter.lookahead
    return Deployment(
        pool_blocks=pool_blocks, target_groups=options.target_groups, target_kv_block_size=options.target_kv_block_size,
        drafter=drafter, max_model_len=max_model_len, max_num_batched_tokens=options.max_num_batched_tokens,
        max_num_seqs=options.max_num_seqs, prefix_caching=prefix_caching,
    )  # fmt: skip


def measure(options: LoadOptions, on_row: Callable[[Row], None] | None = None) -> list[Row]:
    """One row per pool size x prefix caching off / on x stock / ring."""
    from ringkv.bench.lab.simulation.load import run_load
    from ringkv.bench.lab.simulation.scheduler_run import build_vllm_config

    conversations = workload(options)
    rows = []
    for pool in options.pool_blocks:
        for prefix_caching in (False, True):
            setup = deployment(options, pool, prefix_caching)
            config = build_vllm_config(setup)
            for drafter in DRAFTERS:
                result = run_load(config, setup, drafter == "ring", conversations, options.seed)
                rows.append({"pool_blocks": pool, "prefix_caching": prefix_caching, "drafter": drafter,
                             **asdict(result), "recomputed_tokens": result.recomputed_tokens,
                             "mean_running": result.mean_running})  # fmt: skip
                if on_row is not None:
                    on_row(rows[-1])
    return rows


def table(rows: list[Row], title: str) -> Table:
    grid = Table(title=title, title_justify="left")
    for column in ("pool blocks", "prefix caching", "drafter", *(name for _, name, _ in COLUMNS)):
        grid.add_column(column, justify="left" if column == "drafter" else "right")
    for row in rows:
        grid.add_row(f"{row['pool_blocks']:,}", "on" if row["prefix_caching"] else "off", row["drafter"],
                     *(format(row[key], spec) for key, _, spec in COLUMNS))  # fmt: skip
    return grid


def title(options: LoadOptions) -> str:
    chats = (f"{options.conversations} conversations x {options.turns} turns (shared {options.system_tokens}-token "
             f"system prompt, {options.turn_tokens} new tokens a turn, whole history re-sent)")  # fmt: skip
    return (f"{chats} + {options.long_prompts} prompts of {options.long_prompt_tokens:,}, {options.output_tokens} "
            f"tokens out each; drafter W {options.window} / block {options.drafter_kv_block_size} / N "
            f"{options.num_speculative_tokens}, {options.target_groups} target groups x block "
            f"{options.target_kv_block_size}, chunk {options.max_num_batched_tokens}, max {options.max_num_seqs} "
            f"running")  # fmt: skip


def write_text(path: Path, grid: Table, header: list[str]) -> Path:
    with path.open("w") as handle:
        handle.write("\n".join(header) + "\n")
        Console(file=handle, width=200).print(grid)
    return path


def plot(rows: list[Row], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("recomputed_tokens", "tokens recomputed"), ("steps", "scheduler steps"),
              ("peak_running", "peak running requests"), ("mean_running", "mean running requests"))  # fmt: skip
    figure, axes = plt.subplots(1, len(panels), figsize=(17, 4))
    for axis, (key, label) in zip(axes, panels, strict=True):
        for drafter, color in zip(DRAFTERS, ("tab:red", "tab:blue"), strict=True):
            for caching, style in ((False, ":"), (True, "-")):
                points = [(r["pool_blocks"], r[key]) for r in rows
                          if r["drafter"] == drafter and r["prefix_caching"] == caching]  # fmt: skip
                axis.plot(*zip(*points, strict=True), style, color=color, marker="o",
                          label=f"{drafter}, prefix caching {'on' if caching else 'off'}")  # fmt: skip
        axis.set(xlabel="pool blocks", ylabel=label, title=label)
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.suptitle("Same requests, stock drafter vs ring (vLLM Scheduler + KVCacheManager, CPU)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def run(
    options: LoadOptions, out: Path, on_row: Callable[[Row], None] | None = None
) -> tuple[list[Row], Table, list[Path]]:
    """Measure and write ``load.jsonl``, ``load_cpu.txt`` and ``load.png`` into ``out``; returns (rows, the
    table, the files)."""
    rows = measure(options, on_row)
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    grid = table(rows, title(options))
    header = [
        f"Measured {env['time']} on {env['machine']} ({env['cpus']} cores), torch {env['torch']}, {env['vllm']}, "
        f"commit {env['commit']}.",
        f"Command: {options.command(out)}",
    ]
    files = [write_jsonl(out / "load.jsonl", [{**row, "options": asdict(options)} for row in rows]),
             write_text(out / "load_cpu.txt", grid, header), plot(rows, out / "load.png")]  # fmt: skip
    return rows, grid, files
