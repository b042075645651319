# SPDX-License-Identifier: Apache-2.0
"""The vLLM names the simulation drives (scheduler, KV-cache manager, requests), imported in one place; only
the CLI, the benchmarks and the tests import this package, never a serving process."""

from __future__ import annotations

from ringkv.integration.vllm import _compat  # noqa: F401 -- the version check runs first
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager


def runner_output(
    req_ids: list[str], sampled_token_ids: list[list[int]], kv_connector_output: KVConnectorOutput | None = None
) -> ModelRunnerOutput:
    """vLLM's ``ModelRunnerOutput`` for a step: ``req_id_to_index`` up to 0.33, gone in 0.34 (the order of
    ``req_ids`` is the index)."""
    indices = {"req_id_to_index": {rid: i for i, rid in enumerate(req_ids)}}
    extra = indices if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__ else {}
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled_token_ids,
                             kv_connector_output=kv_connector_output, **extra)  # fmt: skip


__all__ = [
    "DraftTokenIds",
    "EngineArgs",
    "FullAttentionSpec",
    "KVCacheBlock",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "KVConnectorOutput",
    "KVConnectorRole",
    "KVTransferConfig",
    "ModelRunnerOutput",
    "OffloadingConnector",
    "OffloadingWorker",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "Scheduler",
    "SchedulerOutput",
    "SlidingWindowSpec",
    "StructuredOutputManager",
    "TransferResult",
    "VllmConfig",
    "get_hash_fn_by_name",
    "get_request_block_hasher",
    "init_none_hash",
    "runner_output",
]
