# SPDX-License-Identifier: Apache-2.0
"""The ring's blocks in vLLM's prefix cache (``RingSWASpec.cache_ring``, env ``RINGKV_RING_PREFIX_CACHE``): which
hit a cached ring allows, and which of a freed request's ring blocks get a hash.

**The hit.** A request of ``N`` tokens whose hit ends at ``L`` recomputes ``L .. N - 1`` (the target's hidden states
there rebuild the drafter's context K/V as a side effect) and first serves the drafter query at ``N``, which sees
keys from ``N - (W - 1)`` on (``ring_geometry.first_visible_position``). So the ring needs the cached K/V of
exactly the logical blocks ``[first, L / bs)`` with ``first = (N - (W - 1)) // bs``, each adopted at its column
``j mod R``::

    logical block   0 ... first-1 | first ... L/bs - 1   | L/bs ...
    hit entry       null ... null | cached ring blocks    | (recomputed)

With no cached block this is the rebuild cap (``L <= N - (W - 1)``, all null; what ``cache_ring=False`` grants);
every cached block from ``first`` on adds a block. It asks for less than vLLM's own sliding-window rule
(``cdiv(W - 1, bs)`` contiguous blocks before ``L``): only the part of the window the request's first query still
sees, so a turn that adds ``d`` tokens needs the previous turn's last ``W - 1 - d`` positions. vLLM's hybrid lookup
calls the finder without the request's length, so the coordinator's wrapper (``prefix_cache.py``) sets
``LOOKUP_TOKENS`` around the call.

**The hash.** A ring block gets the hash of logical block ``j`` only when its request is freed (finished, aborted
or preempted; ``KVCacheManager.free`` or its deferred twin ``pop_blocks_for_free``, both wrapped in
``prefix_cache.py``), and only if (``window_to_hash``):
- its column still holds ``j`` (``RingSWAManager.holds``): a column that took ``j + R`` no longer holds ``j``'s K/V
  (**stale rows**; a long chunk whose first rows share a slot with its last keeps only the last writer: the same
  rule covers these **holes**);
- all of ``j`` lies below the committed count (and the request's tokens: drafts verified past a length stop are
  dropped from them): rejected draft rows and the drafter's own query rows are written at
  positions at or past it (**rejected rows**), and under async scheduling the in-flight steps' tokens (at most the
  lookahead each, ``num_output_placeholders`` steps) are not written yet;
- no cached copy of ``j`` exists already (a turn that recomputed past an earlier turn's window would duplicate it);
- every scheduler step the request took part in ran the drafter: vLLM skips the drafter, and so the context K/V
  store, for a whole batch whose longest sequence is within the lookahead of the drafter's max length (the
  speculative config's ``max_model_len`` where set, ``RingSWASpec.drafter_max_len``; else the engine's)
  (``StepLengths``).
So a freed request leaves at most R hashed blocks, its last window: what its next turn, a sibling branch or its
own resumption adopts; and the windows of its own prefix below it (its earlier turns', its own before a
preemption) lose their hashes (``superseded_windows``), so the ring's share of the cache is one window per
conversation branch.

**Evicted first.** A window block saves at most a window of recompute for one conversation, and only while that
conversation's target blocks stay cached; a target block serves every later hit of its prefix. So no cached target
block is evicted while an unheld window block is cached: ``evict_windows_first`` (wrapping vLLM's
``BlockPool.get_new_blocks``) drops, oldest first, the hashes of as many window blocks as the allocation would
otherwise take cached target blocks, and moves them to the front of the free queue. With room to spare windows stay
as long as vLLM's LRU keeps them; under pressure the cache holds what the rebuild cap alone would leave.

**Never overwritten.** A column about to take the next logical block while it holds a block another request also
holds (an adopted block two requests share) gets a fresh block and releases the shared one; a block this request
holds alone loses its hash before it is written (``RingSWAManager.allocate_new_blocks``). Both happen when the
scheduler allocates, before the step runs, so no later lookup finds it. Under async scheduling the step in flight may
still read the column's old block: it is dead to that step too (``ring_geometry``'s R proof: ``j`` is dead once
``j + R`` is appended), as for the in-place reuse the ring has always done.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Container, Sequence
from contextvars import ContextVar
from typing import Any

from ringkv.kernels.ring_geometry import first_visible_position

from ._compat import KVCacheBlock, get_group_id, resolve_block_hashes
from .errors import RingConfigError

# the number of tokens of the request whose hit the coordinator is looking up (its max_cache_hit_length + 1)
LOOKUP_TOKENS: ContextVar[int | None] = ContextVar("ringkv_lookup_tokens", default=None)


def ring_hit(
    block_hashes: Sequence[Any],
    max_length: int,
    group_ids: list[int],
    block_pool: Any,
    spec: Any,
    drop_eagle_block: bool,
    alignment_tokens: int,
) -> tuple[tuple[list[KVCacheBlock], ...], int]:
    """vLLM's ``find_longest_cache_hit`` contract for a cached ring group: per group the hit's row (null below the
    first visible block, then the adopted ring blocks), and the hit in tokens (a multiple of ``alignment_tokens``,
    never longer than the candidate the coordinator asks about).

    ``drop_eagle_block``: the coordinator asked for one ring block past its candidate (its EAGLE margin; the ring
    manager has no fine-grained lookup, so the margin is one block); the ring needs no block of its own dropped, it
    only stops at the candidate."""
    num_tokens = LOOKUP_TOKENS.get()
    if num_tokens is None:
        raise RingConfigError(
            "ringkv: a cached ring group was looked up outside HybridKVCacheCoordinator.find_longest_cache_hit "
            "(or _per_group), so the request's length is unknown; register the plugin "
            "(ringkv.integration.vllm.register) before vLLM builds its scheduler, or set RINGKV_RING_PREFIX_CACHE=0"
        )
    block_size = spec.block_size
    candidate = (max_length - (block_size if drop_eagle_block else 0)) // block_size
    first = first_visible_position(num_tokens, spec.sliding_window) // block_size
    hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, block_size)
    run: list[list[KVCacheBlock]] = []
    for j in range(first, min(candidate, len(hashes))):
        cached = block_pool.get_cached_block(hashes[j], group_ids)
        if cached is None:
            break
        run.append(cached)
    end = first + len(run) if run else min(first, candidate)
    step = math.lcm(alignment_tokens, block_size) // block_size  # the hit stays a multiple of both
    end = end // step * step
    null = block_pool.null_block
    rows = tuple(
        [null] * min(first, end) + [blocks[index] for blocks in run[: max(0, end - first)]]
        for index in range(len(group_ids))
    )
    return rows, end * block_size


class StepLengths:
    """Per request, the longest sequence of any scheduler step it took part in (vLLM runs the drafter for a batch
    only if ``max_seq_len + lookahead <= drafter max length``): ``record`` each allocation, ``close`` the step when
    the next one starts."""

    def __init__(self) -> None:
        self.open: dict[str, int] = {}  # this step's requests -> their sequence length after the step
        self.peaks: dict[str, int] = {}

    def record(self, request_id: str, seq_len: int) -> None:
        self.open[request_id] = seq_len

    def close(self, live: Container[str]) -> None:
        longest = max(self.open.values(), default=0)
        for request_id in self.open:
            if request_id in live:
                self.peaks[request_id] = max(self.peaks.get(request_id, 0), longest)
        self.open.clear()

    def peak(self, request_id: str) -> int:
        longest = max(self.open.values(), default=0) if request_id in self.open else 0
        return max(self.peaks.get(request_id, 0), longest)

    def forget(self, request_id: str) -> None:
        self.peaks.pop(request_id, None)


def window_to_hash(manager: Any, request: Any, drafter_max_len: int) -> set[int]:
    """The logical blocks of ``request``'s ring (``manager``: its ``RingSWAManager``) whose K/V a later request may
    adopt as it is freed: held by their column, named by the row, wholly committed and written (module docstring);
    those already hashed (adopted) aside."""
    request_id = request.request_id
    lookahead = manager.plan.lookahead
    if manager.steps.peak(request_id) + lookahead > drafter_max_len:
        return set()
    # a request stopped by its length may have verified drafts past its last token: they have no hash
    committed = min(request.num_computed_tokens, request.num_tokens)
    written = committed - getattr(request, "num_output_placeholders", 0) * lookahead
    row = manager.req_to_blocks.get(request_id, [])
    held = zip(manager.rings.get(request_id, []), manager.holds.get(request_id, []), strict=True)
    return {
        j for block, j in held
        if block is not None and 0 <= j < len(row) and row[j] is block and block.block_hash is None
        and (j + 1) * manager.block_size <= written
    }  # fmt: skip


def uncached(manager: Any, request: Any, window: set[int]) -> set[int]:
    """The blocks of ``window`` no cached copy serves yet (a turn that recomputed past an earlier turn's window holds
    blocks that window left cached: hashing them again would duplicate it)."""
    hashes = resolve_block_hashes(request.block_hashes, manager.block_pool.hash_block_size, manager.block_size)
    pool, group = manager.block_pool, [manager.kv_cache_group_id]
    return {j for j in window if pool.get_cached_block(hashes[j], group) is None}


def superseded_windows(manager: Any, request: Any, below: int) -> list[KVCacheBlock]:
    """The unheld cached ring blocks of ``request``'s own prefix below logical block ``below`` (its window): the
    windows of its earlier turns (or of itself before a preemption), which its own window now supersedes. Dropping
    their hashes bounds the ring's share of the cache to one window per conversation branch."""
    hashes = resolve_block_hashes(request.block_hashes, manager.block_pool.hash_block_size, manager.block_size)
    found = (manager.block_pool.get_cached_block(hashes[j], [manager.kv_cache_group_id])
             for j in range(min(below, len(hashes))))  # fmt: skip
    return [blocks[0] for blocks in found if blocks is not None and blocks[0].ref_cnt == 0]


