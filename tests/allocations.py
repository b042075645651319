# SPDX-License-Identifier: Apache-2.0
"""Counting tensor allocations on the host side: which aten calls return a tensor on storage none of their inputs
had. Kernel launches (Triton) never pass through the dispatcher, so a hot path that takes every buffer it writes
from its caller counts zero."""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _tensors(values) -> list[torch.Tensor]:
    values = values if isinstance(values, tuple | list) else (values,)
    return [value for value in values if isinstance(value, torch.Tensor)]


class AllocationCounter(TorchDispatchMode):
    """``with AllocationCounter() as counter: ...``; then ``counter.total`` and ``counter.ops`` (count per aten op)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        inputs = [*_tensors(list(args)), *_tensors(list((kwargs or {}).values()))]
        seen = {t.untyped_storage().data_ptr() for t in inputs}
        for tensor in _tensors(result):
            storage = tensor.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                self.ops[str(func)] += 1
                break
        return result

    @property
    def total(self) -> int:
        return sum(self.ops.values())
