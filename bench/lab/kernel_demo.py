# SPDX-License-Identifier: Apache-2.0
"""The kernel smoke behind ``ringkv demo``: the DFlash2 ring plan, and one drafter attention step deep into
a 262,144-token context, written through ``ring_write`` and checked against the reference."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from ringkv.kernels import BatchMode, ring_attention, ring_attention_reference
from ringkv.kernels.testing import DrafterShape, ErrorReport, RingPool, attention_error

GIB = 1024**3
MIB = 1024**2


# the demo's dtype and the full-length cache it compares the ring with
DTYPE = torch.bfloat16
MAX_MODEL_LEN = 262_144


def plan_rows(shape: DrafterShape) -> list[tuple[str, str]]:
    """(name, value) rows describing the ring plan and its memory next to a full-length cache."""
    plan = shape.plan
    token_bytes = shape.token_bytes(torch.finfo(DTYPE).bits // 8)
    ring_bytes = plan.num_slots * token_bytes
    full_bytes = MAX_MODEL_LEN * token_bytes
    return [
        (
            "window W / block bs / speculative N",
            f"{shape.window} / {shape.kv_block_size} / {shape.num_speculative_tokens}",
        ),
        ("lookahead la = N + 1", str(plan.lookahead)),
        ("ring blocks R = cdiv(W + la - 2, bs) + 1", str(plan.ring_blocks)),
        ("ring slots S = R * bs", str(plan.num_slots)),
        ("drafter KV per request and layer, ring", f"{ring_bytes / MIB:.3f} MiB"),
        (f"drafter KV per request and layer, full {MAX_MODEL_LEN}", f"{full_bytes / GIB:.3f} GiB"),
    ]


@dataclass(frozen=True)
class StepResult:
    positions: tuple[int, int]
    written: int
    error: ErrorReport
    seconds: float


def attention_step(shape: DrafterShape, last_position: int, device: torch.device, seed: int = 0) -> StepResult:
    """Write the last 8192 context positions as one prefill chunk (only the live ``W - 1`` land in the ring),
    then attend the draft block ending at ``last_position`` and compare with the reference."""
    generator = torch.Generator().manual_seed(seed)
    plan = shape.plan
    block = plan.lookahead
    context_len = last_position + 1 - block
    pool = RingPool.allocate(plan, 1, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, dtype=DTYPE,
                             device=device, num_blocks=2 * plan.ring_blocks + 1, generator=generator)  # fmt: skip
    chunk = torch.arange(max(0, context_len - 8192), context_len)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator).to(DTYPE).to(device)

    rows = (len(chunk), shape.num_kv_heads, shape.head_dim)
    slots = pool.write(0, chunk, rand(*rows), rand(*rows), seq_len=context_len)
    args = {
        "q": rand(block, shape.num_q_heads, shape.head_dim),
        "k_new": rand(block, shape.num_kv_heads, shape.head_dim),
        "v_new": rand(block, shape.num_kv_heads, shape.head_dim),
        "k_cache": pool.k_cache, "v_cache": pool.v_cache,
        "batch": pool.batch([context_len], block, mode=BatchMode.DRAFT_BLOCK),
        "window": shape.window, "causal": False,
    }  # fmt: skip
    start = time.perf_counter()
    out = ring_attention(**args)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    ref_hi = ring_attention_reference(**args, compute_dtype=torch.float64)
    ref_lo = ring_attention_reference(**args, compute_dtype=DTYPE)
    error = attention_error(out, ref_hi, ref_lo)
    return StepResult((context_len, last_position), int((slots >= 0).sum()), error, seconds)
