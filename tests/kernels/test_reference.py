# SPDX-License-Identifier: Apache-2.0
"""The reference (ring gather) against the dense oracle (history by absolute position), and the oracle's
masked-softmax core against torch's SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ringkv.kernels import ring_attention_reference
from ringkv.kernels.oracle import dense_history_attention, masked_softmax_attention

from tests.testing import case_oracle_pair, make_ring_case, stable_seed

# (requests, W, bs, Hq, Hkv, D, causal, full_rows)
CASES = [
    ([(0, 1)], 1, 16, 2, 1, 16, True, False),
    ([(0, 8), (7, 8), (15, 8), (16, 8)], 15, 16, 8, 2, 32, False, False),
    ([(33, 5), (2, 3)], 16, 4, 5, 1, 24, True, True),
    ([(2047, 8), (2048, 8), (2 * 2080 + 1, 8)], 2048, 16, 4, 1, 16, False, True),
    ([(262144 - 16, 16)], 2048, 16, 4, 2, 16, True, False),
    ([(40, 33)], 20, 8, 4, 2, 16, False, False),
]


@pytest.mark.parametrize(("requests", "window", "bs", "hq", "hkv", "d", "causal", "full_rows"), CASES)
def test_reference_matches_dense_oracle(requests, window, bs, hq, hkv, d, causal, full_rows):
    case = make_ring_case(
        requests, window=window, kv_block_size=bs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, causal=causal,
        full_rows=full_rows, seed=stable_seed(requests, window, causal),
    )  # fmt: skip
    ref = ring_attention_reference(**case.kernel_args(), compute_dtype=torch.float64)
    oracle, _ = case_oracle_pair(case)
    torch.testing.assert_close(ref, oracle.to(ref.dtype), atol=0, rtol=0)


def test_masked_softmax_matches_sdpa():
    """The one formula, against torch's own attention (GQA 3, a causal-and-window mask with no empty row)."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=generator, dtype=torch.float64) for shape in
               ((7, 6, 16), (20, 2, 16), (20, 2, 12)))  # fmt: skip
    mask = torch.ones(7, 20, dtype=torch.bool).tril(13) & torch.ones(7, 20, dtype=torch.bool).triu(2)
    ours = masked_softmax_attention(q, k, v, mask, 0.3)
    sdpa = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          attn_mask=mask, scale=0.3, enable_gqa=True).transpose(0, 1)  # fmt: skip
    torch.testing.assert_close(ours, sdpa, atol=1e-12, rtol=0)


def test_row_without_keys_is_zero():
    """A query that sees nothing (impossible for a drafter, defined anyway) outputs 0, not NaN."""
    q = torch.randn(2, 2, 8)
    k = torch.randn(3, 1, 8)
    v = torch.randn(3, 1, 8)
    mask = torch.tensor([[False, False, False], [True, False, True]])
    out = masked_softmax_attention(q, k, v, mask, 0.5)
    assert torch.equal(out[0], torch.zeros(2, 8))


def test_unseen_keys_may_hold_nan():
    """Keys no query sees never reach the arithmetic: NaN there leaves the output finite."""
    k = torch.randn(6, 1, 8, dtype=torch.float64)
    k[:2] = float("nan")
    # one query at position 5 (its own row k[5]) over the history 0..4, of which it sees 2..4
    out = dense_history_attention(torch.randn(1, 2, 8, dtype=torch.float64), k[5:], k[5:].clone(), [(0, k[:5], k[:5])],
                                  torch.tensor([0, 1]), torch.tensor([6]), window=4, causal=True)  # fmt: skip
    assert torch.isfinite(out).all()
