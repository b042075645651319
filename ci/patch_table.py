# SPDX-License-Identifier: Apache-2.0
"""Write the table of what ringkv changes in vLLM (``integration/vllm/patches.py``) into docs/vllm-plugin.md,
between its marker lines; ``tests/test_docs.py`` fails when the page and the table differ.

    .venv/bin/python ci/patch_table.py
"""

from __future__ import annotations

from pathlib import Path

from ringkv.bench.markdown_splice import splice

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "vllm-plugin.md"
TABLE_BEGIN = "<!-- patch table: generated from integration/vllm/patches.py by ci/patch_table.py, do not edit -->"
TABLE_END = "<!-- end of patch table -->"


def main() -> None:
    from ringkv.integration.vllm.patches import markdown_table

    PAGE.write_text(splice(PAGE.read_text(), TABLE_BEGIN, TABLE_END, markdown_table(), where="docs/vllm-plugin.md"))


if __name__ == "__main__":
    main()
