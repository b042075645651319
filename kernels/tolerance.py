# SPDX-License-Identifier: Apache-2.0
"""The correctness gate shared by tests, the demo and benchmarks (flash-attention's hopper rule):
``max|out - ref_hi| <= 2 * max|ref_lo - ref_hi| + fwd_atol``, with ``fwd_atol`` the rounding floor."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
