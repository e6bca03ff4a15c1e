"""``parkway snapshots list|show|verify``: what is on disk under the snapshot root, read-only.

    parkway snapshots list   [--run R] [--root DIR] [--config FILE] [--json]
    parkway snapshots show   NAME_OR_CHECKPOINT_ID [...]
    parkway snapshots verify [NAME_OR_CHECKPOINT_ID ...] [...]

The root is ``--root``, else ``$PARKWAY_STATE_DIR/snapshots`` (where ``parkway run`` and the actors
write); the run is ``--run``, then ``$PARKWAY_RUN``, then the ``run:`` of ``--config``, then
``default``, as for ``parkway run``. Exit codes: 0 fine, 1 a snapshot does not verify (``verify``), 2 a
usage error (no such run or snapshot, a configuration that does not load).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from parkway.actors.runtime.settings import RunSettings, SettingsError
from parkway.actors.storage.checks import Problem, check_snapshot
from parkway.actors.storage.inventory import RunInventory, SnapshotInfo, inventory
from parkway.protocol.layout import SNAPSHOTS_DIR, writer_of


class UsageError(Exception):
    """The command cannot run as asked; the message says why (exit 2)."""


def register(sub: Any) -> None:
    """Add ``snapshots`` and its three actions to the ``parkway`` parser's subcommands."""
    parser = sub.add_parser("snapshots", help="list, show and verify the snapshots on disk")
    actions = parser.add_subparsers(required=True, metavar="ACTION")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--run", help="run name (default: $PARKWAY_RUN, else the config's run:, else 'default')"
        )
        p.add_argument(
            "--root", help="snapshot root (default: $PARKWAY_STATE_DIR/snapshots, i.e. .parkway/snapshots)"
        )
        p.add_argument(
            "--config",
            help="the run's configuration: judge which snapshot a restore picks by it (default: assume the "
            "configuration of the newest snapshot that verifies)",
        )
        p.add_argument("--json", action="store_true", help="print one JSON object")

    p = actions.add_parser("list", help="every snapshot of a run, and the one a restore would start from")
    common(p)
    p.set_defaults(func=cmd_list)

    p = actions.add_parser("show", help="one snapshot's manifest, summarized")
    p.add_argument(
        "snapshot", metavar="NAME_OR_CHECKPOINT_ID", help="snapshot_<seq>, <seq> or a checkpoint id"
    )
    common(p)
    p.set_defaults(func=cmd_show)

    p = actions.add_parser("verify", help="re-check every digest; one line per problem")
    p.add_argument("snapshots", nargs="*", metavar="NAME_OR_CHECKPOINT_ID", help="default: every snapshot")
    common(p)
    p.set_defaults(func=cmd_verify)


# -- shared -------------------------------------------------------------------------------------------


def _load(args: argparse.Namespace) -> RunInventory:
    fingerprint = source = None
    config_run = None
    if args.config:
        from parkway.actors.roles.controller.fingerprints import config_fingerprint
        from parkway.actors.run.config import ConfigError
        from parkway.actors.run.config import load as load_config

        try:
            config = load_config(args.config)
        except ConfigError as exc:
            raise UsageError(f"config: {exc}") from None
        config_run = config.run
    run = args.run or os.environ.get("PARKWAY_RUN") or config_run
    try:
        settings = RunSettings.from_env(run=run, allow_ephemeral_secret=True)
    except SettingsError as exc:
        raise UsageError(str(exc)) from None
    if args.config:  # as the controller computes it: of the configuration as loaded
        fingerprint, source = config_fingerprint(config), f"--config {args.config}"
    root = Path(args.root) if args.root else settings.state_root / SNAPSHOTS_DIR
    run_dir = root / settings.run
    if not run_dir.is_dir():
        runs = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        where = f"runs there: {', '.join(runs)}" if runs else "it holds no runs"
        if not root.is_dir():
            where = "it does not exist"
        raise UsageError(f"no snapshots of run {settings.run!r} under {root} ({where})")
    return inventory(run_dir, config_fingerprint=fingerprint, config_source=source or "")


