# SPDX-License-Identifier: Apache-2.0
"""The ring backend as Model Runner V2's DFlash speculator drives it (DFlash2 subclasses it; vLLM 0.32 to 0.34),
on CPU tensors with the interpreter kernels. What the speculator hands the backend, read in vLLM's source
(0.34 paths; 0.32 and 0.33 agree where used here):

- ``v1/worker/gpu/spec_decode/dflash/speculator.py``: ``_prepare_dflash_inputs_kernel`` / ``_pad_dflash_inputs``
  write the persistent buffers: per request ``1 + N`` queries at ``P .. P + N``, ``seq_len = P + 1 + N``;
  requests past the batch repeat the last ``query_start_loc`` and get ``seq_len`` 0; query and context slots are
  PAD for rows past the batch, for rejected suffix rows and for null blocks. ``propose`` builds the metadata with
  ``build()`` (``causal`` a Python bool, ``num_reqs`` and ``num_actual_tokens`` padded to the graph's size), or
  replays a FULL graph captured with ``build_for_cudagraph_capture`` metadata (``dflash/cudagraph.py``: rows
  ``seq_len = query_len``, zeroed block rows, PAD slots, ``max_seq_len = max_model_len``). The context K/V arrive
  through ``do_kv_cache_update``, split around a FULL replay for a chunk longer than the graph's context rows.
- ``v1/worker/gpu/block_table.py`` ``_gather_block_tables_kernel``: a sliding-window group's columns below
  ``(num_computed_tokens - reach) // block_size`` read as the null block (0), ``reach = W - 1``.
- ``v1/worker/gpu/attn_utils.py`` ``get_kv_cache_spec``: ``replace(spec, is_draft=True)`` on draft layers, after
  ``customize_spec`` (0.33+; 0.32 has no ``is_draft``).
- ``v1/worker/gpu/spec_decode/speculator.py`` ``load_model`` (0.32): ``is_draft_layer = True`` on every attention
  layer the draft model added, before the KV cache and the metadata builders exist.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import triton

pytest.importorskip("vllm")

from ringkv.bench.lab.simulation.admission import Deployment, drafter_manager, make_request
from ringkv.integration.vllm import register
from ringkv.integration.vllm._compat import CommonAttentionMetadata, dflash_speculator_class, is_draft_spec
from ringkv.integration.vllm.backend import RingKVBackend
from ringkv.integration.vllm.ring_spec import RingSWASpec
from ringkv.kernels.ring_geometry import PAD_SLOT
from ringkv.kernels.testing import DrafterShape

from tests.testing import NAN, assert_attention_close, oracle_pair

pytestmark = [pytest.mark.vllm, pytest.mark.interpreter]

# W 64, bs 16, N 7: R = cdiv(64 + 8 - 2, 16) + 1 = 6 blocks per request
SMALL = Deployment(
    pool_blocks=200,
    target_groups=1,
    target_kv_block_size=64,
    max_model_len=4096,
    max_num_batched_tokens=256,
    drafter=DrafterShape(window=64, kv_block_size=16, num_speculative_tokens=7),
)
BS, W, LA = SMALL.drafter.kv_block_size, SMALL.drafter.window, SMALL.drafter.lookahead
WIDTH = triton.cdiv(SMALL.max_model_len, BS)  # V2's row width: max_num_blocks_per_req(max_model_len)
HKV, HQ = 2, 8
HAS_IS_DRAFT = any(f.name == "is_draft" for f in dataclasses.fields(RingSWASpec))
# KVCacheSpec.is_draft, vLLM 0.33+'s mark; on 0.32 (CI's version, no such field) a subclass adds it, so the
# builder's reading of the mark is tested there too
MarkableRingSpec = RingSWASpec if HAS_IS_DRAFT else dataclasses.make_dataclass(
    "MarkableRingSpec", [("is_draft", bool, False)], bases=(RingSWASpec,), frozen=True
)  # fmt: skip


def ring_spec(head_size: int, head_size_v: int, draft: bool) -> RingSWASpec:
    """The group spec the drafter's builder gets: ``customize_spec``'s ring spec, marked ``is_draft`` by V2."""
    spec = MarkableRingSpec(block_size=BS, num_kv_heads=HKV, head_size=head_size, head_size_v=head_size_v,
                            dtype=torch.float32, sliding_window=W, lookahead=LA)  # fmt: skip
    return dataclasses.replace(spec, is_draft=draft)


def v2_loaded_config(target_layers: list[str], draft_layers: list[str]) -> SimpleNamespace:
    """The forward context as Model Runner V2 leaves it once the drafter is loaded: vLLM's own
    ``load_model`` of the DFlash speculator (run on a stand-in whose draft model adds ``draft_layers``) marks the
    draft model's attention layers; the builders are made after it."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    class Layer(AttentionLayerBase):
        def get_attn_backend(self):
            return RingKVBackend

        def get_kv_cache_spec(self, vllm_config):
            return None

    context = {name: Layer() for name in target_layers}

    def load_draft_model(target_model, target_attn_layer_names):
        context.update({name: Layer() for name in draft_layers})
        return SimpleNamespace()

    config = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=context),
                             model_config=SimpleNamespace(supports_multimodal_inputs=False))  # fmt: skip
    # an instance of vLLM's own class (0.34's load_model calls super()), its attributes as __init__ leaves them for a
    # single-GPU drafter without draft logits or an acceptance estimator
    speculator = object.__new__(dflash_speculator_class())
    vars(speculator).update(
        vllm_config=config,
        load_draft_model=load_draft_model,
        use_acceptance_estimator=False,
        use_draft_logits=False,
        dcp_size=1,
        _validate_local_argmax_reduction=lambda: None,
    )
    speculator.load_model(None)
    assert speculator.draft_attn_layer_names == set(draft_layers)
    return config


