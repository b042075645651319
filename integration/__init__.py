# SPDX-License-Identifier: Apache-2.0
"""ringkv integrations with serving engines."""
