"""Tasks: what a prompt group works on. A JSONL file (one task a line) or the built-in set."""

from __future__ import annotations

from pathlib import Path

import msgspec
from parkway.actors.run.config import ConfigError, TasksConfig


class Task(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    env: str  # counter | workplace | bank | letters (or a plugin's name)
    prompt: str
    max_turns: int | None = None  # overrides rollout.max_turns for this task


BUILTIN: dict[str, tuple[Task, ...]] = {
    "counter": (
        Task(env="counter", prompt="Raise the counter, then report its value."),
        Task(env="counter", prompt="Add to the counter three times and tell me where it ends."),
        Task(env="counter", prompt="Count up in small steps and report the total."),
        Task(env="counter", prompt="Increment until you are bored, then answer with the value."),
    ),
    "workplace": (
        Task(env="workplace", prompt="Plan my week: add meetings and todos, then summarise."),
        Task(env="workplace", prompt="Put the offsite on the calendar and list what is left to do."),
        Task(env="workplace", prompt="Clear my todo list and tell me how many items remain."),
        Task(env="workplace", prompt="Book two events next week and report the schedule."),
    ),
    "bank": (
        Task(env="bank", prompt="Move money from a to b, then report all balances."),
        Task(env="bank", prompt="Rebalance the three accounts and say what changed."),
        Task(env="bank", prompt="Pay c from whichever account can afford it."),
        Task(env="bank", prompt="Transfer small amounts around and report the totals."),
    ),
}
# The learning example's prompts (docs/training.md): one model call each, scored by the letters in it.
BUILTIN["letters"] = tuple(
    Task(env="letters", prompt=f"Say the letter a as often as you can ({n}).", max_turns=1)
    for n in range(256)
)
BUILTIN["mixed"] = tuple(
    t for trio in zip(*(BUILTIN[k] for k in ("counter", "workplace", "bank")), strict=True) for t in trio
)


def load_tasks(config: TasksConfig, *, base: Path | None = None) -> list[Task]:
    """The run's tasks in order. A bad line is a ``ConfigError`` naming the file and line."""
    if config.path is None:
        tasks = list(BUILTIN[config.builtin])
    else:
        path = Path(config.path)
        if not path.is_absolute() and base is not None:
            path = base / path
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"tasks.path: {exc}") from None
        decoder = msgspec.json.Decoder(Task)
        tasks = []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                tasks.append(decoder.decode(line))
            except msgspec.DecodeError as exc:
                raise ConfigError(f"{path}:{number}: {exc}") from None
    if config.limit is not None:
        tasks = tasks[: config.limit]
    if not tasks:
        raise ConfigError("tasks: no tasks to run")
    return tasks
