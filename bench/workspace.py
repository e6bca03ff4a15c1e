"""The workspace environment's cost at a boundary, and what a command in flight does to a snapshot.

    python bench/workspace.py [--files 250 1000] [--size-mb 50] [--changed-kb 1 64 1024]
                              [--turns 10] [--rounds 3] [--command-s 30] [--quick]

Boundaries: a template of ``--files`` files holding ``--size-mb`` MB in all (the file count scaled with
it, so 250 files hold a quarter of the bytes) is seeded into a workspace; each turn rewrites one file
with ``--changed-kb`` KB and records the boundary (``Workspace.record``: walk, hash what changed, store
new blobs). Per boundary: bytes written to the blob store, bytes read (hashed), and the time; medians
over ``--turns`` turns and ``--rounds`` rounds, the variants interleaved in each round.

Pause: the tool server's cut (``Resources.write_snapshot``, what a commit records of every session)
with one workspace idle and with one whose ``run`` of ``sleep --command-s`` is in flight; the ratio of
the two. A command in flight is not waited for (its session's state was recorded when it started), so
the ratio stays near 1 instead of the command's length. This measures the tool server's part of the
pause only, in one process (no broker, no agents). Writes ``bench/results/workspace.json``.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parent))  # bench/ is scripts, not a package

import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import common


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


def main() -> None:
    parser = common.parser(__doc__)
    common.add_name(parser, "workspace")
    common.add_quick(parser, "one small template, 3 turns, 1 round, a 3 s command")
    parser.add_argument("--files", type=int, nargs="+", default=[250, 1000])
    parser.add_argument("--size-mb", type=float, default=50.0)
    parser.add_argument("--changed-kb", type=int, nargs="+", default=[1, 64, 1024])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--command-s", type=float, default=30.0)
    args = parser.parse_args()
    if args.quick:
        args.files, args.size_mb, args.changed_kb, args.turns, args.rounds, args.command_s = (
            [100],
            1.0,
            [1, 64],
            3,
            1,
            3.0,
        )
    began = common.machine()
    runs: dict[tuple[int, int], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
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
        pauses: dict[str, list[float]] = {"idle": [], "in_flight": []}
        for _ in range(args.rounds):
            for label in ("idle", "in_flight"):
                home = root / "pause" / label / str(time.monotonic_ns())
                pauses[label].append(asyncio.run(cut_ms(home, args.command_s, label == "in_flight")))
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
    idle, busy = statistics.median(pauses["idle"]), statistics.median(pauses["in_flight"])
    print(common.machine_line(began))
    print(
        common.markdown_table(
            ["files", "template MB", "changed KB", "bytes written", "bytes read", "ms / boundary"], rows
        )
    )
    print(
        f"\ntool server cut: idle {idle:.2f} ms, a {args.command_s:g} s command in flight {busy:.2f} ms, "
        f"ratio {busy / idle:.2f}"
    )
    path = common.write_record(
        args.name,
        "workspace",
        began,
        args,
        {
            "boundaries": results,
            "cut_ms": {"idle": idle, "in_flight": busy, "ratio": busy / idle, "all": pauses},
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
