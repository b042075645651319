# SPDX-License-Identifier: Apache-2.0
"""The DFlash2 drafter on ring KV: checkpoint round trip, block-local convolution, ring == full history,
lossless speculative decoding against a transformers target, and the long-context smoke at CI size."""

from __future__ import annotations

import pytest
import torch
from ringkv.dflash2.harness.ring_cache import DraftKVCache
from ringkv.dflash2.harness.smoke import run_smoke
from ringkv.dflash2.harness.spec_decode import TargetModel, greedy_reference, speculative_generate
from ringkv.dflash2.harness.tiny import random_drafter, tiny_config, tiny_target
from ringkv.dflash2.model import DFlash2Drafter, GroupedBlockConv
from ringkv.kernels.testing import attention_error

pytestmark = pytest.mark.interpreter


def test_checkpoint_round_trip(tmp_path):
    config = tiny_config()
    drafter = random_drafter(config, seed=3)
    drafter.save_pretrained(tmp_path)
    loaded = DFlash2Drafter.from_pretrained(tmp_path)
    assert loaded.config == config
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name


def test_block_convolution_never_crosses_a_block_edge():
    torch.manual_seed(0)
    conv = GroupedBlockConv(hidden_size=32, taps=2, group_size=16, draft_block=4)
    torch.nn.init.normal_(conv.base_kernel)
    x = torch.randn(12, 32)
    y, coefficients = conv.prepare(x)
    changed = x.clone()
    changed[4:8] += 10.0  # block 1 only
    y_changed, _ = conv.prepare(changed)
    assert torch.equal(y[:4], y_changed[:4]) and torch.equal(y[8:], y_changed[8:])
    assert not torch.equal(y[4:8], y_changed[4:8])
    assert conv.finish(x, coefficients).shape == x.shape


def drafts_from(cache_kind: str, steps: int = 6):
    """Drafter logits for a few blocks over a 60-token history with W = 16 (the ring wraps many times)."""
    config = tiny_config(window=16, draft_block=4)
    drafter = random_drafter(config, seed=1)
    embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
    head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    torch.manual_seed(5)
    features = torch.randn(60 + 4 * steps, drafter.fc.in_features)
    if cache_kind == "ring":
        cache = DraftKVCache(config, 1, kv_block_size=4)
    elif cache_kind.startswith("fp8"):
        attention = "reference" if cache_kind.endswith("reference") else "triton"
        cache = DraftKVCache(config, 1, kv_cache_dtype="fp8_e4m3", kv_block_size=4, attention=attention)
    else:
        cache = DraftKVCache(config, 1, mode="full", max_positions=200)
    logits, context_len = [], 0
    with torch.no_grad():
        for end in [60] + [60 + 3 * i for i in range(1, steps + 1)]:
            drafter.write_context(cache, 0, features[context_len:end], torch.arange(context_len, end))
            context_len = end
            logits.append(drafter.draft(cache, torch.tensor([7]), [context_len], embed, head)[1])
    return torch.stack(logits)


def test_ring_drafts_match_the_full_history_cache():
    ring, full = drafts_from("ring"), drafts_from("full")
    report = attention_error(ring, full.double(), full)
    assert report.ok, report


def test_fp8_ring_drafts_match_the_reference_on_the_same_fp8_ring():
    """The Triton fp8 ring and the PyTorch reference on the same quantized rows agree to the fp32 bound; both
    differ from the exact full-history drafter by the quantization only (a few percent of the logits here)."""
    fp8, fp8_reference, full = drafts_from("fp8"), drafts_from("fp8-reference"), drafts_from("full")
    report = attention_error(fp8, fp8_reference.double(), fp8_reference)
    assert report.ok, report
    assert 0 < float((fp8 - full).abs().max()) < 0.1 * float(full.abs().max())


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])  # a second model: slow (CI time)
def test_ring_drafter_drafts_what_the_full_history_drafter_drafts(seed):
    """Request 1 of a two-request ring cache: every step's draft logits equal the full-history drafter's
    (greedy verification alone would hide bad drafts), and the output is the target's own greedy decoding."""
    config = tiny_config(window=16, draft_block=4)
    target = TargetModel(tiny_target(seed=seed), config.target_layer_ids)
    drafter = random_drafter(config, seed=seed)
    prompt = [(7 * i + seed) % 120 + 3 for i in range(37)]
    ring = speculative_generate(target, drafter, DraftKVCache(config, 2, kv_block_size=4), prompt, 30, request=1)
    full_cache = DraftKVCache(config, 2, mode="full", max_positions=80)
    full = speculative_generate(target, drafter, full_cache, prompt, 30, request=1)
    assert ring.tokens == full.tokens == greedy_reference(target, prompt, 30)
    assert ring.accepted_per_step == full.accepted_per_step
    assert len(ring.draft_logits) == len(full.draft_logits) > 5
    for step, (got, want) in enumerate(zip(ring.draft_logits, full.draft_logits, strict=True)):
        report = attention_error(got, want.double(), want)
        assert report.ok, f"step {step}: {report}"


def test_partial_acceptance_writes_the_accepted_rows_only(chain_models):
    """The trained drafter agrees with the chain target part of the time: every step stores exactly its bonus
    token and accepted drafts as context (each context_len position once, in order), and its drafts equal the
    full-history drafter's."""
    import random

    from transformers import Qwen3ForCausalLM

    spec = chain_models.spec
    target = TargetModel(Qwen3ForCausalLM.from_pretrained(chain_models.target), spec.target_layer_ids)
    drafter = DFlash2Drafter.from_pretrained(chain_models.drafter, target_hidden_size=spec.hidden_size)
    written: list[int] = []

    class RecordingCache(DraftKVCache):
        def write(self, layer, request, positions, k, v) -> None:
            if layer == 0:
                written.extend(positions.tolist())
            super().write(layer, request, positions, k, v)

    generator = random.Random(1)
    prompt = [generator.randrange(3, spec.vocab_size - 1) for _ in range(150)]
    ring = speculative_generate(target, drafter, RecordingCache(drafter.config, 1), prompt, 48)
    full = speculative_generate(target, drafter, DraftKVCache(drafter.config, 1, mode="full", max_positions=300),
                                prompt, 48)  # fmt: skip
    assert ring.tokens == full.tokens == greedy_reference(target, prompt, 48)
    assert ring.accepted_per_step == full.accepted_per_step
    assert min(ring.accepted_per_step) == 0 and max(ring.accepted_per_step) == spec.num_speculative_tokens
    assert written == list(range(len(prompt) + sum(a + 1 for a in ring.accepted_per_step)))
    for step, (got, want) in enumerate(zip(ring.draft_logits, full.draft_logits, strict=True)):
        # the trained drafter's logits reach ~100: held to the fp32 bound relative to their largest magnitude
        scale = want.abs().max()
        report = attention_error(got / scale, want.double() / scale, want / scale)
        assert report.ok, f"step {step}: {report}"


def test_long_context_smoke_at_ci_size():
    result = run_smoke(context=5000, steps=6, chunk=2048, window=2048, draft_block=8)
    assert result.error.ok, result
    assert result.ring_kv_bytes < result.full_kv_bytes
