# SPDX-License-Identifier: Apache-2.0
"""fp8 ring KV (e4m3fn, e5m2): ring_write's stored bytes against the reference quantization, saturation and
untouched PAD rows; ring_attention (draft blocks and prefill chunks) against the dense fp64 oracle on the
dequantized history, with the fp8 NaN byte in every slot it must not read; bad fp8 inputs."""

from __future__ import annotations

import pytest
import torch
import triton
from ringkv.kernels import BatchMode, RingPlan, VarlenBatch, ring_attention, ring_write
from ringkv.kernels.kv_quant import FP8_KV_CACHE_DTYPES, dequantize, fp8_dtype_of, quantize_fp8
from ringkv.kernels.ring_geometry import PAD_SLOT, UNBOUNDED_WINDOW
from ringkv.kernels.validation import KV_STRIDE_ELEMENTS

from tests.testing import (
    NAN,
    RingCase,
    aligned_cache,
    assert_attention_close,
    case_oracle_pair,
    make_ring_case,
    stable_seed,
)

pytestmark = pytest.mark.interpreter

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# the NaN bytes the pools are poisoned with (either sign)
NAN_BYTES = {E4M3: (0x7F, 0xFF), E5M2: (0x7F, 0xFE)}


def poisoned_fp8_layer(num_blocks: int, kv_block_size: int, heads: int, head_dim: int, fp8: torch.dtype):
    """vLLM's fp8 layer cache: uint8 storage ``[num_blocks, 2, bs, H, D']`` (D' = D rounded up to
    ``KV_STRIDE_ELEMENTS``) full of the fp8 NaN bytes (random sign)."""
    padded = triton.cdiv(head_dim, KV_STRIDE_ELEMENTS) * KV_STRIDE_ELEMENTS
    pattern = torch.tensor(NAN_BYTES[fp8], dtype=torch.uint8)
    generator = torch.Generator().manual_seed(1)
    return pattern[torch.randint(0, 2, (num_blocks, 2, kv_block_size, heads, padded), generator=generator)]


