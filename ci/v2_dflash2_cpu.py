# SPDX-License-Identifier: Apache-2.0
"""vLLM 0.34's engine with Model Runner V2 and the DFlash2 speculator, drafter (and target) on the ring, on CPU.

Outside CI; run with the python of the vLLM 0.34 venv of ``ci/compat.sh`` (``VLLM034_PYTHON``: the GPU wheel
installed beside CPU torch, ringkv editable from this checkout, plus ``openai``, ``openai-harmony``, and
``compressed-tensors`` and ``loguru`` with ``--no-deps``), from the repository root::

    "$VLLM034_PYTHON" ci/v2_dflash2_cpu.py

A tiny Qwen3 target and a DFlash2 drafter (two sliding non-causal layers, W 64; ``load_format="dummy"``) serve a
600-token prompt, 3 speculative tokens, block 32 (R = 4): once on the ring, once with the same kernels over vLLM's
own sliding-window rows; the drafter's attention outputs of every step are compared. It exits non-zero with the
reason unless both runs finish on Model Runner V2 with the DFlash2 speculator, the ring run's drafter group is a
ring of R = 4 blocks and the reference's is not, both record the same number (> 0) of drafter attention calls, and
every output is finite and bitwise equal to its reference. The GPU wheel on CPU needs these patches, each found by
running without it (the call that failed, in order):

1. ``CpuPlatform.check_and_update_config``: "vLLM on x86 CPUs requires Triton (triton-cpu)" -> answered yes for
   that call (``ci/compat_cpu_platform.py``).
2. ``CPUWorker.__init__`` -> ``torch.ops._C.init_cpu_memory_env``: the wheel has no CPU C++ ops -> a no-op op.
3. ``Worker.__init__``: "vLLM's model runner requires Triton." (``vllm.triton_utils`` wants one active GPU driver)
   -> the NVIDIA driver reports active, so vLLM's ``triton.jit`` kernels run in the interpreter.
4. the target's ``CPU_ATTN`` metadata build -> ``torch.ops._C.get_scheduler_metadata`` -> the target's layers on
   RINGKV too (``attention_backend``).
5. ``RotaryEmbedding.forward_cpu`` -> ``torch.ops._C.rotary_embedding`` -> ``custom_ops: ["none"]`` (torch-native
   layers).
6. ``DFlashQwen3Model.precompute_and_store_context_kv`` calls ``ops.rms_norm`` / ``ops.rotary_embedding`` itself
   -> torch versions of those two.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CI = Path(__file__).resolve().parent
WINDOW = 64
# the drafter's ring: cdiv(W + la - 2, bs) + 1 with W 64, block 32, la = 3 speculative tokens + 1
RING_BLOCKS = 4


def make_models(folder: Path) -> None:
    from ringkv.dflash2.harness.engine_models import EngineModelSpec, build_target

    build_target(EngineModelSpec(max_positions=4096), folder / "target")
    drafter = {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "vocab_size": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
        "is_causal": False, "layer_types": ["sliding_attention"] * 2, "sliding_window": WINDOW,
        "use_sliding_window": True, "tie_word_embeddings": False, "torch_dtype": "float32",
        "dflash_config": {"block_size": 4, "target_layer_ids": [0, 2], "mask_token_id": 511, "conv_kernel_size": 2,
                          "conv_group_size": 32, "selector_rank": 16, "selector_top_k": 4},
    }  # fmt: skip
    (folder / "drafter").mkdir(parents=True)
    (folder / "drafter" / "config.json").write_text(json.dumps(drafter))


def patch_vllm_for_cpu() -> None:
    """Patches 1, 2, 3 and 6 of the module docstring (4 and 5 are engine arguments)."""
    import torch
    from triton.backends import backends

    backends["nvidia"].driver.is_active = staticmethod(lambda: True)
    sys.path.insert(0, str(CI))
    import compat_cpu_platform  # noqa: F401

    library = torch.library.Library("_C", "FRAGMENT")
    library.define("init_cpu_memory_env(int[] nodes) -> ()")
    library.impl("init_cpu_memory_env", lambda nodes: None, "CompositeExplicitAutograd")
    patch_vllm_for_cpu.library = library  # keep the registration alive

    from vllm import _custom_ops

    def rms_norm(out, input, weight, epsilon):
        x = input.float()
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon)
        out.copy_((y if weight is None else y * weight.float()).to(out.dtype))

    def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox, rope_dim_offset=0, inverse=False):
        if not is_neox or rope_dim_offset or inverse:
            raise NotImplementedError("only NeoX rotary embedding from dim 0")
        cos, sin = (part[:, None, :] for part in cos_sin_cache[positions.long()].float().chunk(2, dim=-1))
        half = cos.shape[-1]
        for x in (query, key):
            if x is not None:
                view = x.view(x.shape[0], -1, head_size)
                x1, x2 = view[..., :half].float(), view[..., half : 2 * half].float()
                view[..., :half], view[..., half : 2 * half] = (x1 * cos - x2 * sin), (x2 * cos + x1 * sin)

    _custom_ops.rms_norm, _custom_ops.rotary_embedding = rms_norm, rotary_embedding


def serve(models: Path, ring: bool, out: Path) -> None:
    """One engine run; saves the drafter's attention outputs and prints what ran."""
    import torch

    patch_vllm_for_cpu()
    from ringkv.integration.vllm.backend import RingKVBackend
    from ringkv.integration.vllm.impl import RingKVImpl
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine

    if not ring:  # the reference: vLLM's own SlidingWindowSpec rows, the same kernels
        RingKVBackend.customize_spec = classmethod(lambda cls, spec: spec)
    drafter_outputs, forward = [], RingKVImpl.forward

    def recording_forward(self, layer, query, key, value, kv_cache, metadata, output, *args, **kwargs):
        result = forward(self, layer, query, key, value, kv_cache, metadata, output, *args, **kwargs)
        if metadata is not None and self.window == WINDOW:
            drafter_outputs.append(result[: int(metadata.query_start_loc[-1])].clone())
        return result

    RingKVImpl.forward = recording_forward
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=str(models / "target"), skip_tokenizer_init=True, dtype="float32", max_model_len=1024,
            max_num_batched_tokens=256, max_num_seqs=2, enforce_eager=True, enable_prefix_caching=False,
            distributed_executor_backend="uni", load_format="dummy", block_size=32, seed=0,
            attention_backend="RINGKV", compilation_config={"custom_ops": ["none"]},
            speculative_config={"method": "dflash", "model": str(models / "drafter"), "num_speculative_tokens": 3,
                                "attention_backend": "RINGKV"},
        )
    )  # fmt: skip
    core = engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    sys.stdout.write(f"runner {type(runner).__name__} ({type(runner).__mro__[1].__module__}), speculator "
                     f"{type(runner.speculator).__name__}\n")  # fmt: skip
    rings = []
    for group in core.scheduler.kv_cache_manager.kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        ring_blocks, is_draft = getattr(spec, "ring_blocks", "-"), getattr(spec, "is_draft", "-")
        sys.stdout.write(f"group {type(spec).__name__} {group.layer_names} block {spec.block_size} "
                         f"R {ring_blocks} is_draft {is_draft}\n")  # fmt: skip
        if is_draft is True:
            rings.append(ring_blocks)
    sampling = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False, ignore_eos=True)
    engine.add_request("r0", {"prompt_token_ids": [3 + i % 500 for i in range(600)]}, sampling)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    sys.stdout.write(f"{steps} engine steps, {len(drafter_outputs)} drafter attention calls\n")
    torch.save({"outputs": drafter_outputs, "drafter_rings": rings, "runner": type(runner).__mro__[1].__module__,
                "speculator": type(runner.speculator).__name__}, out)  # fmt: skip