# per BlockPool: the freed, hashed ring blocks (block id -> (block, its group)), oldest first; an entry goes stale
# when a request adopts the block or vLLM reuses it (checked when read)
_WINDOWS: weakref.WeakKeyDictionary[Any, dict[int, tuple[KVCacheBlock, int]]] = weakref.WeakKeyDictionary()


def keep_windows(block_pool: Any, blocks: Sequence[KVCacheBlock], group_id: int, freed: bool = True) -> None:
    """Record ring blocks that kept their hash, newest last: freed ones (``release``), or, with ``freed`` False,
    ones vLLM returns to the pool a step later (``pop_blocks_for_free``; an entry read before that counts as stale)."""
    windows = _WINDOWS.setdefault(block_pool, {})
    for block in blocks:
        if (block.ref_cnt == 0 or not freed) and block.block_hash is not None:
            windows.pop(block.block_id, None)
            windows[block.block_id] = (block, group_id)


def is_window(windows: dict[int, tuple[KVCacheBlock, int]], block: KVCacheBlock) -> bool:
    entry = windows.get(block.block_id)
    return (entry is not None and entry[0] is block and block.ref_cnt == 0 and block.block_hash is not None
            and get_group_id(block.block_hash) == entry[1])  # fmt: skip


def evict_windows_first(original: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's ``BlockPool.get_new_blocks(num_blocks)`` taking unheld window blocks before any cached target block
    (module docstring): it counts the cached non-window blocks among the ``num_blocks`` the free queue would hand
    out, and moves that many window blocks, oldest first and unhashed, to the queue's front."""

    def get_new_blocks(self: Any, num_blocks: int) -> list[KVCacheBlock]:
        windows = _WINDOWS.get(self)
        if windows:
            queue, node = self.free_block_queue, self.free_block_queue.fake_free_list_head.next_free_block
            front, doomed = [], 0  # what the queue would hand out, less its cached target blocks; how many those are
            while len(front) + doomed < num_blocks and node is not None and node is not queue.fake_free_list_tail:
                if node.block_hash is None or is_window(windows, node):
                    front.append(node)
                else:
                    doomed += 1
                node = node.next_free_block
            spared, handed_out = [], {block.block_id for block in front}
            while len(spared) < doomed and windows:  # oldest first, without copying the registry
                block_id, (block, _) = next(iter(windows.items()))
                if block_id not in handed_out and is_window(windows, block):
                    spared.append(block)
                del windows[block_id]  # spared, stale, or handed out anyway
            if spared:  # the front's blocks and the spared windows first, in that order
                for block in front + spared:
                    queue.remove(block)
                queue.prepend_n(front + spared)
        return original(self, num_blocks)

    return get_new_blocks