def slot_of(row: list[int], positions: torch.Tensor, pad_null: bool = True) -> torch.Tensor:
    """``row[p // bs] * bs + p % bs``: the drafter's prepare kernel PADs null blocks (id 0), the target's
    ``compute_slot_mappings`` does not (``pad_null=False``)."""
    ids = torch.tensor(row)[positions // BS]
    slots = ids * BS + positions % BS
    return torch.where(ids == 0, PAD_SLOT, slots) if pad_null else slots


def drafter_row(manager, request_id: str) -> list[int]:
    return [block.block_id for block in drafter_manager(manager).req_to_blocks[request_id]]


@dataclasses.dataclass
class Requests:
    """Real requests after their context was stored: the drafter rows and the dense histories."""

    manager: object
    requests: dict = dataclasses.field(default_factory=dict)
    context_len: list[int] = dataclasses.field(default_factory=list)
    rows: list[list[int]] = dataclasses.field(default_factory=list)
    history: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)
    # the last target step's num_computed_tokens (what V2's gather nulls the window against)
    step_start: list[int] = dataclasses.field(default_factory=list)


# the K/V of V2's PAD context rows: finite, so a store of one anywhere (the null block's NaN included) shows
PAD_ROW = 7777.0


def store_context(impl, kv_cache: torch.Tensor, chunks: dict[str, list[int]], head_size_v: int) -> Requests:
    """Each request's prompt through vLLM's KVCacheManager (ring) chunk by chunk; every chunk's context rows go
    through ``do_kv_cache_update`` with V2's PAD rows mixed in (rejected suffix rows), which must land nowhere."""
    register()
    out = Requests(SMALL.manager(ring=True))
    for rid, sizes in chunks.items():
        total = sum(sizes)
        k_hist, v_hist = torch.randn(total, HKV, impl.head_size), torch.randn(total, HKV, head_size_v)
        request, start = make_request(rid, total + 1000), 0
        for size in sizes:
            assert out.manager.allocate_slots(request, size, num_lookahead_tokens=LA) is not None
            request.num_computed_tokens = start + size
            slots = slot_of(drafter_row(out.manager, rid), torch.arange(start, start + size))
            k = torch.cat([k_hist[start : start + size], torch.full((3, HKV, impl.head_size), PAD_ROW)])
            v = torch.cat([v_hist[start : start + size], torch.full((3, HKV, head_size_v), PAD_ROW)])
            expected = kv_cache.clone()
            expected_slots = expected.permute(0, 2, 1, 3)  # [B, bs, Hkv, D + Dv], a view
            for row, slot in enumerate(slots.tolist()):  # in order: a slot's last writer wins; PAD (null) rows skip
                if slot >= 0:
                    expected_slots[slot // BS, slot % BS] = torch.cat([k[row], v[row]], -1)
            impl.do_kv_cache_update(None, k, v, kv_cache, torch.cat([slots, torch.full((3,), PAD_SLOT)]))
            # every block, the null block included, changed at this chunk's slots only: no PAD row stored anywhere
            assert torch.equal(kv_cache.nan_to_num(), expected.nan_to_num()), f"{rid}: a store outside its slots"
            start += size
        out.context_len.append(total)
        out.rows.append(drafter_row(out.manager, rid))
        out.requests[rid] = request
        out.history.append((k_hist, v_hist))
        out.step_start.append(total - sizes[-1])
    return out


class SpeculatorBuffers:
    """V2's persistent inputs (``InputBuffers``, ``BlockTables``): a captured graph reads these addresses."""

    def __init__(self, max_num_reqs: int) -> None:
        self.query_start_loc = torch.zeros(max_num_reqs + 1, dtype=torch.int32)
        self.seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32)
        self.block_table = torch.zeros(max_num_reqs, WIDTH, dtype=torch.int32)
        self.slot_mapping = torch.full((max_num_reqs * LA,), PAD_SLOT, dtype=torch.int64)

    def metadata(self, num_reqs: int, max_seq_len: int, causal: bool) -> CommonAttentionMetadata:
        """``_build_uniform_attn_metadata`` for a FULL-graph size of ``num_reqs`` requests."""
        query_start_loc = self.query_start_loc[: num_reqs + 1]
        return CommonAttentionMetadata(
            query_start_loc=query_start_loc, query_start_loc_cpu=query_start_loc.clone(),
            seq_lens=self.seq_lens[:num_reqs], num_reqs=num_reqs, num_actual_tokens=num_reqs * LA, max_query_len=LA,
            max_seq_len=max_seq_len, block_table_tensor=self.block_table[:num_reqs],
            slot_mapping=self.slot_mapping[: num_reqs * LA], causal=causal,
        )  # fmt: skip

    def capture(self, num_reqs: int, causal: bool) -> CommonAttentionMetadata:
        """``_prepare_dflash_inputs_to_capture``: dummy requests of ``1 + N`` queries at position 0, zeroed block
        rows, PAD slots, ``max_seq_len = max_model_len``."""
        self.query_start_loc.copy_(torch.arange(len(self.query_start_loc)).clamp(max=num_reqs) * LA)
        self.seq_lens[:num_reqs] = LA
        self.block_table.zero_()
        self.slot_mapping.fill_(PAD_SLOT)
        return self.metadata(num_reqs, SMALL.max_model_len, causal)

    def prepare(self, requests: Requests) -> None:
        """The prepare kernel (padded past the batch) and the sliding-window gather, in place."""
        n = len(requests.context_len)
        self.query_start_loc.copy_(torch.arange(len(self.query_start_loc)).clamp(max=n) * LA)
        self.seq_lens.zero_()
        self.block_table.zero_()
        self.slot_mapping.fill_(PAD_SLOT)
        for r, (p, row) in enumerate(zip(requests.context_len, requests.rows, strict=True)):
            self.seq_lens[r] = p + LA
            num_null = max(requests.step_start[r] - (W - 1), 0) // BS
            self.block_table[r, num_null : len(row)] = torch.tensor(row[num_null:], dtype=torch.int32)
            self.slot_mapping[r * LA : (r + 1) * LA] = slot_of(row, torch.arange(p, p + LA))


