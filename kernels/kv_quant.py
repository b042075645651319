# SPDX-License-Identifier: Apache-2.0
"""fp8 ring KV with vLLM's conventions: the cache-dtype names, per-layer scalar ``k_scale`` / ``v_scale``, the
stored value ``fp8(x / scale)`` and the loaded value ``fp8 * scale`` (vLLM ``triton_reshape_and_cache_flash`` /
``_cast_kv_tile``).

Quantization (one rule, here and in ``ring_write``): ``x / scale`` in fp32 (IEEE division), saturated to the fp8
type's largest finite value, then rounded to the nearest fp8 value, ties to even (the cast ``torch`` does);
NaN stays NaN. The block's own K/V never pass through fp8.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._triton_utils import debug_checks_enabled

# vLLM ``CacheDType`` names the ring kernels store as fp8; vLLM allocates the cache as uint8 and views it
FP8_KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
# the names that keep the cache in the model's dtype ("auto") or in a named 16-bit dtype
UNQUANTIZED_KV_CACHE_DTYPES = ("auto", "float16", "bfloat16")
# (exponent bias, mantissa bits) per fp8 type: the constexprs of quantize_fp8_bits
FP8_FORMATS: dict[torch.dtype, tuple[int, int]] = {torch.float8_e4m3fn: (7, 3), torch.float8_e5m2: (15, 2)}
FP8_DTYPES = tuple(FP8_FORMATS)


def fp8_dtype_of(kv_cache_dtype: str) -> torch.dtype | None:
    """The fp8 dtype a vLLM ``kv_cache_dtype`` name stores, ``None`` for an unquantized cache; ``ValueError``
    for a name the ring kernels do not store."""
    if kv_cache_dtype in UNQUANTIZED_KV_CACHE_DTYPES:
        return None
    if kv_cache_dtype in FP8_KV_CACHE_DTYPES:
        return FP8_KV_CACHE_DTYPES[kv_cache_dtype]
    supported = ", ".join(repr(name) for name in (*UNQUANTIZED_KV_CACHE_DTYPES, *FP8_KV_CACHE_DTYPES))
    raise ValueError(
        f"kv_cache_dtype={kv_cache_dtype!r} is not supported by the ring kernels; use one of {supported} "
        "(per-tensor fp8 with the layer's k_scale / v_scale)"
    )


def check_scale(name: str, scale: object, device: torch.device) -> torch.Tensor:
    """A per-layer dequantization scale: a one-element float tensor on the cache's device (vLLM's
    ``layer._k_scale``). Its value (finite, > 0) is checked when that costs no device sync: on CPU, or on any
    device with ``RINGKV_DEBUG_CHECKS=1``."""
    if scale is None:
        raise ValueError(
            f"{name} is None but the cache is fp8; pass the layer's scalar fp32 tensor (vLLM: layer._{name})"
        )
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or not scale.dtype.is_floating_point:
        raise ValueError(f"{name}={scale!r} must be a one-element float tensor (vLLM: layer._{name}, fp32)")
    if scale.device != device:
        raise ValueError(f"{name} is on {scale.device} but the cache is on {device}; move it to the cache's device")
    if scale.device.type == "cpu" or debug_checks_enabled():
        value = float(scale.reshape(()))
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name}={value} must be finite and > 0 (fp8 stores x / {name}, loads fp8 * {name})")
    return scale.reshape(1).to(torch.float32)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reference quantization: ``fp8(x / scale)`` in fp32, saturated to +-max finite, round-to-nearest-even."""
    limit = torch.finfo(dtype).max
    return (x.to(torch.float32) / scale.to(torch.float32)).clamp(-limit, limit).to(dtype)


def dequantize(cache: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``cache * scale`` in ``dtype`` for an fp8 cache; any other cache is only cast."""
    if cache.dtype not in FP8_DTYPES:
        return cache.to(dtype)
    return cache.to(dtype) * scale.to(dtype)


@triton.jit
def quantize_fp8_bits(x, scale, EXP_BIAS: tl.constexpr, MANTISSA: tl.constexpr, MAX_FINITE: tl.constexpr):
    """The bytes of ``fp8(x / scale)`` (uint8, the module's rule) in integer arithmetic, so the result is the
    same on every GPU and under the interpreter (whose fp8 casts round wrongly)."""
    y = tl.math.div_rn(x.to(tl.float32), scale)
    a = tl.minimum(tl.abs(y), MAX_FINITE)
    # the exponent of a, floored at the smallest normal exponent: below it the fp8 quantum stays fixed
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, 1 - EXP_BIAS)
    # a in quanta of 2^(e - MANTISSA): exact scaling by a power of two, then round half to even by adding and
    # subtracting 1.5 * 2^23 (fp32 addition rounds to nearest even; the count is below 2^(MANTISSA + 2))
    inv_quantum = ((127 - (e - MANTISSA)) << 23).to(tl.float32, bitcast=True)
    count = ((a * inv_quantum + 12582912.0) - 12582912.0).to(tl.int32)
    # exponent field and mantissa in one sum: a carry out of the mantissa moves to the next exponent
    bits = ((e - (1 - EXP_BIAS)) << MANTISSA) + count
    bits = tl.where(y != y, 0x7F, bits) | ((y.to(tl.int32, bitcast=True) >> 24) & 0x80)
    return bits.to(tl.uint8)


@triton.jit
def upcast_interpreted(b_x, KV_FP8: tl.constexpr):
    """fp32 of a loaded tile under the interpreter, which decodes the fp8 NaN bytes (e4m3fn 0x7F, e5m2
    0x7D..0x7F, either sign) as finite numbers: those read as NaN again (e5m2 infinity too; writes saturate)."""
    b_f = b_x.to(tl.float32)
    if KV_FP8:
        nonfinite: tl.constexpr = 0x7C if b_x.dtype == tl.float8e5 else 0x7F
        b_f = tl.where((b_x.to(tl.uint8, bitcast=True) & 0x7F) >= nonfinite, float("nan"), b_f)
    return b_f
