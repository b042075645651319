# SPDX-License-Identifier: Apache-2.0
"""The lab's engine runs take the plugin's switches from their own spec, never from the caller's environment: an
exported window would otherwise window the "full" run it is compared with."""

from __future__ import annotations

from ringkv.bench.lab.e2e.runner import inherited_switches
from ringkv.bench.lab.e2e.worker import EngineRunSpec
from ringkv.integration.vllm.names import PLUGIN_SWITCHES, SINKS_ENV, WINDOW_ENV


def test_switches_the_environment_sets_and_the_spec_does_not_are_the_inherited_ones(monkeypatch):
    for name in PLUGIN_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    spec = EngineRunSpec(
        target="t", drafter="d", drafter_backend=None, prompts=[[1]], max_tokens=1, environment={SINKS_ENV: "4"}
    )
    assert inherited_switches(spec) == []
    monkeypatch.setenv(WINDOW_ENV, "64")
    monkeypatch.setenv(SINKS_ENV, "8")
    assert inherited_switches(spec) == [WINDOW_ENV]
