"""Environments a run may not use, refused at set-up (``resolve_run``) with a message naming what is
wrong: a tool spec that does not match its method, state outside the process in exported mode
without export/restore, and a constructor that raises."""

from __future__ import annotations

from typing import Any

import pytest
from parkway.actors.launch.plugins import resolve_run
from parkway.actors.run.config import from_dict
from parkway.actors.sdk import Environment, ToolSpec
from parkway.actors.sdk.plugins import PluginError

HERE = __name__


class Mismatched(Environment):
    name = "mismatched"
    tools = (ToolSpec("restock", (("item", "word"), ("qty", "int"))),)

    def tool_restock(self, item: str, count: int) -> dict[str, Any]:
        return {}


class Unexported(Environment):
    name = "unexported"
    tools = (ToolSpec("restock", (("qty", "int"),)),)
    state_lives_in = "database"

    def tool_restock(self, qty: int) -> dict[str, Any]:
        return {}

    def reset(self) -> None:
        pass


class Exported(Unexported):
    name = "exported_db"

    def export(self, *, copy_state: bool = True) -> dict[str, Any]:
        return {}

    @classmethod
    def restore(cls, data: dict[str, Any]) -> Environment:
        return cls(0)


class NoReset(Environment):
    name = "no_reset"
    tools = (ToolSpec("restock", (("qty", "int"),)),)
    state_lives_in = "database"

    def tool_restock(self, qty: int) -> dict[str, Any]:
        return {}

    def export(self, *, copy_state: bool = True) -> dict[str, Any]:
        return {}

    @classmethod
    def restore(cls, data: dict[str, Any]) -> Environment:
        return cls(0)


class Raising(Environment):
    name = "raising"
    tools = (ToolSpec("restock", (("qty", "int"),)),)

    def __init__(self, seed: int) -> None:
        raise ConnectionError("no database at db.invalid:5432")

    def tool_restock(self, qty: int) -> dict[str, Any]:
        return {}


def refusal(environment: str, mode: str = "exported") -> str:
    config = from_dict(
        {"environments": [f"{HERE}:{environment}"], "resources": {"mode": mode}, "agent": "counter"}
    )
    with pytest.raises(PluginError) as refused:
        resolve_run(config)
    return str(refused.value)


def test_a_tool_spec_that_does_not_match_its_method() -> None:
    assert refusal("Mismatched") == (
        f"environment plugin '{HERE}:Mismatched': tool restock(item:word,qty:int) does not match its "
        "method tool_restock(item, count): the spec's arguments are (item, qty)"
    )


def test_state_outside_the_process_in_exported_mode_without_export_and_restore() -> None:
    assert refusal("Unexported") == (
        f"environment plugin '{HERE}:Unexported': keeps its state in database and does not implement "
        "export() and restore(): resources.mode 'exported' saves each session's state at a boundary and "
        "imports it on restore"
    )
    stateless = from_dict({"environments": [f"{HERE}:Exported"], "resources": {"mode": "stateless"}})
    assert set(resolve_run(stateless).environments) == {"exported_db"}
    exported = from_dict({"environments": [f"{HERE}:Exported"]})
    assert set(resolve_run(exported).environments) == {"exported_db"}


def test_state_outside_the_process_without_reset() -> None:
    # A fresh session must drop a dead attempt's rows; the base class's reset only knows self.state.
    assert refusal("NoReset") == (
        f"environment plugin '{HERE}:NoReset': keeps its state in database and does not implement "
        "reset(): a fresh session (a new attempt, a stateless reopen) must put the store's rows back to "
        "the seed's"
    )


def test_an_environment_raising_in_its_constructor() -> None:
    assert refusal("Raising") == (
        f"environment plugin '{HERE}:Raising': raised in __init__: "
        "ConnectionError: no database at db.invalid:5432"
    )