def fail(message: str) -> None:
    raise SystemExit(f"v2_dflash2_cpu: FAILED: {message}")


def check(ring: dict, stock: dict) -> None:
    """Exit non-zero unless both ran Model Runner V2 with the DFlash2 speculator, the ring run's drafter sits on a
    ring of ``RING_BLOCKS`` and the reference's does not, and both recorded the same drafter attention calls, every
    output finite and bitwise equal."""
    import torch

    for mode, run in (("ring", ring), ("stock rows", stock)):
        if run["runner"] != "vllm.v1.worker.gpu.model_runner" or not run["speculator"].startswith("DFlash"):
            fail(f"the {mode} run used {run['runner']} with {run['speculator']}, not Model Runner V2 with DFlash2")
    if ring["drafter_rings"] != [RING_BLOCKS]:
        fail(f"the ring run's drafter KV groups have rings {ring['drafter_rings']}, expected [{RING_BLOCKS}]")
    if any(blocks != "-" for blocks in stock["drafter_rings"]):
        fail(
            f"the reference run's drafter is on a ring ({stock['drafter_rings']}): it would compare the ring to itself"
        )
    ring_outputs, stock_outputs = ring["outputs"], stock["outputs"]
    if not ring_outputs or len(ring_outputs) != len(stock_outputs):
        fail(f"{len(ring_outputs)} drafter attention calls on the ring, {len(stock_outputs)} on stock rows")
    for call, (a, b) in enumerate(zip(ring_outputs, stock_outputs, strict=True)):
        where = f"drafter attention call {call} of {len(ring_outputs)}"
        if a.shape != b.shape or a.dtype != b.dtype:
            fail(f"{where}: ring output {tuple(a.shape)} {a.dtype}, stock rows {tuple(b.shape)} {b.dtype}")
        for name, t in (("ring", a), ("stock rows", b)):
            if not bool(torch.isfinite(t).all()):
                fail(f"{where}: {int((~torch.isfinite(t)).sum())} non-finite values in the {name} output")
        if not torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)):
            differ = a != b
            first = tuple(int(i) for i in differ.nonzero()[0]) if differ.any() else "signed zeros"
            fail(f"{where}: not bitwise equal; {int(differ.sum())} of {a.numel()} values differ (first at {first}), "
                 f"max |diff| {float((a - b).abs().max()):.3g}")  # fmt: skip


