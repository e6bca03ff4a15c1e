"""``parkway plugins`` and the set-up check of ``parkway run``, as a user runs them: processes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.support.cli import parkway
from tests.support.paths import ROOT

pytestmark = pytest.mark.slow  # each runs `parkway` as a process

BROKEN = """
from parkway.actors.sdk import Environment, ToolSpec


class Broken(Environment):
    name = "broken"
    tools = (ToolSpec("add", (("amount", "int"),)),)

    def tool_add(self, n):
        return {}
"""


def test_plugins_lists_the_built_ins_and_where_they_come_from() -> None:
    result = parkway("plugins", "--json")
    assert result.returncode == 0, result.stderr
    rows = {(r["kind"], r["name"]): r for r in json.loads(result.stdout)}
    assert rows["environment", "workplace"]["class"] == "parkway.actors.builtin.environments:Workplace"
    assert rows["trainer", "example"]["from"].startswith("parkway ")
    table = parkway("plugins")
    assert table.returncode == 0 and table.stdout.splitlines()[0].split() == ["kind", "name", "class", "from"]


def test_a_run_naming_a_broken_plugin_is_refused_before_anything_starts(tmp_path: Path) -> None:
    (tmp_path / "broken_env.py").write_text(BROKEN)
    config = tmp_path / "run.yaml"
    config.write_text("environments: [broken_env:Broken]\ntasks: {builtin: counter}\n")
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    state = tmp_path / "state"
    result = parkway(
        "run", "--config", str(config), cwd=tmp_path, PYTHONPATH=path, PARKWAY_STATE_DIR=str(state)
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "parkway: environment plugin 'broken_env:Broken': tool add(amount:int) does not match its method "
        "tool_add(n): the spec's arguments are (amount)"
    )
    assert not state.exists()  # refused before any actor started (nothing was written)
    check = parkway("plugins", "check", "--config", str(config), cwd=tmp_path, PYTHONPATH=path)
    assert check.returncode == 2 and "does not match its method" in check.stderr


def test_plugins_check_resolves_every_plugin_of_a_run() -> None:
    result = parkway("plugins", "check", "--config", str(ROOT / "examples" / "quickstart.yaml"))
    assert result.returncode == 0, result.stderr
    assert "ok  agent        tool  (parkway.actors.builtin.agents:ToolAgent)" in result.stdout.splitlines()
