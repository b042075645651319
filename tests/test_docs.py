# SPDX-License-Identifier: Apache-2.0
"""The README is a user's page and the docs stay true to the tree: every non-test ``.py`` file is named in the
README's layout table, every link (its anchor too) and every cited repository path exists, every ``ringkv``
command cited names flags the CLI has, the README keeps its size limits and cites its load figures as the results
file holds them, and every plugin module's docstring stays short (its rule is explained once, in docs/)."""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [
    README,
    REPO / "bench" / "README.md",
    REPO / "ENVs.md",
    *sorted((REPO / "docs").glob("*.md")),
    *sorted((REPO / "bench" / "results").glob("*.md")),
]
# a backticked path is checked when it starts at one of these repository entries (vLLM's own paths are not)
TOP_LEVEL = ("kernels/", "dflash2/", "integration/", "bench/", "ci/", "tests/", "docs/", ".ci/")
TOP_FILES = ("README.md", "ENVs.md", "noxfile.py", "pyproject.toml")


def tracked_files() -> list[str]:
    return subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()


def layout_rows(readme: str) -> dict[str, str]:
    """The README's layout list: folder (``kernels/``, ``bench/lab/``, ``./`` for the top level) → its item's text."""
    section = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    folder = None
    for line in section.splitlines():
        if match := re.match(r"- `([^`]*/)`(.*)", line):
            folder, rest = match.groups()
            rows[folder] = rest
        elif folder and line.startswith("  "):
            rows[folder] += " " + line.strip()
        else:
            folder = None
    return rows


def owning_row(path: str, rows: dict[str, str]) -> str | None:
    """The deepest layout row whose folder holds ``path``."""
    folders = [folder for folder in rows if path.startswith(folder) or (folder == "./" and "/" not in path)]
    return max(folders, key=len) if folders else None


def test_every_non_test_python_file_is_in_the_layout_table():
    rows = layout_rows(README.read_text())
    missing = []
    for path in tracked_files():
        if not path.endswith(".py") or path.startswith("tests/"):
            continue
        folder = owning_row(path, rows)
        if folder is None:
            missing.append(f"{path} (no row for its folder)")
            continue
        relative = path if folder == "./" else path[len(folder) :]
        if relative == "__init__.py" or relative.endswith("/__init__.py"):
            named = relative == "__init__.py" or f"`{relative.rsplit('/', 1)[0]}/`" in rows[folder]
        else:
            named = f"`{relative}`" in rows[folder]
        if not named:
            missing.append(f"{path} (row `{folder}` does not name `{relative}`)")
    assert not missing, "README's layout table misses: " + "; ".join(missing)


def test_every_layout_row_names_a_folder_that_exists():
    rows = layout_rows(README.read_text())
    assert {"kernels/", "integration/vllm/", "bench/lab/", "./"} <= set(rows), f"layout rows found: {sorted(rows)}"
    for folder in rows:
        assert (REPO / folder).is_dir(), f"README's layout table has a row for {folder}, which does not exist"


@pytest.mark.vllm
def test_the_plugin_page_lists_the_patch_table_as_register_installs_it():
    pytest.importorskip("vllm")
    from ringkv.integration.vllm.patches import markdown_table

    page = (REPO / "docs" / "vllm-plugin.md").read_text()
    assert "\n" + markdown_table() in page, (
        "docs/vllm-plugin.md's patch table is stale: run .venv/bin/python ci/patch_table.py"
    )


def test_every_link_and_cited_path_exists():
    broken = []
    for page in PAGES:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)}: link {target}")
        for cited in re.findall(r"`([^`\s]+)`", text):
            path = cited.split("::")[0].rstrip(",.:")
            if path.startswith(TOP_LEVEL) or path in TOP_FILES:
                if any(ch in path for ch in "*<>{}$"):
                    continue
                if not (REPO / path).exists():
                    broken.append(f"{page.relative_to(REPO)}: path {path}")
    assert not broken, "missing: " + "; ".join(broken)


def code_texts(text: str) -> list[str]:
    """A page's fenced code blocks and inline code spans: where commands are cited."""
    fenced = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
    unfenced = re.sub(r"```.*?```", "", text, flags=re.S)
    return fenced + re.findall(r"`([^`\n]+)`", unfenced)


