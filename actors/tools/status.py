"""``parkway status``: one table of every actor of a run.

Who is in the run comes from two places: the actors the topology names, and every actor whose heartbeat
(``actors/runtime/heartbeat.py``) is on the run's log stream within the last ``window_s``. Each is asked for its
``Status``; one that does not answer still shows, with when it was last heard from.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgspec
from parkway.actors.runtime.client import Client
from parkway.actors.runtime.heartbeat import HEARTBEAT_EVENT, parse_ts
from parkway.brokers.base import Broker, BrokerError, RequestTimeout
from parkway.protocol.ids import new_checkpoint_id, parse_address
from parkway.protocol.messages import Status, StatusReport

_decode = msgspec.json.Decoder(dict[str, Any]).decode


async def last_heartbeats(
    broker: Broker, *, window_s: float, idle_s: float = 0.5
) -> dict[str, dict[str, Any]]:
    """The newest heartbeat of each actor within the window: read the stream until it goes quiet."""
    since = time.time() - window_s
    latest: dict[str, dict[str, Any]] = {}
    lines = broker.follow_logs(from_start=True, since=since)
    try:
        while True:
            try:
                raw = await asyncio.wait_for(anext(lines), idle_s)
            except TimeoutError:
                break
            try:
                record = _decode(raw)
            except msgspec.DecodeError:
                continue
            if record.get("event") != HEARTBEAT_EVENT or not isinstance(record.get("actor"), str):
                continue
            at = parse_ts(record.get("ts", ""))
            if at is None or at < since:
                continue
            record["heard_at"] = at
            known = latest.get(record["actor"])
            if known is None or known["heard_at"] <= at:
                latest[record["actor"]] = record
    finally:
        with contextlib.suppress(Exception):
            await lines.aclose()
    return latest


async def ask_status(client: Client, address: str, *, timeout: float) -> dict[str, Any]:
    status = Status(checkpoint_id=new_checkpoint_id("status"), deadline=time.time() + timeout)
    try:
        reply = await client.request(address, status)
    except (RequestTimeout, BrokerError) as exc:
        return {"address": address, "reachable": False, "error": str(exc) or type(exc).__name__}
    if isinstance(reply, StatusReport):
        return {"address": address, "reachable": True, "heard_at": time.time(), **msgspec.to_builtins(reply)}
    return {"address": address, "reachable": False, "error": str(reply)}


async def collect(
    client: Client,
    addresses: list[str],
    *,
    timeout: float,
    heartbeats: dict[str, dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """One row per actor, sorted by role and replica: its status, or its last heartbeat and the error."""
    heartbeats = heartbeats or {}
    everyone = sorted(set(addresses) | set(heartbeats), key=_order)
    rows = list(await asyncio.gather(*(ask_status(client, a, timeout=timeout) for a in everyone)))
    for row in rows:
        beat = heartbeats.get(row["address"])
        role, replica = _order(row["address"])
        row.setdefault("role", role)
        row.setdefault("replica", replica)
        if row["reachable"] or beat is None:
            row.setdefault("heard_at", None)
            continue
        # No answer now: show what its last heartbeat said.
        row["heard_at"] = beat["heard_at"]
        for key in ("phase", "pid", "in_flight", "handled", "lease_expires_at", "structures"):
            row.setdefault(key, beat.get(key))
        row.setdefault("checkpoint_id", beat.get("active_checkpoint_id"))
    return rows


def _order(address: str) -> tuple[str, int]:
    try:
        return parse_address(address)
    except ValueError:
        return (address, 0)


def _ago(then: float | None, now: float) -> str:
    if then is None:
        return "never"
    seconds = max(0.0, now - then)
    return f"{seconds:.1f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


def snapshot_note(health: dict[str, Any] | None, now: float) -> str:
    """The controller's snapshots, in a few words: the newest one's age, the failures in a row and the
    last failure (its step, when, why)."""
    if not health:
        return ""
    newest = health.get("newest_snapshot")
    parts = [
        f"newest {newest}, {_ago(health.get('newest_published_at'), now)}" if newest else "no snapshot yet"
    ]
    failures = health.get("consecutive_failures") or 0
    if failures:
        parts.append(f"{failures} failed in a row")
    if health.get("last_failure_at") is not None:
        reason = str(health.get("last_failure_reason") or "")
        reason = reason if len(reason) <= 80 else reason[:77] + "..."
        parts.append(
            f"last failure at {health.get('last_failure_step')} {_ago(health['last_failure_at'], now)}: {reason}"
        )
    return "; ".join(parts)


def structures_note(structures: dict[str, int] | None, *, limit: int = 6) -> str:
    """The largest structures of an actor, ``name=entries`` (``Actor.structure_sizes``); byte counts are
    left to ``--json`` and the gauge, they would crowd the entries out."""
    if not structures:
        return ""
    sized = sorted(
        ((n, v) for n, v in structures.items() if not n.endswith("_bytes")), key=lambda nv: (-nv[1], nv[0])
    )
    shown = " ".join(f"{name}={size}" for name, size in sized[:limit])
    return shown + (f" (+{len(sized) - limit})" if len(sized) > limit else "")


def table(rows: list[dict[str, Any]], *, now: float | None = None) -> str:
    now = time.time() if now is None else now
    header = (
        f"{'ROLE':<10} {'REPLICA':>7} {'PHASE':<10} {'CHECKPOINT':<34} {'LEASE':>7} {'IN-FLIGHT':>9} "
        f"{'HEARTBEAT':>10} {'PID':>7}  NOTE"
    )
    lines = [header]
    for row in rows:
        lease = row.get("lease_expires_at")
        lease_text = f"{lease - now:.1f}s" if lease else "-"
        in_flight = row.get("in_flight")
        if row["reachable"]:
            parts = (snapshot_note(row.get("snapshots"), now), structures_note(row.get("structures")))
            note = "; ".join(p for p in parts if p)
        else:
            note = f"no reply: {row.get('error', '')}"
        lines.append(
            f"{row['role']:<10} {row['replica']:>7} {row.get('phase') or '?':<10} "
            f"{row.get('checkpoint_id') or '-':<34} {lease_text:>7} "
            f"{'-' if in_flight is None else in_flight:>9} {_ago(row.get('heard_at'), now):>10} "
            f"{row.get('pid') or '-':>7}  {note}".rstrip()
        )
    return "\n".join(lines)
