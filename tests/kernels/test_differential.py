# SPDX-License-Identifier: Apache-2.0
"""Randomized differential suite: ``ring_write`` and ``ring_attention`` (draft blocks and prefill chunks) against the
dense fp64 oracle (``ringkv.kernels.oracle``), which keeps every request's history by absolute position, and
against a model of the ring that says which row each slot holds.

Each case is a pure function of (kernel, dtype, tier, seed): tier and seed are in the test id and the seed in
every failure message; ``--seed-offset N`` draws other cases (``-k <tier>-s<seed>`` with the same offset reruns
one). The CI tier redraws from the same stream until a case is cheap under the interpreter. A case is a varlen batch
(zero-query requests included) over a NaN pool in one of vLLM's layouts, with compact (``table_period=R``) or full
logical rows (dead blocks -> the null block 0), int32 or int64 metadata; histories are written in chunks longer
than the ring through ``ring_write`` with ``RingPlan`` slot mappings, or by ``ring_attention(write_ring=True)``.
Before every attention launch each slot no query of it may read is NaN; after every launch the whole pool (guard
padding included) must be byte for byte what the model says: a write touches exactly its live slots. fp8 rings
(e4m3fn / e5m2 under bf16 / fp16 compute, random per-case scales) hold ``quantize_fp8`` bytes of the history, and the
oracle reads the dequantized history: quantization belongs to the input, not to the kernel. The ``_sinks`` variants
draw layers with attention sinks (rows ``[sink blocks | ring]``, histories from position 0) from seeds of their own.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.differential import Draw, RingWorld, attend, draw
from tests.testing import stable_seed

pytestmark = pytest.mark.interpreter

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# fp8 rings: (compute dtype, cache dtype)
FP8 = {f"{kv}-{name}": (DTYPES[name], fp8) for kv, fp8 in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2))
       for name in ("bf16", "fp16")}  # fmt: skip
# cases per (kernel, dtype): (CI, slow); fp8 draws per (kernel, fp8 pair); "_sinks": layers with attention sinks
CASES = {"write": (25, 250), "attention": (30, 300), "prefill": (20, 200), "attention_sinks": (4, 40),
         "prefill_sinks": (3, 30)}  # fmt: skip
FP8_CASES = {"write": (2, 20), "attention": (3, 30), "prefill": (2, 20), "attention_sinks": (1, 10),
             "prefill_sinks": (1, 10)}  # fmt: skip


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``(dtype, seed)`` per case: the CI set unmarked, the larger set ``slow``; ``--seed-offset`` shifts both."""
    if "seed" not in metafunc.fixturenames:
        return
    kernel = metafunc.function.__name__.removeprefix("test_").removesuffix("_differential")
    offset = metafunc.config.getoption("seed_offset")
    params = []
    for name in (*DTYPES, *FP8):
        ci, slow = (CASES if name in DTYPES else FP8_CASES)[kernel]
        for tier, count in (("ci", ci), ("slow", slow)):
            for index in range(count):
                seed = (stable_seed(kernel, name, tier, index) + offset) % 2**32
                marks = [pytest.mark.slow] if tier == "slow" else []
                params.append(pytest.param(name, seed, tier == "ci", marks=marks, id=f"{name}-{tier}-s{seed}"))
    metafunc.parametrize(("dtype_name", "seed", "ci"), params)


@pytest.fixture
def dtype(dtype_name: str) -> torch.dtype:
    """The compute dtype (of an fp8 pair too)."""
    return DTYPES[dtype_name] if dtype_name in DTYPES else FP8[dtype_name][0]


@pytest.fixture
def fp8_dtype(dtype_name: str) -> torch.dtype | None:
    """The fp8 cache dtype of an fp8 pair, else None (the cache holds the compute dtype)."""
    return FP8[dtype_name][1] if dtype_name in FP8 else None


def test_write_differential(dtype, fp8_dtype, seed, ci, device):
    d = draw("write", dtype, seed, ci=ci, fp8_dtype=fp8_dtype)
    world = RingWorld(d, device)
    cursors = list(d.contexts)
    for lens in d.launches:
        spans = [range(c, c + n) for c, n in zip(cursors, lens, strict=True)]
        world.write(spans, [s.stop for s in spans], after=f"ring_write of {spans}")
        cursors = [s.stop for s in spans]


def test_attention_differential(dtype, fp8_dtype, seed, ci, device):
    run_attention(draw("attention", dtype, seed, ci=ci, fp8_dtype=fp8_dtype), device)


def test_prefill_differential(dtype, fp8_dtype, seed, ci, device):
    run_prefill(draw("prefill", dtype, seed, ci=ci, fp8_dtype=fp8_dtype), device)


def test_attention_sinks_differential(dtype, fp8_dtype, seed, ci, device):
    run_attention(draw("attention", dtype, seed, ci=ci, fp8_dtype=fp8_dtype, sinks=True), device)


def test_prefill_sinks_differential(dtype, fp8_dtype, seed, ci, device):
    run_prefill(draw("prefill", dtype, seed, ci=ci, fp8_dtype=fp8_dtype, sinks=True), device)


def run_attention(d: Draw, device: torch.device) -> None:
    """The history through ``ring_write``, then one draft-block launch."""
    world = RingWorld(d, device)
    world.write_history()
    attend(world, d.launches[0], list(d.contexts), prefill=False, write=False)


def run_prefill(d: Draw, device: torch.device) -> None:
    """The history through ``ring_write``, then prefill chunks, each written after reading (the last one maybe
    not)."""
    world = RingWorld(d, device)
    world.write_history()
    contexts = list(d.contexts)
    for step, lens in enumerate(d.launches):
        last = step == len(d.launches) - 1
        attend(world, lens, contexts, prefill=True, write=not last or d.write_last)
        contexts = [c + n for c, n in zip(contexts, lens, strict=True)]
