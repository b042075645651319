# SPDX-License-Identifier: Apache-2.0
"""ring_attention (Triton) on prefill chunks: two-source chunk attention against the reference, and
write-after-read (``write_ring``) through chunks that wrap the ring several times."""

from __future__ import annotations

import pytest
import torch
from ringkv.kernels import BatchMode, RingPlan, VarlenBatch, attention, ring_attention
from ringkv.kernels.ring_geometry import UNBOUNDED_WINDOW
from ringkv.kernels.testing import RingPool

from tests.testing import (
    assert_attention_close,
    assert_kernel_matches_reference,
    make_ring_case,
    oracle_pair,
    stable_seed,
)

pytestmark = pytest.mark.interpreter

# (requests [(P, C)], W, bs, Hq, Hkv, D, dtype, causal, full_rows)
CASES = [
    pytest.param([(100, 300), (0, 50), (37, 1)], 37, 8, 8, 2, 24, torch.float32, True, False, id="wraps-mixed-causal"),
    pytest.param([(100, 300), (0, 50), (37, 1)], 37, 8, 8, 2, 24, torch.float32, False, False, id="wraps-mixed-noncausal"),
    pytest.param([(0, 129), (5, 16)], 16, 16, 5, 1, 59, torch.float32, True, True, id="gqa5-D59-fullrows"),
    pytest.param([(40, 70)], 1, 4, 4, 4, 32, torch.float32, True, False, id="W1"),
    pytest.param([(300, 200), (17, 3)], 64, 16, 4, 1, 64, torch.float16, True, False, id="fp16"),
    pytest.param([(64, 100)], 33, 8, 4, 1, 32, torch.bfloat16, False, True, id="bf16-fullrows"),
    pytest.param([(90, 70), (0, 33)], UNBOUNDED_WINDOW, 16, 4, 2, 32, torch.float32, True, True, id="full-attention"),
    pytest.param([(700, 90), (40, 7)], 300, 128, 4, 1, 32, torch.float32, True, False, id="bs128-two-tiles-a-block"),
    # >= INTERPRETED_LONG_CHUNK queries: the interpreter's tall tiles (several of them, the last one partial)
    pytest.param([(100, 2100), (5, 3)], 37, 8, 4, 2, 16, torch.float32, True, False, id="long-chunk-tall-tiles"),
]  # fmt: skip


@pytest.mark.parametrize(("requests", "window", "bs", "hq", "hkv", "d", "dtype", "causal", "full_rows"), CASES)
def test_ring_prefill_matches_reference(requests, window, bs, hq, hkv, d, dtype, causal, full_rows, device):
    case = make_ring_case(
        requests, window=window, kv_block_size=bs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype,
        causal=causal, lookahead=1, full_rows=full_rows, pad_tokens=3, seed=stable_seed(requests, window, causal),
        mode=BatchMode.PREFILL_CHUNK,
    )  # fmt: skip
    assert_kernel_matches_reference(ring_attention, case, device)


@pytest.mark.parametrize("causal", [True, False])
def test_chunks_through_the_ring_then_decode_match_full_history(causal, device):
    """Two requests, chunks of 5 / 150 / 1 / 90 tokens (W 24, ring of 5 x 8 slots), each attended and written
    after reading; every chunk's output and a final decode block agree with SDPA over the whole history."""
    window, bs, hq, hkv, d = 24, 8, 4, 2, 16
    plan = RingPlan(window, bs, lookahead=4)
    generator = torch.Generator().manual_seed(3)
    pool = RingPool.allocate(plan, 2, num_kv_heads=hkv, head_dim=d, device=device, num_blocks=2 * plan.ring_blocks + 1,
                             generator=generator)  # fmt: skip
    history = [(torch.zeros(0, hkv, d), torch.zeros(0, hkv, d)) for _ in range(2)]
    for chunks in [(5, 150), (1, 90), (150, 1)]:
        context_lens = [len(h[0]) for h in history]
        rows = [torch.randn(c, hkv, d, generator=generator) for c in chunks]
        vals = [torch.randn(c, hkv, d, generator=generator) for c in chunks]
        q = torch.randn(sum(chunks), hq, d, generator=generator)
        batch = pool.batch(context_lens, chunks, mode=BatchMode.PREFILL_CHUNK)
        starts, seq_lens = batch.query_start_loc.cpu(), batch.seq_lens.cpu()
        out = ring_attention(
            q.to(device), torch.cat(rows).to(device), torch.cat(vals).to(device), pool.k_cache, pool.v_cache, batch,
            window=window, causal=causal, write_ring=True,
        )  # fmt: skip
        for r in range(2):
            rows_r = slice(int(starts[r]), int(starts[r + 1]))
            hi, lo = oracle_pair(q[rows_r], rows[r], vals[r], [(0, *history[r])],
                                 torch.tensor([0, chunks[r]]), seq_lens[r : r + 1], window=window, causal=causal)  # fmt: skip
            assert_attention_close(out[rows_r].cpu(), hi, lo, name=f"chunk {chunks} request {r}")
            history[r] = (torch.cat([history[r][0], rows[r]]), torch.cat([history[r][1], vals[r]]))
    # a draft block after the chunks reads only what the writes left in the ring
    block = 4
    context_lens = [len(h[0]) for h in history]
    q = torch.randn(2 * block, hq, d, generator=generator)
    k_new, v_new = (
        torch.randn(2 * block, hkv, d, generator=generator),
        torch.randn(2 * block, hkv, d, generator=generator),
    )
    batch = pool.batch(context_lens, block, mode=BatchMode.DRAFT_BLOCK)
    out = ring_attention(q.to(device), k_new.to(device), v_new.to(device), pool.k_cache, pool.v_cache, batch,
                         window=window, causal=causal)  # fmt: skip
    hi, lo = oracle_pair(q, k_new, v_new, [(0, *h) for h in history], batch.query_start_loc, batch.seq_lens,
                         window=window, causal=causal)  # fmt: skip
    assert_attention_close(out.cpu(), hi, lo, name="decode after prefill chunks")