def draft_inputs(num_tokens: int, head_size: int, head_size_v: int):
    return (
        torch.randn(num_tokens, HQ * head_size),
        torch.randn(num_tokens, HKV, head_size),
        torch.randn(num_tokens, HKV, head_size_v),
    )


def oracle_rows(q, k, v, histories, context_lens: list[int], block: int, causal: bool):
    """(ref_hi, ref_lo) of equal blocks of ``block`` rows at ``context_lens`` over full histories (positions 0..)."""
    starts = torch.arange(0, block * len(context_lens) + 1, block)
    seq_lens = torch.tensor([p + block for p in context_lens])
    dense = [(0, k_hist[:p], v_hist[:p]) for (k_hist, v_hist), p in zip(histories, context_lens, strict=True)]
    return oracle_pair(q, k, v, dense, starts, seq_lens, window=W, causal=causal)


def check_draft_output(output, q, k, v, requests: Requests, head_size: int, causal: bool) -> None:
    tokens = len(requests.context_len) * LA
    expected, expected_lo = oracle_rows(
        q[:tokens].view(tokens, HQ, head_size), k[:tokens], v[:tokens], requests.history, requests.context_len, LA,
        causal,
    )  # fmt: skip
    assert_attention_close(output[:tokens].view(tokens, HQ, -1), expected, expected_lo, name="draft rows")
    assert torch.isnan(output[tokens:]).all(), "rows of padded requests (query_len 0, seq_len 0) were written"


