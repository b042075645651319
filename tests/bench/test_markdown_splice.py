# SPDX-License-Identifier: Apache-2.0
"""``bench/markdown_splice.splice``: generated markdown between two marker lines (the compile report's table in
bench/README.md, the vLLM version matrix in README.md)."""

from __future__ import annotations

import pytest
from ringkv.bench.markdown_splice import splice

BEGIN, END = "<!-- table:begin -->", "<!-- table:end -->"
PAGE = f"# Title\n\nprose\n{BEGIN}\n| old |\n|---|\n{END}\n\n## Next\n"


def test_body_replaces_the_section_exactly():
    body = "| a | b |\n|---|---|\n| 1 | 2 |\n"
    assert splice(PAGE, BEGIN, END, body) == f"# Title\n\nprose\n{BEGIN}\n{body}{END}\n\n## Next\n"
    # without a final newline the end marker follows the body on its line, as given
    assert splice(PAGE, BEGIN, END, "x") == f"# Title\n\nprose\n{BEGIN}\nx{END}\n\n## Next\n"


def test_splice_is_idempotent():
    once = splice(PAGE, BEGIN, END, "| new |\n")
    assert splice(once, BEGIN, END, "| new |\n") == once
    assert splice(splice(once, BEGIN, END, "| other |\n"), BEGIN, END, "| new |\n") == once


def test_a_missing_marker_is_named_with_the_fix():
    with pytest.raises(ValueError, match=f"README.md has no '{END}' marker: keep one, on a line of its own below"):
        splice(PAGE.replace(END, ""), BEGIN, END, "x", where="README.md")
    with pytest.raises(ValueError, match=f"the text has no '{BEGIN}' marker: keep one, on a line of its own above"):
        splice(PAGE.replace(BEGIN, ""), BEGIN, END, "x")


def test_reversed_markers_are_refused():
    reversed_page = PAGE.replace(BEGIN, "@").replace(END, BEGIN).replace("@", END)
    with pytest.raises(ValueError, match=f"has '{END}' before '{BEGIN}': put '{BEGIN}' above"):
        splice(reversed_page, BEGIN, END, "x")


def test_a_duplicated_marker_is_refused():
    with pytest.raises(ValueError, match=f"has 2 '{BEGIN}' markers: keep one"):
        splice(PAGE + BEGIN + "\n", BEGIN, END, "x")
