# SPDX-License-Identifier: Apache-2.0
"""The compile report's results: the CI gates over its rows, the JSONL rows and summary, and the markdown table
spliced into ``bench/README.md`` between its markers."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

from .compile_launches import BLOCK_SIZE, DFLASH2
from .markdown_splice import splice
from .records import REPO

README = REPO / "bench" / "README.md"
RESULTS = REPO / "bench" / "results"
BEGIN_MARK = "<!-- compile-report:begin -->"
END_MARK = "<!-- compile-report:end -->"
# gates (tests/bench/test_compile_report.py): the DFlash2 decode shape at 4 warps
DFLASH2_MAX_REGS = 136


def load_bits(op: str) -> int:
    """Width of a SASS global load: ``LDG.E.128`` 128, ``LDG.E.U16`` 16, plain ``LDG.E`` 32."""
    digits = re.sub(r"\D", "", op.split(".")[-1])
    return int(digits) if digits else 32


def widest_kv_load_bits(row: dict) -> int:
    """The widest K/V tile load a kernel can issue: 128 bits, unless the ring tile (``BLOCK_SIZE`` keys x D) is
    smaller than 16 bytes per thread: an fp8 tile of 16 x 64 is 1 KB, 64 bits for each of 4 warps' threads."""
    tile_bytes = BLOCK_SIZE * row["D"] * (1 if "kv" in row else 2)
    return min(128, 8 * tile_bytes // (32 * row["num_warps"]))


def gate_failures(rows: list[dict]) -> list[str]:
    """The CI gates: no spills anywhere; every K/V tile load as wide as the tile allows (128-bit but for fp8
    tiles under 16 bytes per thread, ``widest_kv_load_bits``); the DFlash2 decode shape <= 136 registers at 4
    warps (>= 3 CTAs per SM). With sinks (an opt-in full-attention layer, not the sliding drafter the register
    bound is set for) that shape keeps >= 3 CTAs per SM at 4 warps."""
    failures = []
    for row in rows:
        if row["provider"] != "ringkv":
            continue
        shape = json.dumps({k: row[k] for k in ("N", "C", "G", "D", "kv", "sinks", "layout") if k in row})
        name = f"{row['kernel']} {row['op']} {shape} sm_{row['arch']}"
        if row["spill_bytes"]:
            failures.append(f"{name}: {row['spill_bytes']} bytes of spills")
        kv = row["kv_loads"] or {}
        widest = widest_kv_load_bits(row)
        narrow = {op: n for op, n in kv.items() if load_bits(op) < widest}
        if narrow:
            failures.append(f"{name}: K/V tile loads narrower than {widest} bits {narrow}")
        if row["kernel"] == "_ring_attention_kernel" and not kv:
            failures.append(f"{name}: no K/V tile load found in the SASS line info")
        dflash2 = row["kernel"] == "_ring_attention_kernel" and all(row.get(k) == v for k, v in DFLASH2.items())
        bounded = not row.get("sinks")
        over = bounded and row["regs"] > DFLASH2_MAX_REGS
        if dflash2 and (row["num_warps"] != 4 or over or row["ctas_per_sm"] < 3):
            want = f"<= {DFLASH2_MAX_REGS} x 4" if bounded else "4 warps"
            failures.append(f"{name}: {row['regs']} registers x {row['num_warps']} warps, "
                            f"{row['ctas_per_sm']} CTAs/SM (want {want}, >= 3)")  # fmt: skip
    return failures


def _loads_text(loads: dict[str, int] | None) -> str:
    if not loads:
        return "-"
    return ", ".join(f"{n}x {op.replace('.E.BYPASS', '').replace('.E', '')}" for op, n in sorted(loads.items()))


def shape_text(key: str, value: object) -> str:
    """A shape column's word: ``G4``, ``D128``, the ring's ``fp8_e4m3``, ``4 sinks``."""
    return {"kv": f"{value}", "sinks": f"{value} sinks"}.get(key, f"{key}{value}")


def markdown_table(rows: list[dict]) -> str:
    """One line per (provider, kernel, shape, layout) with sm_90 and sm_100 side by side; batch sizes that compiled
    to the same kernel are merged, and so are the layouts where they compiled to the same kernels
    (``compact = plugin``)."""
    merged: dict[tuple, dict] = {}
    for row in rows:
        size = "N" if "N" in row else "C" if "C" in row else None
        shape = tuple((k, row[k]) for k in ("G", "D", "kv", "sinks") if k in row)
        ident = (row["provider"], row["op"], row["kernel"], shape, row.get("layout", "-"))
        entry = merged.setdefault(ident, {"sizes": set(), "arch": {}, "keys": set()})
        if size:
            entry["sizes"].add(f"{size}={row[size]}")
        entry["keys"].add((row["arch"], row["key"]))
        entry["arch"].setdefault(row["arch"], row)
    # per shape (first seen first): the compact layout's line, then the plugin's, or one line where both compiled to
    # the same kernels; vLLM's rows have no layout
    ordered: dict[tuple, dict] = {}
    for ident in dict.fromkeys(key[:-1] for key in merged):
        compact, plugin = merged.get((*ident, "compact")), merged.get((*ident, "plugin"))
        if compact and plugin and compact["keys"] == plugin["keys"]:
            ordered[(*ident, "compact = plugin")] = {**compact, "sizes": compact["sizes"] | plugin["sizes"]}
        else:
            ordered.update({key: entry for key, entry in merged.items() if key[:-1] == ident})
    lines = [
        "| provider | kernel | shape | layout | sizes (one kernel) | sm_90 regs / spill B / smem KB / CTAs per SM | "
        "sm_90 MMA | K/V tile loads (sm_90) | sm_100 regs / spill B / smem KB / CTAs per SM | sm_100 MMA |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def res(row: dict | None) -> str:
        if row is None:
            return "-"
        return f"{row['regs']} / {row['spill_bytes']} / {row['smem_bytes'] / 1024:.0f} / {row['ctas_per_sm']}"

    for (provider, op, kernel, shape, layout), entry in ordered.items():
        kernels_per_arch = Counter(arch for arch, _ in entry["keys"])
        sizes = ", ".join(sorted(entry["sizes"], key=lambda s: int(s.split("=")[1])))
        if any(n > 1 for n in kernels_per_arch.values()):
            sizes += f" ({max(kernels_per_arch.values())} kernels)"
        sm90, sm100 = entry["arch"].get(90), entry["arch"].get(100)
        kv = _loads_text(sm90["kv_loads"]) if sm90 else "-"
        if sm90 and sm90["kv_loads"] is None:
            kv = "all global loads: " + _loads_text(sm90["loads"])
        name = f"{op} {kernel.strip('_')}"
        lines.append(
            f"| {provider} | {name} | {' '.join(shape_text(k, v) for k, v in shape) or '-'} | {layout} | "
            f"{sizes or '-'} | {res(sm90)} | "
            f"{sm90['mma'] if sm90 else '-'} | {kv} | {res(sm100)} | {sm100['mma'] if sm100 else '-'} |"
        )
    return "\n".join(lines)


def write_readme_section(body: str) -> None:
    README.write_text(splice(README.read_text(), BEGIN_MARK, END_MARK, body + "\n", where=str(README)))


def write_rows(out: Path, rows: list[dict], summary: dict[str, Any]) -> None:
    """``compile_report.jsonl`` (each row with the environment record) and ``compile_report_summary.json``."""
    out.mkdir(parents=True, exist_ok=True)
    with (out / "compile_report.jsonl").open("w") as handle:
        for row in rows:
            handle.write(json.dumps({**row, **summary["environment"]}) + "\n")
    (out / "compile_report_summary.json").write_text(json.dumps(summary, indent=1))
