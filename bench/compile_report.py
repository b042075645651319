# SPDX-License-Identifier: Apache-2.0
"""Native compile report: every shipped kernel config compiled for sm_90 and sm_100 on a CPU machine, exactly as
a launch on that GPU would compile it, with registers, spill bytes, shared memory, CTAs per SM and the SASS
width of every K/V tile load.

How: each launch (``ring_attention`` on draft blocks and on prefill chunks, in the full sweep also with attention
sinks; ``ring_write``) runs on CPU stand-in tensors that have a real launch's shapes, strides and 16-byte-aligned
buffers, in two layouts (``LAYOUTS``): compact R-column ring rows, and what the vLLM plugin launches (full logical
rows of vLLM's block table, its per-layer cache, packed q/k/v; a table width that is a multiple of 16 specialises
the attention kernel). The kernel's ``run`` is
intercepted and its arguments are bound by Triton's own binder for the target (``create_function_from_signature`` over
``native_specialize_impl``: ``tt.divisibility=16`` on pointers and ints divisible by 16, 1-valued ints as
constants, ``do_not_specialize`` honoured), then ``triton.compile`` builds the cubin. A bare ``ASTSource``
without that specialisation compiles a different kernel: no ``tt.divisibility`` hints, so 2-byte K/V loads.
``cuobjdump --dump-resource-usage`` gives REG / STACK (local-memory spill bytes) / SHARED;
``nvdisasm --print-line-info`` attributes every global load to its source line, so the loads issued by
``_tiles.load_kv_tile`` (every K/V tile of the ring and of the batch's own rows) are counted by width.

This file is the command; the work is in ``native_compile.py`` (the tools, the compile, SASS / registers / spills),
``compile_launches.py`` (the launches compiled, and the sweeps over them) and ``compile_rows.py`` (gates, JSONL rows,
the README table).

Usage (the full sweep writes ``bench/results/compile_report.jsonl`` and the table in ``bench/README.md``)::

    .venv/bin/ringkv bench compile-report
    .venv/bin/ringkv bench compile-report --quick --out "$(mktemp -d)"   # the CI subset, no README
    .venv/bin/ringkv bench compile-report --vllm-source /path/to/site-packages  # + vLLM's kernel

vLLM's ``kernel_unified_attention`` is loaded at run time from its two source files (``vllm_unified.py``);
nothing of vLLM is copied here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer

from .compile_launches import DFLASH2, LAYOUTS, cases, keys_over_batch, layout_specialisation, report_rows, vllm_rows
from .compile_rows import DFLASH2_MAX_REGS, RESULTS, gate_failures, markdown_table, write_readme_section, write_rows
from .native_compile import ARCHS, ctas_per_sm
from .records import environment

# what tests/bench/test_compile_report.py takes from the report
__all__ = ["DFLASH2", "DFLASH2_MAX_REGS", "LAYOUTS", "compile_report", "ctas_per_sm", "gate_failures", "markdown_table"]


def compile_report(
    quick: Annotated[bool, typer.Option(help="the CI subset (no README update)")] = False,
    arch: Annotated[list[int] | None, typer.Option(help="compute capabilities to compile for")] = None,
    out: Annotated[Path, typer.Option(help="folder for compile_report.jsonl")] = RESULTS,
    readme: Annotated[bool, typer.Option(help="rewrite the table in bench/README.md (full sweep only)")] = True,
    vllm_source: Annotated[
        Path | None,
        typer.Option(help="site-packages of a vllm install, or a folder with its two Triton unified-attention files"),
    ] = None,
    keys_max_reqs: Annotated[int, typer.Option(help="count compiled decode kernels over N = 1..this (0: skip)")] = 0,
) -> None:
    """Compile the shipped kernels natively, write JSON rows and the README table, and check the gates."""
    os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter
    archs = tuple(arch or ARCHS)
    rows = report_rows(cases(quick), archs)
    if vllm_source is not None:
        try:
            rows += vllm_rows(vllm_source, archs, (8,) if quick else (1, 8, 256))
        except Exception as error:  # recorded, never fatal: the comparison is optional
            rows.append({"provider": "vllm-triton", "error": repr(error)[:500]})
    summary: dict[str, Any] = {
        "environment": environment(), "gate_failures": gate_failures(rows), "layouts": layout_specialisation(),
    }  # fmt: skip
    if keys_max_reqs:
        shapes = [(4, 128), (4, 256), (8, 128)] if quick else [(g, d) for g in (1, 4, 8) for d in (64, 128, 256)]
        summary["kernels_over_batch"] = {"max_reqs": keys_max_reqs, **keys_over_batch(keys_max_reqs, shapes)}
    write_rows(out, rows, summary)
    table = markdown_table([row for row in rows if "error" not in row])
    typer.echo(table)
    for failure in summary["gate_failures"]:
        typer.echo(f"GATE FAILED: {failure}", err=True)
    if readme and not quick:
        write_readme_section(table)
    if summary["gate_failures"]:
        raise typer.Exit(1)
