# SPDX-License-Identifier: Apache-2.0
"""What the tests, the benchmarks, the CLI, the lab and the drafter harness share around the kernels, apart from
them: the correctness gate, the named drafter shapes and a NaN-poisoned ring pool.

Tolerance (flash-attention's hopper rule): ``max|out - ref_hi| <= 2 * max|ref_lo - ref_hi| + fwd_atol``, with
``fwd_atol`` the rounding floor (``attention_error``).

Shapes: the drafter shapes ringkv is built for, named once: vLLM #55800's DFlash2 drafter (``ISSUE_55800``, the
default everywhere: the demo, the #55800 simulation, the GPU check) and the head shapes the benchmarks sweep beside
it (``DrafterShape``).

Pool: ``RingPool.allocate`` gives each of ``num_reqs`` requests a ring of ``R = plan.ring_blocks`` physical blocks (a
compact row, ``table_period = R``, after the plan's sink blocks if it has sinks) in one ``[num_blocks, bs, Hkv, D]``
K/V pool that is NaN everywhere (fp8: the NaN byte 0x7F), so a read of any slot nothing wrote poisons the output.
Block 0 is the null block and never in a ring. The caches are ``[..., :D]`` views of storage whose head dim is
padded to ``KV_STRIDE_ELEMENTS`` (the kernels' 16-byte alignment, ``check_kv_alignment``); the pad is a NaN guard
band. ``write`` stores rows through the plan's slot mapping (dead positions PAD) and ``batch`` builds the
``VarlenBatch`` of queries over the rings.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton

from .ring_geometry import RingPlan
from .validation import KV_STRIDE_ELEMENTS
from .varlen import BatchMode, VarlenBatch
from .write import ring_write

FP32_ABS_BOUND = 1e-5


@dataclass(frozen=True)
class ErrorReport:
    """How far a kernel output is from the high-precision reference, and what it may be."""

    max_error: float
    bound: float
    worst_index: tuple[int, ...]

    @property
    def ok(self) -> bool:
        return self.max_error <= self.bound


def attention_error(out: torch.Tensor, ref_hi: torch.Tensor, ref_lo: torch.Tensor) -> ErrorReport:
    """Compare ``out`` with ``ref_hi`` (fp64 reference) given ``ref_lo`` (a same-dtype PyTorch run).

    ``fwd_atol = 2 * max|(ref_hi + 0.3) - 0.3 - ref_hi|`` in the output dtype; fp32 is held to 1e-5 instead.
    NaN or inf in ``out`` where ``ref_hi`` is finite makes the error infinite.
    """
    ref_hi = ref_hi.to(out.device, out.dtype)
    hi, got = ref_hi.double(), out.double()
    lo = ref_lo.to(out.device, out.dtype).double()
    fwd_atol = 2 * ((ref_hi + 0.3) - 0.3 - ref_hi).abs().max().double().item() if ref_hi.numel() else 0.0
    bound = 2 * ((lo - hi).abs().max().item() if hi.numel() else 0.0) + fwd_atol
    if out.dtype == torch.float32:
        # no run below fp32 exists to set the relative bound (PyTorch's fp32 run is as precise as the kernel's,
        # tiling reorders the same roundings): fp32 is held to the absolute bound
        bound = FP32_ABS_BOUND
    err = (got - hi).abs()
    err = torch.where(
        torch.isfinite(got) | ~torch.isfinite(hi), err.nan_to_num(0.0), torch.full_like(err, float("inf"))
    )
    if not err.numel():
        return ErrorReport(0.0, bound, ())
    worst = tuple(int(i) for i in (err == err.max()).nonzero()[0])
    return ErrorReport(float(err.max()), bound, worst)


@dataclass(frozen=True)
class DrafterShape:
    """A sliding-window drafter's attention geometry: window W, KV block bs, N speculative tokens, heads."""

    window: int = 2048
    kv_block_size: int = 16
    num_speculative_tokens: int = 7
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128

    @property
    def lookahead(self) -> int:
        """vLLM's ``num_lookahead_tokens`` for DFlash: ``N + 1`` (the draft block)."""
        return self.num_speculative_tokens + 1

    @property
    def plan(self) -> RingPlan:
        return RingPlan.for_dflash(self.window, self.kv_block_size, self.num_speculative_tokens)

    def token_bytes(self, element_bytes: int = 2) -> int:
        """K and V bytes of one position in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * element_bytes


# vLLM #55800: GLM-5.3-class target, DFlash2 drafter with W 2048, KV block 16, 7 speculative tokens, 32/8 x 128
ISSUE_55800 = DrafterShape()


def aligned_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A NaN-filled ``[..., D]`` view of storage whose last dim is padded to a multiple of ``KV_STRIDE_ELEMENTS``
    (fp8: the NaN byte 0x7F)."""
    padded = triton.cdiv(shape[-1], KV_STRIDE_ELEMENTS) * KV_STRIDE_ELEMENTS
    return torch.full((*shape[:-1], padded), float("nan"), dtype=dtype, device=device)[..., : shape[-1]]


