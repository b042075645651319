# SPDX-License-Identifier: Apache-2.0
"""The launches the compile report compiles: ``ring_attention`` on draft blocks and on prefill chunks, and
``ring_write``, on CPU stand-in tensors that have a real launch's shapes, strides and 16-byte-aligned buffers, in two
layouts (``LAYOUTS``): compact R-column ring rows, and what the vLLM plugin launches (full logical rows of vLLM's
block table, its per-layer cache, packed q/k/v; a table width that is a multiple of 16 specialises the attention
kernel). Each sweep runs them under ``native_compile.NativeLaunches``; ``vllm_rows`` does the same for vLLM's
``kernel_unified_attention``, loaded at run time from its two source files (``vllm_unified.py``).

Every name this report takes from ``ringkv.kernels`` is looked up in ``kernel_lookups``, and only there.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

from .native_compile import NativeLaunches, source_lines

# the DFlash2 decode shape (the CI gates' shape, ``compile_rows.gate_failures``) at 4 warps
DFLASH2 = {"op": "decode", "G": 4, "D": 128}


@dataclass(frozen=True)
class KernelLookups:
    """What the report takes from ``ringkv.kernels``: the modules it patches, the kernels it intercepts, the
    launchers and types it calls."""

    attention: ModuleType  # the attention launcher's module: ``device_sms`` patched, ``SplitWorkspace``
    write: ModuleType  # the write launcher's module: ``check_same_device`` patched
    validation: ModuleType  # the launchers' input checks: ``check_same_device`` patched
    kernels: list[Any]  # the @triton.jit kernels a launch compiles
    load_kv_tile: Any  # the K/V tile load of every attention kernel (``_tiles``)
    fp8_dtype_of: Callable[[str], Any]
    package: ModuleType  # ``ringkv.kernels``: ring_attention, ring_write, VarlenBatch, BatchMode, RingPlan


def kernel_lookups() -> KernelLookups:
    """Every lookup of a kernel module or function (imported on first use: the CLI starts without torch)."""
    import ringkv.kernels as package
    from ringkv.kernels import _tiles, attention, kv_quant, validation, write

    return KernelLookups(
        attention=attention, write=write, validation=validation,
        kernels=[attention._ring_attention_kernel, attention._combine_splits_kernel, write._ring_write_kernel],
        load_kv_tile=_tiles.load_kv_tile,
        fp8_dtype_of=kv_quant.fp8_dtype_of,
        package=package,
    )  # fmt: skip


def kv_tile_lines() -> tuple[tuple[str, ...], range]:
    """Source file and lines of ``_tiles.load_kv_tile``: the K/V tile loads of every attention kernel."""
    return source_lines(kernel_lookups().load_kv_tile)


@contextlib.contextmanager
def cpu_stand_ins(num_sms: int = 132) -> Iterator[None]:
    """Let the launchers take CPU tensors as if they were on an H200 (132 SMs): the device check passes and the
    split-KV choice sees the GPU's SM count. Everything else (validation, configs, grids) runs unchanged."""
    lookups = kernel_lookups()

    def same_device(named: dict) -> Any:
        return next(iter(named.values())).device

    with (
        mock.patch.object(lookups.validation, "check_same_device", same_device),
        mock.patch.object(lookups.write, "check_same_device", same_device),
        mock.patch.object(lookups.attention, "device_sms", lambda device: num_sms),
    ):
        yield


def ringkv_kernels() -> list[Any]:
    return kernel_lookups().kernels


# launches on stand-in tensors (shapes and strides of a real launch; the pool holds only one ring: the kernels
# specialise on strides, never on the number of blocks)

