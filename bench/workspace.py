"""The workspace environment's cost at a boundary, and what a command in flight does to a snapshot.

    python bench/workspace.py [--parts boundaries cut cluster] [--files 250 1000] [--size-mb 50]
                              [--changed-kb 1 64 1024] [--turns 10] [--rounds 3] [--command-s 30]
                              [--token-delay 0.01] [--quick]

Boundaries: a template of ``--files`` files holding ``--size-mb`` MB in all (the file count scaled with
it, so 250 files hold a quarter of the bytes) is seeded into a workspace; each turn rewrites one file
with ``--changed-kb`` KB and records the boundary (``Workspace.record``: walk, hash what changed, store
new blobs). Per boundary: bytes written to the blob store, bytes read (hashed), and the time; medians
over ``--turns`` turns and ``--rounds`` rounds, the variants interleaved in each round.

Cut: the tool server's part of a snapshot (``Resources.write_snapshot``, what a commit records of every
session) with one workspace idle and with one whose ``run`` of ``sleep --command-s`` is in flight, in
one process (no broker, no agents); the ratio of the two.

Cluster: the whole snapshot's pause (admission closed, every participant prepared and committed,
resumed: the controller's own record, as ``bench/snapshot_pause.py`` reports it) of an embedded cluster
(every actor in this process, the in-memory broker, the default topology) running one rollout of
``CommandAgent``: a file written, ``run`` of its command, one more model call. ``in_flight``: the command
is ``sleep --command-s``, snapshotted once its process runs, and it must still be the same process after
the snapshot resumed (then it is killed: the rest of it measures nothing). ``none``: the command is
``true``, snapshotted in the model call after it. The two interleaved, ``--rounds`` rounds; medians and
the ratio. A command in flight is not waited for (the attempt parked at the boundary before it, its
session's state was recorded when it started), so the ratios stay near 1 instead of the command's length.

``--parts`` measures fewer; the parts not measured keep an earlier run's figures in
``bench/results/workspace.json`` (``measured`` says when and at what load each part was taken).
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parent))  # bench/ is scripts, not a package

import argparse
import asyncio
import json
import os
import signal
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import cluster
import common
from parkway.actors.sdk import chat
from parkway.actors.sdk.rollout import AgentProgram, RolloutContext

PARTS = ("boundaries", "cut", "cluster")


def make_template(root: Path, files: int, total_bytes: int) -> None:
    size = total_bytes // files
    for i in range(files):
        path = root / f"pkg{i % 20}" / f"mod{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))


def boundaries(home: Path, template: Path, changed: int, turns: int) -> dict[str, float]:
    from parkway.actors.builtin.workspace.environment import Workspace

    class Bench(Workspace):
        name = "bench"

    Bench.template = str(template)
    env = Bench(0)
    env.locate(home)
    env.bind(f"r-{time.monotonic_ns()}", 0)
    env.reset()
    env.record()
    store = env.store
    assert store is not None
    written, hashed, seconds = [], [], []
    for turn in range(turns):
        time.sleep(0.11)  # past the racy window, as turns seconds apart are
        env.apply(
            "write_file",
            {"path": f"pkg{turn % 20}/mod{turn}.py", "content": f"{turn:08d}".ljust(changed, "x")},
        )
        before = store.bytes_written
        started = time.perf_counter()
        env.record()
        seconds.append(time.perf_counter() - started)
        written.append(store.bytes_written - before)
        hashed.append(env.last_scan.bytes_hashed)
    env.close()
    return {
        "bytes_written": statistics.median(written),
        "bytes_hashed": statistics.median(hashed),
        "ms": statistics.median(seconds) * 1000,
    }


async def cut_ms(home: Path, command_s: float, in_flight: bool) -> float:
    from parkway.actors.builtin.workspace.environment import Workspace
    from parkway.actors.roles.resources import Resources
    from parkway.brokers.memory import MemoryBroker, MemoryHub
    from parkway.protocol.messages import Commit, EpisodeRef

    async with MemoryBroker(MemoryHub(), "bench") as broker:
        actor = Resources(broker, secret=b"bench-secret-bench-secret-bench!", snapshot_root=home)
        actor.environments = {"workspace": Workspace}
        from parkway.protocol.messages import ToolCall

        def call(index: int, tool: str, arguments: dict[str, Any]) -> ToolCall:
            return ToolCall(
                rollout_id="r1", attempt=0, call_index=index, env="workspace", tool=tool, arguments=arguments
            )

        await actor.on_tool_call(call(0, "write_file", {"path": "a", "content": "a" * 1000}))
        task = None
        if in_flight:
            task = asyncio.ensure_future(
                actor.on_tool_call(call(1, "run", {"command": f"sleep {command_s}"}))
            )
            for _ in range(1000):  # until the command has started
                if actor.sessions["r1"].running:
                    break
                await asyncio.sleep(0.01)
        directory = home / "bench" / f"tmp_ck-{time.monotonic_ns()}" / "participants" / "resources" / "0"
        directory.mkdir(parents=True)
        commit = Commit(
            checkpoint_id="ck-1",
            deadline=time.time() + 600,
            location="tmp_ck-1",
            episodes=(EpisodeRef(rollout_id="r1", attempt=0, replica=0),),
        )
        started = time.perf_counter()
        await actor.write_snapshot(directory, commit)
        elapsed = time.perf_counter() - started
        if task is not None:
            task.cancel()
        return elapsed * 1000


# -- the whole cluster's pause -----------------------------------------------------------------------


class CommandAgent(AgentProgram):
    """The cluster pause's rollout: a file written, then ``run`` of its task's prompt as the command,
    then one more model call (the moment the variant without a command is snapshotted at)."""

    name = "bench-command"

    async def run(self, ctx: RolloutContext) -> float:
        messages = [chat.Message("system", chat.system_prompt(ctx.prompt, list(ctx.tools), ctx.max_turns))]
        for tool, arguments in (
            ("write_file", {"path": "notes.txt", "content": "x" * 1000}),
            ("run", {"command": ctx.prompt}),
        ):
            reply = await ctx.generate(messages)
            messages.append(chat.Message("assistant", reply.text))
            outcome = await ctx.call_tool(tool, arguments)
            messages.append(chat.Message("tool", json.dumps(outcome.output, sort_keys=True)))
            await ctx.end_tool_round()
        await ctx.generate(messages)
        return await ctx.verify()


def cluster_config(tasks: Path, token_delay: float) -> dict[str, Any]:
    return {
        "run": f"wspause{uuid.uuid4().hex[:6]}",
        "seed": 7,
        # This module as the run imports it (``__main__`` as a script, ``workspace`` from the tests).
        "agent": f"{CommandAgent.__module__}:{CommandAgent.__name__}",
        "environments": ["parkway.actors.builtin.workspace.environment:Workspace"],
        "rollout": {"group_size": 1, "max_turns": 4},
        "tasks": {"path": str(tasks)},
        "policy": {"host": "inline", "per_token_delay_s": token_delay},
        "snapshot_interval_s": 3600.0,  # the benchmark takes them, on its own clock
    }


def commands_running(state: Path) -> dict[int, bytes]:
    """pid -> command line of every ``sleep`` whose working directory is in ``state`` (a workspace's
    command: ``/bin/sh -c`` and ``unshare`` exec it, so the pid stays and its argv changes until then)."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            cwd = os.readlink(proc / "cwd")
        except OSError:
            continue
        if cwd.startswith(str(state)) and os.path.basename(cmdline.split(b"\0")[0]) == b"sleep":
            found[int(proc.name)] = cmdline
    return found