def main() -> None:
    os.environ.update(VLLM_TARGET_DEVICE="cpu", TRITON_INTERPRET="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                      HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")  # fmt: skip
    if len(sys.argv) == 4:
        serve(Path(sys.argv[1]), sys.argv[2] == "ring", Path(sys.argv[3]))
        return
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        make_models(folder)
        for mode in ("ring", "stock-rows"):
            sys.stdout.write(f"== {mode}\n")
            sys.stdout.flush()
            done = subprocess.run([sys.executable, __file__, str(folder), mode, str(folder / f"{mode}.pt")],
                                  capture_output=True, text=True)  # fmt: skip
            sys.stdout.write(done.stdout)
            if done.returncode:
                fail(f"the {mode} engine run exited with {done.returncode}; its stderr ends:\n{done.stderr[-3000:]}")
        ring, stock = torch.load(folder / "ring.pt"), torch.load(folder / "stock-rows.pt")
    pairs = list(zip(ring["outputs"], stock["outputs"], strict=False))  # check() names a count mismatch
    if pairs and all(a.shape == b.shape for a, b in pairs):
        worst = max(float((a - b).abs().max()) for a, b in pairs)
        distinct = torch.cat([t.flatten() for t in ring["outputs"]]).unique().numel()
        sys.stdout.write(f"drafter outputs, ring vs stock rows: {len(pairs)} calls, max |diff| {worst:.3g} "
                         f"({distinct} distinct output values)\n")  # fmt: skip
    check(ring, stock)
    sys.stdout.write("PASS: every drafter attention output on the ring is bitwise equal to stock rows'\n")


if __name__ == "__main__":
    main()