# "d": a verify-sized last step, where the gather nulls up to the very column its first query needs
CHUNKS = {"a": [128, 128, 44], "b": [37], "c": [100], "d": [79, 1]}
GRAPH_REQS = 6  # the FULL graph's request count: 2 padded requests


@pytest.mark.parametrize(("head_size", "head_size_v"), [(32, 32), (64, 32)])
@pytest.mark.parametrize("causal", [False, True])
def test_eager_draft_step_with_padded_requests(head_size, head_size_v, causal):
    """``build()`` then ``forward`` on the speculator's padded batch (4 requests in a 6-request graph size):
    the drafts match the dense oracle, padded requests write nothing, and a draft layer stores no block row
    (0.33+: the spec is ``is_draft``; 0.32, which has no such field: the builder reads V2's marked layers)."""
    torch.manual_seed(0)
    impl = RingKVBackend.get_impl_cls()(HQ, head_size, head_size**-0.5, HKV, sliding_window=W)
    kv_cache = torch.full((SMALL.pool_blocks, HKV, BS, head_size + head_size_v), NAN)  # vLLM [B, H, bs, D + Dv]
    requests = store_context(impl, kv_cache, CHUNKS, head_size_v)
    buffers = SpeculatorBuffers(max_num_reqs=GRAPH_REQS)
    buffers.prepare(requests)
    draft_max_seq_len = min(max(requests.context_len) + 2 * LA, SMALL.max_model_len)
    builder = RingKVBackend.get_builder_cls()(ring_spec(head_size, head_size_v, draft=True), ["drafter"],
                                              v2_loaded_config(["target"], ["drafter"]), "cpu")  # fmt: skip
    metadata = builder.build(0, buffers.metadata(GRAPH_REQS, draft_max_seq_len, causal))
    assert not metadata.write_ring
    q, k, v = draft_inputs(GRAPH_REQS * LA, head_size, head_size_v)
    output = torch.full((GRAPH_REQS * LA, HQ * head_size_v), NAN)
    before = kv_cache.clone()
    impl.forward(None, q, k, v, kv_cache, metadata, output)
    check_draft_output(output, q, k, v, requests, head_size, causal)
    assert torch.equal(kv_cache.nan_to_num(), before.nan_to_num()), "a draft block's rows were stored"


@pytest.mark.parametrize(
    ("draft_layers", "builder_layers", "writes_ring"),
    [
        pytest.param(["d0", "d1"], ["d0", "d1"], False, id="drafter-builder"),
        pytest.param(["d0", "d1"], ["t0"], True, id="target-builder"),
        # vLLM 0.32 groups a drafter's layers with the target's of an equal spec; the target's builder serves both
        pytest.param(["d0", "d1"], ["t0", "d0"], True, id="mixed-builder"),
        pytest.param([], ["t0"], True, id="v1-runner-marks-none"),
    ],
)  # fmt: skip
def test_the_builder_learns_draft_layers_from_model_runner_v2(draft_layers, builder_layers, writes_ring):
    """On every vLLM: a builder of the drafter's layers (marked by V2's speculator) never stores block rows, even
    with a spec vLLM did not mark ``is_draft`` (0.32); a builder with any target layer stores them."""
    spec = ring_spec(32, 32, draft=False)
    assert not is_draft_spec(spec)
    config = v2_loaded_config(["t0"], draft_layers)
    builder = RingKVBackend.get_builder_cls()(spec, builder_layers, config, "cpu")
    buffers = SpeculatorBuffers(max_num_reqs=1)
    assert builder.build(0, buffers.capture(num_reqs=1, causal=False)).write_ring is writes_ring


