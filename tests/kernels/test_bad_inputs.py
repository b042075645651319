# SPDX-License-Identifier: Apache-2.0
"""Every bad input is a ValueError naming the value and the fix, raised before any launch (nothing changes)."""

from __future__ import annotations

import re

import pytest
import torch
from ringkv.kernels import BatchMode, VarlenBatch, ring_attention, ring_write
from ringkv.kernels.ring_geometry import UNBOUNDED_WINDOW
from ringkv.kernels.varlen import MAX_SEQ_LEN

from tests.testing import NAN, aligned_cache, make_ring_case


@pytest.fixture
def case():
    return make_ring_case([(40, 8), (3, 2)], window=37, kv_block_size=8, num_q_heads=4, num_kv_heads=2, head_dim=16)


def _replace(args: dict, **changes) -> dict:
    return {**args, **changes}


def _batch(args: dict, **changes) -> VarlenBatch:
    """The case's batch with some fields replaced (validation runs again)."""
    return VarlenBatch(**{**args["batch"].__dict__, **changes})


BAD_ATTENTION = [
    ("q-float64", lambda a: _replace(a, q=a["q"].double()), "q has dtype torch.float64"),
    ("k_new-fp16", lambda a: _replace(a, k_new=a["k_new"].half()), "k_new has dtype torch.float16"),
    ("q-2d", lambda a: _replace(a, q=a["q"][:, 0]), "q has shape"),
    ("gqa-3-over-2", lambda a: _replace(a, q=a["q"][:, :3].contiguous()), "not a multiple of num_kv_heads=2"),
    ("head_dim-512", lambda a: _replace(
        a, q=torch.zeros(10, 4, 512), k_new=torch.zeros(10, 2, 512), v_new=torch.zeros(10, 2, 512),
        k_cache=torch.zeros(4, 8, 2, 512), v_cache=torch.zeros(4, 8, 2, 512)), "head_dim=512 is not supported"),
    ("cache-heads", lambda a: _replace(a, k_cache=a["k_cache"][:, :, :1], v_cache=a["v_cache"][:, :, :1]),
     "do not match num_kv_heads=2"),
    ("B-beyond-ring", lambda a: _replace(a, batch=_batch(a, table_period=2)), "it needs R >= 7"),
    ("table-too-short-full-rows", lambda a: _replace(a, batch=_batch(
        a, table_period=None, block_table=a["batch"].block_table[:, :3])), "too short for max_seq_len=48"),
    ("window-0", lambda a: _replace(a, window=0), "window=0 must be an int in 1..1099511627776"),
    ("window-past-unbounded", lambda a: _replace(a, window=UNBOUNDED_WINDOW + 1),
     "window=1099511627777 must be an int in 1..1099511627776 (keys a query sees, itself included); pass "
     "UNBOUNDED_WINDOW for full attention"),
    ("scale-nan", lambda a: _replace(a, scale=float("nan")), "scale=nan must be a finite positive"),
    ("out-shape", lambda a: _replace(a, out=torch.zeros(3, 4, 16)), "out is (3, 4, 16)"),
    ("device-meta", lambda a: _replace(a, batch=_batch(a, seq_lens=a["batch"].seq_lens.to("meta"))),
     "seq_lens is on meta"),
    ("q-strided-headdim", lambda a: _replace(a, q=torch.zeros(10, 4, 32)[..., ::2]), "q has last-dim stride 2"),
    ("splits-0", lambda a: _replace(a, num_splits=0), "num_splits=0 must be an int >= 1"),
    ("splits-17", lambda a: _replace(a, num_splits=17), "num_splits=17 exceeds MAX_SPLITS=16"),
    ("splits-for-prefill", lambda a: _replace(a, batch=_batch(a, mode=BatchMode.PREFILL_CHUNK), num_splits=2),
     "num_splits=2 applies to draft blocks"),
    ("slots-without-write", lambda a: _replace(a, slot_mapping=torch.zeros(10, dtype=torch.int64)),
     "slot_mapping was given with write_ring=False"),
    ("slots-short", lambda a: _replace(a, write_ring=True, slot_mapping=torch.zeros(3, dtype=torch.int64)),
     "slot_mapping is torch.int64 (3,); expected int32/int64 [>= 10]"),
    ("slots-list", lambda a: _replace(a, write_ring=True, slot_mapping=list(range(10))),
     "slot_mapping is list; expected int32/int64 [>= 10]"),
    ("batch-not-varlen", lambda a: _replace(a, batch=a["batch"].__dict__), "build one with VarlenBatch.build"),
]  # fmt: skip


