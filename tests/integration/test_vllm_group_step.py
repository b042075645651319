# SPDX-License-Identifier: Apache-2.0
"""One step of a two-layer KV-cache group on the ring backend, as vLLM's DFlash models drive it: each layer's
context K/V through ``do_kv_cache_update`` (every layer handed the same slot-mapping tensor), then each layer's
draft block through ``forward`` on the group's metadata. The group's last writers are computed once per step and
a decode launch allocates nothing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from ringkv.integration.vllm import backend_step
from ringkv.integration.vllm.backend import RingKVBackend
from ringkv.integration.vllm.backend_step import split_kv_cache
from ringkv.kernels import attention
from ringkv.kernels.ring_geometry import PAD_SLOT, last_writer_slots
from ringkv.kernels.write import ring_write

from tests.allocations import AllocationCounter

pytestmark = [pytest.mark.vllm, pytest.mark.interpreter]

BS, LA, HEAD = 16, 8, 32


class Group:
    """Two ring layers of one KV-cache group (an impl and a vLLM-layout cache each) and one builder."""

    def __init__(self, device, *, num_reqs: int, num_kv_heads: int, window: int, context_len: int = 40) -> None:
        from vllm.v1.attention.backend import CommonAttentionMetadata

        self.device, self.hkv, self.hq = device, num_kv_heads, 4 * num_kv_heads
        impl_cls = RingKVBackend.get_impl_cls()
        self.impls = [impl_cls(self.hq, HEAD, HEAD**-0.5, num_kv_heads, sliding_window=window) for _ in range(2)]
        blocks = 1 + 5 * num_reqs
        self.caches = [torch.full((blocks, num_kv_heads, BS, 2 * HEAD), float("nan"), device=device)
                       for _ in self.impls]  # fmt: skip
        self.table = (torch.arange(5 * num_reqs, dtype=torch.int32).view(num_reqs, 5) + 1).to(device)
        query_start_loc = torch.arange(0, LA * num_reqs + 1, LA, dtype=torch.int32)
        self.common = CommonAttentionMetadata(
            query_start_loc=query_start_loc.to(device), query_start_loc_cpu=query_start_loc,
            seq_lens=torch.full((num_reqs,), context_len + LA, dtype=torch.int32, device=device), num_reqs=num_reqs,
            num_actual_tokens=LA * num_reqs, max_query_len=LA, max_seq_len=context_len + LA,
            block_table_tensor=self.table, slot_mapping=torch.full((LA * num_reqs,), PAD_SLOT, device=device),
            causal=False,
        )  # fmt: skip
        spec = SimpleNamespace(is_draft=True, sliding_window=window)
        self.builder = RingKVBackend.get_builder_cls()(spec, ["drafter.0", "drafter.1"], None, device)
        self.tokens = LA * num_reqs

    def rows(self, num_rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.randn(num_rows, self.hkv, HEAD, device=self.device),
                 torch.randn(num_rows, self.hkv, HEAD, device=self.device)) for _ in self.impls]  # fmt: skip

    def store(self, rows, slot_mappings) -> None:
        for impl, cache, (k, v), slots in zip(self.impls, self.caches, rows, slot_mappings, strict=True):
            impl.do_kv_cache_update(None, k, v, cache, slots)

    def forward(self, qkv, out) -> None:
        metadata = self.builder.build(0, self.common)
        for impl, cache, (q, k, v) in zip(self.impls, self.caches, qkv, strict=True):
            impl.forward(None, q, k, v, cache, metadata, out)

    def draft_inputs(self):
        return [(torch.randn(self.tokens, self.hq * HEAD, device=self.device),
                 torch.randn(self.tokens, self.hkv, HEAD, device=self.device),
                 torch.randn(self.tokens, self.hkv, HEAD, device=self.device)) for _ in self.impls]  # fmt: skip


def stored_per_layer(group: Group, rows, slots: torch.Tensor) -> list[torch.Tensor]:
    """The caches each layer's rows leave when the layer computes its own last writers (no sharing)."""
    expected = [cache.clone() for cache in group.caches]
    for impl, cache, (k, v) in zip(group.impls, expected, rows, strict=True):
        ring_write(k, v, *split_kv_cache(cache, impl.head_size), last_writer_slots(slots[: len(k)]))
    return expected


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())


