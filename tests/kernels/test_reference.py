# SPDX-License-Identifier: Apache-2.0
"""The reference against an independent oracle: SDPA with a dense absolute-position mask."""

from __future__ import annotations

import pytest
import torch
from ringkv.kernels import ring_attention_reference

from tests.testing import dense_oracle, make_ring_case, stable_seed

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
        requests, window=window, block_size=bs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, causal=causal,
        full_rows=full_rows, seed=stable_seed(requests, window, causal),
    )  # fmt: skip
    ref = ring_attention_reference(**case.kernel_args(), compute_dtype=torch.float64)
    oracle = dense_oracle(case)
    torch.testing.assert_close(ref.double(), oracle, atol=1e-6, rtol=1e-6)


def test_reference_row_without_keys_is_zero():
    """A query that sees nothing (impossible for a drafter, defined anyway) outputs 0, not NaN."""
    from ringkv.kernels.reference import masked_softmax_attention

    q = torch.randn(2, 2, 8)
    k = torch.randn(3, 1, 8)
    v = torch.randn(3, 1, 8)
    mask = torch.tensor([[False, False, False], [True, False, True]])
    out = masked_softmax_attention(q, k, v, mask, 0.5)
    assert torch.equal(out[0], torch.zeros(2, 8))
    assert torch.isfinite(out).all()
