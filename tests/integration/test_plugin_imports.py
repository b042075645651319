# SPDX-License-Identifier: Apache-2.0
"""The vLLM plugin's import graph is one-way: no module of ``integration/vllm/`` reaches itself through imports,
counting imports inside functions (a function-level import hides a cycle from Python, not from a reader), and
selection learns the backend's path and capabilities without importing ``backend.py``. Read with ``ast`` from the
source, so no vLLM is needed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import ringkv.integration.vllm

PACKAGE = "ringkv.integration.vllm"
PLUGIN_DIR = Path(ringkv.integration.vllm.__file__).parent


def plugin_imports(path: Path, modules: set[str]) -> set[str]:
    """The plugin modules ``path`` imports, at any depth of its tree: ``from .x import y``, ``from . import x``,
    ``import ringkv.integration.vllm.x`` and ``from ringkv.integration.vllm[.x] import y`` (a name of the package
    that is no module of it is the package's ``__init__``)."""

    def module_of(dotted: str) -> str | None:
        if dotted == PACKAGE:
            return "__init__"
        name = dotted.removeprefix(f"{PACKAGE}.").split(".")[0] if dotted.startswith(f"{PACKAGE}.") else None
        return name if name in modules else None

    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [module_of(alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level <= 1:  # level 2 and up: above the plugin
            base = (f"{PACKAGE}.{node.module}" if node.module else PACKAGE) if node.level == 1 else node.module or ""
            # `from package import name` imports the submodule `name` when there is one, else the package
            targets = [module_of(f"{base}.{alias.name}") or module_of(base) for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target is not None)
    found.discard(path.stem)
    return found


def import_graph(directory: Path) -> dict[str, set[str]]:
    """Module stem -> the plugin modules it imports (``__init__`` included as a module of its own)."""
    paths = sorted(directory.glob("*.py"))
    modules = {path.stem for path in paths}
    return {path.stem: plugin_imports(path, modules) for path in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None when the graph is acyclic (depth-first search)."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return [*stack[stack.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_the_plugins_import_graph_is_acyclic():
    graph = import_graph(PLUGIN_DIR)
    assert {"backend", "selection", "planning", "kv_cache", "names", "errors"} <= graph.keys()
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle in integration/vllm/: {' -> '.join(cycle)}"


def test_selection_does_not_import_the_backend():
    graph = import_graph(PLUGIN_DIR)
    assert "backend" not in graph["selection"], "selection.py imports backend.py: use names.py / capabilities.py"


@pytest.mark.parametrize(
    ("source", "imports"),
    [
        pytest.param("from .backend import RingKVBackend", {"backend"}, id="relative"),
        pytest.param("from . import backend, names", {"backend", "names"}, id="relative-modules"),
        pytest.param("def f():\n    from .backend import RingKVBackend", {"backend"}, id="function-level"),
        pytest.param("import ringkv.integration.vllm.backend", {"backend"}, id="absolute-import"),
        pytest.param("from ringkv.integration.vllm.backend import RingKVBackend", {"backend"}, id="absolute-from"),
        pytest.param("from ringkv.integration.vllm import backend", {"backend"}, id="absolute-module"),
        pytest.param("from ringkv.integration.vllm import register", {"__init__"}, id="package-name"),
        pytest.param("from ..simulation import admission\nfrom ringkv.kernels import ring_geometry\nimport os", set(),
                     id="outside-the-plugin"),
    ],
)  # fmt: skip
def test_every_import_form_is_seen(tmp_path, source, imports):
    """The reader sees every way a plugin module can import another (so a cycle cannot hide behind a form)."""
    for stem in ("__init__", "backend", "names"):
        (tmp_path / f"{stem}.py").write_text("")
    (tmp_path / "selection.py").write_text(source + "\n")
    assert import_graph(tmp_path)["selection"] == imports


def test_a_function_level_import_back_is_a_cycle(tmp_path):
    (tmp_path / "a.py").write_text("from .b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from .a import y\n")
    (tmp_path / "c.py").write_text("from .a import z\n")
    assert find_cycle(import_graph(tmp_path)) == ["a", "b", "a"]
