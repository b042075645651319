# SPDX-License-Identifier: Apache-2.0
"""The kernels compiled natively for sm_90 and sm_100 on a CPU machine (``ringkv bench compile-report``), in the
compact ring layout and in the one the vLLM plugin launches (full logical block-table rows), gated: no spills in any
shipped config, every K/V tile load 128-bit, the DFlash2 decode shape at <= 136 registers x 4 warps (>= 3 CTAs per
SM), and one compiled attention kernel per shape and layout for every batch size N = 1..256."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ringkv.bench.compile_report import DFLASH2, DFLASH2_MAX_REGS, LAYOUTS, ctas_per_sm, gate_failures, markdown_table


def run_report(tmp_path: Path, *options: str) -> tuple[list[dict], dict, str]:
    # compiled kernels, not the interpreter tests/conftest.py chose for this process
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "ringkv.bench.cli", "bench", "compile-report", "--out", str(tmp_path), *options],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "compile_report.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "compile_report_summary.json").read_text())
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]  # 1: a gate failed
    return rows, summary, done.stderr[-3000:]


def test_quick_compile_report_passes_the_gates(tmp_path):
    rows, summary, stderr = run_report(tmp_path, "--quick", "--keys-max-reqs", "256")
    # one compiled kernel per shape whatever the number of requests (runtime split count and bounds)
    over_batch = dict(summary["kernels_over_batch"])
    assert over_batch.pop("max_reqs") == 256
    assert set(over_batch) == {"G4-D128", "G4-D256", "G8-D128", "G4-D128-plugin", "G4-D256-plugin", "G8-D128-plugin"}
    assert all(counts == {"_ring_attention_kernel": 1, "_combine_splits_kernel": 1}
               for counts in over_batch.values()), over_batch  # fmt: skip
    assert summary["gate_failures"] == [], stderr
    assert {row["arch"] for row in rows} == {90, 100}
    kernels = {row["kernel"] for row in rows}
    assert kernels == {"_ring_attention_kernel", "_combine_splits_kernel", "_ring_write_kernel"}
    # every DFlash2-shape case (decode, prefill, write; bf16 and fp8) compiled in both layouts
    dflash2_cases = {
        (row["op"], row.get("kv"), row["arch"]) for row in rows if row.get("G", 4) == 4 and row["D"] == 128
    }
    for layout in LAYOUTS:
        assert dflash2_cases == {(row["op"], row.get("kv"), row["arch"]) for row in rows if row["layout"] == layout and
                                 row.get("G", 4) == 4 and row["D"] == 128}, layout  # fmt: skip
    dflash2 = [row for row in rows if row["kernel"] == "_ring_attention_kernel" and
               all(row[k] == v for k, v in DFLASH2.items())]  # fmt: skip
    assert {(row["arch"], row["layout"]) for row in dflash2} == {
        (arch, layout) for arch in (90, 100) for layout in LAYOUTS
    }
    for row in dflash2:
        assert row["regs"] <= DFLASH2_MAX_REGS and row["num_warps"] == 4 and row["ctas_per_sm"] >= 3
        assert row["spill_bytes"] == 0 and row["kv_loads"] and all(op.endswith(".128") for op in row["kv_loads"])

    # the plugin's table width (table_period = stride_bt_r = cdiv(max_model_len, bs)) is the only specialisation
    # between the layouts: a multiple of 16 compiles another attention kernel (gated above), any other width the
    # compact layout's; the split merge never changes
    layouts = summary["layouts"]
    for op in ("decode", "prefill"):
        assert layouts[f"{op} width 16384"]["_ring_attention_kernel"] == {
            "same_kernel": False,
            "differs": {"table_period": ["i32", "i32 D"], "stride_bt_r": ["i64", "i64 D"]},
        }
        assert all(entry["same_kernel"] for entry in layouts[f"{op} width 16385"].values()), layouts
    assert layouts["decode width 16384"]["_combine_splits_kernel"]["same_kernel"], layouts


@pytest.mark.slow
def test_full_compile_report_passes_the_gates(tmp_path):
    """Every shipped config (decode N x G x D, prefill C x G x D, ring_write D) on both archs."""
    rows, summary, stderr = run_report(tmp_path, "--no-readme", "--keys-max-reqs", "256")
    assert summary["gate_failures"] == [], stderr
    shapes = {(row["op"], row.get("G"), row.get("D"), row.get("kv"), row["layout"], row["arch"]) for row in rows}
    assert len(shapes) == 2 * 2 * 2 * (9 + 9 + 3), "every shape: bf16 and fp8 rings, both layouts, both archs"


def test_ctas_per_sm():
    # registers: 65,536 per SM, allocated per warp in units of 256
    assert ctas_per_sm(255, 45 * 1024, 4) == 2
    assert ctas_per_sm(160, 33 * 1024, 4) == 3
    assert ctas_per_sm(168, 33 * 1024, 4) == 3 and ctas_per_sm(169, 33 * 1024, 4) == 2
    assert ctas_per_sm(128, 41 * 1024, 4) == 4
    assert ctas_per_sm(64, 100 * 1024, 4) == 2, "shared memory bounds it: 228 KB per SM"
    assert ctas_per_sm(16, 0, 1) == 32, "at most 32 CTAs per SM"
    assert ctas_per_sm(32, 0, 32) == 2, "2048 threads per SM"


def test_gates_catch_spills_narrow_loads_and_register_pressure():
    good = {"provider": "ringkv", "kernel": "_ring_attention_kernel", "op": "decode", "N": 1, **DFLASH2, "arch": 90,
            "regs": 128, "num_warps": 4, "ctas_per_sm": 4, "spill_bytes": 0,
            "kv_loads": {"LDGSTS.E.BYPASS.128": 20}}  # fmt: skip
    assert gate_failures([good]) == []
    assert gate_failures([{**good, "spill_bytes": 8}]) == [
        '_ring_attention_kernel decode {"N": 1, "G": 4, "D": 128} sm_90: 8 bytes of spills'
    ]
    assert "narrower than 128 bits" in gate_failures([{**good, "kv_loads": {"LDG.E.U16": 16, "LDG.E.128": 4}}])[0]
    # an fp8 tile of 16 keys x 64 dims is 1 KB: 8 bytes for each of 128 threads
    fp8_d64 = {**good, "D": 64, "kv": "fp8_e4m3", "kv_loads": {"LDGSTS.E.64": 6}}
    assert gate_failures([fp8_d64]) == []
    assert "narrower than 64 bits" in gate_failures([{**fp8_d64, "kv_loads": {"LDG.E": 6}}])[0]
    assert "narrower than 128 bits" in gate_failures([{**fp8_d64, "D": 128}])[0]
    assert "no K/V tile load" in gate_failures([{**good, "kv_loads": {}}])[0]
    assert "160 registers x 4 warps" in gate_failures([{**good, "regs": 160, "ctas_per_sm": 3}])[0]
    assert gate_failures([{**good, "G": 8, "regs": 200, "ctas_per_sm": 2}]) == [], "the register gate is DFlash2's"
    assert gate_failures([{**good, "provider": "vllm-triton", "spill_bytes": 8}]) == [], "baselines are not gated"


def test_table_merges_the_layouts_only_where_they_compiled_the_same_kernels():
    row = {"provider": "ringkv", "op": "decode", "kernel": "_ring_attention_kernel", "G": 4, "D": 128, "arch": 90,
           "key": "a", "regs": 128, "spill_bytes": 0, "smem_bytes": 41 * 1024, "ctas_per_sm": 4, "mma": "wgmma",
           "kv_loads": {"LDGSTS.E.BYPASS.128": 20}, "loads": {}}  # fmt: skip
    compact, plugin = {**row, "N": 1, "layout": "compact"}, {**row, "N": 256, "layout": "plugin"}
    lines = markdown_table([compact, plugin]).splitlines()[2:]
    assert len(lines) == 1 and "| compact = plugin | N=1, N=256 |" in lines[0], lines
    lines = markdown_table([compact, {**plugin, "key": "b"}]).splitlines()[2:]
    assert ["| compact | N=1 |" in lines[0], "| plugin | N=256 |" in lines[1]] == [True, True], lines
