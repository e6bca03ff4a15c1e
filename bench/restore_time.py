"""Restore time: from process start to the first resumed generation, against rollouts saved.

    python bench/restore_time.py [--rollouts 16 64 256 1024] [--modes embedded rabbitmq] [--repeat 2]

For each size: a run with that many rollouts in flight is stopped dead right after its first snapshot
(every rollout saved mid-way, a few turns in). Then, per repeat, a copy of that state is restarted from
nothing: new processes (``embedded``: one, the whole cluster in it; ``rabbitmq``: every actor its own
process plus the controller's), timed from the moment they are spawned to the first model call a
restored rollout makes (its saved turns replayed, the next one generated live). The restarted
controller reports when it got there: Python and parkway imported, every actor answering, the newest
snapshot selected and verified (every digest read back), participants restored and resumed, the first
restored rollout's model call, and every restored rollout's ("all resumed"; the restarted engine is
slow, so each makes exactly one call in that time). Writes ``bench/results/restore_time.json`` and ``.png``. Not a test: nothing here asserts
on time.
"""

from __future__ import annotations

import time

T_PROCESS = time.time()  # this process's start, before the imports it pays for

import sys as _sys  # noqa: E402
from pathlib import Path as _Path  # noqa: E402

_sys.path.insert(0, str(_Path(__file__).resolve().parent))  # bench/ is scripts, not a package

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from typing import Any  # noqa: E402

import common  # noqa: E402 - the standard library only: cheap before the timed imports

PHASES = (
    "imported",
    "cluster_ready",
    "restore_started",
    "selected",
    "restored",
    "first_generation",
    "all_resumed",
)


def workload(rollouts: int, *, delay: float) -> dict[str, Any]:
    tasks = 12
    return {
        "run": f"restore{rollouts}",
        "seed": 9,
        "rollout": {"group_size": math.ceil(rollouts / tasks), "max_turns": 12, "max_in_flight": rollouts},
        "tasks": {"builtin": "mixed", "limit": tasks},
        "policy": {"host": "inline", "per_token_delay_s": delay},
        "snapshot_interval_s": 3.0,
    }


# -- the parent --------------------------------------------------------------------------------------


async def make_snapshot(rollouts: int, state: _Path) -> dict[str, Any]:
    """A run stopped dead right after its first snapshot: that snapshot and nothing after it."""
    import cluster
    from parkway.actors.roles.controller.controller import SimulatedCrash

    data = workload(rollouts, delay=0.01)
    async with cluster.started(data, state=state) as c:
        try:
            await c.run(stop_after_snapshots=1)
        except SimulatedCrash:
            pass
        else:
            raise RuntimeError("the run finished before its first snapshot")
    [snapshot] = (state / "snapshots" / data["run"]).glob("snapshot_*")
    manifest = json.loads((snapshot / "manifest.json").read_text())
    size = sum(p.stat().st_size for p in snapshot.rglob("*") if p.is_file())
    return {"rollouts_saved": len(manifest["episodes"]), "bytes": size}


def restart(mode: str, rollouts: int, state: _Path) -> dict[str, Any]:
    """Spawn the restarted cluster at t0 and read the controller's timeline (seconds after t0)."""
    import cluster

    # Tuning only (the snapshot's fingerprint is the same): slow generations, so each restored rollout
    # makes exactly one model call in the time measured, and "all resumed" can be counted.
    data = workload(rollouts, delay=0.05)
    if mode == "rabbitmq":  # nothing left on the broker from the restart before
        from parkway.actors.run.config import from_dict

        asyncio.run(cluster.delete_run(from_dict(data)))
    t0 = time.time()
    actors = cluster.spawn_actors(data, state, "warning") if mode == "rabbitmq" else []
    try:
        child = subprocess.run(
            [_sys.executable, __file__, "--child", mode, str(state), json.dumps(data)],
            capture_output=True,
            text=True,
            timeout=300,
            env=os.environ.copy(),
        )
    finally:
        cluster.stop_processes(actors, kill=True)
    if child.returncode != 0:
        raise RuntimeError(f"the restarted controller failed:\n{child.stderr[-3000:]}")
    marks = json.loads(child.stdout.strip().splitlines()[-1])
    return {phase: round(marks[phase] - t0, 4) for phase in PHASES} | {
        "restored_rollouts": marks["continued"]
    }


