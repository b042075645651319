# SPDX-License-Identifier: Apache-2.0
"""The ring attention backend: declared capabilities, spec conversion, misconfiguration errors, selection,
and forward / do_kv_cache_update driven with vLLM's CommonAttentionMetadata on a vLLM-layout KV cache."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from ringkv.bench.lab.simulation.admission import Deployment, drafter_manager, make_request
from ringkv.integration.vllm import register
from ringkv.integration.vllm.backend import RingKVBackend
from ringkv.integration.vllm.planning import RingConfigError, check_ring_config
from ringkv.integration.vllm.ring_spec import RingSWASpec, to_ring_spec
from ringkv.kernels.testing import DrafterShape
from vllm.config import KVTransferConfig

from tests.testing import NAN, assert_attention_close

pytestmark = pytest.mark.vllm


def swa_spec(kv_block_size: int = 16, window: int = 2048):
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(
        block_size=kv_block_size, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, sliding_window=window
    )


def test_backend_is_registered_as_custom_and_ringkv():
    register()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert AttentionBackendEnum.CUSTOM.get_class() is RingKVBackend
    assert AttentionBackendEnum["RINGKV"].get_class() is RingKVBackend
    assert RingKVBackend.get_name() in AttentionBackendEnum.__members__


def test_declared_capabilities():
    from vllm.v1.attention.backend import MultipleOf

    assert RingKVBackend.supports_sliding_window()
    assert RingKVBackend.supports_non_causal()
    assert RingKVBackend.supports_head_size(128) and RingKVBackend.supports_head_size(59)
    assert RingKVBackend.supports_head_size(256) and not RingKVBackend.supports_head_size(512)
    assert RingKVBackend.supports_head_size_v(128, 64) and not RingKVBackend.supports_head_size_v(128, 512)
    assert all(RingKVBackend.supports_dtype(d) for d in (torch.float16, torch.bfloat16, torch.float32))
    assert RingKVBackend.get_supported_kernel_block_sizes() == [MultipleOf(16)]
    assert RingKVBackend.supports_block_size(16) and not RingKVBackend.supports_block_size(8)
    assert RingKVBackend.forward_includes_kv_cache_update
    # vLLM's own check (AttentionBackend.supports_kv_cache_dtype) over its CacheDType names
    for name in ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"):
        assert RingKVBackend.supports_kv_cache_dtype(name), name
    for name in ("fp8_inc", "fp8_ds_mla", "fp8_per_token_head", "int8_per_token_head"):
        assert not RingKVBackend.supports_kv_cache_dtype(name), name


def test_customize_spec_is_idempotent_and_derives_r_from_the_final_block_size():
    ring = RingKVBackend.customize_spec(swa_spec())
    assert isinstance(ring, RingSWASpec) and RingKVBackend.customize_spec(ring) is ring
    ring8 = to_ring_spec(swa_spec(), lookahead=8)
    assert to_ring_spec(ring8, lookahead=3) is ring8, "a planned ring is never re-planned"
    assert ring8.ring_blocks == 130 and ring8.prefix_cacheable == ring8.cache_ring
    assert ring8.max_admission_blocks_per_request(max_in_flight_tokens=16_384, max_model_len=262_144) == 130
    # page-size unification rescales a drafter's block after the spec is built: R follows
    assert ring8.copy_with_new_block_size(32).ring_blocks == (2048 + 8 - 2 + 31) // 32 + 1 == 66
    config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=262_144))
    assert ring8.max_memory_usage_bytes(config) == 130 * ring8.page_size_bytes


@pytest.mark.parametrize(("value", "cached"), [(None, True), ("1", True), ("0", False)])
def test_the_switch_puts_the_ring_in_the_prefix_cache(monkeypatch, value, cached):
    if value is None:
        monkeypatch.delenv("RINGKV_RING_PREFIX_CACHE", raising=False)
    else:
        monkeypatch.setenv("RINGKV_RING_PREFIX_CACHE", value)
    ring = to_ring_spec(swa_spec(), lookahead=8)
    assert ring.cache_ring is ring.prefix_cacheable is cached


def test_a_switch_value_other_than_0_or_1_is_refused(monkeypatch):
    monkeypatch.setenv("RINGKV_RING_PREFIX_CACHE", "yes")
    with pytest.raises(RingConfigError, match=r"RINGKV_RING_PREFIX_CACHE='yes'; set it to 1 .* or 0"):
        to_ring_spec(swa_spec(), lookahead=8)


def dflash_config(num_speculative_tokens: int = 7):
    """The parts of a VllmConfig the ring reads: DFlash's num_lookahead_tokens = N + 1, prefix caching off."""
    return SimpleNamespace(
        num_lookahead_tokens=num_speculative_tokens + 1,
        cache_config=SimpleNamespace(enable_prefix_caching=False),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
    )