def test_the_builder_reads_a_spec_vllm_marked_as_a_drafters():
    """0.33+: Model Runner V2 marks the drafter group's spec ``is_draft`` (``attn_utils.get_kv_cache_spec``) and
    marks no layer; that builder stores no block rows."""
    builder = RingKVBackend.get_builder_cls()(ring_spec(32, 32, draft=True), ["d0"], v2_loaded_config(["t0"], []),
                                              "cpu")  # fmt: skip
    assert not builder.build(0, SpeculatorBuffers(max_num_reqs=1).capture(num_reqs=1, causal=False)).write_ring


def test_a_replay_reads_this_steps_buffers_through_the_captured_metadata():
    """FULL graph: metadata from ``build_for_cudagraph_capture`` on dummy inputs (the capture run itself works:
    no context, zeroed rows, PAD slots), then the speculator rewrites its buffers in place for a real step with
    fewer requests and the captured metadata serves it: nothing the builder derived is stale."""
    torch.manual_seed(1)
    impl = RingKVBackend.get_impl_cls()(HQ, 32, 32**-0.5, HKV, sliding_window=W)
    kv_cache = torch.full((SMALL.pool_blocks, HKV, BS, 64), NAN)
    requests = store_context(impl, kv_cache, CHUNKS, 32)
    buffers = SpeculatorBuffers(max_num_reqs=GRAPH_REQS)
    builder = RingKVBackend.get_builder_cls()(ring_spec(32, 32, draft=True), ["drafter"], None, "cpu")
    captured = builder.build_for_cudagraph_capture(buffers.capture(num_reqs=GRAPH_REQS, causal=False))
    q, k, v = draft_inputs(GRAPH_REQS * LA, 32, 32)
    impl.do_kv_cache_update(None, k, v, kv_cache, buffers.slot_mapping)  # capture: context slots all PAD
    impl.forward(None, q, k, v, kv_cache, captured, torch.empty(GRAPH_REQS * LA, HQ * 32))
    buffers.prepare(requests)
    output = torch.full((GRAPH_REQS * LA, HQ * 32), NAN)
    impl.forward(None, q, k, v, kv_cache, captured, output)
    check_draft_output(output, q, k, v, requests, 32, causal=False)