@pytest.fixture
def last_writer_calls(monkeypatch) -> list[int]:
    calls = []
    original = backend_step.last_writer_slots
    monkeypatch.setattr(backend_step, "last_writer_slots", lambda slots: calls.append(len(slots)) or original(slots))
    return calls


def test_the_groups_layers_share_one_last_writer_computation_per_step(device, last_writer_calls):
    """One computation per step for both layers; a step that refills the same tensor in place (vLLM's kernels
    bump no version) is a new step for every layer, and each stores exactly what a per-layer computation does."""
    torch.manual_seed(0)
    group = Group(device, num_reqs=2, num_kv_heads=2, window=64)
    buffer = torch.full((64,), PAD_SLOT, dtype=torch.int64, device=device)  # the speculator's persistent slots
    # rows 0 and 2 share a slot (row 2 wins), row 5 is PAD
    buffer[:6] = torch.tensor([16, 17, 16, 18, 19, PAD_SLOT])
    for step, num_rows in enumerate((6, 6)):
        if step == 1:
            buffer[:6] = torch.tensor([35, 36, 37, 36, PAD_SLOT, 33], device=device)
        slots = buffer[:num_rows]
        rows = group.rows(num_rows)
        expected = stored_per_layer(group, rows, slots)
        group.store(rows, [slots, slots])
        assert last_writer_calls == [num_rows] * (step + 1), "the group's last writers were computed per layer"
        assert all(same(got, want) for got, want in zip(group.caches, expected, strict=True)), f"step {step}"
    # the same tensor object again (no fresh view): still one computation per step
    rows = group.rows(6)
    expected = stored_per_layer(group, rows, slots)
    group.store(rows, [slots, slots])
    assert len(last_writer_calls) == 3
    assert all(same(got, want) for got, want in zip(group.caches, expected, strict=True))


def test_layers_handed_views_of_their_own_compute_their_own(device, last_writer_calls):
    """Model Runner V2 hands each layer its own view when the drafter's layers map to groups one by one: nothing
    is shared between distinct tensors."""
    torch.manual_seed(1)
    group = Group(device, num_reqs=1, num_kv_heads=2, window=64)
    buffer = torch.tensor([16, 17, 16, 18], device=device)
    rows = group.rows(4)
    expected = stored_per_layer(group, rows, buffer)
    group.store(rows, [buffer[:4], buffer[:4]])
    assert last_writer_calls == [4, 4]
    assert all(same(got, want) for got, want in zip(group.caches, expected, strict=True))


@pytest.mark.parametrize(("num_reqs", "num_kv_heads", "window"), [(2, 2, 64), (1, 1, 128)], ids=["unsplit", "split-kv"])
def test_a_decode_step_allocates_only_the_groups_context_slots(num_reqs, num_kv_heads, window, device, monkeypatch):
    """After a warm-up step (the builder's workspace is allocated on first use): the context store allocates only
    the group's one last-writer computation, the draft blocks' forwards nothing (split partials, LSEs included)."""
    torch.manual_seed(2)
    splits = []
    split_count = attention.split_count
    monkeypatch.setattr(attention, "split_count",
                        lambda *a, **k: splits.append(split_count(*a, **k)) or splits[-1])  # fmt: skip
    group = Group(device, num_reqs=num_reqs, num_kv_heads=num_kv_heads, window=window)
    buffer = torch.arange(16, 16 + group.tokens, device=device)
    rows, qkv = group.rows(group.tokens), group.draft_inputs()
    out = torch.empty(group.tokens, group.hq * HEAD, device=device)

    def step() -> tuple[AllocationCounter, AllocationCounter, AllocationCounter]:
        slots = buffer[: group.tokens]  # the speculator's fresh view, handed to every layer
        counters = AllocationCounter(), AllocationCounter(), AllocationCounter()
        for impl, cache, (k, v), counter in zip(group.impls, group.caches, rows, counters, strict=False):
            with counter:
                impl.do_kv_cache_update(None, k, v, cache, slots)
        with counters[2]:
            group.forward(qkv, out)
        return counters

    step()
    first_layer, second_layer, forward = step()
    with AllocationCounter() as one_computation:
        last_writer_slots(buffer[: group.tokens])
    assert first_layer.ops == one_computation.ops, "the context store allocates more than the last writers"
    assert second_layer.total == 0, second_layer.ops
    assert forward.total == 0, forward.ops
    if device.type == "cpu":
        assert set(splits) == ({2} if num_kv_heads == 1 else {1}), splits  # one SM under the interpreter
