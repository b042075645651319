# SPDX-License-Identifier: Apache-2.0
"""``ringkv bench load``: the named workloads (``ringkv.bench.lab.simulation.workloads``) through vLLM's real
Scheduler and KVCacheManager, stock drafter vs ring-today (every hit capped to rebuild the ring) vs ring-cached
(the ring's blocks in the prefix cache, ``RingSWASpec.cache_ring``), at pools given as multiples of the base
pool: the smallest where stock neither preempts nor evicts (``cells.search_base_pool``).

Every cell (workload, mode, pool) runs in a process of its own (a fresh child of a fork server that has imported
vLLM and run nothing), and the whole table runs ``repeats`` times; the rows of every repeat must be identical.
Per workload the table goes to ``{stem}[_{workload}]_cpu.txt`` (the chat workload's without the suffix),
headed by the command and the commit; every row of every repeat to ``{stem}.jsonl``; the plot to ``{stem}.png``
(``load_report.py``); ``stem`` is ``load_w{W}`` for #55800's drafter (``LoadOptions.stem``). The command fails
(``run``'s ``ok``) unless every repeat gives identical rows, no request of a ring group held more than its bound
``ns + R`` at any step, and every block was back in the pool at the end.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .load_options import LoadOptions
from .load_report import plot, table, write_text
from .records import environment, write_jsonl

if TYPE_CHECKING:
    from ringkv.bench.lab.simulation.cells import Cell, Shape

Row = dict[str, Any]
# the module every cell's process needs, imported once by the fork server
CELL_MODULE = "ringkv.bench.lab.simulation.cells"
# the fork server's (hence every cell's) PYTHONHASHSEED
HASH_SEED = "0"


def text_name(stem: str, workload: str) -> str:
    """The results file of one workload's table (the chat workload's is the headline, without its name)."""
    return f"{stem}{'' if workload == 'chat' else '_' + workload}_cpu.txt"


def bound_failures(rows: list[Row]) -> list[str]:
    """The cells where a request held more drafter blocks than its ring group's bound at some step, or blocks
    stayed out of the pool at the end, as ``workload/mode/pool: what``."""
    failures = []
    for row in rows:
        if "pool_too_small" in row:
            continue
        cell = f"{row['workload']}/{row['mode']}/{row['pool_blocks']}"
        if row["requests_over_bound"]:
            failures.append(f"{cell}: {row['requests_over_bound']} (step, request, group) over the ring's bound")
        if row["leaked_blocks"]:
            failures.append(f"{cell}: {row['leaked_blocks']} blocks not back in the pool")
    return failures


@dataclass
class Search:
    """One workload's base pool and the stock probes that found it (pool order)."""

    base_pool: int
    probes: list[Row]

    def describe(self) -> str:
        below = next(p for p in reversed(self.probes) if p["pool_blocks"] < self.base_pool)
        why = (
            "no request ran" if "pool_too_small" in below
            else f"preemptions {below['preemptions']}, evicted cache entries "
                 f"{below['target_evictions'] + below['drafter_evictions']}"
        )  # fmt: skip
        return (f"base pool {self.base_pool:,} blocks: the smallest where stock neither preempts nor evicts "
                f"(doubling, then bisection: {len(self.probes)} stock runs; at {below['pool_blocks']:,}: "
                f"{why})")  # fmt: skip


def _search(shape: Shape) -> Search:
    from ringkv.bench.lab.simulation.cells import search_base_pool

    return Search(*search_base_pool(shape))


def _cell(cell: Cell) -> tuple[tuple[int, int], Row]:
    """(this process: its id and start time, unique while the machine runs; the cell's row)."""
    from ringkv.bench.lab.simulation.cells import run_cell

    # /proc/self/stat's 22nd field, the start time in clock ticks (the name in field 2 may hold spaces)
    started = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    return (os.getpid(), started), run_cell(cell)


def measure(options: LoadOptions, on_cell: Callable[[], None] | None = None) -> tuple[list[Row], dict[str, Search]]:
    """Every repeat's rows (workload, repeat, pool, mode order) and each workload's search; each search and each
    cell in a process of its own (checked: ``RuntimeError`` if two cells shared one), all forked from a fork server
    started with ``PYTHONHASHSEED=HASH_SEED``."""
    # every cell forks from the fork server and inherits its str/bytes hash seed: vLLM's offloading iterates sets of
    # chunk keys (bytes), so without a pinned seed its rows could differ from one run of the command to the next
    # (the server starts with this process's environment at the first submit, and then lives on)
    caller_seed = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = HASH_SEED
    try:
        return _measure(options, on_cell)
    finally:
        if caller_seed is None:
            del os.environ["PYTHONHASHSEED"]
        else:
            os.environ["PYTHONHASHSEED"] = caller_seed