def test_spec_is_planned_with_vllms_lookahead_only_inside_its_config():
    """Outside any vLLM config scope (a page-size probe) the ring stays unplanned and every size query refuses;
    inside it, R comes from num_lookahead_tokens (N + 1 = 8 for DFlash: R = 130, not 129)."""
    from vllm.config import set_current_vllm_config

    probe = RingKVBackend.customize_spec(swa_spec())
    assert probe.lookahead == 0 and probe.page_size_bytes == swa_spec().page_size_bytes
    with pytest.raises(RingConfigError, match="num_lookahead_tokens"):
        probe.max_admission_blocks_per_request(max_in_flight_tokens=16, max_model_len=262_144)
    with set_current_vllm_config(dflash_config()):
        planned = RingKVBackend.customize_spec(probe)
    assert planned.lookahead == 8 and planned.ring_blocks == 130


@pytest.mark.parametrize("v2", [False, True], ids=["V1 runner", "Model Runner V2"])
def test_the_spec_knows_whether_the_runner_skips_the_drafter_near_its_max_length(v2):
    """V1 skips the drafter, and its context K/V store, for a batch within the lookahead of the drafter's max length
    (the cached ring then hashes nothing of the requests in it); Model Runner V2 (0.34's only runner) never does."""
    from ringkv.integration.vllm._compat import vllm_version
    from vllm.config import set_current_vllm_config

    config = dflash_config()
    config.use_v2_model_runner = v2
    with set_current_vllm_config(config):
        planned = RingKVBackend.customize_spec(swa_spec())
    only_v2 = vllm_version().release[:2] >= (0, 34)
    assert planned.drafter_skips_near_max_len is not (v2 or only_v2)


def test_worker_spec_collection_runs_inside_the_workers_config():
    """vLLM's Worker.get_kv_cache_spec calls customize_spec with no config in scope; register() wraps it."""
    from ringkv.integration.vllm import patches
    from vllm.config import get_current_vllm_config_or_none
    from vllm.v1.worker.gpu_worker import Worker

    register()
    patches.entry("Worker.get_kv_cache_spec").install()
    seen = []
    worker = SimpleNamespace(vllm_config=dflash_config(), model_runner=SimpleNamespace(
        get_kv_cache_spec=lambda: seen.append(get_current_vllm_config_or_none()) or {}))  # fmt: skip
    assert Worker.get_kv_cache_spec(worker) == {}
    assert seen == [worker.vllm_config]
    assert get_current_vllm_config_or_none() is None


def test_full_attention_layers_keep_vllms_spec():
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    full = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    assert RingKVBackend.customize_spec(full) is full


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (SimpleNamespace(scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=True)),
         "--disable-hybrid-kv-cache-manager"),
        (SimpleNamespace(kv_transfer_config=KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")),
         "SupportsHMA"),
        (SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=True),
                         attention_config=SimpleNamespace(backend_per_kind={"sliding_window": "RINGKV"})),
         "--no-enable-prefix-caching"),
        (SimpleNamespace(num_lookahead_tokens=65), "lower num_speculative_tokens"),
    ],
)  # fmt: skip
def test_misconfiguration_is_a_clear_error(config, message):
    with pytest.raises(RingConfigError, match=message):
        check_ring_config(config)


