# SPDX-License-Identifier: Apache-2.0
"""The ``ringkv`` command line."""

from __future__ import annotations

import os

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


if __name__ == "__main__":
    app()