def _measure(options: LoadOptions, on_cell: Callable[[], None] | None) -> tuple[list[Row], dict[str, Search]]:
    from ringkv.bench.lab.simulation.cells import MODES, Cell

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([CELL_MODULE])
    with ProcessPoolExecutor(options.jobs, mp_context=context, max_tasks_per_child=1) as pool:
        searches = {w: pool.submit(_search, options.shape(w)) for w in options.workload}
        cells: list[tuple[Row, Future[tuple[tuple[int, int], Row]]]] = []
        for workload in options.workload:
            search = searches[workload].result()
            if on_cell is not None:
                on_cell()
            for repeat in range(1, options.repeats + 1):
                for multiple in options.pool_multiple:
                    pool_blocks = max(2, round(multiple * search.base_pool))
                    cpu_blocks = max(1, round(options.offload_multiple * search.base_pool))
                    for mode in options.mode:
                        tier = cpu_blocks if MODES[mode].offload else 0
                        cell = Cell(options.shape(workload), mode, pool_blocks, tier)
                        coordinates = {"repeat": repeat, "pool_multiple": multiple, "base_pool": search.base_pool}
                        cells.append((coordinates, pool.submit(_cell, cell)))
        rows, processes = [], set()
        for coordinates, future in cells:
            process, row = future.result()
            processes.add(process)
            rows.append({**coordinates, **row})
            if on_cell is not None:
                on_cell()
    if len(processes) != len(rows):
        raise RuntimeError(f"{len(rows)} cells ran in {len(processes)} processes; each needs its own")
    return rows, {w: f.result() for w, f in searches.items()}


def differing_repeats(rows: list[Row]) -> list[str]:
    """The cells whose rows differ between repeats (every measured column), as ``workload/mode/pool (multiple)``."""
    first: dict[tuple, Row] = {}
    differ = []
    for row in rows:
        key = (row["workload"], row["mode"], f"{row['pool_blocks']} ({row['pool_multiple']:g})")
        measured = {k: v for k, v in row.items() if k != "repeat"}
        if key in first and first[key] != measured:
            differ.append("/".join(map(str, key)))
        first.setdefault(key, measured)
    return differ


def cell_count(options: LoadOptions) -> int:
    """Progress units: one per search, one per cell."""
    cells = options.repeats * len(options.pool_multiple) * len(options.mode)
    return len(options.workload) * (1 + cells)


def run(
    options: LoadOptions, out: Path, on_cell: Callable[[], None] | None = None
) -> tuple[list[Row], list[Path], bool]:
    """Measure and write the text tables, the JSONL rows and the plot into ``out``; returns (rows, the files, ok:
    every repeat gave identical rows and no cell has ``bound_failures``)."""
    rows, searches = measure(options, on_cell)
    differ, failures = differing_repeats(rows), bound_failures(rows)
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    header = [
        f"Measured {env['time']} on {env['machine']} ({env['cpus']} cores), torch {env['torch']}, {env['vllm']}, "
        f"commit {env['commit']}.",
        f"Command: {options.command(out)}",
    ]
    identical = (f"{options.repeats} runs of the table, each cell in a process of its own: "
                 + (f"rows DIFFER at {', '.join(differ)}" if differ else "every row identical"))  # fmt: skip
    bounds = ("Drafter blocks per request within each ring group's ns + R at every step, every block back in the pool "
              "at the end: " + ("; ".join(failures) if failures else "yes, in every cell"))  # fmt: skip
    recorded = [{**row, "identical_repeats": not differ, "options": asdict(options)} for row in rows]
    files = [write_jsonl(out / f"{options.stem}.jsonl", recorded)]
    for workload in options.workload:
        first = [r for r in rows if r["workload"] == workload and r["repeat"] == 1]
        grid = table(first, options, searches[workload].describe())
        files.append(write_text(out / text_name(options.stem, workload), grid, [*header, identical, bounds]))
    files.append(plot([r for r in rows if r["repeat"] == 1], out / f"{options.stem}.png"))
    return rows, files, not differ and not failures
