# SPDX-License-Identifier: Apache-2.0
"""Shared test helpers: ring cases with NaN-poisoned pools, the dense oracle's reference pair, the tolerance rule."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import triton
from ringkv.kernels.kv_quant import dequantize, quantize_fp8
from ringkv.kernels.oracle import oracle_pair
from ringkv.kernels.reference import ring_attention_reference, ring_write_reference
from ringkv.kernels.ring_geometry import RingPlan, first_visible_position
from ringkv.kernels.testing import RingPool, aligned_cache, attention_error
from ringkv.kernels.varlen import BatchMode, VarlenBatch

NAN = float("nan")
TENSOR_FIELDS = ("q", "k_new", "v_new", "k_cache", "v_cache", "block_table", "query_start_loc", "seq_lens")


def stable_seed(*parts: object) -> int:
    """A per-case seed from the case's parameters (stable across runs and processes)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little")


@dataclass
class RingCase:
    """One varlen draft-block batch over ring KV, plus the dense history the oracle uses."""

    q: torch.Tensor
    k_new: torch.Tensor
    v_new: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    window: int
    causal: bool
    table_period: int | None
    plan: RingPlan
    # per request: (first history position, history K [n, Hkv, D], history V [n, Hkv, Dv])
    history: list[tuple[int, torch.Tensor, torch.Tensor]] = field(repr=False)
    seed: int = 0
    mode: BatchMode = BatchMode.DRAFT_BLOCK
    # fp8 caches: the per-layer dequantization scales ([1] fp32), else None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def batch(self) -> VarlenBatch:
        """The case's varlen batch (bounds read from the tensors)."""
        return VarlenBatch.build(
            self.query_start_loc, self.seq_lens, self.block_table, mode=self.mode, table_period=self.table_period
        )

    def kernel_args(self) -> dict[str, object]:
        scales = {} if self.k_scale is None else {"k_scale": self.k_scale, "v_scale": self.v_scale}
        return {
            "q": self.q, "k_new": self.k_new, "v_new": self.v_new, "k_cache": self.k_cache,
            "v_cache": self.v_cache, "batch": self.batch(), "window": self.window, "causal": self.causal, **scales,
        }  # fmt: skip

    def to(self, device: torch.device) -> RingCase:
        """The same case with every tensor on ``device``."""
        moved = {name: getattr(self, name).to(device) for name in TENSOR_FIELDS}
        if self.k_scale is not None:
            moved |= {"k_scale": self.k_scale.to(device), "v_scale": self.v_scale.to(device)}
        # .to() would copy a padded view into a dense (unaligned) tensor: move the padded storage instead
        for name in ("k_cache", "v_cache"):
            cache = getattr(self, name)
            moved[name] = aligned_cache(tuple(cache.shape), cache.dtype, device).copy_(cache)
        return RingCase(**{**self.__dict__, **moved})

    @property
    def context_lens(self) -> list[int]:
        lens = (self.query_start_loc[1:] - self.query_start_loc[:-1]).tolist()
        return [s - n for s, n in zip(self.seq_lens.tolist(), lens, strict=True)]


def make_ring_case(
    requests: list[tuple[int, int]],
    *,
    window: int,
    kv_block_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    head_dim_v: int | None = None,
    dtype: torch.dtype = torch.float32,
    causal: bool = False,
    lookahead: int | None = None,
    full_rows: bool = False,
    pad_tokens: int = 0,
    seed: int = 0,
    history_fn=None,
    mode: BatchMode = BatchMode.DRAFT_BLOCK,
    fp8_dtype: torch.dtype | None = None,
) -> RingCase:
    """Build a batch: request ``r`` has context_len ``P_r`` positions and ``B_r`` queries (a draft block, or a
    prefill chunk with ``mode=BatchMode.PREFILL_CHUNK``).

    The pool (``RingPool.allocate``: NaN, head dim padded to the kernels' 16-element alignment, block 0 a NaN
    "null block", rings a random permutation of a 2x-oversized pool) is NaN everywhere except the live context
    ``[max(0, P-W+1), P)`` of each request, written through ``RingPlan.slot_mapping``. ``full_rows`` gives
    vLLM-style logical rows (dead blocks -> 0) instead of compact R-column rows. ``history_fn(positions) -> (k, v)``
    overrides the random history values.
    ``fp8_dtype`` (float8_e4m3fn / float8_e5m2) makes the caches fp8 with random per-case scales; the history the
    oracle sees is then the dequantized ring (quantization error belongs to the input, not to the kernel).
    """
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    generator = torch.Generator().manual_seed(seed)
    lookahead = max(b for _, b in requests) if lookahead is None else lookahead
    # a window beyond every position (full attention) keeps all of them: size the ring for what exists
    plan = RingPlan(
        window=min(window, max(p + b for p, b in requests)), kv_block_size=kv_block_size, lookahead=lookahead
    )
    ring_blocks = plan.ring_blocks
    scales: dict[str, torch.Tensor] = {}
    if fp8_dtype is not None:
        # scales that put randn rows over most of the fp8 range (and a few e4m3 rows past it: saturation)
        scales = {name: torch.rand(1, generator=generator) * 0.05 + 0.005 for name in ("k_scale", "v_scale")}
    pool = RingPool.allocate(
        plan, len(requests), num_kv_heads=num_kv_heads, head_dim=head_dim, head_dim_v=head_dim_v,
        dtype=dtype if fp8_dtype is None else fp8_dtype, num_blocks=2 * ring_blocks * len(requests) + 1,
        generator=generator,
    )  # fmt: skip
    k_cache, v_cache, rings = pool.k_cache, pool.v_cache, pool.rings
    if full_rows:
        width = max(triton.cdiv(p + b, kv_block_size) for p, b in requests) + 1
        logical = torch.arange(width)
        block_table = rings[:, logical % ring_blocks].clone()
        for r, (p, _) in enumerate(requests):
            dead_blocks = logical < plan.first_visible_block(p)
            block_table[r, dead_blocks] = 0
        table_period = None
    else:
        block_table, table_period = rings, ring_blocks
    history = []
    for r, (p, _) in enumerate(requests):
        first = max(0, p - window - 2 * kv_block_size)
        positions = torch.arange(first, p)
        if history_fn is None:
            k_hist = torch.randn(len(positions), num_kv_heads, head_dim, generator=generator).to(dtype)
            v_hist = torch.randn(len(positions), num_kv_heads, head_dim_v, generator=generator).to(dtype)
        else:
            k_hist, v_hist = history_fn(positions)
            k_hist, v_hist = k_hist.to(dtype), v_hist.to(dtype)
        live = positions >= first_visible_position(p, window)
        slots = plan.slot_mapping(positions[live], block_table[r], period=table_period or block_table.shape[1])
        ring_write_reference(k_hist[live], v_hist[live], k_cache, v_cache, slots, **scales)
        if scales:
            k_hist = dequantize(quantize_fp8(k_hist, scales["k_scale"], fp8_dtype), scales["k_scale"])
            v_hist = dequantize(quantize_fp8(v_hist, scales["v_scale"], fp8_dtype), scales["v_scale"])
        history.append((first, k_hist, v_hist))
    lens = [b for _, b in requests]
    num_tokens = sum(lens) + pad_tokens
    q = torch.randn(num_tokens, num_q_heads, head_dim, generator=generator).to(dtype)
    k_new = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype)
    v_new = torch.randn(num_tokens, num_kv_heads, head_dim_v, generator=generator).to(dtype)
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([p + b for p, b in requests], dtype=torch.int32)
    return RingCase(
        q, k_new, v_new, k_cache, v_cache, block_table, starts, seq_lens, window, causal,
        table_period, plan, history, seed, mode, **scales,
    )  # fmt: skip


