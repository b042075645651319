# SPDX-License-Identifier: Apache-2.0
"""What the plugin cannot serve is a clear error at construction, never a silent wrong answer."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from ringkv.integration.vllm import _compat
from ringkv.integration.vllm.impl import RingKVImpl
from ringkv.integration.vllm.kv_cache import RingSWASpec
from ringkv.integration.vllm.metadata import resolve_causal

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"alibi_slopes": [1.0, 2.0]}, "ALiBi"),
        ({"logits_soft_cap": 30.0}, "logits_soft_cap=30.0"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype='fp8'"),
        ({"attn_type": "encoder_only"}, "attn_type=encoder_only"),
        ({"sinks": torch.zeros(2)}, "attention sinks"),
    ],
)
def test_impl_refuses_unsupported_features(kwargs, message):
    with pytest.raises(NotImplementedError, match=message):
        RingKVImpl(2, 16, 0.25, 1, sliding_window=64, **kwargs)


def test_forward_refuses_fused_output_quantization():
    impl = RingKVImpl(2, 16, 0.25, 1, sliding_window=64)
    out = torch.zeros(1, 32)
    with pytest.raises(NotImplementedError, match="fused output quantization"):
        impl.forward(None, out, out, out, out, None, out, output_scale=torch.ones(1))


def test_ring_spec_refuses_retained_tokens_below_the_window():
    with pytest.raises(ValueError, match="extra_retained_tokens=3"):
        RingSWASpec(block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float16, sliding_window=64,
                    extra_retained_tokens=3, lookahead=8)  # fmt: skip


@pytest.mark.parametrize(("lookahead", "message"), [(-1, "lookahead=-1"), (True, "lookahead=True"), (2.5, "2.5")])
def test_ring_spec_refuses_an_impossible_plan(lookahead, message):
    with pytest.raises(ValueError, match=message):
        RingSWASpec(block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float16, sliding_window=64,
                    lookahead=lookahead)  # fmt: skip


def test_mixed_causality_in_one_group_is_an_error():
    assert resolve_causal(torch.tensor([True, True])) is True
    with pytest.raises(ValueError, match="mixes causal and non-causal"):
        resolve_causal(torch.tensor([True, False]))


@pytest.mark.parametrize(
    ("version", "message"),
    [("0.31.2", "vLLM 0.31.2 is not supported"), ("0.35.0", "vLLM 0.35.0 is not supported"),
     ("dev", "cannot parse the vLLM version 'dev'")],
)  # fmt: skip
def test_unsupported_vllm_versions_fail_clearly(version, message):
    with pytest.raises(ImportError, match=message):
        _compat._check_version(version)
    _compat._check_version("0.32.0")