def ringkv_commands() -> list[tuple[str, list[str]]]:
    """Every ``ringkv ...`` command line cited in the README, docs and bench pages, and in results headers."""
    found = []
    for page in PAGES:
        for code in code_texts(page.read_text()):
            for line in re.findall(r"(?:^|[\s/])ringkv ([^&;|#\n]+)", code.replace("\\\n", " "), flags=re.M):
                found.append((str(page.relative_to(REPO)), shlex.split(line)))
    for result in sorted((REPO / "bench" / "results").glob("*.txt")):  # a results file's header: its command
        for line in result.read_text().splitlines()[:3]:
            if match := re.match(r"(?:# |Command: )ringkv (.*?)(?: \(commit .*)?$", line):
                found.append((str(result.relative_to(REPO)), shlex.split(match.group(1))))
    return found


@pytest.mark.parametrize(
    ("page", "words"), ringkv_commands(), ids=lambda value: " ".join(value) if isinstance(value, list) else value
)
def test_every_cited_ringkv_command_and_flag_exists(page, words):
    from ringkv.integration.cli import app
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, [*[word for word in words if word != "..."], "--help"])
    assert result.exit_code == 0, f"{page} cites `ringkv {' '.join(words)}`, which the CLI rejects:\n{result.output}"


def test_the_readme_is_a_page_a_user_reads():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; keep it to 150 and move detail to docs/"
    words = len(text.split())
    assert words <= 1500, f"README.md has {words} words; keep it to 1,500 and move detail to docs/"
    long = [number for number, line in enumerate(lines, 1) if len(line) > 120]
    assert not long, f"README.md lines over 120 characters: {long}"


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", text, flags=re.S), flags=re.M):
        anchors.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return anchors


def plugin_docstrings(folder: Path) -> dict[Path, str]:
    """Each module docstring of ``folder``'s ``.py`` files, read with ``ast`` (nothing imported)."""
    docstrings = {}
    for path in sorted(folder.glob("*.py")):
        docstring = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        if docstring is not None:
            docstrings[path] = docstring
    return docstrings


PLUGIN = REPO / "integration" / "vllm"
DOCSTRING_LINES = 12


def shown(path: Path) -> str:
    """``path`` as a message names it: from the repository root where it lies inside it."""
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def test_every_link_anchor_names_a_heading():
    """A link's ``#anchor`` names a heading of the page it links to; a plugin module's docstring links (to where
    docs/ explains its rule) are checked here too, their targets included."""
    texts = {page: page.read_text() for page in PAGES}
    texts.update(plugin_docstrings(PLUGIN))
    broken = []
    for page, text in texts.items():
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", text):
            linked = (page.parent / target) if target else page
            if "://" in target:
                continue
            if not linked.exists():
                broken.append(f"{shown(page)}: {target} does not exist")
            elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked.read_text()):
                broken.append(f"{shown(page)}: {target}#{anchor} names no heading")
    assert not broken, "broken links: " + "; ".join(broken)


def test_every_plugin_module_docstring_is_short():
    long = {path: len(doc.splitlines()) for path, doc in plugin_docstrings(PLUGIN).items()}
    long = {path: lines for path, lines in long.items() if lines > DOCSTRING_LINES}
    assert not long, (
        f"plugin module docstrings over {DOCSTRING_LINES} lines (explain the rule once in docs/ and link it): "
        + "; ".join(f"{shown(path)} ({lines})" for path, lines in long.items())
    )


LOAD_RESULTS = REPO / "bench" / "results" / "load_w2048_cpu.txt"


def base_pool_turn_medians(results: str) -> dict[str, str]:
    """Per mode, the per-turn recompute p50 at the base pool (``(1)``) of a ``ringkv bench load`` table."""
    medians = {}
    for line in results.splitlines():
        cells = [cell.strip() for cell in line.strip("│ ").split("│")]
        if len(cells) > 3 and cells[0].endswith("(1)"):
            medians[cells[1]] = cells[3].split(" / ")[0]
    return medians


def test_the_readme_cites_the_load_figures_its_results_file_holds():
    readme = " ".join(README.read_text().split())
    cited = re.search(
        r"a median ([\d,]+) target tokens \(stock ([\d,]+); ([\d,]+) under the rebuild cap; the base pool of "
        rf"`bench/results/{re.escape(LOAD_RESULTS.name)}`\)",
        readme,
    )
    assert cited, f"README.md no longer cites the per-turn recompute medians of {shown(LOAD_RESULTS)}"
    medians = base_pool_turn_medians(LOAD_RESULTS.read_text())
    measured = tuple(medians.get(mode) for mode in ("ring-cached", "stock", "ring-today"))
    assert cited.groups() == measured, (
        f"README.md cites medians (ring-cached, stock, ring-today) {cited.groups()}, "
        f"{shown(LOAD_RESULTS)} holds {measured} at its base pool"
    )