def case_oracle_pair(case: RingCase) -> tuple[torch.Tensor, torch.Tensor]:
    """``oracle_pair`` of a case: its dense history, not its ring."""
    return oracle_pair(case.q, case.k_new, case.v_new, case.history, case.query_start_loc, case.seq_lens,
                       window=case.window, causal=case.causal)  # fmt: skip


def reference_pair(case: RingCase) -> tuple[torch.Tensor, torch.Tensor]:
    """(ref_hi, ref_lo): the reference in fp64 cast to the output dtype, and in the case's own dtype."""
    args = case.kernel_args()
    ref_hi = ring_attention_reference(**args, compute_dtype=torch.float64)
    lo_dtype = case.q.dtype if case.q.dtype != torch.float32 else torch.float32
    ref_lo = ring_attention_reference(**args, compute_dtype=lo_dtype)
    return ref_hi, ref_lo


def assert_kernel_matches_reference(
    kernel: Callable[..., torch.Tensor], case: RingCase, device: torch.device | str, **options: object
) -> None:
    """``kernel(**case.kernel_args(), out=out, **options)`` on ``device`` holds the tolerance rule against
    ``reference_pair(case)`` and leaves the NaN padding rows past ``query_start_loc[-1]`` unwritten."""
    ref_hi, ref_lo = reference_pair(case)
    case = case.to(device)
    out = torch.full_like(ref_hi, NAN, device=device)
    kernel(**case.kernel_args(), out=out, **options)
    real = int(case.query_start_loc[-1])
    assert torch.isnan(out[real:]).all(), f"{kernel.__name__}: padding rows past query_start_loc[-1] were written"
    assert_attention_close(out[:real].cpu(), ref_hi[:real], ref_lo[:real], name=kernel.__name__, case=case)


def describe_index(case: RingCase | None, token: int) -> str:
    """Request, query offset, absolute position and ring slot of an output token."""
    if case is None:
        return f"token {token}"
    starts = case.query_start_loc.tolist()
    for r in range(len(starts) - 1):
        if starts[r] <= token < starts[r + 1]:
            pos = case.context_lens[r] + token - starts[r]
            period = case.table_period or case.block_table.shape[1]
            slot = case.plan.slot_mapping(torch.tensor([pos]), case.block_table[r], period=period)
            return f"request {r}, query {token - starts[r]}, position {pos}, ring slot {int(slot)}"
    return f"padding token {token}"


def assert_attention_close(
    out: torch.Tensor, ref_hi: torch.Tensor, ref_lo: torch.Tensor, *, name: str, case: RingCase | None = None
) -> None:
    """The tolerance rule of ``ringkv.kernels.testing``, with NaN/inf counted apart and a readable failure."""
    for label, bad in (
        ("NaN", torch.isnan),
        ("+inf", lambda t: t == float("inf")),
        ("-inf", lambda t: t == -float("inf")),
    ):
        unexpected = bad(out) & ~bad(ref_hi.to(out.dtype))
        if unexpected.any():
            token = int(unexpected.nonzero()[0, 0])
            raise AssertionError(
                f"{name}: {int(unexpected.sum())} unexpected {label} values, first at {describe_index(case, token)}"
            )
    report = attention_error(out, ref_hi, ref_lo)
    if not report.ok:
        token, head, dim = report.worst_index
        raise AssertionError(
            f"{name}: max error {report.max_error:.3e} > bound {report.bound:.3e} at head {head}, dim {dim}, "
            f"{describe_index(case, token)} (seed {case.seed if case else 'n/a'})"
        )
