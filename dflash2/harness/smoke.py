# SPDX-License-Identifier: Apache-2.0
"""The drafter-level long-context smoke behind ``ringkv smoke``.

Context K/V for a ``context``-position prompt are written in chunks through the ring (target features are
synthesized, seeded: the point is the drafter's KV path, not a target forward), then ``steps`` draft steps
with random acceptance lengths. Every step's draft logits from the ring are checked against a full-history
cache (every position kept, window mask by absolute position) under the tolerance rule: the full-history
drafter in fp64 is ``ref_hi``, in fp32 ``ref_lo``. With an fp8 ``kv_cache_dtype`` the ring stores fp8 rows
(``DraftKVCache(kv_cache_dtype=...)``, scales 1.0 as vLLM's default) while both references keep exact K/V: the
error is then the quantization's, and the tolerance bound (a kernel bound) is reported beside it: ``SmokeResult.ok``
does not gate it.

Run: ``.venv/bin/ringkv smoke --context 262144 --kv-cache-dtype fp8_e4m3``.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from ringkv.dflash2.model import DFlash2Drafter
from ringkv.kernels.kv_quant import fp8_dtype_of
from ringkv.kernels.testing import ErrorReport, attention_error

from .ring_cache import DraftKVCache
from .tiny import random_drafter, tiny_config


@dataclass(frozen=True)
class SmokeResult:
    context: int
    steps: int
    final_position: int
    # the worst step's (largest max_error / bound): the smoke passes when it does
    error: ErrorReport
    worst_step: int
    ring_kv_bytes: int
    full_kv_bytes: int
    seconds: float
    kv_cache_dtype: str = "auto"

    @property
    def ok(self) -> bool:
        """The smoke's verdict: every step within the tolerance rule; an fp8 ring's error is the input's
        quantization, which a kernel bound does not cover, so it is reported and not gated."""
        return fp8_dtype_of(self.kv_cache_dtype) is not None or self.error.ok


def run_smoke(
    context: int,
    steps: int = 32,
    *,
    chunk: int = 8192,
    window: int = 2048,
    draft_block: int = 8,
    seed: int = 0,
    attention: str = "triton",
    device: str = "cpu",
    progress: Callable[[str, int], None] | None = None,
    kv_cache_dtype: str = "auto",
) -> SmokeResult:
    """Ring vs full-history drafter on one request at ``context`` positions (see the module docstring)."""
    config = tiny_config(window=window, draft_block=draft_block, hidden_size=64, num_layers=2, num_q_heads=4,
                         num_kv_heads=1, head_dim=32, target_layer_ids=(0, 1))  # fmt: skip
    drafter = random_drafter(config, seed).to(device)
    reference = random_drafter(config, seed).double().to(device)
    embed = torch.nn.Embedding(config.vocab_size, config.hidden_size).to(device)
    head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False).to(device)
    embed64, head64 = copy.deepcopy(embed).double(), copy.deepcopy(head).double()
    capacity = context + steps * draft_block + draft_block
    options = {"attention": attention, "kv_block_size": 16, "device": device}
    ring = DraftKVCache(config, 1, kv_cache_dtype=kv_cache_dtype, **options)  # type: ignore[arg-type]
    full32 = DraftKVCache(config, 1, mode="full", max_positions=capacity, device=device)
    full64 = DraftKVCache(config, 1, mode="full", max_positions=capacity, dtype=torch.float64, device=device)
    features_rng = torch.Generator().manual_seed(seed)
    width = drafter.fc.in_features
    started = time.perf_counter()

    def commit(start: int, end: int) -> None:
        features = torch.randn(end - start, width, generator=features_rng).to(device)
        positions = torch.arange(start, end, device=device)
        with torch.no_grad():
            drafter.write_context(ring, 0, features, positions)
            drafter.write_context(full32, 0, features, positions)
            reference.write_context(full64, 0, features.double(), positions)

    for start in range(0, context, chunk):
        commit(start, min(start + chunk, context))
        if progress is not None:
            progress("prefill", min(start + chunk, context))
    rng = random.Random(seed)
    context_len, worst, worst_step = context, ErrorReport(0.0, 0.0, ()), 0
    for step in range(steps):
        anchor = torch.tensor([rng.randrange(config.vocab_size - 1)], device=device)
        with torch.no_grad():
            _, logits = drafter.draft(ring, anchor, [context_len], embed, head)
            _, logits_lo = drafter.draft(full32, anchor, [context_len], embed, head)
            _, logits_hi = reference.draft(full64, anchor, [context_len], embed64, head64)
        report = attention_error(logits, logits_hi, logits_lo)
        if report.max_error / max(report.bound, 1e-30) >= worst.max_error / max(worst.bound, 1e-30):
            worst, worst_step = report, step
        accepted = 1 + rng.randint(0, draft_block - 1)
        commit(context_len, context_len + accepted)
        context_len += accepted
        if progress is not None:
            progress("draft", step + 1)
    return SmokeResult(
        context=context, steps=steps, final_position=context_len, error=worst, worst_step=worst_step,
        ring_kv_bytes=ring.nbytes(), full_kv_bytes=_full_bytes(full32, context_len),
        seconds=time.perf_counter() - started, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip


def _full_bytes(cache: DraftKVCache, positions: int) -> int:
    """Bytes a full-history cache needs for ``positions`` tokens (the allocation is a little larger)."""
    k, _ = cache.storage[0]
    per_position = 2 * k[0, 0].numel() * k.element_size() * len(cache.storage)
    return per_position * positions


__all__ = ["DFlash2Drafter", "SmokeResult", "run_smoke"]
