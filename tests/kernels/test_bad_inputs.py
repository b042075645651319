# SPDX-License-Identifier: Apache-2.0
"""Every bad input is a ValueError naming the value and the fix, raised before any launch (nothing changes)."""

from __future__ import annotations

import pytest
import torch
from ringkv.kernels import ring_attention, ring_write

from tests.testing import NAN, make_ring_case


@pytest.fixture
def case():
    return make_ring_case([(40, 8), (3, 2)], window=37, block_size=8, num_q_heads=4, num_kv_heads=2, head_dim=16)


def _replace(args: dict, **changes) -> dict:
    return {**args, **changes}


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
    ("B-beyond-ring", lambda a: _replace(a, table_period=2), "it needs R >= 7"),
    ("table-too-short-full-rows", lambda a: _replace(a, table_period=None, block_table=a["block_table"][:, :3]),
     "too short for max_seq_len=48"),
    ("table-float", lambda a: _replace(a, block_table=a["block_table"].float()), "block_table has dtype torch.float32"),
    ("query_start_loc-length", lambda a: _replace(a, query_start_loc=a["query_start_loc"][:2]),
     "expected num_reqs + 1 = 3"),
    ("window-0", lambda a: _replace(a, window=0), "window=0 must be an int >= 1"),
    ("scale-nan", lambda a: _replace(a, scale=float("nan")), "scale=nan must be a finite positive"),
    ("out-shape", lambda a: _replace(a, out=torch.zeros(3, 4, 16)), "out is (3, 4, 16)"),
    ("device-meta", lambda a: _replace(a, seq_lens=a["seq_lens"].to("meta")), "seq_lens is on meta"),
    ("q-strided-headdim", lambda a: _replace(a, q=torch.zeros(10, 4, 32)[..., ::2]), "q has last-dim stride 2"),
    ("max_query_len-65", lambda a: _replace(a, max_query_len=65), "max_query_len=65 must be in 1..64"),
    ("splits-0", lambda a: _replace(a, num_splits=0), "num_splits=0 must be an int >= 1"),
]  # fmt: skip


@pytest.mark.parametrize(("mutate", "message"), [pytest.param(m, msg, id=i) for i, m, msg in BAD_ATTENTION])
def test_ring_attention_rejects(case, mutate, message):
    args = mutate(case.kernel_args())
    out = args.pop("out", None)
    before = [t.clone() for t in (case.k_cache, case.v_cache)]
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        ring_attention(**args, out=out)
    for saved, now in zip(before, (case.k_cache, case.v_cache), strict=True):
        torch.testing.assert_close(saved, now, equal_nan=True, atol=0, rtol=0)


def _write_args():
    k = torch.randn(4, 2, 16)
    caches = torch.full((3, 8, 2, 16), NAN), torch.full((3, 8, 2, 16), NAN)
    return {"k": k, "v": k.clone(), "k_cache": caches[0], "v_cache": caches[1], "slot_mapping": torch.arange(4)}


BAD_WRITE = [
    ("slots-float", {"slot_mapping": torch.arange(4).float()}, "slot_mapping is torch.float32"),
    ("slots-short", {"slot_mapping": torch.arange(2)}, r"expected int32/int64 \[>= 4\]"),
    ("k-fp16", {"k": torch.randn(4, 2, 16).half()}, "must equal the cache dtypes"),
    ("cache-3d", {"k_cache": torch.zeros(3, 8, 32)}, "k_cache has shape"),
    ("v-heads", {"v": torch.randn(4, 1, 16)}, "must match k"),
]


@pytest.mark.parametrize(("changes", "message"), [pytest.param(c, m, id=i) for i, c, m in BAD_WRITE])
def test_ring_write_rejects(changes, message):
    args = {**_write_args(), **changes}
    with pytest.raises(ValueError, match=message):
        ring_write(**args)
    assert torch.isnan(args["v_cache"]).all(), "a rejected call wrote to the cache"


def test_ring_prefill_attention_rejects_bad_inputs(case):
    from ringkv.kernels import ring_prefill_attention

    with pytest.raises(ValueError, match=r"k_new has dtype torch\.float16"):
        ring_prefill_attention(**{**case.kernel_args(), "k_new": case.k_new.half()})
    with pytest.raises(ValueError, match="window=0 must be an int >= 1"):
        ring_prefill_attention(**{**case.kernel_args(), "window": 0})
    # a prefill ring needs only the window: R = cdiv(W - 1, bs) + 1 = 6 for W 37, bs 8 (no draft-block slack)
    before = case.k_cache.clone()
    with pytest.raises(ValueError, match="it needs R >= 6"):
        ring_prefill_attention(**{**case.kernel_args(), "table_period": 5})
    torch.testing.assert_close(case.k_cache, before, equal_nan=True, atol=0, rtol=0)