def test_a_target_chunk_with_a_different_value_head_size():
    """A target sliding layer's prefill chunk (``ring_attention`` on a ``PREFILL_CHUNK``, more than 64 queries) with
    ``head_size_v != head_size`` (what ``supports_head_size_v`` declares): attends, then stores its live rows."""
    torch.manual_seed(2)
    head_size, head_size_v, context_len, chunk = 64, 32, 150, 70
    assert RingKVBackend.supports_head_size_v(head_size, head_size_v)
    impl = RingKVBackend.get_impl_cls()(HQ, head_size, head_size**-0.5, HKV, sliding_window=W)
    kv_cache = torch.full((SMALL.pool_blocks, HKV, BS, head_size + head_size_v), NAN)
    requests = store_context(impl, kv_cache, {"a": [context_len]}, head_size_v)
    assert requests.manager.allocate_slots(requests.requests["a"], chunk, num_lookahead_tokens=LA) is not None
    row = drafter_row(requests.manager, "a")
    positions = torch.arange(context_len, context_len + chunk)
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, chunk], dtype=torch.int32), query_start_loc_cpu=torch.tensor([0, chunk]),
        seq_lens=torch.tensor([context_len + chunk], dtype=torch.int32), num_reqs=1, num_actual_tokens=chunk,
        max_query_len=chunk, max_seq_len=context_len + chunk, block_table_tensor=torch.tensor([row], dtype=torch.int32),
        slot_mapping=slot_of(row, positions, pad_null=False), causal=True,
    )  # fmt: skip
    metadata = RingKVBackend.get_builder_cls()(
        ring_spec(head_size, head_size_v, draft=False), ["t"], None, "cpu"
    ).build(0, common)
    q, k, v = draft_inputs(chunk, head_size, head_size_v)
    output = torch.full((chunk, HQ * head_size_v), NAN)
    impl.forward(None, q, k, v, kv_cache, metadata, output)
    expected, expected_lo = oracle_rows(
        q.view(chunk, HQ, head_size), k, v, requests.history, [context_len], chunk, causal=True
    )
    assert_attention_close(output.view(chunk, HQ, head_size_v), expected, expected_lo, name="chunk rows")
    last = context_len + chunk - 1
    slot = int(slot_of(row, torch.tensor([last])))
    stored = kv_cache.view(-1, HKV, BS, head_size + head_size_v)[slot // BS, :, slot % BS]
    assert torch.equal(stored[:, :head_size], k[-1]) and torch.equal(stored[:, head_size:], v[-1])


def _split_write_speculator(spec) -> tuple[SimpleNamespace, torch.Tensor, dict]:
    """A DFlash speculator's context store state after a 40-token step then a 200-token chunk (W 64, R 6):
    the chunk's first rows (positions 40..47) sit in block 2, appended live by the first step, which is ring
    block 2 again at logical block 14 (positions 224..239, live). vLLM's own ``_precompute_context_kv`` runs on
    it; the model stand-in stores the rows through ``do_kv_cache_update``."""
    manager = SMALL.manager(ring=True)
    request = make_request("r", 240)
    assert manager.allocate_slots(request, 40, num_lookahead_tokens=LA) is not None
    request.num_computed_tokens = 40
    assert manager.allocate_slots(request, 200, num_lookahead_tokens=LA) is not None
    row = drafter_row(manager, "r")
    assert row[2] == row[14] != 0 and row[3] == 0, row
    positions = torch.arange(40, 240)
    impl = RingKVBackend.get_impl_cls()(HQ, 32, 32**-0.5, HKV, sliding_window=W)
    kv_cache = torch.full((SMALL.pool_blocks, HKV, BS, 64), NAN)
    rows = torch.randn(len(positions), HKV, 64, generator=torch.Generator().manual_seed(3))

    def store(hidden_states, context_positions, context_slots):
        k, v = hidden_states[:, :, :32].contiguous(), hidden_states[:, :, 32:].contiguous()
        impl.do_kv_cache_update(None, k, v, kv_cache, context_slots)

    slots = torch.full((1, 256), PAD_SLOT, dtype=torch.int64)
    slots[0, : len(positions)] = slot_of(row, positions)
    speculator = SimpleNamespace(
        _context_slot_mappings=slots, _layer_group_idx=None, hidden_states=rows, context_positions=positions,
        model=SimpleNamespace(precompute_and_store_context_kv=store), draft_kv_cache_group_ids=[0],
        kv_cache_config=SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)]),
    )  # fmt: skip
    return speculator, kv_cache, {"row": row, "rows": rows, "positions": positions}


def test_a_context_store_split_around_a_full_replay_keeps_the_live_rows():
    """``_prepare_graph_replay`` stores rows ``[num_context, T)`` eagerly, then the replayed graph stores rows
    ``[0, num_context)``: the ring must end as one ``do_kv_cache_update`` over all rows leaves it."""
    register()
    spec = ring_spec(32, 32, draft=True)
    precompute = dflash_speculator_class()._precompute_context_kv
    whole, whole_cache, case = _split_write_speculator(spec)
    precompute(whole, 0, 200)
    split, split_cache, _ = _split_write_speculator(spec)
    num_context = 1 * LA  # _num_graph_context_tokens(1)
    precompute(split, num_context, 200)  # eager, before the replay
    precompute(split, 0, num_context)  # inside the graph
    for p in range(240 - (W - 1), 240):  # every live position holds its own row
        slot = int(slot_of(case["row"], torch.tensor([p])))
        assert torch.equal(split_cache[slot // BS, :, slot % BS], case["rows"][p - 40]), f"position {p}"
    assert torch.equal(split_cache.nan_to_num(), whole_cache.nan_to_num())


def test_the_split_store_fix_leaves_groups_off_the_ring_alone():
    from ringkv.integration.vllm._compat import SlidingWindowSpec

    stock = SlidingWindowSpec(block_size=BS, num_kv_heads=HKV, head_size=32, dtype=torch.float32, sliding_window=W)
    register()
    speculator, _, _ = _split_write_speculator(stock)
    before = speculator._context_slot_mappings.clone()
    dflash_speculator_class()._precompute_context_kv(speculator, LA, 200)
    assert torch.equal(speculator._context_slot_mappings, before)
