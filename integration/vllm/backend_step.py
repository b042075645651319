# SPDX-License-Identifier: Apache-2.0
"""The ring backend's steps on vLLM's per-layer cache, vLLM-free: ``RingKVImpl`` runs these (and
``ring_attention``), and ``bench/v2_replay.py`` drives them on a GPU machine without vLLM exactly as the impl does.

vLLM's per-layer cache is ``[num_blocks, Hkv, bs, D + Dv]``: K in the first ``D`` channels, V after them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from ringkv.kernels.ring_geometry import last_writer_slots
from ringkv.kernels.varlen import MAX_QUERY_LEN, BatchMode, VarlenBatch
from ringkv.kernels.write import ring_write


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


@dataclass
class _StepSlots:
    source: torch.Tensor  # the slot mapping the group's layers were handed
    num_rows: int
    slots: torch.Tensor  # its last writers
    layers: set[int]  # ids of the layers that stored through them


class ContextSlots:
    """The last writers of a KV-cache group's context slot mapping, computed once per step for all its layers.

    vLLM's DFlash models store a step's context K/V layer by layer (``precompute_and_store_context_kv``), handing
    every layer of the group the same slot-mapping tensor (V1: a view of its slot buffer; Model Runner V2: a view
    of the group's row of ``_context_slot_mappings``), before or outside the forward context, so the step's
    metadata is out of reach. The first layer computes the last writers, the other layers of that step reuse
    them. A step is told from the next by the layers: vLLM refills its slot buffers in place, with kernels that
    bump no tensor version, and may hand over the same tensor object step after step, so a layer that stores
    through a tensor a second time starts a new step and recomputes. A layer handed another tensor (Model Runner
    V2's per-layer views of models whose layers map to groups one by one) recomputes too, so caching never
    changes what is stored. Per thread: micro-batches run in threads of their own.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def last_writers(self, slot_mapping: torch.Tensor, num_rows: int, layer: object) -> torch.Tensor:
        """``last_writer_slots(slot_mapping[:num_rows])``, shared by the layers that store this step's rows."""
        step: _StepSlots | None = getattr(self._local, "step", None)
        key = id(layer)
        if step is not None and step.source is slot_mapping and step.num_rows == num_rows and key not in step.layers:
            step.layers.add(key)
            return step.slots
        slots = last_writer_slots(slot_mapping[:num_rows])
        self._local.step = _StepSlots(slot_mapping, num_rows, slots, {key})
        return slots


def store_rows(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    context_slots: ContextSlots | None = None,
    layer: object = None,
    **scales: torch.Tensor,
) -> None:
    """``do_kv_cache_update``: store ``key [n, Hkv, D]`` / ``value [n, Hkv, Dv]`` at ``slot_mapping[:n]`` of the
    ``split_kv_cache`` views; PAD (< 0) and superseded duplicates (all but a slot's last writer) are skipped. The
    last writers come from this call's slots (vLLM fills its slot buffers in place): computed here, or with
    ``context_slots`` once per step for the group ``layer`` belongs to. An fp8 cache stores ``x / scale``
    (``scales``: ``k_scale`` / ``v_scale``)."""
    num_rows = key.shape[0]
    if context_slots is None:
        slots = last_writer_slots(slot_mapping[:num_rows])
    else:
        slots = context_slots.last_writers(slot_mapping, num_rows, layer)
    ring_write(key, value, k_cache, v_cache, slots, **scales)


def vllm_batch(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, max_query_len: int,
    max_seq_len: int,
) -> VarlenBatch:  # fmt: skip
    """vLLM's metadata as a batch: ``query_start_loc [num_reqs + 1]``, ``seq_lens [num_reqs]``, full logical block
    rows ``[num_reqs, width]`` (no period); a draft block up to ``MAX_QUERY_LEN`` rows, a prefill chunk past it."""
    mode = BatchMode.DRAFT_BLOCK if max_query_len <= MAX_QUERY_LEN else BatchMode.PREFILL_CHUNK
    return VarlenBatch(query_start_loc, seq_lens, block_table, max_query_len, max_seq_len, table_period=None, mode=mode)