def _pick(found: RunInventory, key: str) -> SnapshotInfo:
    snapshot = found.find(key)
    if snapshot is None:
        names = ", ".join(s.name for s in found.snapshots) or "none"
        raise UsageError(f"no snapshot {key!r} in run {found.run!r} (snapshots: {names})")
    return snapshot


def run_command(func: Any, args: argparse.Namespace) -> int:
    try:
        return int(func(args))
    except UsageError as exc:
        print(f"parkway: snapshots: {exc}", file=sys.stderr)
        return 2


def human_size(size: int) -> str:
    if size < 1024:
        return f"{size} B"
    value = float(size)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def human_age(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


def _when(stamp: float, now: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(stamp)) + f" ({human_age(now - stamp)} ago)"


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, sort_keys=True, default=str))


# -- list ---------------------------------------------------------------------------------------------


def cmd_list(args: argparse.Namespace) -> int:
    return run_command(_list, args)


def _list(args: argparse.Namespace) -> int:
    found, now = _load(args), time.time()
    if args.json:
        _print_json(found.to_json(now))
        return 0
    print(list_table(found, now))
    return 0


def list_table(found: RunInventory, now: float) -> str:
    count = len(found.snapshots)
    lines = [f"run {found.run!r} in {found.run_dir}: {count} snapshot{'s' if count != 1 else ''}"]
    rows = [("", "SNAPSHOT", "CHECKPOINT", "TRAINER STEP", "ROLLOUTS", "SIZE", "AGE", "NOTE")]
    for s in found.snapshots:
        rows.append(
            (
                "*" if s.restore else "",
                s.name,
                s.checkpoint_id or "?",
                _text(s.trainer_step),
                _text(s.rollouts_saved),
                human_size(s.size_bytes),
                human_age(now - s.created_at),
                s.skip_reason or "",
            )
        )
    if count:
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        right = {3, 4, 5, 6}
        for row in rows:
            cells = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(row)]
            lines.append("  ".join(cells).rstrip())
    lines.append(f"restore: {found.restore_detail}" + (" (*)" if found.selected else ""))
    if found.config_source:
        lines.append(f"configuration: {found.config_source}")
    if found.trainer_steps:
        lines.append(f"trainer checkpoints: steps {', '.join(map(str, found.trainer_steps))}")
    if found.temporary:
        lines.append(f"unpublished (temporary) directories: {', '.join(found.temporary)}")
    return "\n".join(lines)


def _text(value: Any) -> str:
    return "?" if value is None else str(value)


# -- show ---------------------------------------------------------------------------------------------


def cmd_show(args: argparse.Namespace) -> int:
    return run_command(_show, args)


def summary(
    snapshot: SnapshotInfo, found: RunInventory, problems: list[Problem], now: float
) -> dict[str, Any]:
    participants: dict[str, list[dict[str, Any]]] = {}
    for entry in snapshot.listed_files():
        participants.setdefault(writer_of(entry["path"]), []).append(
            {k: entry.get(k) for k in ("path", "records", "size", "sha256")}
        )
    return {
        **snapshot.to_json(now),
        "run": snapshot.field("run"),
        "schema": snapshot.field("schema"),
        "topology_fingerprint": snapshot.field("topology_fingerprint"),
        "replicas": snapshot.field("replicas"),
        "episodes": snapshot.field("episodes"),
        "restart_only": snapshot.field("restarts"),
        "participants": dict(sorted(participants.items())),
        "problems": [p.to_json() for p in problems],
        "verifies": not problems,
        "restore_detail": found.restore_detail,
    }


def _show(args: argparse.Namespace) -> int:
    found, now = _load(args), time.time()
    snapshot = _pick(found, args.snapshot)
    problems = check_snapshot(snapshot.path)
    data = summary(snapshot, found, problems, now)
    if args.json:
        _print_json(data)
        return 0
    print(show_text(data, now))
    return 0


