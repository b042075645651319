# SPDX-License-Identifier: Apache-2.0
"""ringkv DFlash2 drafter side: config parsing, ring plans, a standalone drafter on ring KV."""