WINDOW, BLOCK_SIZE, NUM_KV_HEADS, DRAFT_BLOCK, CONTEXT = 2048, 16, 8, 8, 262_136
# a full-attention layer served on a bounded ring: the window plus StreamingLLM's 4 sink tokens (the rows' "sinks";
# the count is a runtime argument that never specialises, so any count compiles this kernel)
SINK_TOKENS = 4
# the fp8 ring the report compiles (vLLM's kv_cache_dtype name); rows without "kv" are bf16 rings
FP8_CASES = "fp8_e4m3"
# Each launch in two layouts (the rows' "layout"):
# - "compact": compact R-column ring rows (VarlenBatch table_period=R, R = 130) over contiguous
#   [num_blocks, bs, Hkv, D] caches: the kernel API's ring (tests, harness, gpu_check);
# - "plugin": what RingKVImpl launches (integration/vllm): full logical block-table rows (table_period=None, entry
#   j = ring[j mod R] or the null block, ``vllm_batch``) of vLLM's [num_reqs, cdiv(max_model_len, bs)] table, its
#   per-layer cache [num_blocks, Hkv, bs, D + Dv] split into K/V views (``split_kv_cache``), q/k/v views of one packed
#   qkv projection, split scratch from a ``SplitWorkspace``, context rows stored by ``store_rows``. The kernel then
#   reads table_period = stride_bt_r = the table width; a width that is a multiple of 16 specialises both
#   (tt.divisibility=16) into another kernel, any other width compiles the compact layout's
#   (``layout_specialisation``).
LAYOUTS = ("compact", "plugin")
# the plugin's table: max_model_len 262,144 (CONTEXT + a draft block) -> cdiv(262,144, bs) = 16,384 columns, a
# multiple of 16
PLUGIN_TABLE_WIDTH = 262_144 // BLOCK_SIZE


def _caches(
    num_blocks: int, head_dim: int, dtype: Any, kv_cache_dtype: str = "auto", layout: str = "compact"
) -> dict[str, Any]:
    """Ring cache views (``k_cache``, ``v_cache``) of ``dtype``, or of the fp8 type a vLLM ``kv_cache_dtype``
    names, with the layer's scales (``k_scale``, ``v_scale``); ``layout="plugin"``: K/V views of vLLM's per-layer
    cache (an fp8 one allocated as uint8, as vLLM does)."""
    import torch
    from ringkv.integration.vllm.backend_step import split_kv_cache

    fp8 = kernel_lookups().fp8_dtype_of(kv_cache_dtype)
    if layout == "plugin":
        kv_cache = torch.empty(num_blocks, NUM_KV_HEADS, BLOCK_SIZE, 2 * head_dim, dtype=torch.uint8 if fp8 else dtype)
        k_cache, v_cache = split_kv_cache(kv_cache, head_dim, fp8)
    else:
        shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, head_dim)
        k_cache, v_cache = torch.empty(shape, dtype=fp8 or dtype), torch.empty(shape, dtype=fp8 or dtype)
    scales = {"k_scale": torch.ones(1), "v_scale": torch.ones(1)} if fp8 else {}
    return {"k_cache": k_cache, "v_cache": v_cache, **scales}


def _qkv(tokens: int, group: int, head_dim: int, layout: str) -> tuple[Any, Any, Any]:
    """``q [T, Hkv * G, D]``, ``k_new`` / ``v_new [T, Hkv, D]`` in bf16; ``layout="plugin"``: views of one packed
    ``[T, (Hq + 2 Hkv) D]`` projection, as vLLM's models split it."""
    import torch

    heads = (NUM_KV_HEADS * group, NUM_KV_HEADS, NUM_KV_HEADS)
    if layout == "compact":
        return tuple(torch.empty(tokens, h, head_dim, dtype=torch.bfloat16) for h in heads)
    qkv = torch.empty(tokens, sum(heads) * head_dim, dtype=torch.bfloat16)
    parts = qkv.split([h * head_dim for h in heads], dim=-1)
    return tuple(part.view(tokens, h, head_dim) for part, h in zip(parts, heads, strict=True))


def _batch(query_len: int, seq_len: int, num_reqs: int, plan: Any, mode: Any, layout: str, width: int) -> Any:
    """``num_reqs`` requests of ``query_len`` queries ending at ``seq_len``: compact rows of ``plan.row_blocks``
    columns (sink blocks, then the ring's R), or (plugin) ``vllm_batch`` over full rows ``width`` columns wide
    (block ids never specialise: zeros)."""
    import torch
    from ringkv.integration.vllm.backend_step import vllm_batch

    query_start_loc = torch.arange(0, num_reqs * query_len + 1, query_len, dtype=torch.int32)
    seq_lens = torch.full((num_reqs,), seq_len, dtype=torch.int32)
    if layout == "plugin":
        batch = vllm_batch(query_start_loc, seq_lens, torch.zeros(num_reqs, width, dtype=torch.int32), query_len,
                           seq_len)  # fmt: skip
        assert batch.mode is mode, f"vllm_batch chose {batch.mode} for {query_len} queries per request, not {mode}"
        return batch
    block_table = torch.zeros(num_reqs, plan.row_blocks, dtype=torch.int32)
    return kernel_lookups().package.VarlenBatch(query_start_loc, seq_lens, block_table, query_len, seq_len,
                                                table_period=plan.ring_blocks, mode=mode)  # fmt: skip


