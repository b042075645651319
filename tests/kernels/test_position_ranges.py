# SPDX-License-Identifier: Apache-2.0
"""The kernels at the ends of their integer ranges (positions are int32 inside them): requests whose last
position is the largest allowed (a tiny ring: the ring is addressed by ``(p // bs) mod R``), and windows around
and past 2^31. Checked against the dense oracle."""

from __future__ import annotations

import pytest
import torch
from ringkv.kernels import BatchMode, ring_attention
from ringkv.kernels.ring_geometry import MAX_POSITION, UNBOUNDED_WINDOW
from ringkv.kernels.varlen import MAX_SEQ_LEN

from tests.testing import NAN, assert_attention_close, case_oracle_pair, make_ring_case

pytestmark = pytest.mark.interpreter


def run(case, device) -> torch.Tensor:
    """``ring_attention`` on the case (draft block or prefill chunk) into a NaN-filled output."""
    case = case.to(device)
    out = torch.full((case.q.shape[0], case.q.shape[1], case.v_new.shape[-1]), NAN, dtype=case.q.dtype, device=device)
    return ring_attention(**case.kernel_args(), out=out).cpu()


@pytest.mark.parametrize("mode", [BatchMode.DRAFT_BLOCK, BatchMode.PREFILL_CHUNK], ids=["draft", "prefill"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_last_positions(mode, causal, device):
    """Three requests ending at MAX_SEQ_LEN, one before it and 37 before it (W 37, bs 8: a ring of 6-11 blocks);
    query counts that leave the last tile of keys and of query rows partial."""
    draft = mode is BatchMode.DRAFT_BLOCK
    lens = [8, 5, 13] if draft else [45, 3, 70]
    requests = [
        (MAX_SEQ_LEN - lens[0], lens[0]),
        (MAX_SEQ_LEN - 1 - lens[1], lens[1]),
        (MAX_SEQ_LEN - 37 - lens[2], lens[2]),
    ]
    case = make_ring_case(requests, window=37, kv_block_size=8, num_q_heads=4, num_kv_heads=2, head_dim=24,
                          causal=causal, lookahead=max(lens) if draft else 1, mode=mode, seed=11)  # fmt: skip
    assert_attention_close(run(case, device), *case_oracle_pair(case), name=f"{mode.value} at MAX_SEQ_LEN", case=case)


@pytest.mark.parametrize("window", [2**31 - 1, MAX_POSITION, 2**31, UNBOUNDED_WINDOW])
@pytest.mark.parametrize("mode", [BatchMode.DRAFT_BLOCK, BatchMode.PREFILL_CHUNK], ids=["draft", "prefill"])
def test_windows_around_2_31_see_everything(mode, window, device):
    """Non-causal (where the right edge ``k - q < W`` is computed): any window past every position is full
    attention, however close to int32's end it is."""
    draft = mode is BatchMode.DRAFT_BLOCK
    requests = [(100, 8), (3, 5)] if draft else [(100, 50), (0, 17)]
    case = make_ring_case(requests, window=window, kv_block_size=8, num_q_heads=4, num_kv_heads=2, head_dim=16,
                          full_rows=True, lookahead=8 if draft else 1, mode=mode, seed=5)  # fmt: skip
    assert_attention_close(run(case, device), *case_oracle_pair(case), name=f"{mode.value} W={window}", case=case)
