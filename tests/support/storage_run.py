"""The small bank run the storage-fault process tests share, and reading a process's JSON log lines."""

from __future__ import annotations

import contextlib
import json
from typing import Any

CONFIG = """
run: diskfull
seed: 21
rollout: {group_size: 3, max_turns: 6}
tasks: {builtin: bank, limit: 2}
policy: {host: inline, per_token_delay_s: 0.004}
topology: {agents: 1, resources: 1}
recovery: {target_level: turn}
snapshot_interval_s: 0.3
prepare_timeout_s: 10
"""


def json_lines(text: str) -> list[dict[str, Any]]:
    found = []
    for line in text.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                found.append(json.loads(line))
    return found