def _scratch(layout: str) -> dict[str, Any]:
    """The plugin's split scratch: views of a ``SplitWorkspace`` (its metadata builder holds one)."""
    return {"workspace": kernel_lookups().attention.SplitWorkspace()} if layout == "plugin" else {}


def launch_decode(
    num_reqs: int, group: int, head_dim: int, context: int = CONTEXT, kv_cache_dtype: str = "auto",
    layout: str = "compact", width: int = PLUGIN_TABLE_WIDTH, sink_tokens: int = 0,
) -> None:  # fmt: skip
    """``ring_attention`` on N draft blocks of 8 after ``context`` positions at the DFlash2 ring (W 2048, bs 16,
    R 130), bf16, non-causal (``kv_cache_dtype``: an fp8 ring, vLLM's name; ``layout``: ``LAYOUTS``, ``width``: the
    plugin's table width; ``sink_tokens``: a layer with attention sinks, rows ``[sink blocks | ring]``)."""
    kernels = kernel_lookups().package
    plan = kernels.RingPlan(WINDOW, BLOCK_SIZE, DRAFT_BLOCK, sink_tokens)
    q, k_new, v_new = _qkv(num_reqs * DRAFT_BLOCK, group, head_dim, layout)
    batch = _batch(DRAFT_BLOCK, context + DRAFT_BLOCK, num_reqs, plan, kernels.BatchMode.DRAFT_BLOCK, layout, width)
    caches = _caches(plan.row_blocks + 1, head_dim, q.dtype, kv_cache_dtype, layout)
    kernels.ring_attention(q, k_new, v_new, batch=batch, window=WINDOW, causal=False, sink_tokens=sink_tokens,
                           **caches, **_scratch(layout))  # fmt: skip


def launch_prefill(
    chunk: int, group: int, head_dim: int, kv_cache_dtype: str = "auto", layout: str = "compact",
    width: int = PLUGIN_TABLE_WIDTH, sink_tokens: int = 0,
) -> None:  # fmt: skip
    """``ring_attention`` of one causal prefill chunk after 8192 positions of history (the kernel only: a target
    layer's write after it is the ``ring_write`` kernel of ``launch_write``, same tensors)."""
    kernels = kernel_lookups().package
    plan = kernels.RingPlan(WINDOW, BLOCK_SIZE, 1, sink_tokens)
    q, k_new, v_new = _qkv(chunk, group, head_dim, layout)
    batch = _batch(chunk, 8192 + chunk, 1, plan, kernels.BatchMode.PREFILL_CHUNK, layout, width)
    caches = _caches(plan.row_blocks + 1, head_dim, q.dtype, kv_cache_dtype, layout)
    kernels.ring_attention(q, k_new, v_new, batch=batch, window=WINDOW, causal=True, sink_tokens=sink_tokens,
                           **caches, **_scratch(layout))  # fmt: skip


def launch_write(head_dim: int, kv_cache_dtype: str = "auto", layout: str = "compact") -> None:
    """``ring_write`` of 64 rows (a decode step's context rows for 8 requests); plugin: ``store_rows``
    (``do_kv_cache_update``) of K/V views of a packed projection (G 4) into vLLM's cache."""
    import torch
    from ringkv.integration.vllm.backend_step import store_rows

    caches = _caches(131, head_dim, torch.bfloat16, kv_cache_dtype, layout)
    slots = torch.arange(64, dtype=torch.int64)
    if layout == "plugin":
        _, k_new, v_new = _qkv(64, 4, head_dim, layout)
        store_rows(k_new, v_new, slot_mapping=slots, **caches)
        return
    rows = torch.empty(64, NUM_KV_HEADS, head_dim, dtype=torch.bfloat16)
    kernel_lookups().package.ring_write(rows, rows.clone(), slot_mapping=slots, **caches)


