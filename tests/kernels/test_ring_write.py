# SPDX-License-Identifier: Apache-2.0
"""ring_write (Triton) against the reference, on plain and vLLM-layout cache views."""

from __future__ import annotations

import pytest
import torch
import triton
from ringkv.kernels import RingPlan, ring_write, ring_write_reference
from ringkv.kernels.validation import KV_STRIDE_ELEMENTS

from tests.testing import NAN

pytestmark = pytest.mark.interpreter


def vllm_layer_view(num_blocks: int, kv_block_size: int, heads: int, head_dim: int, dtype: torch.dtype, order: str):
    """A vLLM per-layer cache ``[num_blocks, H, N, 2D']`` (logical) with physical layout ``order`` and its
    K/V views ``[num_blocks, N, H, D]``: ``"BHN"`` = heads outer (LBHNC), ``"BNH"`` = slots outer (LBNHC).
    ``D' = D`` rounded up to 16 elements: the kernels need 16-element strides (``check_kv_alignment``)."""
    padded = triton.cdiv(head_dim, KV_STRIDE_ELEMENTS) * KV_STRIDE_ELEMENTS
    if order == "BHN":
        storage = torch.full((num_blocks, heads, kv_block_size, 2 * padded), NAN, dtype=dtype)
    else:
        storage = torch.full((num_blocks, kv_block_size, heads, 2 * padded), NAN, dtype=dtype).transpose(1, 2)
    return storage, *kv_views(storage, head_dim)


def kv_views(storage: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V ``[num_blocks, N, H, D]`` views of a ``[num_blocks, H, N, 2D']`` layer cache."""
    padded = storage.shape[-1] // 2
    return storage[..., :head_dim].transpose(1, 2), storage[..., padded : padded + head_dim].transpose(1, 2)


@pytest.mark.parametrize("order", ["BHN", "BNH"])
@pytest.mark.parametrize(
    ("dtype", "heads", "head_dim"), [(torch.float32, 3, 59), (torch.float16, 8, 128), (torch.bfloat16, 1, 64)]
)
def test_ring_write_matches_reference(order, dtype, heads, head_dim, device):
    plan = RingPlan(window=37, kv_block_size=8, lookahead=8)
    num_blocks = 3 * plan.ring_blocks
    ring = torch.randperm(num_blocks)[: plan.ring_blocks]
    # a chunk longer than the ring: positions 0..299 end at 300; only the last W-1 = 36 survive
    positions = torch.arange(0, 300)
    slots = plan.slot_mapping(positions, ring, seq_len=300)
    slots[5] = -1  # an explicit PAD among the dead rows is skipped as well
    k = torch.randn(300, heads, head_dim).to(dtype)
    v = torch.randn(300, heads, head_dim).to(dtype)
    _, k_ref, v_ref = vllm_layer_view(num_blocks, 8, heads, head_dim, dtype, order)
    ring_write_reference(k, v, k_ref, v_ref, slots)
    storage, k_view, v_view = vllm_layer_view(num_blocks, 8, heads, head_dim, dtype, order)
    storage = storage.to(device)
    k_view, v_view = kv_views(storage, head_dim)
    ring_write(k.to(device), v.to(device), k_view, v_view, slots.to(device))
    torch.testing.assert_close(k_view.cpu(), k_ref, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(v_view.cpu(), v_ref, equal_nan=True, atol=0, rtol=0)
    written = int((~torch.isnan(k_view.float().cpu()[..., 0, 0])).sum())
    assert written == 36, f"expected the 36 live positions only, found {written} written slots"


def test_ring_write_large_pool_offsets(device):
    """A slot whose byte offset exceeds 2**31 lands where it should (int64 offsets)."""
    kv_block_size, heads, head_dim = 16, 1, 64
    num_blocks = (2**31) // (kv_block_size * heads * head_dim * 2) + 64  # fp16: > 2 GiB of K
    # untouched pages of torch.empty are never materialised, so this costs almost no memory
    k_cache = torch.empty((num_blocks, kv_block_size, heads, head_dim), dtype=torch.float16, device=device)
    v_cache = torch.empty((num_blocks, kv_block_size, heads, head_dim), dtype=torch.float16, device=device)
    k = torch.randn(1, heads, head_dim, dtype=torch.float16, device=device)
    v = torch.randn(1, heads, head_dim, dtype=torch.float16, device=device)
    slot = (num_blocks - 1) * kv_block_size + 3
    ring_write(k, v, k_cache, v_cache, torch.tensor([slot], dtype=torch.int32, device=device))
    assert torch.equal(k_cache[num_blocks - 1, 3], k[0])
    assert torch.equal(v_cache[num_blocks - 1, 3], v[0])