# -- the child: the restarted controller (and, embedded, the whole cluster) ---------------------------


def child(mode: str, state: str, data_text: str) -> None:
    import cluster
    from parkway.actors.roles.controller import controller as controller_module
    from parkway.actors.roles.controller import restore, snapshots
    from parkway.actors.roles.policy import Policy
    from parkway.protocol.messages import Status, StatusReport

    marks: dict[str, float] = {"imported": time.time(), "process": T_PROCESS}
    first, everyone = asyncio.Event(), asyncio.Event()
    restored = asyncio.Event()
    resumed: set[str] = set()

    wait_for_cluster = controller_module.Controller.wait_for_cluster

    async def timed_wait(self: Any, *args: Any, **kwargs: Any) -> None:
        await wait_for_cluster(self, *args, **kwargs)
        marks["cluster_ready"] = time.time()

    restore_if_any = snapshots.SnapshotCoordinator.restore_if_any

    async def timed_restore(self: Any) -> bool:
        marks["restore_started"] = time.time()
        done = await restore_if_any(self)
        marks["restored"] = time.time()
        marks["continued"] = self.metrics.rollouts_restored
        restored.set()
        all_resumed()
        return done

    select_snapshot = restore.select_snapshot

    def timed_select(*args: Any, **kwargs: Any) -> Any:
        found = select_snapshot(*args, **kwargs)
        marks["selected"] = time.time()
        return found

    on_generate = Policy.on_generate

    async def first_generation(self: Any, call: Any) -> Any:
        if call.attempt > 0 and call.rollout_id not in resumed:
            resumed.add(call.rollout_id)
            if not first.is_set():
                marks["first_generation"] = time.time()
                first.set()
            all_resumed()
        return await on_generate(self, call)

    def all_resumed() -> None:
        if restored.is_set() and len(resumed) >= marks["continued"] and not everyone.is_set():
            marks["all_resumed"] = time.time()
            everyone.set()

    controller_module.Controller.wait_for_cluster = timed_wait  # type: ignore[method-assign]
    snapshots.SnapshotCoordinator.restore_if_any = timed_restore  # type: ignore[method-assign]
    restore.select_snapshot = timed_select
    Policy.on_generate = first_generation  # type: ignore[method-assign]

    async def watch_policy(c: cluster.Cluster) -> None:
        """Over RabbitMQ the policy is another process: the model calls it is generating (each restored
        rollout makes one, and it lasts seconds)."""
        await restored.wait()
        while not everyone.is_set():
            reply = await c.controller.client.request(
                "policy/0", Status(checkpoint_id=f"watch-{time.monotonic_ns()}", deadline=time.time() + 5)
            )
            generating = reply.in_flight if isinstance(reply, StatusReport) else 0
            if generating > 0 and not first.is_set():
                marks["first_generation"] = time.time()
                first.set()
            if generating >= marks["continued"]:
                marks["all_resumed"] = time.time()
                everyone.set()
            await asyncio.sleep(0.002)

    async def go() -> None:
        async with cluster.started(json.loads(data_text), mode, state=_Path(state), spawn=False) as c:
            run = asyncio.ensure_future(c.run())
            watcher = asyncio.ensure_future(watch_policy(c)) if mode == "rabbitmq" else None
            waiting = {run, asyncio.ensure_future(everyone.wait())} | ({watcher} if watcher else set())
            done, _ = await asyncio.wait(waiting, timeout=240, return_when="FIRST_COMPLETED")
            for task in done & {run, watcher}:
                task.result()  # a failure, not a finish: raise it
            if not everyone.is_set():
                raise TimeoutError("not every restored rollout generated within 240 s")
            print(json.dumps(marks), flush=True)
            os._exit(0)  # the measurement is over: no graceful stop of a thousand rollouts

    asyncio.run(go())