async def until(
    check: Callable[[], Awaitable[bool]], run: asyncio.Future[Any], what: str, *, done_ok: bool = False
) -> None:
    """Poll ``check`` until true; the workload ending first is an error unless ``done_ok``."""
    deadline = time.monotonic() + 120
    while not await check():
        if run.done():
            run.result()
            if done_ok:
                return
            raise RuntimeError(f"the workload ended before {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"not {what} within 120 s")
        await asyncio.sleep(0.01)


async def cluster_pause(command: str, in_flight: bool, token_delay: float, scratch: Path) -> dict[str, Any]:
    """One snapshot of an embedded cluster (every actor in this process, the in-memory broker) whose one
    rollout runs ``command``: taken while it runs (``in_flight``), or in the model call after it. The
    controller's record of it, with what was running before and after."""
    tasks = scratch / f"tasks-{uuid.uuid4().hex[:6]}.jsonl"
    tasks.write_text(json.dumps({"env": "workspace", "prompt": command}) + "\n")
    async with cluster.started(cluster_config(tasks, token_delay)) as c:
        run = asyncio.ensure_future(c.run())

        servers = [f"resources/{replica}" for replica in range(c.config.topology.resources)]

        async def command_started() -> bool:
            return bool(commands_running(c.state))

        async def in_the_next_model_call() -> bool:
            calls = sum([(await c.status(s)).counts.get("tool_calls", 0) for s in servers])
            return calls >= 2 and (await c.status("policy/0")).in_flight > 0

        async def no_call_in_flight() -> bool:
            return not any([(await c.status(s)).in_flight for s in servers])

        try:
            if in_flight:
                await until(command_started, run, "the command started")
            else:  # its command answered, the rollout waits for its next model call
                await until(in_the_next_model_call, run, "the model call after the command")
            running = commands_running(c.state)
            assert c.controller.snapshots is not None
            records = c.controller.snapshots.metrics.records
            taken = len(records)
            if await c.controller.take_snapshot() is None or len(records) != taken + 1:
                raise RuntimeError("the snapshot was not published")
            record = dict(records[-1])
            after = commands_running(c.state)
            for pid in after:  # proven in flight through the snapshot: the rest of it is not measured
                os.kill(pid, signal.SIGKILL)
            # Its answer handled before the cluster stops: a session released under a running command
            # has its directory removed, and the command's end then fails to record it.
            await until(no_call_in_flight, run, "the killed command answered", done_ok=True)
        finally:
            await cluster.cancel(run)
        left = commands_running(c.state)
    return {
        **record,
        "command": command,
        "running_at_snapshot": len(running),
        # The same processes before the snapshot and after its resume: the command ran through it.
        "ran_through": bool(running) and all(after.get(pid) == line for pid, line in running.items()),
        "left_running": len(left),
    }


def cluster_pauses(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """The cluster's pause with no command in flight and with ``sleep --command-s`` in flight,
    interleaved, ``--rounds`` rounds."""
    runs: dict[str, list[dict[str, Any]]] = {"none": [], "in_flight": []}
    load = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for label, command in (("none", "true"), ("in_flight", f"sleep {args.command_s:g}")):
            point = asyncio.run(cluster_pause(command, label == "in_flight", args.token_delay, scratch))
            if point["rollouts"] != 1 or point["left_running"]:
                raise AssertionError(f"{label}: not one rollout saved, or a command left behind: {point}")
            if label == "in_flight" and not point["ran_through"]:
                raise AssertionError(f"the command was not in flight through the snapshot: {point}")
            if label == "none" and point["running_at_snapshot"]:
                raise AssertionError(f"a command ran at the snapshot without one: {point}")
            runs[label].append(point)
            load.append(os.getloadavg()[0])
    none, busy = (statistics.median(p["pause_ms"] for p in runs[k]) for k in ("none", "in_flight"))
    return {
        "none": none,
        "in_flight": busy,
        "ratio": busy / none,
        "park_wait_ms": {k: statistics.median(p["park_wait_ms"] for p in v) for k, v in runs.items()},
        "all": runs,
        "load": {"start": load[0], "max": max(load), "end": load[-1]},
    }


def boundary_part(args: argparse.Namespace, root: Path) -> tuple[list[dict[str, Any]], str]:
    """Per template and changed size: the medians per boundary, and their table."""
    runs: dict[tuple[int, int], list[dict[str, float]]] = {}
    templates = {}
    for files in args.files:
        templates[files] = root / f"template-{files}"
        make_template(templates[files], files, int(args.size_mb * (1 << 20) * files / max(args.files)))
    for _ in range(args.rounds):  # the variants interleaved, every round
        for files in args.files:
            for kb in args.changed_kb:
                home = root / "home" / str(files)
                runs.setdefault((files, kb), []).append(
                    boundaries(home, templates[files], kb << 10, args.turns)
                )
    rows, results = [], []
    for (files, kb), points in sorted(runs.items()):
        point = {k: statistics.median(p[k] for p in points) for k in points[0]}
        mb = args.size_mb * files / max(args.files)
        results.append({"files": files, "template_mb": mb, "changed_kb": kb, **point})
        rows.append(
            [
                files,
                f"{mb:.1f}",
                kb,
                int(point["bytes_written"]),
                int(point["bytes_hashed"]),
                f"{point['ms']:.2f}",
            ]
        )
    headers = ["files", "template MB", "changed KB", "bytes written", "bytes read", "ms / boundary"]
    return results, common.markdown_table(headers, rows)


def cut_part(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    pauses: dict[str, list[float]] = {"idle": [], "in_flight": []}
    for _ in range(args.rounds):
        for label in ("idle", "in_flight"):
            home = root / "pause" / label / str(time.monotonic_ns())
            pauses[label].append(asyncio.run(cut_ms(home, args.command_s, label == "in_flight")))
    idle, busy = statistics.median(pauses["idle"]), statistics.median(pauses["in_flight"])
    return {"idle": idle, "in_flight": busy, "ratio": busy / idle, "all": pauses}


KEYS = {"boundaries": "boundaries", "cut": "cut_ms", "cluster": "cluster_pause_ms"}


def merged(
    name: str, results: dict[str, Any], began: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    """The parts measured now beside those an earlier run of this name measured (``--parts`` ran fewer),
    with when, at what load and with which settings each part was taken (``measured``)."""
    path = common.RESULTS / f"{name}.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    old = {"when": previous.get("when"), "loadavg_1m_at_start": previous.get("loadavg_1m_at_start")}
    measured = {
        key: previous.get("measured", {}).get(key, {**old, "settings": previous.get("settings")})
        for key in previous.get("results", {})
    }
    now = {"when": began["when"], "loadavg_1m_at_start": began["loadavg_1m_at_start"]}
    measured.update({key: {**now, "settings": common.settings(args)} for key in results})
    return {"results": {**previous.get("results", {}), **results}, "measured": measured}


def main() -> None:
    parser = common.parser(__doc__)
    common.add_name(parser, "workspace")
    common.add_quick(parser, "one small template, 3 turns, 1 round, a 2 s command")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="what to measure")
    parser.add_argument("--files", type=int, nargs="+", default=[250, 1000])
    parser.add_argument("--size-mb", type=float, default=50.0)
    parser.add_argument("--changed-kb", type=int, nargs="+", default=[1, 64, 1024])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--command-s", type=float, default=30.0)
    parser.add_argument(
        "--token-delay", type=float, default=0.01, help="the cluster's engine, seconds per token"
    )
    args = parser.parse_args()
    if args.quick:
        args.files, args.size_mb, args.changed_kb, args.turns, args.rounds, args.command_s = (
            [100],
            1.0,
            [1, 64],
            3,
            1,
            2.0,
        )
    began = common.machine()
    results: dict[str, Any] = {}
    lines = [common.machine_line(began)]
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        if "boundaries" in args.parts:
            results["boundaries"], table = boundary_part(args, root)
            lines.append(table)
        if "cut" in args.parts:
            cut = results["cut_ms"] = cut_part(args, root)
            lines.append(
                f"tool server cut (Resources.write_snapshot, one process): idle {cut['idle']:.2f} ms, "
                f"a {args.command_s:g} s command in flight {cut['in_flight']:.2f} ms, ratio {cut['ratio']:.2f}"
            )
        if "cluster" in args.parts:
            pause = results["cluster_pause_ms"] = cluster_pauses(args, root)
            lines.append(cluster_lines(pause, args))
    print("\n\n".join(lines))
    record = merged(args.name, results, began, args)
    path = common.write_record(
        args.name, "workspace", began, args, record["results"], measured=record["measured"]
    )
    print(f"wrote {path}")


def cluster_lines(pause: dict[str, Any], args: argparse.Namespace) -> str:
    rounds = {k: ", ".join(f"{p['pause_ms']:.1f}" for p in v) for k, v in pause["all"].items()}
    wait, load = pause["park_wait_ms"], pause["load"]
    return (
        f"cluster pause (admission closed to resumed, the controller's record; one rollout): "
        f"no command in flight {pause['none']:.1f} ms, a {args.command_s:g} s command in flight "
        f"{pause['in_flight']:.1f} ms, ratio {pause['ratio']:.2f}\n"
        f"  per round (ms): none {rounds['none']}; in flight {rounds['in_flight']}\n"
        f"  prepare's wait for a boundary, median: none {wait['none']:.1f} ms, in flight {wait['in_flight']:.1f} ms\n"
        f"  the command ran through every in-flight snapshot (same pid before it and after its resume)\n"
        f"  load average (1 min): start {load['start']:.2f}, max {load['max']:.2f}, end {load['end']:.2f}"
    )


if __name__ == "__main__":
    main()
