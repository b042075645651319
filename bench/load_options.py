# SPDX-License-Identifier: Apache-2.0
"""The options of ``ringkv bench load`` (``load.py`` runs them, ``load_report.py`` heads its tables with them)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ringkv.bench.lab.simulation.cells import Shape

WORKLOAD_NAMES = ("chat", "agentic", "long")
MODE_NAMES = ("stock", "ring-today", "ring-cached", "stock-offload", "ring-offload", "ring-cached-offload")


@dataclass(frozen=True)
class LoadOptions:
    """The run (each field a ``ringkv bench load`` flag): #55800's deployment (W 2048, block 16, N 7; 6 target
    groups x block 2304, chunk 8192), the workloads, the modes and the pools as multiples of the base pool; the CPU
    tier of the offloading modes as a multiple of the base pool (``offload_multiple``, in the pool's blocks).
    ``full_window`` > 0: a mixed drafter (issue 38), a full-attention group beside the sliding one, vLLM's
    ``FullAttentionSpec`` in the stock modes and windowed to ``full_window`` keys plus ``sinks`` sink tokens in the
    ring modes (``RINGKV_DRAFTER_FULL_WINDOW`` / ``_SINKS``); the plugin's refusals of sinks hold here
    (``cells.run_cell``)."""

    workload: tuple[str, ...] = WORKLOAD_NAMES[:2]
    mode: tuple[str, ...] = MODE_NAMES
    pool_multiple: tuple[float, ...] = (0.125, 0.25, 0.375, 0.5, 0.75, 1.0)
    offload_multiple: float = 1.0
    window: int = 2048
    drafter_kv_block_size: int = 16
    num_speculative_tokens: int = 7
    target_groups: int = 6
    target_kv_block_size: int = 2304
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 64
    conversations: int = 0
    seed: int = 0
    full_window: int = 0
    sinks: int = 0
    prefix_caching: bool = True
    repeats: int = 2
    jobs: int = 2

    def command(self, out: Path) -> str:
        """The ``ringkv`` command line that makes this run."""
        flags = []
        for field in fields(self):
            values, flag = getattr(self, field.name), field.name.replace("_", "-")
            if isinstance(values, bool):
                flags.append(f"--{'' if values else 'no-'}{flag}")
                continue
            for value in values if isinstance(values, tuple) else (values,):
                flags.append(f"--{flag} {value}")
        return " ".join(["ringkv bench load", *flags, f"--out {out}"])

    @property
    def stem(self) -> str:
        """The results files' name: ``load_w{W}``, then ``_wf{Wf}`` for a mixed drafter, ``_s{S}`` with sinks,
        ``_nopc`` with prefix caching off."""
        mixed = f"_wf{self.full_window}" if self.full_window else ""
        sinks = f"_s{self.sinks}" if self.sinks else ""
        return f"load_w{self.window}{mixed}{sinks}{'' if self.prefix_caching else '_nopc'}"

    def shape(self, workload: str) -> Shape:
        from ringkv.bench.lab.simulation.cells import Shape

        shared = {field.name: getattr(self, field.name) for field in fields(Shape) if field.name != "workload"}
        return Shape(workload=workload, **shared)