def test_vllm_slot_mapping_drops_dead_rows_and_duplicates(device):
    """With a caller's slot mapping (vLLM's), dead positions are not written and the last writer wins."""
    case = make_ring_case([(0, 100)], window=16, kv_block_size=4, num_q_heads=2, num_kv_heads=1, head_dim=16,
                          lookahead=1, mode=BatchMode.PREFILL_CHUNK)  # fmt: skip
    case = case.to(device)
    plan = case.plan
    positions = torch.arange(100, device=device)
    # every position mapped through the ring without dropping dead ones: slots repeat every S positions
    slots = plan.slot_mapping(positions, case.block_table[0])
    ring_attention(**case.kernel_args(), write_ring=True, slot_mapping=slots)
    live = positions >= 100 - 15
    stored = case.k_cache.flatten(0, 1)[slots[live]]
    torch.testing.assert_close(stored, case.k_new[:100][live], atol=0, rtol=0)
    written = (~torch.isnan(case.k_cache[..., 0, 0])).sum()
    assert int(written) == 15


def test_query_tiles_go_on_grid_x(monkeypatch, device):
    """Grid y and z stop at 65,535: a chunk of 2^21 queries (131,072 tiles of 16 queries at G 4) must put its
    query tiles on x. Checked on the grid the launcher computes, with the launch replaced by a recorder."""
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            launches.append(grid)
            return lambda *args, **kwargs: None

    monkeypatch.setattr(attention, "_ring_attention_kernel", Recorder())
    monkeypatch.setattr(attention, "is_interpreter", lambda: False)  # the native tiles, not the interpreter's tall ones
    case = make_ring_case([(40, 8), (3, 5)], window=37, kv_block_size=8, num_q_heads=8, num_kv_heads=2, head_dim=16,
                          lookahead=1, mode=BatchMode.PREFILL_CHUNK).to(device)  # fmt: skip
    batch = VarlenBatch(**{**case.batch().__dict__, "max_query_len": 1 << 21, "max_seq_len": (1 << 21) + 40})
    ring_attention(**{**case.kernel_args(), "batch": batch})
    config = attention.select_prefill_config(group_size=4, head_dim=16, head_dim_v=16, kv_block_size=8)
    assert launches == [((1 << 21) // config.BLOCK_Q, 2, 2)] and launches[0][0] > attention.MAX_GRID_YZ
    many = VarlenBatch(**{**batch.__dict__, "query_start_loc": torch.zeros(65_537, dtype=torch.int32),
                          "seq_lens": torch.ones(65_536, dtype=torch.int32),
                          "block_table": torch.zeros(65_536, 1, dtype=torch.int32), "table_period": None})  # fmt: skip
    with pytest.raises(ValueError, match="num_reqs=65536 exceed the grid's 65535"):
        attention.attention_grid(many, 2, config.BLOCK_Q, 1)
    with pytest.raises(ValueError, match="num_kv_heads=65536 / num_reqs=2 exceed the grid's 65535"):
        attention.attention_grid(batch, 65_536, config.BLOCK_Q, 1)
