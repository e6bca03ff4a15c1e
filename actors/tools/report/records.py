"""From raw log lines to the records of one run: decoded, filtered to the run, deduplicated, in time
order, and cut to the run's newest session. What is skipped is counted, not raised.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

import msgspec
from parkway.actors.tools.report.model import CONTROLLER, LineCounts

_decoder = msgspec.json.Decoder()


def _timestamp(value: object) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)  # structlog writes UTC
    return moment.timestamp()


def parse_lines(lines: Iterable[bytes | str], run: str) -> tuple[list[dict[str, Any]], LineCounts]:
    """The records of ``run`` in time order, with a ``_t`` (epoch seconds) each, and what was skipped."""
    counts = LineCounts()
    seen: set[bytes] = set()
    records: list[dict[str, Any]] = []
    for raw in lines:
        data = (raw.encode() if isinstance(raw, str) else raw).strip()
        if not data:
            continue
        counts.read += 1
        try:
            record = _decoder.decode(data)
        except msgspec.DecodeError:
            counts.malformed += 1
            continue
        ts = _timestamp(record.get("ts")) if isinstance(record, dict) else None
        if ts is None or not isinstance(record.get("event"), str):
            counts.malformed += 1
            continue
        if "run" not in record:
            counts.no_run += 1
            continue
        if record["run"] != run:
            counts.other_runs += 1
            continue
        if data in seen:
            counts.duplicates += 1
            continue
        seen.add(data)
        record["_t"] = ts
        records.append(record)
    records.sort(key=lambda r: r["_t"])  # stable: one process's lines keep their order on a tie
    counts.used = len(records)
    return records, counts


def last_session(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The records from the newest session on: a run started again after it finished is a new one,
    from the first process start after the old one's ``run_finished`` (its stopping lines stay behind)."""
    cut, finished = 0, False
    for index, record in enumerate(records):
        if record["event"] == "run_finished" and record.get("actor") == CONTROLLER:
            finished = True
        elif finished and record["event"] in ("actor_started", "run_started"):
            cut, finished = index, False
    return records[cut:], cut