@pytest.mark.parametrize(("mutate", "message"), [pytest.param(m, msg, id=i) for i, m, msg in BAD_ATTENTION])
def test_ring_attention_rejects(case, mutate, message):
    args = mutate(case.kernel_args())
    out = args.pop("out", None)
    before = [t.clone() for t in (case.k_cache, case.v_cache)]
    with pytest.raises(ValueError, match=re.escape(message)):
        ring_attention(**args, out=out)
    for saved, now in zip(before, (case.k_cache, case.v_cache), strict=True):
        torch.testing.assert_close(saved, now, equal_nan=True, atol=0, rtol=0)


BAD_BATCH = [
    ("table-float", {"block_table": torch.zeros(2, 7)}, "block_table has dtype torch.float32"),
    ("table-1d", {"block_table": torch.zeros(7, dtype=torch.int32)}, "block_table has shape (7,)"),
    ("table-rows", {"block_table": torch.zeros(1, 7, dtype=torch.int32)}, "block_table has 1 rows for 2 requests"),
    ("query_start_loc-length", {"query_start_loc": torch.tensor([0, 8], dtype=torch.int32)},
     "expected num_reqs + 1 = 3"),
    ("seq_lens-list", {"seq_lens": [48, 5]}, "seq_lens is list"),
    ("mode-string", {"mode": "draft_block"}, "mode='draft_block' must be BatchMode"),
    ("max_query_len-65", {"max_query_len": 65}, "max_query_len=65 must be an int in 1..64; a draft block"),
    ("max_query_len-0", {"max_query_len": 0}, "max_query_len=0 must be an int in 1..64"),
    ("max_query_len-float", {"max_query_len": 8.0}, "max_query_len=8.0 must be an int"),
    ("max_seq_len-negative", {"max_seq_len": -1}, "max_seq_len=-1 must be an int in 0.."),
    ("max_seq_len-past-int32-positions", {"max_seq_len": MAX_SEQ_LEN + 1},
     f"max_seq_len={MAX_SEQ_LEN + 1} must be an int in 0..{MAX_SEQ_LEN}; the longest seq_len"),
    ("table_period-wider-than-table", {"table_period": 8}, "table_period=8 must be an int in 1..7"),
]  # fmt: skip


@pytest.mark.parametrize(("changes", "message"), [pytest.param(c, m, id=i) for i, c, m in BAD_BATCH])
def test_varlen_batch_rejects(case, changes, message):
    fields = {**case.kernel_args()["batch"].__dict__, **changes}
    with pytest.raises(ValueError, match=re.escape(message)):
        VarlenBatch(**fields)


def test_varlen_batch_build_reads_bounds_and_keeps_the_mode(case):
    batch = VarlenBatch.build(case.query_start_loc, case.seq_lens, case.block_table, mode=BatchMode.PREFILL_CHUNK)
    assert (batch.max_query_len, batch.max_seq_len, batch.num_reqs) == (8, 48, 2)
    assert batch.mode is BatchMode.PREFILL_CHUNK and batch.period == case.block_table.shape[1]
    # a prefill chunk may be as long as a sequence; a draft block may not
    assert VarlenBatch(**{**batch.__dict__, "max_query_len": 100_000}).max_query_len == 100_000


def misaligned(tensor: torch.Tensor, how: str) -> torch.Tensor:
    """The same values in a cache view the fast kernel cannot load 16 bytes at a time."""
    num_blocks, kv_block_size, heads, dim = tensor.shape
    if how == "base":  # a view starting 4 bytes into its storage
        storage = torch.full((tensor.numel() + 1,), NAN, dtype=tensor.dtype)
        view = storage[1:].view(num_blocks, kv_block_size, heads, dim)
    else:  # head dim padded to 24 elements: 16-byte strides for fp32, but not multiples of 16 elements
        view = torch.full((num_blocks, kv_block_size, heads, 24), NAN, dtype=tensor.dtype)[..., :dim]
    return view.copy_(tensor)