@dataclass(frozen=True)
class Case:
    op: str
    shape: dict[str, Any]
    launch: Callable[[], None]


def cases(quick: bool) -> list[Case]:
    """The shipped configs in both ``LAYOUTS``: decode N x G x D (B = 8), prefill C x G x D, ring_write D, bf16 and
    fp8 rings, attention also with ``SINK_TOKENS`` sinks (the rows' "sinks"; full sweep only); quick = the CI subset
    (the DFlash2 shape G4 D128 everywhere, bf16 compact also G4 D256)."""
    all_groups_dims = [(g, d) for g in (1, 4, 8) for d in (64, 128, 256)]
    batch_sizes = (1, 8, 64, 256)
    chunks = (512, 8192)
    write_dims = (64, 128, 256)
    if quick:
        batch_sizes, chunks, write_dims = (1, 256), (8192,), (128,)
    out = []
    for layout in LAYOUTS:
        # an fp8 e4m3 ring under bf16 compute, gated as bf16
        for kv in ("auto", FP8_CASES):
            groups_dims = all_groups_dims
            if quick:
                groups_dims = [(4, 128), (4, 256)] if (layout, kv) == ("compact", "auto") else [(4, 128)]
            ring = {"kv": kv} if kv != "auto" else {}
            for sinks in (0,) if quick else (0, SINK_TOKENS):
                tags = {**ring, **({"sinks": sinks} if sinks else {}), "layout": layout}
                out += [Case("decode", {"N": n, "G": g, "D": d, **tags},
                             lambda n=n, g=g, d=d, kv=kv, layout=layout, sinks=sinks: launch_decode(
                                 n, g, d, kv_cache_dtype=kv, layout=layout, sink_tokens=sinks))
                        for g, d in groups_dims for n in batch_sizes]  # fmt: skip
                out += [Case("prefill", {"C": c, "G": g, "D": d, **tags},
                             lambda c=c, g=g, d=d, kv=kv, layout=layout, sinks=sinks: launch_prefill(
                                 c, g, d, kv, layout, sink_tokens=sinks))
                        for g, d in groups_dims for c in chunks]  # fmt: skip
            out += [Case("write", {"D": d, **ring, "layout": layout},
                         lambda d=d, kv=kv, layout=layout: launch_write(d, kv, layout))
                    for d in write_dims]  # fmt: skip
    return out


def report_rows(case_list: list[Case], archs: tuple[int, ...]) -> list[dict]:
    """Compile every case for every arch; one row per (case, arch, kernel launched)."""
    kv_lines = kv_tile_lines()
    rows = []
    for arch in archs:
        native = NativeLaunches(arch, compile=True, kv_lines=kv_lines)
        with cpu_stand_ins(), native.intercept(ringkv_kernels()):
            for case in case_list:
                first = len(native.launched)
                case.launch()
                for kernel, key, grid in native.launched[first:]:
                    compiled = native.cache[(kernel, key)]
                    rows.append({"provider": "ringkv", "op": case.op, **case.shape, "grid": list(grid),
                                 **dataclasses.asdict(compiled)})  # fmt: skip
    return rows


def keys_over_batch(max_reqs: int, groups_dims: list[tuple[int, int]], arch: int = 90) -> dict[str, dict[str, int]]:
    """Distinct specialisations (= compiled kernels) per decode shape, layout and kernel over N = 1..max_reqs
    requests, each batch at another context length (positions must not specialise either)."""
    found: dict[str, dict[str, set[str]]] = {}
    native = NativeLaunches(arch, compile=False, kv_lines=None)
    with cpu_stand_ins(), native.intercept(ringkv_kernels()):
        for layout in LAYOUTS:
            for group, head_dim in groups_dims:
                first = len(native.launched)
                for num_reqs in range(1, max_reqs + 1):
                    launch_decode(num_reqs, group, head_dim, context=num_reqs * 1021 % CONTEXT, layout=layout)
                shape = f"G{group}-D{head_dim}" + ("" if layout == "compact" else f"-{layout}")
                per_kernel = found.setdefault(shape, {})
                for kernel, key, _ in native.launched[first:]:
                    per_kernel.setdefault(kernel, set()).add(key)
    return {shape: {kernel: len(keys) for kernel, keys in kernels.items()} for shape, kernels in found.items()}


