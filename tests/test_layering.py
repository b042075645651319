# SPDX-License-Identifier: Apache-2.0
"""The layers, read from the source with ``ast`` (nothing imported): the product (``ringkv.integration``: the
plugin a serving process loads and the CLI's product commands) imports neither the benchmarks nor the lab
(``ringkv.bench``, ``ringkv.bench.lab``), and the kernels import no vLLM."""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from pathlib import Path


def package_files(package: str) -> list[Path]:
    """Every module file of the installed ``package`` (found without importing it)."""
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations, f"{package} is not an installed package"
    return sorted(path for root in spec.submodule_search_locations for path in Path(root).rglob("*.py"))


def module_name(package: str, root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join((package, *parts[:-1], *(() if parts[-1] == "__init__" else parts[-1:])))


def imported_names(package: str) -> Iterator[tuple[str, str]]:
    """(module, name it imports) for every import statement in ``package``, relative ones resolved; ``from m
    import a`` names both ``m`` and ``m.a`` (``a`` may be a submodule)."""
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations
    for root in map(Path, spec.submodule_search_locations):
        for path in sorted(root.rglob("*.py")):
            module = module_name(package, root, path)
            # the package a relative import starts from
            here = module if path.name == "__init__.py" else module.rpartition(".")[0]
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    yield from ((module, alias.name) for alias in node.names)
                elif isinstance(node, ast.ImportFrom):
                    base = here.rsplit(".", node.level - 1)[0] if node.level else ""
                    source = ".".join(part for part in (base, node.module) if part)
                    yield module, source
                    yield from ((module, f"{source}.{alias.name}") for alias in node.names)


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(f"{package}.")


def test_the_layering_walk_reads_every_module():
    """The checks below read real files: the plugin's modules and a kernel file are among them."""
    assert any(path.name == "backend.py" for path in package_files("ringkv.integration"))
    assert any(path.name == "attention.py" for path in package_files("ringkv.kernels"))
    assert ("ringkv.integration.vllm.backend", "ringkv.integration.vllm._compat") in set(
        imported_names("ringkv.integration")
    )


def test_the_product_imports_neither_bench_nor_the_lab():
    offenders = sorted({(module, name) for module, name in imported_names("ringkv.integration")
                        if within(name, "ringkv.bench")})  # fmt: skip
    assert not offenders, f"the product imports the benchmarks or the lab: {offenders}"


def test_the_kernels_import_no_vllm():
    offenders = sorted({(module, name) for module, name in imported_names("ringkv.kernels") if within(name, "vllm")})
    assert not offenders, f"the kernels import vLLM: {offenders}"


def test_the_ringkv_script_is_the_products_app_and_finds_the_labs_commands():
    """The installed ``ringkv`` script runs ``ringkv.integration.cli:app``, which adds the lab's commands through the
    ``ringkv.commands`` entry point (it imports nothing of the lab itself)."""
    from importlib.metadata import entry_points

    from ringkv.integration.cli import COMMAND_SETS, app

    (script,) = entry_points(group="console_scripts", name="ringkv")
    assert script.value == "ringkv.integration.cli:app"
    assert [entry.value for entry in entry_points(group=COMMAND_SETS)] == ["ringkv.bench.cli:add_lab_commands"]
    commands = [command.callback.__name__ for command in app.registered_commands]
    assert commands == ["smoke", "plan", "demo", "admission", "e2e"]
    assert [group.name for group in app.registered_groups] == ["bench"]