@pytest.mark.parametrize(
    ("how", "message", "fix"),
    [
        ("base", "k_cache starts at address", "slice cache views at multiples of 4 elements"),
        ("stride", "k_cache has head stride 24 elements (dim 2 of (29, 8, 2, 16)), not a multiple of 16",
         "allocate the cache with the head dim padded to a multiple of 16 and pass the [..., :head_dim] view"),
    ],
)  # fmt: skip
def test_misaligned_kv_cache_is_refused_before_launch(case, how, message, fix):
    """An unaligned cache would compile a kernel with 2-byte K/V loads (bench/README.md): refused, with the fix."""
    k_cache = misaligned(case.k_cache, how)
    before = k_cache.clone()
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        ring_attention(**{**case.kernel_args(), "k_cache": k_cache})
    assert fix in str(error.value)
    with pytest.raises(ValueError, match=re.escape(message)):
        ring_write(case.k_new, case.v_new, k_cache, case.v_cache, torch.arange(case.k_new.shape[0]))
    torch.testing.assert_close(k_cache, before, equal_nan=True, atol=0, rtol=0)


def test_padded_head_dim_view_is_accepted(case):
    """The documented repack: storage with the head dim padded to 16 elements, the kernel gets the [..., :D] view."""
    k_cache = aligned_cache((*case.k_cache.shape[:3], 12), case.k_cache.dtype)
    assert k_cache.stride(2) == 16 and k_cache.shape[-1] == 12
    args = {**case.kernel_args(), "q": case.q[..., :12].contiguous(), "k_new": case.k_new[..., :12].contiguous(),
            "k_cache": k_cache.copy_(case.k_cache[..., :12])}  # fmt: skip
    out = ring_attention(**args)
    assert out.shape == (case.q.shape[0], 4, 16) and torch.isfinite(out[: int(case.query_start_loc[-1])]).all()


def _write_args():
    k = torch.randn(4, 2, 16)
    caches = torch.full((3, 8, 2, 16), NAN), torch.full((3, 8, 2, 16), NAN)
    return {"k": k, "v": k.clone(), "k_cache": caches[0], "v_cache": caches[1], "slot_mapping": torch.arange(4)}


BAD_WRITE = [
    ("slots-float", {"slot_mapping": torch.arange(4).float()}, "slot_mapping is torch.float32"),
    ("slots-short", {"slot_mapping": torch.arange(2)}, r"expected int32/int64 \[>= 4\]"),
    ("slots-list", {"slot_mapping": [0, 1, 2, 3]}, "slot_mapping is list; expected int32/int64"),
    ("k-fp16", {"k": torch.randn(4, 2, 16).half()}, "k/v dtypes torch.float16/torch.float32 must be one of"),
    (
        "rows-fp16",
        {"k": torch.randn(4, 2, 16).half(), "v": torch.randn(4, 2, 16).half()},
        "but the rows are torch.float16",
    ),
    ("cache-3d", {"k_cache": torch.zeros(3, 8, 32)}, "k_cache has shape"),
    ("v-heads", {"v": torch.randn(4, 1, 16)}, "must match k"),
]


@pytest.mark.parametrize(("changes", "message"), [pytest.param(c, m, id=i) for i, c, m in BAD_WRITE])
def test_ring_write_rejects(changes, message):
    args = {**_write_args(), **changes}
    with pytest.raises(ValueError, match=message):
        ring_write(**args)
    assert torch.isnan(args["v_cache"]).all(), "a rejected call wrote to the cache"


def test_ring_attention_rejects_bad_prefill_inputs():
    prefill = make_ring_case([(40, 8), (3, 2)], window=37, kv_block_size=8, num_q_heads=4, num_kv_heads=2, head_dim=16,
                             mode=BatchMode.PREFILL_CHUNK)  # fmt: skip
    args = {**prefill.kernel_args(), "write_ring": True}
    with pytest.raises(ValueError, match=r"k_new has dtype torch\.float16"):
        ring_attention(**{**args, "k_new": prefill.k_new.half()})
    with pytest.raises(ValueError, match=re.escape("window=0 must be an int in 1..")):
        ring_attention(**{**args, "window": 0})
    # a prefill ring needs only the window: R = cdiv(W - 1, bs) + 1 = 6 for W 37, bs 8 (no draft-block slack)
    before = prefill.k_cache.clone()
    with pytest.raises(ValueError, match="it needs R >= 6"):
        ring_attention(**{**args, "batch": _batch(args, table_period=5)})
    torch.testing.assert_close(prefill.k_cache, before, equal_nan=True, atol=0, rtol=0)