def show_text(data: dict[str, Any], now: float) -> str:
    def episodes(pairs: Any) -> str:
        if not isinstance(pairs, list):
            return "?"
        return ", ".join(f"{r}@{a}" for r, a in pairs) if pairs else "-"

    trainer = (
        f"step {data['trainer_step']}, policy version {data['policy_version']}"
        if data["trainer_step"] is not None
        else "?"
    )
    if data["restore"]:
        restore = "a restore starts from this snapshot"
    elif data["skip_reason"]:
        restore = f"a restore passes over it: {data['skip_reason']}"
    else:
        restore = data["restore_detail"]
    verifies = "yes" if data["verifies"] else f"no, {len(data['problems'])} problem(s):"
    rows = [
        ("snapshot", f"{data['name']} ({data['path']})"),
        ("checkpoint id", _text(data["checkpoint_id"])),
        ("run", _text(data["run"])),
        ("created", _when(data["created_at"], now)),
        ("trainer anchor", trainer),
        ("config fingerprint", _text(data["config_fingerprint"])),
        ("topology fingerprint", _text(data["topology_fingerprint"])),
        ("replicas", _replicas(data.get("replicas"))),
        ("size", f"{human_size(data['size_bytes'])} in {data['files']} files"),
        ("restore", restore),
        ("verifies", verifies),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines += [f"  {p['message']}" for p in data["problems"]]
    saved = data["episodes"]
    lines.append("")
    lines.append(f"episodes saved ({len(saved) if isinstance(saved, list) else '?'}): {episodes(saved)}")
    restarts = data["restart_only"]
    lines.append(
        f"restart-only ({len(restarts) if isinstance(restarts, list) else '?'}): {episodes(restarts)}"
    )
    lines.append("")
    table = [("PARTICIPANT", "FILE", "RECORDS", "SIZE")]
    for who, files in data["participants"].items():
        for f in files:
            size = human_size(f["size"]) if isinstance(f["size"], int) else "?"
            table.append((who, f["path"], _text(f["records"]), size))
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    for row in table:
        lines.append(
            "  ".join(
                c.rjust(widths[i]) if i >= 2 else c.ljust(widths[i]) for i, c in enumerate(row)
            ).rstrip()
        )
    return "\n".join(lines)


# -- verify -------------------------------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    return run_command(_verify, args)


def _verify(args: argparse.Namespace) -> int:
    found = _load(args)
    chosen = [_pick(found, key) for key in args.snapshots] if args.snapshots else found.snapshots
    results = [(s, check_snapshot(s.path)) for s in chosen]
    bad = sum(1 for _, problems in results if problems)
    if args.json:
        _print_json(
            {
                "run": found.run,
                "run_dir": str(found.run_dir),
                "ok": bad == 0,
                "snapshots": [
                    {
                        "name": s.name,
                        "checkpoint_id": s.checkpoint_id,
                        "ok": not problems,
                        "problems": [p.to_json() for p in problems],
                    }
                    for s, problems in results
                ],
            }
        )
        return 1 if bad else 0
    if not results:
        print(f"run {found.run!r} in {found.run_dir}: no snapshots")
        return 0
    for s, problems in results:
        if not problems:
            print(
                f"{s.name}: ok ({s.files - 1} files and the manifest, {human_size(s.size_bytes)}, every digest matches)"
            )
        for p in problems:
            print(p.message)
    print(f"{len(results) - bad} of {len(results)} snapshot(s) verify" + (f"; {bad} do not" if bad else ""))
    return 1 if bad else 0


def _replicas(replicas: object) -> str:
    """``agent=2 policy=1 resources=2 tq=1``; an older manifest records none."""
    if not isinstance(replicas, dict) or not replicas:
        return "not recorded (an older snapshot: restores onto its own topology only)"
    return " ".join(f"{role}={count}" for role, count in sorted(replicas.items()))