def fp8_views(storage: torch.Tensor, head_dim: int, fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V ``[num_blocks, bs, H, D]`` views of the uint8 layer cache as ``fp8``, as vLLM views it."""
    views = storage.view(fp8)
    return views[:, 0, ..., :head_dim], views[:, 1, ..., :head_dim]


@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_ring_write_stores_reference_bytes(fp8, dtype, device):
    """Bytes equal ``quantize_fp8`` exactly (ties, subnormals, saturation at +-max included); PAD rows and dead
    positions leave the NaN bytes untouched."""
    heads, head_dim, bs = 2, 40, 8
    plan = RingPlan(window=21, kv_block_size=bs, lookahead=4)
    num_blocks = 2 * plan.ring_blocks
    generator = torch.Generator().manual_seed(stable_seed(fp8, dtype))
    ring = torch.randperm(num_blocks, generator=generator)[: plan.ring_blocks]
    positions = torch.arange(0, 60)  # ends at 60: positions < 40 are dead (W - 1 = 20 live)
    slots = plan.slot_mapping(positions, ring, seq_len=60)
    slots[45] = PAD_SLOT  # an explicit PAD among the live rows
    k_scale, v_scale = torch.tensor([0.37]), torch.tensor([2.5])
    limit = torch.finfo(fp8).max
    # magnitudes over the whole fp8 range, the exact midpoints between fp8 values (ties), and rows beyond the
    # largest finite value (saturation)
    k = torch.randn(60, heads, head_dim, generator=generator) * torch.logspace(-6, 2, head_dim) * k_scale
    grid = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    grid = grid[grid.isfinite()].sort().values
    ties = (grid[:-1] + grid[1:]) / 2 * v_scale
    v = ties[torch.randint(0, len(ties), (60, heads, head_dim), generator=generator)]
    k[50, 0] = 3 * limit * k_scale
    k[51, 1] = -3 * limit * k_scale
    k, v = k.to(dtype), v.to(dtype)

    before = poisoned_fp8_layer(num_blocks, bs, heads, head_dim, fp8)
    storage = before.to(device)
    k_view, v_view = fp8_views(storage, head_dim, fp8)
    ring_write(k.to(device), v.to(device), k_view, v_view, slots.to(device), k_scale=k_scale.to(device),
               v_scale=v_scale.to(device))  # fmt: skip

    live = slots >= 0
    blocks, offsets = slots[live] // bs, slots[live] % bs
    got_k = k_view.cpu()[blocks, offsets].view(torch.uint8)
    got_v = v_view.cpu()[blocks, offsets].view(torch.uint8)
    assert torch.equal(got_k, quantize_fp8(k[live], k_scale, fp8).view(torch.uint8))
    assert torch.equal(got_v, quantize_fp8(v[live], v_scale, fp8).view(torch.uint8))
    # saturation: +-max finite, never NaN / inf
    assert float(k_view.cpu()[slots[50] // bs, slots[50] % bs, 0].float().min()) == limit
    assert float(k_view.cpu()[slots[51] // bs, slots[51] % bs, 1].float().max()) == -limit
    # every other byte of the layer (dead positions, the PAD row, head-dim padding) is still a NaN byte
    written = torch.zeros(before.shape, dtype=torch.bool)
    written[blocks, :, offsets, :, :head_dim] = True
    after = storage.cpu()
    assert torch.equal(after[~written], before[~written]), "ring_write touched bytes outside the live rows"


def attend_matches_oracle(case: RingCase, device: torch.device, **options: object) -> RingCase:
    """``ring_attention`` of the case into a NaN output: the batch's rows match the dense oracle on the dequantized
    history, the padding rows stay NaN. Returns the case on ``device`` (its caches as the launch left them)."""
    ref_hi, ref_lo = case_oracle_pair(case)
    case = case.to(device)
    out = torch.full(ref_hi.shape, NAN, dtype=case.q.dtype, device=device)
    ring_attention(**case.kernel_args(), out=out, **options)
    real = int(case.query_start_loc[-1])
    assert torch.isnan(out[real:]).all(), "padding rows were written"
    assert_attention_close(out[:real].cpu(), ref_hi[:real], ref_lo[:real], name=f"fp8 {case.mode.value}", case=case)
    return case


# (requests [(P, B)], W, bs, Hq, Hkv, D, compute dtype, fp8, causal, num_splits)
DECODE = [
    pytest.param([(14, 8), (15, 8), (0, 3)], 15, 16, 8, 2, 64, torch.bfloat16, E4M3, False, None, id="e4m3-bf16-W15"),
    pytest.param([(100, 5), (3, 8)], 37, 8, 8, 2, 48, torch.float16, E5M2, True, 2, id="e5m2-fp16-causal-split2"),
    pytest.param([(300, 8), (2, 5)], 257, 16, 4, 1, 32, torch.bfloat16, E5M2, False, 3, id="e5m2-bf16-W257-split3"),
    pytest.param([(77, 7)], 37, 8, 5, 1, 59, torch.float16, E4M3, True, None, id="e4m3-fp16-gqa5-D59-causal"),
    pytest.param([(50, 4)], 20, 4, 2, 2, 32, torch.float32, E4M3, False, 3, id="e4m3-fp32-split3"),
    pytest.param([(60, 8), (0, 8)], UNBOUNDED_WINDOW, 16, 4, 2, 32, torch.bfloat16, E4M3, False, None,
                 id="e4m3-full-attention"),
]  # fmt: skip


@pytest.mark.parametrize(("requests", "window", "bs", "hq", "hkv", "d", "dtype", "fp8", "causal", "splits"), DECODE)
def test_fp8_ring_attention_matches_oracle(requests, window, bs, hq, hkv, d, dtype, fp8, causal, splits, device):
    case = make_ring_case(
        requests, window=window, kv_block_size=bs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype,
        causal=causal, full_rows=window == UNBOUNDED_WINDOW, pad_tokens=2, fp8_dtype=fp8,
        seed=stable_seed(requests, window, bs, d, dtype, fp8, causal),
    )  # fmt: skip
    attend_matches_oracle(case, device, num_splits=splits)


PREFILL = [
    pytest.param([(100, 60), (0, 20), (37, 1)], 37, 8, 8, 2, 24, torch.bfloat16, E4M3, True, id="e4m3-bf16-causal"),
    pytest.param([(64, 50)], 33, 8, 4, 1, 40, torch.float16, E5M2, False, id="e5m2-fp16-noncausal"),
]  # fmt: skip


@pytest.mark.parametrize(("requests", "window", "bs", "hq", "hkv", "d", "dtype", "fp8", "causal"), PREFILL)
def test_fp8_ring_prefill_matches_oracle_and_writes_quantized(requests, window, bs, hq, hkv, d, dtype, fp8, causal,
                                                              device):  # fmt: skip
    """Chunk attention over an fp8 ring, then write-after-read: the ring then holds the chunk's live rows as
    ``quantize_fp8`` bytes."""
    case = make_ring_case(
        requests, window=window, kv_block_size=bs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype,
        causal=causal, lookahead=1, pad_tokens=3, mode=BatchMode.PREFILL_CHUNK, fp8_dtype=fp8,
        seed=stable_seed(requests, window, dtype, fp8, causal),
    )  # fmt: skip
    case = attend_matches_oracle(case, device, write_ring=True)
    start = 0
    for r, (p, c) in enumerate(requests):
        for t in range(max(0, c - (window - 1)), c):  # the chunk's live rows
            slot = int(case.plan.slot_mapping(torch.tensor([p + t]), case.block_table[r].cpu(),
                                              period=case.table_period))  # fmt: skip
            stored = case.k_cache[slot // bs, slot % bs].cpu().view(torch.uint8)
            expected = quantize_fp8(case.k_new[start + t].cpu(), case.k_scale.cpu(), fp8).view(torch.uint8)
            assert torch.equal(stored, expected), f"request {r} position {p + t}: ring bytes differ"
        start += c


def test_dequantize_matches_vllm_convention():
    """Stored ``fp8(x / s)``, loaded ``fp8 * s``: the round trip is the fp8 rounding of ``x / s`` times ``s``."""
    x, s = torch.tensor([1.0, -3.3, 1000.0]), torch.tensor([0.5])
    stored = quantize_fp8(x, s, E4M3)
    assert stored.float().tolist() == [2.0, -6.5, 448.0]
    assert dequantize(stored, s).tolist() == [1.0, -3.25, 224.0]


def test_kv_cache_dtype_names():
    assert FP8_KV_CACHE_DTYPES == {"fp8": E4M3, "fp8_e4m3": E4M3, "fp8_e5m2": E5M2}
    assert fp8_dtype_of("auto") is None and fp8_dtype_of("bfloat16") is None
    assert fp8_dtype_of("fp8_e5m2") is E5M2
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8_inc' is not supported .* 'fp8_e4m3'"):
        fp8_dtype_of("fp8_inc")


def _fp8_args():
    case = make_ring_case([(20, 4)], window=9, kv_block_size=8, num_q_heads=2, num_kv_heads=1, head_dim=16,
                          dtype=torch.bfloat16, fp8_dtype=E4M3, seed=5)  # fmt: skip
    return case.kernel_args()


BAD_FP8 = [
    ("k_scale-missing", {"k_scale": None}, "k_scale is None but the cache is fp8"),
    ("v_scale-zero", {"v_scale": torch.tensor([0.0])}, r"v_scale=0.0 must be finite and > 0"),
    ("k_scale-negative", {"k_scale": torch.tensor([-1.0])}, r"k_scale=-1.0 must be finite and > 0"),
    ("k_scale-nan", {"k_scale": torch.tensor([NAN])}, r"k_scale=nan must be finite"),
    ("k_scale-inf", {"k_scale": torch.tensor([float("inf")])}, r"k_scale=inf must be finite"),
    ("k_scale-float", {"k_scale": 0.5}, r"k_scale=0.5 must be a one-element float tensor"),
    ("k_scale-two", {"k_scale": torch.ones(2)}, "must be a one-element float tensor"),
    ("k_scale-other-device", {"k_scale": torch.ones(1, device="meta")}, "k_scale is on meta but the cache is on cpu"),
    ("mixed-fp8", {"v_cache": E5M2}, "k_cache is torch.float8_e4m3fn but v_cache is torch.float8_e5m2"),
    ("int8-cache", {"k_cache": torch.int8, "v_cache": torch.int8}, "k_cache/v_cache have dtypes torch.int8/torch.int8"),
    ("scales-on-bf16", {"k_cache": torch.bfloat16, "v_cache": torch.bfloat16}, "scales apply to fp8 caches only"),
]


@pytest.mark.parametrize(("changes", "message"), [pytest.param(c, m, id=i) for i, c, m in BAD_FP8])
@pytest.mark.parametrize("mode", [BatchMode.DRAFT_BLOCK, BatchMode.PREFILL_CHUNK], ids=["decode", "prefill"])
def test_fp8_bad_inputs_raise_before_launch(changes, message, mode):
    args = _fp8_args()
    if mode is BatchMode.PREFILL_CHUNK:
        args["batch"] = VarlenBatch.build(
            args["batch"].query_start_loc, args["batch"].seq_lens, args["batch"].block_table,
            mode=mode, table_period=args["batch"].table_period,
        )  # fmt: skip
        args["write_ring"] = True
    for name, value in changes.items():
        # a dtype replaces a cache by a same-shaped one of that dtype (padded storage, as the kernels need)
        if isinstance(value, torch.dtype):
            value = aligned_cache(tuple(args[name].shape), torch.float32).to(value)
        args[name] = value
    before = args["k_cache"].clone()
    with pytest.raises(ValueError, match=message):
        ring_attention(**args)
    assert torch.equal(args["k_cache"].view(torch.uint8), before.view(torch.uint8)), "a rejected call wrote"


def test_ring_write_rejects_fp8_rows_and_missing_scales():
    k_cache = torch.zeros(2, 8, 1, 16, dtype=E4M3)
    rows = torch.randn(3, 1, 16)
    slots = torch.arange(3)
    with pytest.raises(ValueError, match=r"k/v dtypes torch.float8_e4m3fn/torch.float8_e4m3fn must be one of"):
        ring_write(rows.to(E4M3), rows.to(E4M3), k_cache, k_cache.clone(), slots)
    with pytest.raises(ValueError, match="v_scale is None but the cache is fp8"):
        ring_write(rows, rows, k_cache, k_cache.clone(), slots, k_scale=torch.tensor([1.0]))
    assert not k_cache.view(torch.uint8).any()
