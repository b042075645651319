# SPDX-License-Identifier: Apache-2.0
"""``SplitWorkspace``: ``ring_attention`` launches take their split partials and LSEs from persistent scratch
instead of allocating them, with the output of a fresh allocation bit for bit."""

from __future__ import annotations

import pytest
import torch
from ringkv.kernels import attention
from ringkv.kernels.attention import SplitWorkspace, ring_attention, split_rows_bound
from ringkv.kernels.configs import select_num_splits
from ringkv.kernels.varlen import MAX_QUERY_LEN, BatchMode

from tests.allocations import AllocationCounter
from tests.testing import NAN, make_ring_case

pytestmark = pytest.mark.interpreter


def launch(args: dict, workspace: SplitWorkspace | None, **kwargs) -> torch.Tensor:
    """``ring_attention`` into a NaN output (rows past the batch stay NaN)."""
    q, v_new = args["q"], args["v_new"]
    out = torch.full((q.shape[0], q.shape[1], v_new.shape[2]), NAN, device=q.device)
    return ring_attention(**args, out=out, workspace=workspace, **kwargs)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.cpu().view(torch.int32)


# (requests [(P, B)], W, Hq, Hkv, mode, forced num_splits, whether the workspace holds the launch on one SM)
CASES = [
    pytest.param([(150, 8)], 128, 4, 1, BatchMode.DRAFT_BLOCK, None, True, id="chosen-splits"),
    pytest.param([(300, 8)], 256, 4, 1, BatchMode.DRAFT_BLOCK, 3, True, id="forced-3"),
    # more rows than any chosen split count needs: the launch allocates, as without a workspace
    pytest.param([(150, 8), (40, 3)], 128, 8, 2, BatchMode.DRAFT_BLOCK, 2, False, id="forced-2-past-the-bound"),
    pytest.param([(300, 8), (200, 8)], 256, 4, 1, BatchMode.DRAFT_BLOCK, 16, False, id="forced-16-past-the-bound"),
    pytest.param([(60, 8)], 64, 4, 2, BatchMode.DRAFT_BLOCK, 1, True, id="one-split"),
    pytest.param([(90, 70)], 64, 4, 2, BatchMode.PREFILL_CHUNK, None, True, id="prefill-chunk"),
]  # fmt: skip


@pytest.mark.parametrize(("requests", "window", "hq", "hkv", "mode", "splits", "held"), CASES)
def test_a_launch_through_a_workspace_equals_a_fresh_one_bitwise(requests, window, hq, hkv, mode, splits, held, device):
    case = make_ring_case(requests, window=window, kv_block_size=16, num_q_heads=hq, num_kv_heads=hkv, head_dim=32,
                          mode=mode, pad_tokens=2, seed=7)  # fmt: skip
    args = case.to(device).kernel_args()
    fresh = launch(args, None, num_splits=splits)
    workspace = SplitWorkspace()
    assert torch.equal(bits(launch(args, workspace, num_splits=splits)), bits(fresh))
    # the second launch reuses the scratch the first left
    out = torch.full_like(fresh, NAN)
    with AllocationCounter() as counter:
        ring_attention(**args, out=out, workspace=workspace, num_splits=splits)
    assert torch.equal(bits(out), bits(fresh))
    if device.type == "cpu":
        assert (counter.total == 0) is held, counter.ops


@pytest.mark.parametrize(("hkv", "requests"), [(1, [(150, 8)]), (2, [(150, 8), (70, 8)])], ids=["split", "unsplit"])
def test_a_draft_launch_through_a_workspace_allocates_nothing(hkv, requests, device, monkeypatch):
    case = make_ring_case(requests, window=128, kv_block_size=16, num_q_heads=4 * hkv, num_kv_heads=hkv, head_dim=32,
                          seed=3).to(device)  # fmt: skip
    chosen = []
    split_count = attention.split_count
    monkeypatch.setattr(attention, "split_count", lambda *a, **k: chosen.append(split_count(*a, **k))
                        or chosen[-1])  # fmt: skip
    out = torch.empty(case.q.shape[0], case.q.shape[1], case.v_new.shape[2], device=device)
    args = case.kernel_args()
    workspace = SplitWorkspace()
    ring_attention(**args, out=out, workspace=workspace)  # first use of this head shape: the workspace allocates
    with AllocationCounter() as counter:
        ring_attention(**args, out=out, workspace=workspace)
    assert counter.total == 0, counter.ops
    if device.type == "cpu":
        assert chosen[-1] == (2 if hkv == 1 else 1), chosen  # one SM under the interpreter
    with AllocationCounter() as counter:
        ring_attention(**args, out=out)
    assert counter.total > 0, "without a workspace the launch allocates its scratch: the count above proves nothing"


@pytest.mark.parametrize("num_sms", [1, 8, 132, 148])
@pytest.mark.parametrize(("num_kv_heads", "group", "window", "tile_n"), [(1, 4, 2048, 16), (2, 4, 128, 16),
                         (8, 4, 2048, 64), (4, 1, 300, 32), (1, 16, 37, 16)])  # fmt: skip
def test_the_workspace_bound_holds_every_batch_that_splits(num_kv_heads, group, window, tile_n, num_sms):
    """Any batch of ``n`` requests of up to ``query_len`` rows that ``select_num_splits`` splits fits the bound."""
    block_q = max(64, group) // group
    bound = split_rows_bound(num_kv_heads=num_kv_heads, block_q=block_q, window=window, tile_n=tile_n,
                             num_sms=num_sms)  # fmt: skip
    for query_len in range(1, MAX_QUERY_LEN + 1):
        num_m_blocks = -(-query_len // block_q)
        for num_reqs in range(1, 1200):
            splits = select_num_splits(num_reqs=num_reqs, num_kv_heads=num_kv_heads, num_m_blocks=num_m_blocks,
                                       window=window, tile_n=tile_n, num_sms=num_sms)  # fmt: skip
            if splits > 1:
                assert splits * num_reqs * query_len <= bound, (num_reqs, query_len, splits, bound)