def layout_specialisation(arch: int = 90) -> dict[str, dict[str, Any]]:
    """How the plugin's launch specialises against the compact layout's, at the DFlash2 decode shape (N 8) and a
    prefill chunk, for a table width that is a multiple of 16 (max_model_len 262,144) and one that is not (262,160):
    per kernel, whether it is the compact layout's compiled kernel, and the runtime arguments specialised otherwise
    (``[compact, plugin]``: type and ``D``, divisible by 16)."""
    native = NativeLaunches(arch, compile=False, kv_lines=None)
    launches = {
        "decode": lambda **kw: launch_decode(8, DFLASH2["G"], DFLASH2["D"], **kw),
        "prefill": lambda **kw: launch_prefill(8192, DFLASH2["G"], DFLASH2["D"], **kw),
    }
    out: dict[str, dict[str, Any]] = {}

    def keys(launch: Callable[..., None], **kwargs: Any) -> list[tuple[str, str]]:
        first = len(native.launched)
        launch(**kwargs)
        return [(kernel, key) for kernel, key, _ in native.launched[first:]]

    with cpu_stand_ins(), native.intercept(ringkv_kernels()):
        for op, launch in launches.items():
            compact = keys(launch)
            for width in (PLUGIN_TABLE_WIDTH, PLUGIN_TABLE_WIDTH + 1):
                plugin = keys(launch, layout="plugin", width=width)
                entry = out.setdefault(f"{op} width {width}", {})
                for (kernel, base), (_, key) in zip(compact, plugin, strict=True):
                    before, after = native.specialised[(kernel, base)], native.specialised[(kernel, key)]
                    entry[kernel] = {
                        "same_kernel": key == base,
                        "differs": {p: [before[p], after[p]] for p in before if before[p] != after[p]},
                    }
    return out


# vLLM's kernel_unified_attention, for comparison


def vllm_rows(source: Path, archs: tuple[int, ...], batch_sizes: tuple[int, ...]) -> list[dict]:
    """``unified_attention`` (its own launcher's choices) at the DFlash2 decode shape: 2D path, B = 8 queries per
    request, ``window_size=(W-1, W-1)`` (non-causal), a periodic block-table row as ``table_period=None``."""
    import torch

    from .vllm_unified import load_unified_attention

    unified = load_unified_attention(source)
    head_dim, group = 128, 4
    rows = []
    for arch in archs:
        native = NativeLaunches(arch, compile=True, kv_lines=None)
        with native.intercept([unified.kernel_unified_attention]):
            for num_reqs in batch_sizes:
                tokens = num_reqs * DRAFT_BLOCK
                q = torch.empty(tokens, NUM_KV_HEADS * group, head_dim, dtype=torch.bfloat16)
                caches = _caches(131, head_dim, torch.bfloat16)
                k_cache, v_cache = caches["k_cache"], caches["v_cache"]
                first = len(native.launched)
                unified.unified_attention(
                    q=q, k=k_cache, v=v_cache, out=torch.empty_like(q),
                    cu_seqlens_q=torch.arange(0, tokens + 1, DRAFT_BLOCK, dtype=torch.int32),
                    max_seqlen_q=DRAFT_BLOCK, seqused_k=torch.full((num_reqs,), CONTEXT + 8, dtype=torch.int32),
                    max_seqlen_k=CONTEXT + 8, softmax_scale=head_dim**-0.5, causal=False,
                    window_size=(WINDOW - 1, WINDOW - 1), block_table=torch.zeros(num_reqs, 16384, dtype=torch.int32),
                    softcap=0, q_descale=None, k_descale=None, v_descale=None,
                )  # fmt: skip
                for kernel, key, grid in native.launched[first:]:
                    rows.append({"provider": "vllm-triton", "op": "decode", "N": num_reqs, "G": group, "D": head_dim,
                                 "grid": list(grid), **dataclasses.asdict(native.cache[(kernel, key)])})  # fmt: skip
    return rows