@dataclass(frozen=True)
class RingPool:
    """Ring K/V of ``num_reqs`` requests in one pool.

    Attributes:
        plan: the rings' geometry (``plan.row_blocks`` blocks per request: ``ns`` sink blocks, then ``R``).
        k_cache: [num_blocks, bs, Hkv, D] K cache (any strides the kernels take).
        v_cache: [num_blocks, bs, Hkv, Dv] V cache.
        rings: [num_reqs, ns + R] int32 physical block ids: request ``r``'s compact row ``[sink blocks | ring]``.
    """

    plan: RingPlan
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    rings: torch.Tensor

    @classmethod
    def allocate(
        cls,
        plan: RingPlan,
        num_reqs: int,
        *,
        num_kv_heads: int,
        head_dim: int,
        head_dim_v: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        num_blocks: int | None = None,
        generator: torch.Generator | None = None,
    ) -> RingPool:
        """A NaN pool of ``num_blocks`` blocks (default ``1 + num_reqs * (ns + R)``: the null block and the rows).

        Rows take blocks ``1 ..`` in order, or, given ``generator``, the first ``num_reqs * (ns + R)`` of a random
        permutation of blocks ``1 .. num_blocks - 1`` (drawn on the generator's device; the other blocks stay NaN).
        ``dtype`` is the caches' (fp8 for an fp8 ring).
        """
        owned = num_reqs * plan.row_blocks
        num_blocks = 1 + owned if num_blocks is None else num_blocks
        if num_blocks < 1 + owned:
            raise ValueError(f"num_blocks={num_blocks} cannot hold the null block and {num_reqs} rows of "
                             f"{plan.row_blocks} blocks; pass num_blocks >= {1 + owned}")  # fmt: skip
        if generator is None:
            physical = torch.arange(1, 1 + owned)
        else:
            physical = (torch.randperm(num_blocks - 1, generator=generator, device=generator.device) + 1)[:owned]
        rings = physical.view(num_reqs, plan.row_blocks).to(torch.int32).to(device)
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        caches = (aligned_cache((num_blocks, plan.kv_block_size, num_kv_heads, d), dtype, device)
                  for d in (head_dim, head_dim_v))  # fmt: skip
        return cls(plan, *caches, rings)

    @property
    def num_reqs(self) -> int:
        """Requests with a ring (rows of ``rings``)."""
        return self.rings.shape[0]

    def slot_mapping(
        self, positions: torch.Tensor, request: int = 0, *, seq_len: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """``RingPlan.slot_mapping`` of ``positions`` through request ``request``'s ring, on the pool's device."""
        return self.plan.slot_mapping(positions.to(self.rings.device), self.rings[request], seq_len=seq_len)

    def write(
        self,
        request: int,
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        seq_len: int,
        **scales: torch.Tensor,
    ) -> torch.Tensor:
        """``ring_write`` of request ``request``'s rows ``k`` / ``v`` ([T, Hkv, D|Dv]) at ``positions`` by a batch
        ending at ``seq_len`` (positions before ``seq_len - (W - 1)`` past the sink blocks are dead: not stored).
        ``scales``: fp8
        ``k_scale`` / ``v_scale``. Returns the slot mapping it wrote through (PAD = -1)."""
        slots = self.slot_mapping(positions, request, seq_len=seq_len)
        ring_write(k, v, self.k_cache, self.v_cache, slots, **scales)
        return slots

    def batch(
        self,
        context_lens: Sequence[int],
        query_lens: Sequence[int] | int,
        *,
        mode: BatchMode,
        requests: Sequence[int] | None = None,
    ) -> VarlenBatch:
        """Request ``i`` of the batch: ``query_lens[i]`` query rows (back to back) at positions
        ``context_lens[i] ..``, over the ring of request ``requests[i]`` (default ``i``). Bounds come from the host
        lists: no device sync."""
        if isinstance(query_lens, int):
            query_lens = [query_lens] * len(context_lens)
        device = self.rings.device
        seq_lens = [p + n for p, n in zip(context_lens, query_lens, strict=True)]
        if requests is None:
            rows = self.rings[: len(context_lens)]
        else:
            rows = self.rings[torch.tensor(list(requests), device=device)]
        return VarlenBatch(
            torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32, device=device),
            torch.tensor(seq_lens, dtype=torch.int32, device=device), rows,
            max_query_len=max([1, *query_lens]), max_seq_len=max(seq_lens, default=0),
            table_period=self.plan.ring_blocks, mode=mode,
        )  # fmt: skip
