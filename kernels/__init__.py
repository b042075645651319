# SPDX-License-Identifier: Apache-2.0
"""ringkv kernels: ring geometry, the Triton ring write and ring attention (draft blocks and prefill chunks), and their
references."""

from .attention import ring_attention
from .reference import ring_attention_reference, ring_write_reference
from .ring_geometry import RingPlan, ring_blocks_needed
from .varlen import BatchMode, VarlenBatch
from .write import ring_write

__all__ = [
    "BatchMode",
    "RingPlan",
    "VarlenBatch",
    "ring_attention",
    "ring_attention_reference",
    "ring_blocks_needed",
    "ring_write",
    "ring_write_reference",
]
