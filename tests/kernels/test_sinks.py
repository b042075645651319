# SPDX-License-Identifier: Apache-2.0
"""Attention sinks (``sink_tokens``): a query also sees keys ``0 .. sink_tokens - 1``, held in sink blocks before the
ring's columns (``[sink blocks | ring]``). ``ring_attention`` (draft blocks, split or not, and prefill chunks, fp8
rings) against the dense fp64 oracle, with NaN in every slot no query may read (sink-block positions past the sinks
below the window included); the reference against the oracle; the attended set named exactly; chunks through the
ring and a decode after them; bad inputs."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import pytest
import torch
import triton
from ringkv.kernels import BatchMode, RingPlan, ring_attention, ring_attention_reference
from ringkv.kernels.kv_quant import dequantize, quantize_fp8
from ringkv.kernels.oracle import dense_history_attention, oracle_pair
from ringkv.kernels.ring_geometry import UNBOUNDED_WINDOW, first_visible_position, sinks_below_window
from ringkv.kernels.testing import RingPool

from tests.testing import NAN, RingCase, assert_attention_close, stable_seed

pytestmark = pytest.mark.interpreter


@dataclass
class SinkCase:
    """A ``RingCase`` over rows ``[sink blocks | ring]``: its history is each request's window, ``sink_history`` the
    K/V of the sinks below it (positions ``0 .. min(sink_tokens, first) - 1``)."""

    case: RingCase
    sink_tokens: int
    sink_history: list[tuple[torch.Tensor, torch.Tensor]]

    def kernel_args(self) -> dict[str, object]:
        return {**self.case.kernel_args(), "sink_tokens": self.sink_tokens}

    def oracle_pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.case
        return oracle_pair(c.q, c.k_new, c.v_new, c.history, c.query_start_loc, c.seq_lens, window=c.window,
                           causal=c.causal, sink_tokens=self.sink_tokens, sink_history=self.sink_history)  # fmt: skip

    def to(self, device: torch.device) -> SinkCase:
        return replace(self, case=self.case.to(device))


def full_rows(plan: RingPlan, rows: torch.Tensor, requests: list[tuple[int, int]]) -> torch.Tensor:
    """vLLM-style logical rows of the compact rows ``[sink blocks | ring]``: entry ``j`` is sink block ``j``
    (``j < ns``), the null block 0 for a ring block wholly below the first query's window, else ring column
    ``(j - ns) mod R``."""
    ns, ring = plan.sink_blocks, plan.ring_blocks
    width = max(triton.cdiv(p + b, plan.kv_block_size) for p, b in requests) + 1
    logical = torch.arange(width)
    table = rows[:, torch.where(logical < ns, logical, ns + (logical - ns) % ring)].clone()
    for r, (p, _) in enumerate(requests):
        table[r, (logical >= ns) & (logical < plan.first_visible_block(p))] = 0
    return table


def make_sink_case(
    requests: list[tuple[int, int]],
    *,
    window: int,
    sink_tokens: int,
    kv_block_size: int,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    dtype: torch.dtype = torch.float32,
    causal: bool = False,
    mode: BatchMode = BatchMode.DRAFT_BLOCK,
    logical_rows: bool = False,
    fp8_dtype: torch.dtype | None = None,
    pad_tokens: int = 2,
    history_fn=None,
) -> SinkCase:
    """Request ``r`` = ``(P, B)``: ``B`` queries (a draft block, or a chunk with ``mode=PREFILL_CHUNK``) after
    ``P`` positions. The pool is NaN but for each request's window ``[max(0, P-W+1), P)`` and its sinks below it,
    written through ``RingPool.write`` (the plan's slot mapping); a sink block's positions past the sinks below the
    window stay NaN. ``logical_rows``: vLLM-style full rows (``full_rows``) instead of compact ones.
    ``history_fn(positions) -> (k, v)`` overrides the random history."""
    seed = stable_seed(requests, window, sink_tokens, kv_block_size, head_dim, dtype, causal, mode, fp8_dtype)
    generator = torch.Generator().manual_seed(seed)
    lookahead = max(b for _, b in requests) if mode is BatchMode.DRAFT_BLOCK else 1
    plan = RingPlan(window, kv_block_size, lookahead, sink_tokens)
    scales: dict[str, torch.Tensor] = {}
    if fp8_dtype is not None:
        scales = {name: torch.rand(1, generator=generator) * 0.05 + 0.005 for name in ("k_scale", "v_scale")}
    pool = RingPool.allocate(
        plan, len(requests), num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=fp8_dtype or dtype,
        num_blocks=2 * plan.row_blocks * len(requests) + 1, generator=generator,
    )  # fmt: skip
    history, sinks = [], []
    for r, (p, _) in enumerate(requests):
        first = first_visible_position(p, window)
        positions = torch.cat([torch.arange(sinks_below_window(p, window, sink_tokens)), torch.arange(first, p)])
        if history_fn is None:
            k = torch.randn(len(positions), num_kv_heads, head_dim, generator=generator).to(dtype)
            v = torch.randn(len(positions), num_kv_heads, head_dim, generator=generator).to(dtype)
        else:
            k, v = (x.to(dtype) for x in history_fn(positions))
        slots = pool.write(r, positions, k, v, seq_len=p, **scales)
        assert bool((slots >= 0).all()), "every sink and window position is written"
        if scales:
            k = dequantize(quantize_fp8(k, scales["k_scale"], fp8_dtype), scales["k_scale"])
            v = dequantize(quantize_fp8(v, scales["v_scale"], fp8_dtype), scales["v_scale"])
        below = len(positions) - (p - first)
        sinks.append((k[:below], v[:below]))
        history.append((first, k[below:], v[below:]))
    batch = pool.batch([p for p, _ in requests], [b for _, b in requests], mode=mode)
    table, period = batch.block_table, batch.table_period
    if logical_rows:
        table, period = full_rows(plan, batch.block_table, requests), None
    num_tokens = sum(b for _, b in requests) + pad_tokens
    q = torch.randn(num_tokens, num_q_heads, head_dim, generator=generator).to(dtype)
    k_new, v_new = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype) for _ in range(2))
    case = RingCase(
        q, k_new, v_new, pool.k_cache, pool.v_cache, table, batch.query_start_loc, batch.seq_lens, window, causal,
        period, plan, history, seed, mode, **scales,
    )  # fmt: skip
    return SinkCase(case, sink_tokens, sinks)


def attend(case: SinkCase, device: torch.device, **options: object) -> torch.Tensor:
    """``ring_attention`` into a NaN output, checked against the oracle; padding rows stay NaN."""
    ref_hi, ref_lo = case.oracle_pair()
    on_device = case.to(device)
    out = torch.full(ref_hi.shape, NAN, dtype=case.case.q.dtype, device=device)
    ring_attention(**on_device.kernel_args(), out=out, **options)
    real = int(case.case.query_start_loc[-1])
    assert torch.isnan(out[real:]).all(), "padding rows were written"
    name = f"sinks={case.sink_tokens} {case.case.mode.value} {options}"
    assert_attention_close(out[:real].cpu(), ref_hi[:real], ref_lo[:real], name=name, case=case.case)
    return out.cpu()


# (requests [(P, B)], W, sinks, bs, causal, num_splits): W below and above a drafter's sliding window; sinks not a
# multiple of the block; P below the sinks, at the window's edge, and rings wrapped; split-KV off and on (3: splits
# that mix sink and window tiles; 16: splits left without a tile)
DRAFT = [
    pytest.param([(0, 8), (3, 8), (40, 5), (300, 8)], 37, 5, 16, True, None, id="W37-S5-bs16-causal"),
    pytest.param([(0, 8), (3, 8), (40, 5), (300, 8)], 37, 5, 16, False, 3, id="W37-S5-bs16-split3"),
    pytest.param([(19, 8), (36, 8), (37, 1), (999, 8)], 37, 20, 16, False, None, id="W37-S20-two-sink-blocks"),
    pytest.param([(50, 8), (777, 4)], 37, 37, 8, True, 2, id="S-equals-W-bs8-split2"),
    pytest.param([(64, 8), (200, 8)], 64, 16, 16, False, 16, id="S16-whole-block-split16"),
    pytest.param([(100, 7), (6, 5)], 20, 20, 24, True, 3, id="bs24-tiles-straddle-blocks-split3"),
    pytest.param([(5000, 8), (2100, 8)], 2048, 4, 16, False, None, id="W2048-S4-wrap"),
    pytest.param([(5000, 8)], 2048, 300, 16, True, 4, id="W2048-S300-split4"),
    pytest.param([(1000, 8), (60, 3)], 300, 33, 128, False, 2, id="bs128-two-tiles-a-block-split2"),
    pytest.param([(262_136, 8)], 64, 20, 16, True, None, id="query-at-262143"),
    pytest.param([(262_136, 8)], 64, 20, 16, False, 3, id="query-at-262143-split3"),
]  # fmt: skip


@pytest.mark.parametrize(("requests", "window", "sinks", "bs", "causal", "splits"), DRAFT)
def test_draft_blocks_with_sinks_match_oracle(requests, window, sinks, bs, causal, splits, device):
    case = make_sink_case(requests, window=window, sink_tokens=sinks, kv_block_size=bs, causal=causal)
    attend(case, device, num_splits=splits)


@pytest.mark.parametrize("splits", [None, 2], ids=["unsplit", "split2"])
def test_logical_rows_with_sinks(splits, device):
    """vLLM's full logical rows: sink blocks at columns ``0 .. ns-1``, dead ring blocks on the null block 0."""
    case = make_sink_case([(300, 8), (10, 8), (45, 3)], window=37, sink_tokens=20, kv_block_size=16,
                          logical_rows=True)  # fmt: skip
    assert case.case.table_period is None and bool((case.case.block_table == 0).any())
    attend(case, device, num_splits=splits)


# (requests [(P, C)], W, sinks, bs, causal): chunks that start inside the sinks (the chunk's own rows are sinks),
# wrap the ring several times, and one long enough for the interpreter's tall tiles
PREFILL = [
    pytest.param([(0, 300), (3, 50), (100, 70)], 37, 5, 16, True, id="S5-causal"),
    pytest.param([(0, 300), (3, 50), (100, 70)], 37, 5, 16, False, id="S5-noncausal"),
    pytest.param([(10, 200), (700, 33)], 24, 20, 8, True, id="S20-bs8"),
    pytest.param([(0, 2100), (5, 3)], 37, 5, 8, False, id="long-chunk-tall-tiles"),
    pytest.param([(90, 70), (0, 33)], 300, 40, 16, True, id="W300-S40"),
]  # fmt: skip


@pytest.mark.parametrize(("requests", "window", "sinks", "bs", "causal"), PREFILL)
def test_prefill_chunks_with_sinks_match_oracle(requests, window, sinks, bs, causal, device):
    case = make_sink_case(requests, window=window, sink_tokens=sinks, kv_block_size=bs, causal=causal,
                          mode=BatchMode.PREFILL_CHUNK)  # fmt: skip
    attend(case, device)


@pytest.mark.parametrize(
    ("fp8", "mode"),
    [(torch.float8_e4m3fn, BatchMode.DRAFT_BLOCK), (torch.float8_e5m2, BatchMode.PREFILL_CHUNK)],
    ids=["e4m3-draft-split2", "e5m2-prefill"],
)
def test_fp8_ring_with_sinks(fp8, mode, device):
    requests = [(300, 8), (4, 8)] if mode is BatchMode.DRAFT_BLOCK else [(300, 40), (4, 20)]
    case = make_sink_case(requests, window=37, sink_tokens=20, kv_block_size=16, dtype=torch.bfloat16,
                          fp8_dtype=fp8, mode=mode)  # fmt: skip
    attend(case, device, **({"num_splits": 2} if mode is BatchMode.DRAFT_BLOCK else {}))


@pytest.mark.parametrize("mode", [BatchMode.DRAFT_BLOCK, BatchMode.PREFILL_CHUNK], ids=["draft", "prefill"])
def test_zero_sinks_is_the_sinkless_launch(mode, device):
    """``sink_tokens=0`` is today's launch: the same bytes as without the argument, over the same rows."""
    requests = [(300, 8), (3, 5)] if mode is BatchMode.DRAFT_BLOCK else [(300, 50), (3, 5)]
    case = make_sink_case(requests, window=37, sink_tokens=0, kv_block_size=16, mode=mode)
    assert case.case.plan.row_blocks == case.case.plan.ring_blocks
    out = attend(case, device)
    plain = ring_attention(**case.to(device).case.kernel_args()).cpu()
    real = int(case.case.query_start_loc[-1])
    assert torch.equal(out[:real], plain[:real])


@pytest.mark.parametrize("logical_rows", [False, True], ids=["compact", "logical"])
def test_reference_reads_sinks_through_the_ring(logical_rows):
    """The reference (ring gather) equals the oracle (dense history) exactly, in fp64."""
    case = make_sink_case([(0, 8), (19, 8), (1000, 5), (262_136, 8)], window=37, sink_tokens=20, kv_block_size=16,
                          logical_rows=logical_rows)  # fmt: skip
    ref = ring_attention_reference(**case.kernel_args(), compute_dtype=torch.float64)
    hi, _ = case.oracle_pair()
    torch.testing.assert_close(ref, hi.to(ref.dtype), atol=0, rtol=0)


def onehot_history(depth: int):
    """K = 0 (uniform weights over the attended set), V = one-hot(position mod depth): the output names the set."""

    def history(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(len(positions), 1, depth), torch.nn.functional.one_hot(positions % depth, depth)[:, None]

    return history


def attended(query: int, context_len: int, queries: int, window: int, sinks: int, causal: bool) -> list[int]:
    """Positions a query sees, the contract spelled out: the sinks, its window, the block's own keys it may see."""
    keys = range(context_len + queries)
    right = (lambda k: k <= query) if causal else (lambda k: k - query < window)
    return [k for k in keys if (k < sinks or query - k < window) and right(k)]


# (W, sinks, bs, [(P, B)], causal, splits): the sinks below, inside and straddling the window, blocks the sinks share
# with window positions (S 5 of 16), and the block's own rows as sinks (P < S)
EXACT = [
    (9, 5, 16, [(0, 8), (3, 8), (12, 8), (40, 8), (2 * 16 * 4 + 7, 8)], True, None),
    (9, 5, 16, [(3, 8), (40, 8), (200, 8)], False, 3),
    (17, 12, 4, [(5, 8), (14, 8), (30, 8), (17 * 9 + 2, 8)], False, 2),
    # a window shorter than the block: the block's own first rows are sinks to its last queries
    (3, 3, 4, [(0, 8), (2, 8), (9, 8)], True, None),
    (3, 3, 4, [(0, 8), (2, 8), (9, 8)], False, 2),
]


@pytest.mark.parametrize(
    ("window", "sinks", "bs", "requests", "causal", "splits"),
    EXACT,
    ids=[f"W{c[0]}-S{c[1]}-bs{c[2]}-{'causal' if c[4] else 'noncausal'}" for c in EXACT],
)
def test_sinks_name_the_attended_set(window, sinks, bs, requests, causal, splits, device):
    """Every key once: a sink counted twice, or a window key missed, changes the uniform weights."""
    depth = 64
    case = make_sink_case(requests, window=window, sink_tokens=sinks, kv_block_size=bs, num_q_heads=2,
                          num_kv_heads=1, head_dim=depth, causal=causal, history_fn=onehot_history(depth),
                          pad_tokens=0)  # fmt: skip
    starts = case.case.query_start_loc.tolist()
    own = torch.cat([torch.arange(p, p + b) for p, b in requests])
    case.case.k_new.zero_()
    case.case.v_new.copy_(onehot_history(depth)(own)[1])
    out = ring_attention(**case.to(device).kernel_args(), num_splits=splits).cpu()
    for r, (p, b) in enumerate(requests):
        for i in range(b):
            want = attended(p + i, p, b, window, sinks, causal)
            expected = torch.zeros(depth)
            expected.index_add_(0, torch.tensor(want) % depth, torch.full((len(want),), 1 / len(want)))
            got = out[starts[r] + i, 0]
            assert torch.allclose(got, expected, atol=1e-6, rtol=0), (
                f"request {r} (P={p}) query {i} at position {p + i}: expected {len(want)} keys {want}; weights "
                f"{[(k, round(float(got[k]) * len(want), 3)) for k in range(depth) if got[k] > 0]}"
            )


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_chunks_through_the_ring_then_decode_keep_the_sinks(causal, device):
    """Chunks of 30 / 150 then 1 / 90 tokens (W 24, 20 sinks in 3 blocks of 8, a ring of 5 x 8 slots), each attended
    and written after reading: a sink block's rows are never dead, so after the ring wrapped many times the sink
    blocks hold positions 0 .. 23, and every chunk and a final draft block agree with the oracle over the whole
    history."""
    window, sinks, bs, hq, hkv, d = 24, 20, 8, 4, 2, 16
    plan = RingPlan(window, bs, lookahead=4, sink_tokens=sinks)
    generator = torch.Generator().manual_seed(5)
    pool = RingPool.allocate(plan, 2, num_kv_heads=hkv, head_dim=d, device=device, num_blocks=2 * plan.row_blocks + 1,
                             generator=generator)  # fmt: skip
    history = [(torch.zeros(0, hkv, d), torch.zeros(0, hkv, d)) for _ in range(2)]
    steps = [((30, 150), BatchMode.PREFILL_CHUNK), ((1, 90), BatchMode.PREFILL_CHUNK), ((4, 4), BatchMode.DRAFT_BLOCK)]
    for lens, mode in steps:
        prefill = mode is BatchMode.PREFILL_CHUNK
        if not prefill:
            assert_sink_blocks_hold(pool, history, plan.sink_blocks * bs)
        context_lens = [len(h[0]) for h in history]
        rows = [[torch.randn(n, hkv, d, generator=generator) for _ in range(2)] for n in lens]
        q = torch.randn(sum(lens), hq, d, generator=generator)
        batch = pool.batch(context_lens, list(lens), mode=mode)
        k_new, v_new = (torch.cat([r[i] for r in rows]) for i in range(2))
        out = ring_attention(q.to(device), k_new.to(device), v_new.to(device), pool.k_cache, pool.v_cache, batch,
                             window=window, causal=causal, sink_tokens=sinks, write_ring=prefill)  # fmt: skip
        hi, lo = oracle_pair(q, k_new, v_new, [(0, *h) for h in history], batch.query_start_loc.cpu(),
                             batch.seq_lens.cpu(), window=window, causal=causal, sink_tokens=sinks)  # fmt: skip
        assert_attention_close(out.cpu(), hi, lo, name=f"{mode.value} of {lens} after {context_lens}")
        history = [(torch.cat([h[0], r[0]]), torch.cat([h[1], r[1]])) for h, r in zip(history, rows, strict=True)]


def assert_sink_blocks_hold(pool: RingPool, history: list[tuple[torch.Tensor, torch.Tensor]], end: int) -> None:
    """Each request's sink blocks hold the K rows of positions ``0 .. end - 1``."""
    for r, (k_hist, _) in enumerate(history):
        stored = pool.k_cache.flatten(0, 1)[pool.slot_mapping(torch.arange(end), r)].cpu()
        torch.testing.assert_close(stored, k_hist[:end], atol=0, rtol=0)


def bad_case() -> SinkCase:
    return make_sink_case([(40, 8), (3, 2)], window=37, sink_tokens=5, kv_block_size=8, head_dim=16)


BAD = [
    ("negative", {"sink_tokens": -1}, "sink_tokens=-1 must be >= 0; pass 0 for no sinks"),
    ("float", {"sink_tokens": 4.0}, "sink_tokens=4.0 must be an int"),
    ("bool", {"sink_tokens": True}, "sink_tokens=True must be an int"),
    ("past-window", {"sink_tokens": 38}, "sink_tokens=38 exceeds window=37; pass sink_tokens <= window"),
    ("past-unbounded-window", {"window": UNBOUNDED_WINDOW, "sink_tokens": UNBOUNDED_WINDOW + 1},
     f"sink_tokens={UNBOUNDED_WINDOW + 1} exceeds window={UNBOUNDED_WINDOW}"),
]  # fmt: skip


@pytest.mark.parametrize("mode", [BatchMode.DRAFT_BLOCK, BatchMode.PREFILL_CHUNK], ids=["draft", "prefill"])
@pytest.mark.parametrize(("changes", "message"), [pytest.param(c, m, id=i) for i, c, m in BAD])
def test_bad_sink_tokens_raise_before_launch(changes, message, mode):
    case = bad_case()
    args = {**case.kernel_args(), **changes, "write_ring": mode is BatchMode.PREFILL_CHUNK}
    args["batch"] = replace(args["batch"], mode=mode)
    before = case.case.k_cache.clone()
    with pytest.raises(ValueError, match=re.escape(message)):
        ring_attention(**args)
    torch.testing.assert_close(case.case.k_cache, before, equal_nan=True, atol=0, rtol=0)


def test_compact_rows_without_the_sink_columns_are_refused():
    """A compact row of R columns read with sinks: the sink blocks would alias ring columns."""
    case = bad_case()
    args = case.kernel_args()
    batch = args["batch"]
    ring_only = replace(batch, block_table=batch.block_table[:, case.case.plan.sink_blocks :].contiguous())
    message = "block_table width 7 cannot hold the 1 sink blocks of sink_tokens=5 (kv_block_size=8) before a ring of "
    with pytest.raises(ValueError, match=re.escape(message + "table_period=7 columns")) as error:
        ring_attention(**{**args, "batch": ring_only})
    assert "give each request 8 columns (RingPlan(..., sink_tokens=...).row_blocks)" in str(error.value)


def test_ring_plan_and_oracle_refuse_bad_sinks():
    with pytest.raises(ValueError, match=re.escape("sink_tokens=17 exceeds window=16")):
        RingPlan(16, 16, 8, sink_tokens=17)
    with pytest.raises(ValueError, match=re.escape("sink_tokens=-2 must be >= 0")):
        RingPlan(16, 16, 8, sink_tokens=-2)
    # the oracle needs the K/V of the sinks below a history that starts past them
    q, k = torch.randn(1, 2, 8), torch.randn(1, 1, 8)
    history = [(10, torch.randn(3, 1, 8), torch.randn(3, 1, 8))]
    with pytest.raises(ValueError, match=re.escape("request 0: its queries see the sinks 0..3 below its history")):
        dense_history_attention(q, k, k, history, torch.tensor([0, 1]), torch.tensor([14]), window=4, causal=True,
                                sink_tokens=4)  # fmt: skip
