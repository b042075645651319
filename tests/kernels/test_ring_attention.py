# SPDX-License-Identifier: Apache-2.0
"""ring_attention (Triton) on draft blocks against the reference: tolerance rule, NaN-poisoned pools, exact index
cases."""

from __future__ import annotations

import pytest
import torch
from ringkv.kernels import (
    BatchMode,
    RingPlan,
    ring_attention,
    ring_attention_reference,
)
from ringkv.kernels.kv_quant import quantize_fp8
from ringkv.kernels.ring_geometry import PAD_SLOT, UNBOUNDED_WINDOW, first_visible_position
from ringkv.kernels.testing import RingPool

from tests.testing import (
    assert_attention_close,
    assert_kernel_matches_reference,
    make_ring_case,
    reference_pair,
    stable_seed,
)

pytestmark = pytest.mark.interpreter

S130 = 130 * 16  # slots of the DFlash2 ring (W 2048, bs 16, la <= 18)

# (requests [(P, B)], W, bs, Hq, Hkv, D, Dv, dtype, causal, full_rows, num_splits)
CASES = [
    pytest.param([(0, 1), (5, 1)], 1, 16, 4, 1, 64, 64, torch.float32, True, False, None, id="W1-causal"),
    pytest.param([(14, 8), (15, 8), (0, 3)], 15, 16, 8, 2, 64, 64, torch.float32, False, False, None, id="W15-P14-P15-P0"),
    pytest.param([(16, 8), (15, 1)], 16, 16, 5, 1, 59, 59, torch.float32, True, True, None, id="W16-gqa5-D59-fullrows"),
    pytest.param([(48, 8), (97, 8)], 17, 16, 4, 4, 128, 128, torch.float32, False, False, 2, id="W17-exactwrap-mha-split2"),
    pytest.param([(262144 - 8, 8)], 2048, 16, 8, 2, 128, 128, torch.float32, False, True, None, id="W2048-P262136-fullrows"),
    pytest.param([(2047, 8), (2048, 16), (2 * S130, 8)], 2048, 16, 4, 1, 128, 128, torch.float32, True, False, None,
                 id="W2048-mixed-causal-wrap2"),
    pytest.param([(5000, 16)], 2048, 16, 16, 2, 256, 256, torch.float32, False, False, 4, id="W2048-gqa8-D256-split4"),
    pytest.param([(200, 33)], 64, 16, 8, 2, 64, 64, torch.float32, True, False, None, id="B33-two-row-blocks"),
    pytest.param([(100, 5), (3, 8)], 37, 8, 8, 2, 96, 96, torch.float16, True, False, None, id="fp16-W37"),
    pytest.param([(77, 8)], 37, 8, 4, 1, 64, 64, torch.bfloat16, False, True, None, id="bf16-W37-fullrows"),
    # split partials are stored in the output dtype and merged in fp32: the tolerance rule holds for 16-bit dtypes
    pytest.param([(300, 8), (2, 5)], 257, 16, 8, 2, 64, 64, torch.bfloat16, False, False, 3, id="bf16-W257-split3"),
    pytest.param([(100, 7)], 100, 16, 4, 1, 48, 48, torch.float16, True, True, 2, id="fp16-W100-D48-split2"),
    pytest.param([(50, 4)], 20, 4, 2, 2, 100, 64, torch.float32, True, False, 3, id="D100-Dv64-split3"),
    pytest.param([(0, 8), (1, 8), (S130, 8), (12345, 3)], 2048, 16, 5, 1, 80, 80, torch.float32, False, False, 3,
                 id="W2048-P0-P1-wrap-gqa5-D80-split3"),
    # block sizes other than 16: 2 tiles of 64 keys per block (one block id each), 3 tiles of 16 per block of 48,
    # and tiles of 16 that straddle blocks of 24 (one block id per key)
    pytest.param([(1000, 8), (100, 3)], 300, 128, 4, 1, 64, 64, torch.float32, False, False, 2, id="bs128-split2"),
    pytest.param([(500, 8)], 200, 48, 8, 2, 32, 32, torch.float32, True, True, None, id="bs48-fullrows"),
    pytest.param([(333, 5), (7, 8)], 101, 24, 4, 2, 32, 32, torch.float32, False, False, 3, id="bs24-split3"),
    # full-attention layers (vLLM's sliding_window None): every context key, vLLM-style full rows
    pytest.param([(300, 8), (0, 8), (45, 3)], UNBOUNDED_WINDOW, 16, 8, 2, 64, 64, torch.float32, False, True, None,
                 id="full-attention-noncausal"),
    pytest.param([(700, 8), (33, 8)], UNBOUNDED_WINDOW, 16, 4, 1, 32, 32, torch.float32, True, True, 3,
                 id="full-attention-causal-split3"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("requests", "window", "bs", "hq", "hkv", "d", "dv", "dtype", "causal", "full_rows", "splits"), CASES
)
def test_ring_attention_matches_reference(
    requests, window, bs, hq, hkv, d, dv, dtype, causal, full_rows, splits, device
):
    seed = stable_seed(requests, window, bs, hq, hkv, d, dv, dtype, causal, full_rows, splits)
    case = make_ring_case(
        requests, window=window, kv_block_size=bs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=dv,
        dtype=dtype, causal=causal, full_rows=full_rows, pad_tokens=2, seed=seed,
    )  # fmt: skip
    assert_kernel_matches_reference(ring_attention, case, device, num_splits=splits)


def onehot_history(depth: int):
    """History values that name their position: K = 0 (uniform weights), V = one-hot(pos mod depth)."""

    def history(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values = torch.nn.functional.one_hot(positions % depth, depth).float()[:, None, :]
        return torch.zeros(len(positions), 1, depth), values

    return history


def expected_attended(context_len: int, offset: int, num_queries: int, window: int, causal: bool) -> list[int]:
    """Positions a query at ``context_len + offset`` sees (the contract, spelled out as a list)."""
    query = context_len + offset
    context = list(range(first_visible_position(query, window), context_len))
    block = [context_len + j for j in range(num_queries)]
    block = [k for k in block if query - k < window and (k <= query if causal else k - query < window)]
    return context + block


# (W, bs, [(P, B)], causal, full_rows): every window edge, ring wrap 0/1/many times, every query offset
EXACT = [
    (15, 16, [(0, 8), (1, 8), (14, 8), (15, 8), (16, 8)], True, False),
    (16, 16, [(15, 1), (16, 1), (17, 1), (0, 1)], False, True),
    (17, 16, [(48, 8), (49, 8), (3 * 48 + 5, 8)], False, False),
    (37, 8, [(40, 16), (36, 16), (8 * 53 + 3, 16)], True, True),
    (17, 4, [(17 * 9 + 2, 8), (16, 8)], False, True),
]


@pytest.mark.parametrize(
    ("window", "bs", "requests", "causal", "full_rows"), EXACT, ids=[f"W{c[0]}-bs{c[1]}" for c in EXACT]
)
def test_ring_attention_names_the_attended_set(window, bs, requests, causal, full_rows, device):
    depth = 64
    case = make_ring_case(
        requests, window=window, kv_block_size=bs, num_q_heads=2, num_kv_heads=1, head_dim=depth, causal=causal,
        full_rows=full_rows, history_fn=onehot_history(depth),
    )  # fmt: skip
    starts = case.query_start_loc.tolist()
    for r, (p, _b) in enumerate(requests):
        positions = torch.arange(p, p + _b)
        case.k_new[starts[r] : starts[r + 1]] = 0
        case.v_new[starts[r] : starts[r + 1]] = torch.nn.functional.one_hot(positions % depth, depth).float()[:, None]
    out = ring_attention(**case.to(device).kernel_args()).cpu()
    for r, (p, b) in enumerate(requests):
        for i in range(b):
            want = expected_attended(p, i, b, window, causal)
            got = out[starts[r] + i, 0]
            seen = sorted(int(c) for c in (got > 0).nonzero())
            # all residues distinct: len(want) < depth here, so the output names the set exactly
            want_residues = sorted(k % depth for k in want)
            assert seen == want_residues, (
                f"request {r} (P={p}) query {i} at position {p + i}: attended {len(seen)} keys, expected "
                f"{len(want)}; missing residues {sorted(set(want_residues) - set(seen))}, "
                f"extra {sorted(set(seen) - set(want_residues))}"
            )
            expected = torch.zeros(depth)
            expected[want_residues] = 1 / len(want)
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("order", ["BHN", "BNH"])
def test_ring_attention_reads_vllm_layer_views(order, device):
    """K/V as strided views of one vLLM per-layer tensor ``[num_blocks, H, N, 2D]`` (no copies)."""
    case = make_ring_case([(300, 8), (20, 3)], window=64, kv_block_size=16, num_q_heads=8, num_kv_heads=2, head_dim=32)
    ref_hi, ref_lo = reference_pair(case)
    d = case.k_cache.shape[-1]
    if order == "BHN":
        storage = torch.cat([case.k_cache, case.v_cache], -1).transpose(1, 2).contiguous()
    else:
        storage = torch.cat([case.k_cache, case.v_cache], -1).contiguous().transpose(1, 2)
    storage = storage.to(device)
    args = {**case.to(device).kernel_args(), "k_cache": storage[..., :d].transpose(1, 2)}
    args["v_cache"] = storage[..., d:].transpose(1, 2)
    out = ring_attention(**args)
    assert_attention_close(out.cpu(), ref_hi, ref_lo, name=f"ring_attention[{order}]", case=case)


@pytest.mark.parametrize("kind", ["draft", "prefill"])
def test_ring_reads_beyond_2_31_elements(kind, device):
    """A ring whose blocks sit past 2^31 elements of the pool is read where it should be (int64 offsets)."""
    window, bs, head_dim, context, queries = 40, 16, 64, 50, 8
    plan = RingPlan(window, bs, lookahead=queries)
    num_blocks = 2**31 // (bs * head_dim) + 64  # > 2^31 elements (4 GiB of fp16) of K
    # untouched pages of torch.empty are never materialised, so this costs almost no memory
    k_cache, v_cache = (torch.empty(num_blocks, bs, 1, head_dim, dtype=torch.float16, device=device) for _ in range(2))
    # the pool's last R blocks, not RingPool.allocate's NaN fill (it would materialise both 4 GiB caches)
    ring = torch.arange(num_blocks - plan.ring_blocks, num_blocks, dtype=torch.int32, device=device)
    pool = RingPool(plan, k_cache, v_cache, ring[None])
    generator = torch.Generator().manual_seed(7)
    positions = torch.arange(context - (window - 1), context)
    rows = [torch.randn(len(positions), 1, head_dim, generator=generator).half().to(device) for _ in range(2)]
    pool.write(0, positions, *rows, seq_len=context)
    q = torch.randn(queries, 4, head_dim, generator=generator).half().to(device)
    k_new, v_new = (torch.randn(queries, 1, head_dim, generator=generator).half().to(device) for _ in range(2))
    mode = BatchMode.DRAFT_BLOCK if kind == "draft" else BatchMode.PREFILL_CHUNK
    batch = pool.batch([context], queries, mode=mode)
    args = {"q": q, "k_new": k_new, "v_new": v_new, "k_cache": k_cache, "v_cache": v_cache, "batch": batch,
            "window": window, "causal": True}  # fmt: skip
    out = ring_attention(**args)
    ref_hi = ring_attention_reference(**args, compute_dtype=torch.float64)
    ref_lo = ring_attention_reference(**args, compute_dtype=torch.float16)
    assert_attention_close(out.cpu(), ref_hi.cpu(), ref_lo.cpu(), name=f"{kind} beyond 2^31 elements")


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (NaN and fp8 included)."""
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.view(bits), b.view(bits))


# (requests [(P, B)], W, bs, Hq, Hkv, D, dtype, fp8 ring)
DRAFT_WRITES = [
    pytest.param([(14, 8), (40, 5), (0, 3)], 15, 16, 4, 2, 32, torch.float32, None, id="W15-fp32"),
    pytest.param([(13, 7), (29, 8), (0, 3)], 5, 8, 6, 2, 24, torch.float16, None, id="W5-dead-rows-gqa3-D24-fp16"),
    pytest.param([(21, 6), (3, 8)], 11, 8, 3, 1, 40, torch.bfloat16, torch.float8_e4m3fn, id="W11-D40-e4m3-bf16"),
]


@pytest.mark.parametrize("vllm_slots", [False, True], ids=["ring-rows", "vllm-slots-full-rows"])
@pytest.mark.parametrize(("requests", "window", "bs", "hq", "hkv", "d", "dtype", "fp8"), DRAFT_WRITES)
def test_draft_blocks_store_their_rows_after_reading(requests, window, bs, hq, hkv, d, dtype, fp8, vllm_slots, device):
    """``write_ring`` on draft blocks (vLLM: a target sliding layer's decode step, through vLLM's slot mapping over
    full block rows): the output is the read-only launch's, and the pool afterwards is the reference's byte for
    byte: each request's live block rows (``p >= seq_len - (W - 1)``) at their slots, fp8-quantized for an fp8
    ring, dead rows nowhere, every other byte (NaN poison included) as it was."""
    case = make_ring_case(requests, window=window, kv_block_size=bs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                          dtype=dtype, pad_tokens=2, full_rows=vllm_slots, fp8_dtype=fp8,
                          seed=stable_seed(requests, window, d, vllm_slots)).to(device)  # fmt: skip
    real = int(case.query_start_loc[-1])
    slots, live = [], []
    for r, (context_len, seq_len) in enumerate(zip(case.context_lens, case.seq_lens.tolist(), strict=True)):
        positions = torch.arange(context_len, seq_len, device=device)
        live.append(positions >= seq_len - (window - 1))
        if vllm_slots:  # vLLM's formula over the full logical row, dead rows included (the launcher drops them)
            slots.append(case.block_table[r, positions // bs].long() * bs + positions % bs)
        else:
            slots.append(case.plan.slot_mapping(positions, case.block_table[r], period=case.table_period,
                                                seq_len=seq_len))  # fmt: skip
    slots, live = torch.cat(slots), torch.cat(live)
    assert bool((~live).any()) == any(b > window - 1 for _, b in requests)
    options: dict[str, object] = {"write_ring": True}
    if vllm_slots:
        options["slot_mapping"] = torch.cat([slots, torch.full((case.q.shape[0] - real,), PAD_SLOT, device=device)])
    read_only = ring_attention(**case.kernel_args())[:real].clone()
    before = [cache.clone() for cache in (case.k_cache, case.v_cache)]
    expected = [cache.clone() for cache in before]
    ring_attention_reference(**{**case.kernel_args(), "k_cache": expected[0], "v_cache": expected[1]}, **options)
    out = ring_attention(**case.kernel_args(), **options)
    assert torch.equal(out[:real], read_only)
    for cache, ref, rows, saved, scale in zip(
        (case.k_cache, case.v_cache), expected, (case.k_new, case.v_new), before, (case.k_scale, case.v_scale),
        strict=True,
    ):  # fmt: skip
        assert same_bytes(cache, ref), "the pool differs from the reference's after the write"
        flat, flat_saved = cache.flatten(0, 1), saved.flatten(0, 1)
        stored = rows[:real][live] if fp8 is None else quantize_fp8(rows[:real][live], scale, fp8)
        assert same_bytes(flat[slots[live]], stored), "a live row is not at its slot"
        untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=device)
        untouched[slots[live]] = False
        assert same_bytes(flat[untouched], flat_saved[untouched]), "a write touched a slot no live row maps to"