# -- results -----------------------------------------------------------------------------------------


def table(rows: list[dict[str, Any]]) -> str:
    """Seconds from the spawn, the median of the repeats."""
    headers = [
        "mode",
        "saved",
        "MB",
        "imported",
        "cluster",
        "selected",
        "restored",
        "first gen",
        "all resumed",
    ]
    body = []
    for r in rows:
        m = r["median_s"]
        body.append(
            [r["mode"], r["rollouts_saved"], f"{r['bytes'] / 1e6:.2f}"]
            + [f"{m[k]:.2f}" for k in ("imported", "cluster_ready", "selected", "restored")]
            + [f"{m['first_generation']:.2f}", f"{m['all_resumed']:.2f}"]
        )
    return common.markdown_table(headers, body) + "\n(seconds from the processes' spawn, median of repeats)"


def plot(rows: list[dict[str, Any]], path: _Path, title: str) -> None:
    plt = common.pyplot()
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.6), squeeze=False)
    segments = (
        ("start-up: imports", None, "imported"),
        ("every actor answering", "imported", "cluster_ready"),
        ("setup checks; select + verify snapshot", "cluster_ready", "selected"),
        ("restore participants, resume", "selected", "restored"),
        ("to the first generation", "restored", "first_generation"),
        ("to every restored rollout generating", "first_generation", "all_resumed"),
    )
    for ax, mode in zip(axes[0], modes, strict=True):
        mine = [r for r in rows if r["mode"] == mode]
        labels = [str(r["rollouts_saved"]) for r in mine]
        bottom = [0.0] * len(mine)
        for name, start, end in segments:
            values = [max(0.0, r["median_s"][end] - (r["median_s"][start] if start else 0.0)) for r in mine]
            ax.bar(labels, values, bottom=bottom, label=name)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        for x, r in enumerate(mine):
            ax.annotate(
                f"first {r['median_s']['first_generation']:.2f} s, all {r['median_s']['all_resumed']:.2f} s",
                (x, bottom[x]),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_xlabel("rollouts saved in the snapshot")
        ax.set_ylabel("seconds from the processes' spawn")
        ax.set_title(f"{mode}: restart to the resumed rollouts' first generations")
        ax.legend(fontsize=7, loc="upper left")
        ax.set_ylim(top=max(bottom) * 1.25)
        ax.grid(True, axis="y", alpha=0.3)
    common.save_figure(fig, path, title)


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--rollouts", type=int, nargs="+", default=[16, 64, 256, 1024])
    common.add_modes(parser)
    parser.add_argument("--repeat", type=int, default=2)
    common.add_quick(parser, "16 and 256 rollouts, once each")
    common.add_name(parser, "restore_time")
    parser.add_argument("--child", nargs=3, metavar=("MODE", "STATE", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    if args.quick:
        args.rollouts, args.repeat = [16, 256], 1
    began = common.machine()
    rows = []
    for n in args.rollouts:
        source = _Path(tempfile.mkdtemp(prefix=f"parkway-bench-restore{n}-"))
        made = asyncio.run(make_snapshot(n, source))
        for mode in args.modes:
            repeats = []
            for _ in range(args.repeat):
                state = _Path(tempfile.mkdtemp(prefix="parkway-bench-restart-")) / "state"
                shutil.copytree(source, state)
                repeats.append(restart(mode, n, state))
                shutil.rmtree(state.parent, ignore_errors=True)
            median = {phase: round(statistics.median(r[phase] for r in repeats), 3) for phase in PHASES}
            rows.append({"mode": mode, "rollouts": n, **made, "median_s": median, "repeats": repeats})
            print(f"  {mode} {n}: first generation {median['first_generation']} s", file=_sys.stderr)
        shutil.rmtree(source, ignore_errors=True)
    print(table(rows))
    common.write_record(args.name, "restore_time", began, args, rows, exclude=("name", "child"))
    plot(rows, common.figure_path(args.name), common.machine_line(began))


if __name__ == "__main__":
    main()
