"""The environments parkway ships: a counter, a workplace (calendar and todos), a bank, and the
learning example's letters.

Each is pure and deterministic (no I/O); its state is a JSON-friendly dict, so export and restore
round-trip exactly. They register under the ``parkway.environments`` entry-point group like any plugin.
"""

from __future__ import annotations

import copy
from typing import Any

from parkway.actors.sdk.chat import ToolSpec
from parkway.actors.sdk.environments import Environment, Record, ToolError


class Counter(Environment):
    """A counter to drive to a target: the smallest environment where a double increment shows."""

    name = "counter"
    tools = (ToolSpec("increment", (("by", "int"),)), ToolSpec("get", (), mutates=False))

    def initial_state(self, seed: int) -> dict[str, Any]:
        return {"value": seed % 10}

    def tool_increment(self, by: int) -> dict[str, Any]:
        if not 1 <= by <= 100:
            raise ToolError(f"increment by {by}: 'by' must be between 1 and 100")
        self.state["value"] += by
        return {"value": self.state["value"]}

    def tool_get(self) -> dict[str, Any]:
        return {"value": self.state["value"]}


_TODO_WORDS = ("standup", "expenses", "backups", "review", "invoices", "triage")


class Workplace(Environment):
    """A calendar and todo store. Records share one sequence of ids (1, 2, ...); ``complete_todo``
    takes the id that ``add_todo`` and ``list_items`` report.
    """

    name = "workplace"
    tools = (
        ToolSpec("add_event", (("title", "word"), ("day", "int"))),
        ToolSpec("add_todo", (("text", "word"),)),
        ToolSpec("complete_todo", (("index", "int"),)),
        ToolSpec("list_items", (), mutates=False),
    )

    def initial_state(self, seed: int) -> dict[str, Any]:
        todos = [
            {"id": i + 1, "text": _TODO_WORDS[(seed + i) % len(_TODO_WORDS)], "done": False}
            for i in range(seed % 3)
        ]
        return {"next_id": len(todos) + 1, "events": [], "todos": todos}

    def _next_id(self) -> int:
        record_id = self.state["next_id"]
        self.state["next_id"] += 1
        return record_id

    def tool_add_event(self, title: str, day: int) -> dict[str, Any]:
        if not 1 <= day <= 31:
            raise ToolError(f"add_event on day {day}: 'day' must be between 1 and 31")
        record_id = self._next_id()
        self.state["events"].append({"id": record_id, "title": title, "day": day})
        return {"id": record_id}

    def tool_add_todo(self, text: str) -> dict[str, Any]:
        record_id = self._next_id()
        self.state["todos"].append({"id": record_id, "text": text, "done": False})
        return {"id": record_id}

    def tool_complete_todo(self, index: int) -> dict[str, Any]:
        todo = next((t for t in self.state["todos"] if t["id"] == index), None)
        if todo is None:
            raise ToolError(f"complete_todo {index}: there is no todo with that id")
        if todo["done"]:
            raise ToolError(f"complete_todo {index}: that todo is already completed")
        todo["done"] = True
        return {"id": index, "done": True}

    def tool_list_items(self) -> dict[str, Any]:
        return {"events": copy.deepcopy(self.state["events"]), "todos": copy.deepcopy(self.state["todos"])}


_ACCOUNTS = ("a", "b", "c")


class Bank(Environment):
    """Three accounts and transfers between them: a transfer applied twice shows in the balances."""

    name = "bank"
    tools = (
        ToolSpec("transfer", (("src", "choice:a|b|c"), ("dst", "choice:a|b|c"), ("amount", "int"))),
        ToolSpec("balance", (("account", "choice:a|b|c"),), mutates=False),
    )

    def initial_state(self, seed: int) -> dict[str, Any]:
        return {"balances": {name: 100 + (seed // 50**i) % 50 for i, name in enumerate(_ACCOUNTS)}}

    def tool_transfer(self, src: str, dst: str, amount: int) -> dict[str, Any]:
        balances = self.state["balances"]
        if src == dst:
            raise ToolError(f"transfer from {src} to itself: src and dst must differ")
        if amount <= 0:
            raise ToolError(f"transfer of {amount}: the amount must be positive")
        if balances[src] < amount:
            raise ToolError(f"transfer of {amount} from {src}: insufficient funds ({balances[src]})")
        balances[src] -= amount
        balances[dst] += amount
        return {src: balances[src], dst: balances[dst]}

    def tool_balance(self, account: str) -> dict[str, Any]:
        return {"account": account, "balance": self.state["balances"][account]}


class Letters(Environment):
    """The learning example's task (docs/training.md): say one letter as often as you can. The agent
    submits the model's reply; ``verify`` scores the fraction of its characters that are the target,
    a reward a random tiny model earns a little of and GRPO can raise."""

    name = "letters"
    tools = (ToolSpec("submit", (("text", "word"),)),)
    target = "a"

    def initial_state(self, seed: int) -> dict[str, Any]:
        return {"text": ""}

    def tool_submit(self, text: str) -> dict[str, Any]:
        self.state["text"] = text
        return {"length": len(text)}

    def verify(self, calls: Record) -> float:
        if super().verify(calls) == 0.0:  # the submission must be the one the agent recorded
            return 0.0
        text = self.state["text"]
        return text.count(self.target) / len(text) if text else 0.0


# The tool environments, whose score checks the session against the agent's record (the property
# tests walk these); ``Letters`` scores a reply instead and registers by its entry point alone.
ENVIRONMENTS: dict[str, type[Environment]] = {cls.name: cls for cls in (Counter, Workplace, Bank)}
