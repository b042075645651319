# SPDX-License-Identifier: Apache-2.0
"""The prepared GPU check (one H200 run, <= 8 minutes): correctness first, then timings, JSON to $OUT.

1. the kernel test-suite natively on the GPU (``pytest tests/kernels -m interpreter``), then bf16 cases on
   the DFlash2 shape (bf16 and fp8 rings) against the fp64 dense oracle, each repeated 10x and required bitwise
   equal;
2. ``ring_attention`` on the named shapes (DFlash2 32 q / 8 kv / hd 128; 16 / 2 / 256; 64 / 8 / 128; W 2048),
   B 8 and 16, N = 1/8/64/256 requests, the DFlash2 shape on a bf16 and on an fp8 e4m3 ring:
   ``triton.testing.do_bench`` medians with p20/p80, GB/s and % of 4.3 TB/s; cold L2 by rotating over
   >= 6 x 50 MB of distinct ring sets; CUDA-graph replay (``do_bench_cudagraph``) for N <= 8;
   FlexAttention (sliding-window mask) and SDPA on the same inputs for the DFlash2 shape, and with
   ``--vllm-source`` vLLM's own ``unified_attention`` on the same ring (``vllm_unified.py``: its two Triton files
   from a vllm install or a carried, uncommitted copy), each provider checked against ringkv's output, baselines
   stopped at ``--budget-s``; prefill chunks C = 512/2048/8192 (TFLOP/s by
   the keys each row sees) beside FlexAttention;
3. the drafter-level smoke (``ringkv smoke``) at 262,144 positions, natively;
4. V2's DFlash drafter step on the ring backend, CUDA-graph captured and replayed (``v2_replay.py``);
5. ``ring_attention`` with its ring write captured once in a CUDA graph per padded batch size (padded requests and
   PAD token rows as vLLM pads), replayed with other contents and context lengths across ring wraps and back, each
   replay bitwise equal to eager with the captured launch (config, splits, grid), NaN-poisoned slots untouched
   (``graph_replay.py``); run right after step 1's bf16 cases, so a short lease checks it first.

Usage: ``bash bench/on_gpu.sh --out $OUT`` on the GPU (``ringkv bench gpu-check`` where installed); ``--smoke``
runs a tiny CPU/interpreter version of every step (what CI runs to keep this script working).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from ringkv.kernels.testing import ISSUE_55800, DrafterShape

from .graph_replay import graph_replay_rows
from .records import REPO, environment
from .v2_replay import v2_replay_rows

HBM_BYTES_PER_S = 4.3e12


# the smoke form's tiny shape (CPU, interpreter)
SMOKE_SHAPE = DrafterShape(window=37, kv_block_size=8, num_q_heads=4, num_kv_heads=1, head_dim=16)


# fp8 rings: randn rows over the e4m3 range (|x| <= 4 sigma below 448 * scale)
FP8_SCALE = 4.0 / 448


def build_batch(shape: DrafterShape, num_reqs: int, block: int, context_len: int, dtype, device, seed: int = 0,
                kv_cache_dtype: str = "auto"):  # fmt: skip
    """N requests at the same context length: a ring each, live context written through ``ring_write``,
    plus the same K/V linearized (``[N, Hkv, W-1+B, D]``) for the dense baselines. ``kv_cache_dtype`` (vLLM's
    name, e.g. ``"fp8_e4m3"``): an fp8 ring with scales ``FP8_SCALE``, its dense K/V the dequantized ring in fp32."""
    import torch
    from ringkv.kernels import BatchMode, RingPlan
    from ringkv.kernels.kv_quant import dequantize, fp8_dtype_of, quantize_fp8
    from ringkv.kernels.testing import RingPool

    plan = RingPlan(shape.window, shape.kv_block_size, lookahead=max(block, 8))
    # generated where it is used: a 256-request batch is gigabytes
    generator = torch.Generator(device=device).manual_seed(seed)
    fp8 = fp8_dtype_of(kv_cache_dtype)
    cache_dtype = dtype if fp8 is None else fp8
    pool = RingPool.allocate(plan, num_reqs, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                             dtype=cache_dtype, device=device, generator=generator)  # fmt: skip
    scales = {}
    if fp8 is not None:
        scales = {name: torch.full((1,), FP8_SCALE, device=device) for name in ("k_scale", "v_scale")}
    context = torch.arange(max(0, context_len - (shape.window - 1)), context_len)
    ctx_len = len(context)

    def randn(*size: int):
        return torch.randn(*size, generator=generator, device=device).to(dtype)

    k_ctx = randn(num_reqs, ctx_len, shape.num_kv_heads, shape.head_dim)
    v_ctx = randn(num_reqs, ctx_len, shape.num_kv_heads, shape.head_dim)
    for r in range(num_reqs):
        pool.write(r, context, k_ctx[r], v_ctx[r], seq_len=context_len, **scales)
    if scales:
        # what the ring holds, for the oracle: quantization error belongs to the input
        k_ctx, v_ctx = (dequantize(quantize_fp8(x, scale, cache_dtype), scale, torch.float32)
                        for x, scale in ((k_ctx, scales["k_scale"]), (v_ctx, scales["v_scale"])))  # fmt: skip
    tokens = num_reqs * block
    q = randn(tokens, shape.num_q_heads, shape.head_dim)
    k_new = randn(tokens, shape.num_kv_heads, shape.head_dim)
    v_new = randn(tokens, shape.num_kv_heads, shape.head_dim)
    args = {"q": q, "k_new": k_new, "v_new": v_new, "k_cache": pool.k_cache, "v_cache": pool.v_cache,
            "batch": pool.batch([context_len] * num_reqs, block, mode=BatchMode.DRAFT_BLOCK), "window": shape.window,
            "causal": False, **scales}  # fmt: skip
    # dense layout [N, H, L, D]: context then the block's own keys
    k_blk, v_blk = (x.view(num_reqs, block, *x.shape[1:]).to(k_ctx.dtype) for x in (k_new, v_new))
    k_dense = torch.cat([k_ctx, k_blk], 1).transpose(1, 2)
    v_dense = torch.cat([v_ctx, v_blk], 1).transpose(1, 2)
    q_dense = q.view(num_reqs, block, *q.shape[1:]).transpose(1, 2)
    return args, (q_dense.contiguous(), k_dense.contiguous(), v_dense.contiguous()), ctx_len


def dense_mask(ctx_len: int, block: int, window: int, device):
    """[B, ctx_len + B] visibility of the linearized window (non-causal drafter layer)."""
    import torch
    from ringkv.kernels.ring_geometry import visible

    q_lin = ctx_len + torch.arange(block, device=device)[:, None]
    k_lin = torch.arange(ctx_len + block, device=device)[None, :]
    return visible(q_lin, k_lin, window, causal=False)


def make_baselines(dense, ctx_len: int, block: int, window: int, device, compile_flex: bool):
    """SDPA with a boolean mask and FlexAttention with a sliding-window ``mask_mod`` on the same K/V."""
    import torch
    import torch.nn.functional as F

    q, k, v = dense
    mask = dense_mask(ctx_len, block, window, device)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    baselines = {"torch-sdpa": sdpa}
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def sliding(b, h, q_idx, kv_idx):
            q_lin = q_idx + ctx_len
            return (q_lin - kv_idx < window) & (kv_idx - q_lin < window)

        block_mask = create_block_mask(sliding, None, None, block, ctx_len + block, device=str(device))
        flex = torch.compile(flex_attention) if compile_flex else flex_attention

        def flex_call():
            return flex(q, k, v, block_mask=block_mask, enable_gqa=True)

        baselines["torch-flex"] = flex_call
    except Exception as error:  # a missing or failing baseline is recorded, never fatal
        baselines["torch-flex"] = error
    return baselines


def vllm_unified_call(unified, args: dict, shape: DrafterShape, block: int, context_len: int):
    """vLLM's ``unified_attention`` (``vllm_unified.py``; its launcher's own tile choices) on the same ring. vLLM
    reads every key from the cache, so the block's own K/V are first written into the ring's slack (positions
    ``P..P+B-1``, which never alias live context), and each ring row becomes vLLM's periodic logical row
    (column ``j`` -> ``ring[j mod R]``). Returns the call; its result is in the dense ``[N, Hq, B, D]`` layout."""
    import torch
    import triton
    from ringkv.kernels import ring_write
    from ringkv.kernels.ring_geometry import block_column, table_slot_mapping, varlen_positions

    batch, k_cache, v_cache = args["batch"], args["k_cache"], args["v_cache"]
    num_tokens = args["q"].shape[0]
    request, positions, _ = varlen_positions(batch.query_start_loc, batch.seq_lens, num_tokens)
    slots = table_slot_mapping(positions, batch.block_table, kv_block_size=shape.kv_block_size, window=shape.window,
                               period=batch.period, request_index=request)  # fmt: skip
    ring_write(args["k_new"], args["v_new"], k_cache, v_cache, slots)
    columns = block_column(torch.arange(triton.cdiv(context_len + block, shape.kv_block_size), device=k_cache.device),
                         batch.period)  # fmt: skip
    table = batch.block_table[:, columns].contiguous()
    out = torch.empty_like(args["q"])

    def call():
        unified.unified_attention(
            q=args["q"], k=k_cache, v=v_cache, out=out, cu_seqlens_q=batch.query_start_loc, max_seqlen_q=block,
            seqused_k=batch.seq_lens, max_seqlen_k=context_len + block, softmax_scale=shape.head_dim**-0.5,
            causal=False, window_size=(shape.window - 1, shape.window - 1), block_table=table, softcap=0,
            q_descale=None, k_descale=None, v_descale=None,
        )  # fmt: skip
        return out.view(batch.num_reqs, block, *out.shape[1:]).transpose(1, 2)

    return call


def to_token_major(out_dense, num_reqs: int, block: int):
    """[N, Hq, B, D] -> [N*B, Hq, D]."""
    return out_dense.transpose(1, 2).reshape(num_reqs * block, *out_dense.shape[1:2], out_dense.shape[-1])


def time_fn(fn, smoke: bool, cuda_graph: bool = False) -> tuple[float, float, float]:
    """(p50, p20, p80) in microseconds: one timed call under ``smoke``; else ``triton.testing.do_bench``, or with
    ``cuda_graph`` ``do_bench_cudagraph`` (calls replayed from one CUDA graph, as vLLM runs the drafter)."""
    if smoke:
        start = time.perf_counter()
        fn()
        elapsed = (time.perf_counter() - start) * 1e6
        return elapsed, elapsed, elapsed
    import triton.testing

    quantiles = [0.5, 0.2, 0.8]
    if cuda_graph:
        p50, p20, p80 = triton.testing.do_bench_cudagraph(fn, rep=100, quantiles=quantiles)
    else:
        p50, p20, p80 = triton.testing.do_bench(fn, quantiles=quantiles, warmup=25, rep=100)
    return p50 * 1e3, p20 * 1e3, p80 * 1e3


def gate(out, dense, context_len: int, window: int) -> dict:
    """The tolerance rule for ``out`` ([N*B, Hq, D]) against the dense oracle on the same K/V (``build_batch``'s
    ``[N, H, L, D]`` tensors, non-causal, at positions ``context_len - ctx_len .. context_len + B - 1``): the
    tests' ``oracle_pair`` (fp64, and the batch's own dtype)."""
    import torch
    from ringkv.kernels.oracle import oracle_pair
    from ringkv.kernels.testing import attention_error

    q, k, v = dense
    num_reqs, block = q.shape[0], q.shape[2]

    def block_rows(x: torch.Tensor) -> torch.Tensor:
        # [N, H, L, D] -> the block's own rows [N * B, H, D]
        return x[:, :, -block:].transpose(1, 2).flatten(0, 1)

    first = context_len + block - k.shape[2]
    histories = [(first, k[r, :, :-block].transpose(0, 1), v[r, :, :-block].transpose(0, 1)) for r in range(num_reqs)]
    starts = torch.arange(0, num_reqs * block + 1, block)
    seq_lens = torch.full((num_reqs,), context_len + block)
    ref_hi, ref_lo = oracle_pair(block_rows(q), block_rows(k), block_rows(v), histories, starts, seq_lens,
                                 window=window, causal=False)  # fmt: skip
    report = attention_error(out, ref_hi, ref_lo)
    return {"max_error": report.max_error, "bound": report.bound, "ok": report.ok}


def run_test_suite(timeout_s: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "pytest", "tests/kernels", "-m", "interpreter", "-q", "-p", "no:cacheprovider",
           "--benchmark-disable", "-x"]  # fmt: skip
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        tail = (done.stdout + done.stderr)[-3000:]
        return {"returncode": done.returncode, "seconds": time.perf_counter() - start, "tail": tail}
    except subprocess.TimeoutExpired:
        return {"returncode": None, "seconds": timeout_s, "tail": "timed out"}


def bf16_cases(shape: DrafterShape, device, smoke: bool) -> list[dict]:
    """bf16 on the DFlash2 shape (bf16 and fp8 rings): deep positions, a mixed batch, forced splits; 10
    bitwise-equal repeats."""
    import torch
    from ringkv.kernels import ring_attention

    rows = []
    cases = [(1, 8, 262_136, None, "auto"), (4, 16, 5_000, None, "auto"), (2, 8, 3_000, 4, "auto"),
             (1, 8, 100, None, "auto"), (1, 8, 262_136, None, "fp8_e4m3"), (2, 8, 3_000, 4, "fp8_e5m2")]  # fmt: skip
    if smoke:
        cases = [(1, 8, 100, None, "auto"), (1, 8, 100, 2, "fp8_e4m3")]
    for num_reqs, block, context_len, splits, kv in cases:
        args, dense, _ = build_batch(shape, num_reqs, block, context_len, torch.bfloat16, device, seed=context_len,
                                     kv_cache_dtype=kv)  # fmt: skip
        first = ring_attention(**args, num_splits=splits)
        repeats_equal = all(torch.equal(first, ring_attention(**args, num_splits=splits)) for _ in range(10))
        rows.append({"num_reqs": num_reqs, "block": block, "context_len": context_len, "num_splits": splits,
                     "kv_cache_dtype": kv, "bitwise_repeats": repeats_equal,
                     **gate(first, dense, context_len, shape.window)})  # fmt: skip
    return rows


SHAPES = {
    "dflash2-32-8-128": ISSUE_55800,
    "16-2-256": DrafterShape(num_q_heads=16, num_kv_heads=2, head_dim=256),
    "64-8-128": DrafterShape(num_q_heads=64, num_kv_heads=8, head_dim=128),
}
L2_BYTES = 50 * 2**20
COLD_SETS_BYTES = 6 * L2_BYTES


def rotating(calls: list) -> callable:
    """One call per invocation, cycling through ring sets so each timed call reads KV not in L2."""
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(calls)
        return calls[state["i"]]()

    return call


def timing_rows(shape_names: list[str], device, smoke: bool, budget_s: float, unified=None) -> list[dict]:
    import torch
    import triton
    from ringkv.kernels import ring_attention
    from ringkv.kernels.kv_quant import fp8_dtype_of
    from ringkv.kernels.testing import attention_error

    dtype = torch.bfloat16
    rows = []
    started = time.perf_counter()
    grid = [(b, n) for b in (8, 16) for n in (1, 8, 64, 256)]
    if smoke:
        grid = [(8, 1)]
    for shape_name in shape_names:
        shape = SHAPES[shape_name] if not smoke else SMOKE_SHAPE
        primary = shape_name == "dflash2-32-8-128"
        # the DFlash2 shape also on an fp8 e4m3 ring (ringkv only: no baseline reads fp8 KV non-causally)
        for kv, (block, num_reqs) in [(kv, point) for kv in (("auto", "fp8_e4m3") if primary else ("auto",))
                                      for point in grid]:  # fmt: skip
            context_len = 262_136 if not smoke else 100
            ring_itemsize = (fp8_dtype_of(kv) or dtype).itemsize
            per_set = 2 * num_reqs * (shape.window - 1 + block) * shape.num_kv_heads * shape.head_dim * ring_itemsize
            num_sets = 1 if smoke else max(1, min(32, triton.cdiv(COLD_SETS_BYTES, per_set)))
            batches = [build_batch(shape, num_reqs, block, context_len, dtype, device, seed=s, kv_cache_dtype=kv)
                       for s in range(num_sets)]  # fmt: skip
            args, dense, ctx_len = batches[0]
            outs = [torch.empty_like(b[0]["q"]) for b in batches]
            calls = [lambda a=b[0], o=o: ring_attention(**a, out=o) for b, o in zip(batches, outs, strict=True)]
            calls[0]()
            check = gate(outs[0], dense, context_len, shape.window)
            kv_bytes = 2 * num_reqs * shape.num_kv_heads * shape.head_dim * (ctx_len * ring_itemsize
                                                                             + block * dtype.itemsize)  # fmt: skip
            qo_bytes = 2 * num_reqs * block * shape.num_q_heads * shape.head_dim * dtype.itemsize
            base = {"shape": shape_name, "block": block, "num_reqs": num_reqs, "context_len": context_len,
                    "dtype": str(dtype), "kv_cache_dtype": kv, "bytes": kv_bytes + qo_bytes,
                    "ring_sets": num_sets}  # fmt: skip
            providers = {"ringkv": rotating(calls)}
            if device.type == "cuda" and num_reqs <= 8:
                providers["ringkv-cudagraph"] = rotating(calls)
            if (primary or smoke) and kv == "auto":
                compile_flex = not smoke and time.perf_counter() - started < budget_s
                providers.update(make_baselines(dense, ctx_len, block, shape.window, device, compile_flex))
                if unified is not None:
                    try:
                        providers["vllm-triton"] = rotating([vllm_unified_call(unified, b[0], shape, block, context_len)
                                                              for b in batches])  # fmt: skip
                    except Exception as error:  # recorded like any other baseline
                        providers["vllm-triton"] = error
            for name, fn in providers.items():
                row = {**base, "provider": name}
                if isinstance(fn, Exception):
                    rows.append({**row, "error": repr(fn)})
                    continue
                try:
                    result = fn()
                    if name.startswith("ringkv"):
                        row.update(check)
                    else:
                        report = attention_error(to_token_major(result, num_reqs, block), outs[0], outs[0])
                        row["max_diff_vs_ringkv"] = report.max_error
                    if not name.startswith("ringkv") and time.perf_counter() - started > budget_s:
                        rows.append({**row, "skipped": "time budget"})
                        continue
                    p50, p20, p80 = time_fn(fn, smoke, cuda_graph=name == "ringkv-cudagraph")
                    gbps = row["bytes"] / (p50 * 1e-6) / 1e9
                    row.update({"us_p50": p50, "us_p20": p20, "us_p80": p80, "GBps": gbps,
                                "pct_of_4.3TBps": 100 * gbps * 1e9 / HBM_BYTES_PER_S})  # fmt: skip
                except Exception as error:
                    row["error"] = repr(error)[:500]
                rows.append(row)
            del batches, args, dense, outs, calls, providers
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def prefill_rows(device, smoke: bool, budget_s: float) -> list[dict]:
    """``ring_attention`` on prefill chunks of the DFlash2 shape, causal W 2048: one chunk of C tokens after 8192
    tokens of history in the ring, beside FlexAttention on the linearized [history, chunk]. TFLOP/s counts the keys each
    row really sees (``2 * Hq * sum(visible keys) * (D + Dv)``). Gate: the dense oracle pair (fp64 and bf16) over
    slices of 512 queries."""
    import torch
    from ringkv.kernels import BatchMode, RingPlan, ring_attention
    from ringkv.kernels.oracle import oracle_pair
    from ringkv.kernels.ring_geometry import visible
    from ringkv.kernels.testing import RingPool, attention_error

    shape = SMOKE_SHAPE if smoke else ISSUE_55800
    window, dtype = shape.window, torch.bfloat16
    context_len = 8192 if not smoke else 100
    rows = []
    started = time.perf_counter()
    for chunk in (512, 2048, 8192) if not smoke else (40,):
        generator = torch.Generator(device=device).manual_seed(chunk)

        def randn(*size: int, generator=generator):
            return torch.randn(*size, generator=generator, device=device).to(dtype)

        pool = RingPool.allocate(RingPlan(window, shape.kv_block_size, 1), 1, num_kv_heads=shape.num_kv_heads,
                                 head_dim=shape.head_dim, dtype=dtype, device=device)  # fmt: skip
        history = torch.arange(context_len - (window - 1), context_len, device=device)
        k_hist, v_hist = (randn(len(history), shape.num_kv_heads, shape.head_dim) for _ in range(2))
        pool.write(0, history, k_hist, v_hist, seq_len=context_len)
        q = randn(chunk, shape.num_q_heads, shape.head_dim)
        k_new, v_new = (randn(chunk, shape.num_kv_heads, shape.head_dim) for _ in range(2))
        args = {"q": q, "k_new": k_new, "v_new": v_new, "k_cache": pool.k_cache, "v_cache": pool.v_cache,
                "batch": pool.batch([context_len], chunk, mode=BatchMode.PREFILL_CHUNK), "window": window,
                "causal": True}  # fmt: skip
        out = torch.empty_like(q)

        def ringkv_call(args=args, out=out):
            return ring_attention(**args, out=out)

        ringkv_call()
        q_pos = context_len + torch.arange(chunk, device=device)
        k_pos = torch.cat([history, q_pos])
        # [L, Hkv, D]: the history, then the chunk
        k_all, v_all = torch.cat([k_hist, k_new]), torch.cat([v_hist, v_new])
        # the dense oracle pair over slices of 512 queries, each a request whose history is the ring's plus the
        # chunk before it (the fp64 scores of a whole 8192-query chunk would take 21 GB)
        slices = range(0, chunk, 512)
        ref_hi, ref_lo = oracle_pair(
            q, k_new, v_new, [(context_len - len(history), k_all[: len(history) + lo], v_all[: len(history) + lo])
                              for lo in slices],
            torch.tensor([*slices, chunk]), torch.tensor([context_len + min(lo + 512, chunk) for lo in slices]),
            window=window, causal=True,
        )  # fmt: skip
        report = attention_error(out, ref_hi, ref_lo)
        keys, values = k_all.transpose(0, 1)[None], v_all.transpose(0, 1)[None]
        visible_keys = visible(q_pos[:, None], k_pos[None, :], window, True).sum().item()
        flops = 2 * shape.num_q_heads * visible_keys * 2 * shape.head_dim
        base = {"op": "prefill", "chunk": chunk, "context_len": context_len, "visible_keys": visible_keys,
                "flops": flops, "dtype": str(dtype)}  # fmt: skip
        providers = {"ringkv": ringkv_call}
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            offset = len(history)

            def sliding_causal(b, h, q_idx, kv_idx, offset=offset):
                return (q_idx + offset >= kv_idx) & (q_idx + offset - kv_idx < window)

            block_mask = create_block_mask(sliding_causal, None, None, chunk, offset + chunk, device=str(device))
            flex = flex_attention if smoke else torch.compile(flex_attention)
            q_dense = q.transpose(0, 1)[None]
            providers["torch-flex"] = functools.partial(flex, q_dense, keys, values, block_mask=block_mask,
                                                        enable_gqa=True)  # fmt: skip
        except Exception as error:
            rows.append({**base, "provider": "torch-flex", "error": repr(error)[:500]})
        for name, fn in providers.items():
            row = {**base, "provider": name}
            if name == "ringkv":
                row.update({"max_error": report.max_error, "bound": report.bound, "ok": report.ok})
            try:
                if name != "ringkv" and time.perf_counter() - started > budget_s:
                    rows.append({**row, "skipped": "time budget"})
                    continue
                fn()
                p50, p20, p80 = time_fn(fn, smoke)
                row.update({"us_p50": p50, "us_p20": p20, "us_p80": p80, "TFLOPs": flops / (p50 * 1e-6) / 1e12})
            except Exception as error:
                row["error"] = repr(error)[:500]
            rows.append(row)
    return rows


def drafter_smoke(device, smoke: bool) -> dict:
    """``ringkv smoke`` natively: the tiny DFlash2 drafter on ring KV at 262,144 positions vs full history."""
    from ringkv.dflash2.harness.smoke import run_smoke

    result = run_smoke(context=262_144 if not smoke else 3000, steps=32 if not smoke else 2, device=str(device))
    return {**asdict(result), "ok": result.ok}


def gpu_check(out: Path, smoke: bool, budget_s: float, skip_tests: bool, shapes: list[str],
              vllm_source: Path | None) -> int:  # fmt: skip
    """The GPU check (module docstring); ``smoke``: its tiny CPU/interpreter form. Returns the exit code."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    shape = SMOKE_SHAPE if smoke else ISSUE_55800
    report = {"environment": {**environment(), "device": str(device)}, "shape": asdict(shape)}
    if not smoke and not skip_tests:
        report["test_suite"] = run_test_suite(timeout_s=150)
        print("test suite:", report["test_suite"]["tail"][-400:], flush=True)
    report["bf16"] = bf16_cases(shape, device, smoke)
    print(json.dumps(report["bf16"], indent=1), flush=True)
    report["graph_replay"] = graph_replay_rows(device, smoke)
    print(json.dumps(report["graph_replay"]), flush=True)
    unified = None
    if vllm_source is not None:
        from .vllm_unified import load_unified_attention

        unified = load_unified_attention(vllm_source)
    report["timing"] = timing_rows(shapes, device, smoke, budget_s, unified)
    report["prefill"] = prefill_rows(device, smoke, budget_s)
    report["drafter_smoke"] = drafter_smoke(device, smoke)
    print("drafter smoke:", report["drafter_smoke"], flush=True)
    report["v2_replay"] = v2_replay_rows(shape, device, smoke)
    for row in report["timing"] + report["prefill"] + report["v2_replay"]:
        print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / ("gpu_check_smoke.json" if smoke else "gpu_check.json")).write_text(json.dumps(report, indent=1))
    failed = [r for r in report["bf16"] if not (r["ok"] and r["bitwise_repeats"])]
    failed += [] if report["drafter_smoke"]["ok"] else [report["drafter_smoke"]]
    failed += [r for r in report["v2_replay"] + report["graph_replay"] if not r["ok"]]
    failed += [
        r for r in report["timing"] + report["prefill"] if r["provider"].startswith("ringkv") and not r.get("ok", False)
    ]
    return 1 if failed else 0
