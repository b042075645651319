# SPDX-License-Identifier: Apache-2.0
"""PNG plots for the CLI and the benchmarks (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path


def plot_drafter_blocks(series: dict[str, tuple[list[int], list[int]]], path: Path, title: str) -> Path:
    """``series``: label -> (context_len tokens per step, drafter blocks held per step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for label, (context, blocks) in series.items():
        axis.plot(context, blocks, marker=".", markersize=3, label=label)
    axis.set_xlabel("context (context_len tokens)")
    axis.set_ylabel("drafter KV blocks held")
    axis.set_title(title)
    axis.set_ylim(bottom=0)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
