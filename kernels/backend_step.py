# SPDX-License-Identifier: Apache-2.0
"""The ring backend's steps on vLLM's per-layer cache, vLLM-free: ``RingKVImpl`` runs these (and
``ring_attention``), and ``bench/v2_replay.py`` drives them on a GPU machine without vLLM exactly as the impl does.

vLLM's per-layer cache is ``[num_blocks, Hkv, bs, D + Dv]``: K in the first ``D`` channels, V after them.
"""

from __future__ import annotations

import torch

from .ring_geometry import last_writer_slots
from .ring_write import ring_write
from .varlen import MAX_QUERY_LEN, BatchMode, VarlenBatch


def split_kv_cache(
    kv_cache: torch.Tensor, head_size: int, fp8_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-layer ``[num_blocks, H, N, hs + hs_v]`` -> K and V views ``[num_blocks, N, H, hs]``; an fp8
    ``kv_cache_dtype`` allocates uint8 (vLLM's ``STR_DTYPE_TO_TORCH_DTYPE``), viewed as ``fp8_dtype``."""
    if fp8_dtype is not None:
        if kv_cache.dtype not in (torch.uint8, fp8_dtype):
            raise ValueError(
                f"the layer's KV cache is {kv_cache.dtype} but kv_cache_dtype stores {fp8_dtype}: vLLM allocates fp8 "
                "caches as uint8; check the cache config"
            )
        kv_cache = kv_cache.view(fp8_dtype)
    blocks_first = kv_cache.transpose(1, 2)
    return blocks_first[..., :head_size], blocks_first[..., head_size:]


def store_rows(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    **scales: torch.Tensor,
) -> None:
    """``do_kv_cache_update``: store ``key [n, Hkv, D]`` / ``value [n, Hkv, Dv]`` at ``slot_mapping[:n]`` of the
    ``split_kv_cache`` views; PAD (< 0) and superseded duplicates (all but a slot's last writer) are skipped. The
    last writers are computed from this call's slots every time: vLLM fills its slot buffers in place. An fp8 cache
    stores ``x / scale`` (``scales``: ``k_scale`` / ``v_scale``)."""
    ring_write(key, value, k_cache, v_cache, last_writer_slots(slot_mapping[: key.shape[0]]), **scales)


def vllm_batch(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, max_query_len: int,
    max_seq_len: int,
) -> VarlenBatch:  # fmt: skip
    """vLLM's metadata as a batch: ``query_start_loc [num_reqs + 1]``, ``seq_lens [num_reqs]``, full logical block
    rows ``[num_reqs, width]`` (no period); a draft block up to ``MAX_QUERY_LEN`` rows, a prefill chunk past it."""
    mode = BatchMode.DRAFT_BLOCK if max_query_len <= MAX_QUERY_LEN else BatchMode.PREFILL_CHUNK
    return VarlenBatch(query_start_loc, seq_lens, block_table, max_query_len, max_seq_len, table_period=None, mode=mode)