@pytest.mark.parametrize(("target_window", "refused"), [(None, False), (4096, True)])
def test_attention_backend_ringkv_refuses_prefix_caching_only_for_a_target_with_sliding_layers(target_window, refused):
    """``--attention-backend RINGKV`` in the worker's config serves the target's sliding layers, if it has any:
    prefix caching cannot rebuild those, so it is refused then; a full-attention target's drafter takes hits."""
    from ringkv.integration.vllm import planning

    config = SimpleNamespace(
        cache_config=SimpleNamespace(enable_prefix_caching=True), attention_config=SimpleNamespace(backend="RINGKV"),
        model_config=SimpleNamespace(get_sliding_window=lambda: target_window), num_lookahead_tokens=8,
    )  # fmt: skip
    collecting = planning._collecting_worker_specs.set(True)
    try:
        if refused:
            with pytest.raises(RingConfigError, match="--no-enable-prefix-caching"):
                check_ring_config(config)
        else:
            check_ring_config(config)
    finally:
        planning._collecting_worker_specs.reset(collecting)


def test_registering_first_keeps_vllms_built_in_specs():
    """vLLM's registry skips its built-ins once it is non-empty; register() must fill them in first."""
    code = (
        "import torch\n"
        "from ringkv.integration.vllm import register\n"
        "register()\n"
        "from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry as R\n"
        "from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec\n"
        "full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float16)\n"
        "print(R.get_manager_class(full).__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("FullAttentionManager")


def test_plugin_entry_point_is_installed():
    from importlib.metadata import entry_points

    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("ringkv") == "ringkv.integration.vllm:register"


def test_vllm_attention_backend_env_selects_the_drafter_backend(monkeypatch):
    from ringkv.integration.vllm import patches, selection

    seen = []
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setattr(EngineArgs, "create_speculative_config", lambda self, *a, **k: seen.append(self))
    patches.entry("EngineArgs.create_speculative_config").install()
    args = SimpleNamespace(speculative_config={"method": "dflash", "num_speculative_tokens": 7}, spec_method=None)
    EngineArgs.create_speculative_config(args)
    assert seen == [args] and args.speculative_config["attention_backend"] == "RINGKV"
    explicit = SimpleNamespace(speculative_config={"method": "dflash", "attention_backend": "FLASH_ATTN"})
    selection.apply_drafter_backend(explicit)
    assert explicit.speculative_config["attention_backend"] == "FLASH_ATTN"


SMALL = Deployment(pool_blocks=200, target_groups=1, target_kv_block_size=64, max_model_len=4096,
                   max_num_batched_tokens=256,
                   drafter=DrafterShape(window=64, kv_block_size=16, num_speculative_tokens=7, num_kv_heads=2,
                                        head_dim=32))  # fmt: skip
NUM_Q_HEADS = 8


def vllm_slot_mapping(row: torch.Tensor, positions: torch.Tensor, kv_block_size: int) -> torch.Tensor:
    """vLLM's DFlash prepare kernel: ``row[p // bs] * bs + p % bs``, PAD where the block is the null block."""
    block_ids = row[positions // kv_block_size]
    return torch.where(block_ids == 0, -1, block_ids * kv_block_size + positions % kv_block_size)


@pytest.mark.interpreter
@pytest.mark.parametrize(
    ("causal", "kv_cache_dtype"), [(False, "auto"), (True, "auto"), (False, "fp8_e4m3"), (True, "fp8_e5m2")]
)
def test_forward_and_kv_update_with_common_attention_metadata(causal, kv_cache_dtype, device):
    """Two requests through vLLM's KVCacheManager (ring), context written by do_kv_cache_update in chunks,
    then one draft block each through forward, against an SDPA oracle over the dense history (fp8: vLLM's uint8
    cache full of NaN bytes, the layer's scalar _k_scale / _v_scale, the oracle on the dequantized history)."""
    from types import SimpleNamespace

    from ringkv.kernels.kv_quant import dequantize, fp8_dtype_of, quantize_fp8
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from tests.testing import oracle_pair

    register()
    torch.manual_seed(0)
    manager = SMALL.manager(ring=True)
    drafter = drafter_manager(manager)
    prompts = {"a": 300, "b": 37}
    heads, dim, bs = SMALL.drafter.num_kv_heads, SMALL.drafter.head_dim, SMALL.drafter.kv_block_size
    kv_cache = torch.full((SMALL.pool_blocks, heads, bs, 2 * dim), NAN).to(device)  # vLLM [B, H, N, 2D]
    fp8 = fp8_dtype_of(kv_cache_dtype)
    layer = None
    if fp8 is not None:
        kv_cache = kv_cache.to(fp8).view(torch.uint8)  # the NaN byte everywhere
        layer = SimpleNamespace(_k_scale=torch.tensor(0.02, device=device), _v_scale=torch.tensor(0.03, device=device))
    impl = RingKVBackend.get_impl_cls()(NUM_Q_HEADS, dim, dim**-0.5, heads, sliding_window=SMALL.drafter.window,
                                        kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    history = {}
    for rid, length in prompts.items():
        request = make_request(rid, length)
        history[rid] = (torch.randn(length, heads, dim), torch.randn(length, heads, dim))
        for start in range(0, length, 128):
            end = min(start + 128, length)
            lookahead = SMALL.drafter.lookahead
            assert manager.allocate_slots(request, end - start, num_lookahead_tokens=lookahead) is not None
            request.num_computed_tokens = end
            row = torch.tensor([b.block_id for b in drafter.req_to_blocks[rid]])
            slots = vllm_slot_mapping(row, torch.arange(start, end), bs)
            k, v = history[rid][0][start:end], history[rid][1][start:end]
            impl.do_kv_cache_update(layer, k.to(device), v.to(device), kv_cache, slots.to(device))
    block = SMALL.drafter.lookahead
    width = max(len(drafter.req_to_blocks[r]) for r in prompts)
    table = torch.zeros(len(prompts), width, dtype=torch.int32)
    for i, rid in enumerate(prompts):
        ids = [b.block_id for b in drafter.req_to_blocks[rid]]
        table[i, : len(ids)] = torch.tensor(ids)
    lengths = list(prompts.values())
    query_start_loc = torch.arange(0, block * len(prompts) + 1, block, dtype=torch.int32)
    seq_lens = torch.tensor([n + block for n in lengths], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=query_start_loc.to(device), query_start_loc_cpu=query_start_loc,
        seq_lens=seq_lens.to(device), num_reqs=len(prompts), num_actual_tokens=block * len(prompts),
        max_query_len=block, max_seq_len=int(seq_lens.max()), block_table_tensor=table.to(device),
        slot_mapping=torch.full((block * len(prompts),), -1, device=device), causal=causal,
    )  # fmt: skip
    builder = RingKVBackend.get_builder_cls()(None, ["drafter"], None, device)
    metadata = builder.build(0, common)
    tokens = block * len(prompts)
    q = torch.randn(tokens, NUM_Q_HEADS * dim)
    k_new, v_new = torch.randn(tokens, heads, dim), torch.randn(tokens, heads, dim)
    output = torch.full((tokens + 3, NUM_Q_HEADS * dim), NAN, device=device)
    impl.forward(layer, q.to(device), k_new.to(device), v_new.to(device), kv_cache, metadata, output)
    if fp8 is not None:
        scales = (layer._k_scale.cpu(), layer._v_scale.cpu())
        history = {r: tuple(dequantize(quantize_fp8(x, s, fp8), s) for x, s in zip(kv, scales, strict=True))
                   for r, kv in history.items()}  # fmt: skip
    expected, expected_lo = oracle_pair(
        q.view(tokens, NUM_Q_HEADS, dim), k_new, v_new, [(0, *history[r]) for r in prompts], query_start_loc,
        seq_lens, window=SMALL.drafter.window, causal=causal,
    )  # fmt: skip
    got = output[:tokens].view(tokens, NUM_Q_HEADS, dim).cpu()
    assert_attention_close(got, expected, expected_lo, name="RingKVImpl.forward")
    assert torch.isnan(output[tokens:]).all(), "padding rows were written"


def _one_draft_block(device, causal: bool = False):
    """One request at context_len P = 40 (W 64, bs 16), its 8-row draft block, and a ring-row block table."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    block, context_len, bs, heads, dim = 8, 40, 16, 2, 32
    table = torch.tensor([[1, 2, 3, 4, 5]], dtype=torch.int32)
    query_start_loc = torch.tensor([0, block], dtype=torch.int32)
    positions = torch.arange(context_len, context_len + block)
    common = CommonAttentionMetadata(
        query_start_loc=query_start_loc.to(device), query_start_loc_cpu=query_start_loc,
        seq_lens=torch.tensor([context_len + block], dtype=torch.int32, device=device), num_reqs=1,
        num_actual_tokens=block, max_query_len=block, max_seq_len=context_len + block,
        block_table_tensor=table.to(device), slot_mapping=(table[0, positions // bs] * bs + positions % bs).to(device),
        causal=causal,
    )  # fmt: skip
    kv_cache = torch.randn(6, heads, bs, 2 * dim).to(device)
    q, k, v = torch.randn(block, NUM_Q_HEADS * dim), torch.randn(block, heads, dim), torch.randn(block, heads, dim)
    impl = RingKVBackend.get_impl_cls()(NUM_Q_HEADS, dim, dim**-0.5, heads, sliding_window=64)
    return common, kv_cache, impl, (q.to(device), k.to(device), v.to(device))


@pytest.mark.interpreter
@pytest.mark.parametrize("route", ["build_for_drafting", "is_draft spec"])
def test_a_drafters_block_rows_are_never_written_to_the_ring(route, device):
    """vLLM 0.32 marks no spec is_draft: the drafter builds through build_for_drafting (V1); 0.34 marks
    is_draft and builds with build() (V2). Either way the ring is unchanged by the draft block's forward."""
    common, kv_cache, impl, (q, k, v) = _one_draft_block(device)
    if route == "build_for_drafting":
        metadata = RingKVBackend.get_builder_cls()(None, ["drafter"], None, device).build_for_drafting(common, 0)
    else:
        spec = SimpleNamespace(is_draft=True, sliding_window=64)
        metadata = RingKVBackend.get_builder_cls()(spec, ["drafter"], None, device).build(0, common)
    before = kv_cache.clone()
    impl.forward(None, q, k, v, kv_cache, metadata, torch.empty(len(q), q.shape[1], device=device))
    assert not metadata.write_ring
    assert torch.equal(kv_cache, before), "a draft block's K/V were stored in the ring"


@pytest.mark.interpreter
def test_a_target_layers_new_rows_are_stored_after_attending(device):
    common, kv_cache, impl, (q, k, v) = _one_draft_block(device, causal=True)
    spec = SimpleNamespace(sliding_window=64)
    metadata = RingKVBackend.get_builder_cls()(spec, ["target"], None, device).build(0, common)
    impl.forward(None, q, k, v, kv_cache, metadata, torch.empty(len(q), q.shape[1], device=device))
    # positions 40..47 -> block 3 (column 2), offsets 8..15; K is the first head_size features
    assert torch.equal(kv_cache[3, :, 8:16, :32].transpose(0, 1).cpu(), k.cpu())


def test_a_ringkv_selection_survives_pickling_into_a_fresh_process():
    """vLLM pickles its config (the selected backend included) into the engine-core process before any plugin
    has run there; "RINGKV" must travel as a member that process can resolve."""
    import pickle

    register()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    payload = pickle.dumps(AttentionBackendEnum["RINGKV"]).hex()
    code = f"import pickle; print(pickle.loads(bytes.fromhex('{payload}')).name)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("CUSTOM")


@pytest.mark.interpreter
def test_an_in_place_rewrite_of_the_slot_buffer_is_seen_by_the_next_update(device):
    """vLLM fills its slot buffers in place with kernels that do not bump the tensor version: each
    do_kv_cache_update must read this step's slots, never a cached form of the last step's."""
    _, kv_cache, impl, (_, k, v) = _one_draft_block(device)
    slots = torch.arange(16, 24, device=device)  # block 1, offsets 0..7
    impl.do_kv_cache_update(None, k, v, kv_cache, slots)
    slots.data.copy_(torch.arange(40, 48))  # block 2, offsets 8..15, same tensor, same version
    impl.do_kv_cache_update(None, 2 * k, 2 * v, kv_cache, slots)
    assert torch.equal(kv_cache[2, :, 8:16, :32].transpose(0, 1).cpu(), 2 * k.cpu())


@pytest.mark.interpreter
def test_two_builds_before_their_forwards_do_not_share_state(device):
    """Micro-batching builds every batch's metadata before the forwards run: a later build must not change
    what an earlier build's forward stores."""
    first, kv_cache, impl, (q, k, v) = _one_draft_block(device, causal=True)
    second = replace(first, slot_mapping=first.slot_mapping + 16)  # the same rows one block further on
    builder = RingKVBackend.get_builder_cls()(SimpleNamespace(sliding_window=64), ["target"], None, device)
    metadata_first, _ = builder.build(0, first), builder.build(0, second)
    impl.forward(None, q, k, v, kv_cache, metadata_first, torch.empty(len(q), q.shape[1], device=device))
    assert torch.equal(kv_cache[3, :, 8:16, :32].transpose(0, 1).cpu(), k.cpu())


def test_a_host_sync_during_graph_capture_is_refused(monkeypatch):
    from ringkv.integration.vllm.host_sync import HostSyncDuringCapture
    from ringkv.integration.vllm.metadata import resolve_causal

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert resolve_causal(torch.tensor([True, True])) is True  # a host tensor never syncs
    device_flags = SimpleNamespace(device=torch.device("cuda"), flatten=lambda: pytest.fail("read during capture"))
    with pytest.raises(HostSyncDuringCapture, match="per-group causal flag as a bool"):
        resolve_causal(device_flags)


def test_cross_layer_kv_sharing_is_refused():
    with pytest.raises(NotImplementedError, match=r"kv_sharing_target_layer_name='model\.layers\.0"):
        RingKVBackend.get_impl_cls()(8, 32, 0.1, 2, sliding_window=64,
                                     kv_sharing_target_layer_name="model.layers.0.self_attn.attn")  # fmt: skip


# what the plugin must not load: the scheduler, the engine (core, client, args), the simulation driving them,
# the engine-level probe, vLLM's CPU attention (vLLM's own KV-cache modules do load the type-only
# vllm.v1.engine package and vllm.v1.core.sched.output)
NOT_FOR_SERVING = (
    "vllm.v1.core.sched.scheduler", "vllm.v1.engine.core", "vllm.v1.engine.llm_engine", "vllm.engine.arg_utils",
    "vllm.v1.attention.backends.cpu_attn", "ringkv.bench.lab.simulation", "ringkv.bench.lab.e2e",
)  # fmt: skip


def test_the_plugin_imports_no_scheduler_or_engine_module():
    """register() runs in every vLLM process: it loads nothing for serving beyond what vLLM's worker module
    (whose spec collection it wraps) loads itself; in 0.34 that module loads the scheduler, in 0.32/0.33 not."""
    code = (
        "import sys\n"
        "import vllm.v1.worker.gpu_worker\n"
        "baseline = set(sys.modules)\n"
        "from ringkv.integration.vllm import register\n"
        "register()\n"
        f"print(sorted(m for m in set(sys.modules) - baseline if m.startswith({NOT_FOR_SERVING!r})))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "RINGKV_"))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
