# SPDX-License-Identifier: Apache-2.0
"""The vLLM names the simulation drives (scheduler, KV-cache manager, requests), imported in one place; only
the CLI, the benchmarks and the tests import this package, never a serving process."""

from __future__ import annotations

from ringkv.integration.vllm import _compat  # noqa: F401 -- the version check runs first
from vllm.config import VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

__all__ = [
    "DraftTokenIds",
    "EngineArgs",
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "ModelRunnerOutput",
    "Request",
    "SamplingParams",
    "Scheduler",
    "SlidingWindowSpec",
    "StructuredOutputManager",
    "VllmConfig",
]
