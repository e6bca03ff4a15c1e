"""A long run through the same actor processes: memory and per-snapshot cost over 100,000 rollouts.

    python bench/soak.py [--rollouts 100000] [--in-flight 256] [--turns 1] [--snapshot-every 3]
                         [--sample-every 5] [--warmup 0.1] [--trace-allocations] [--quick] [--name soak]

Every actor is its own ``parkway actor`` process over the local RabbitMQ (2 agents, 2 tool servers,
the policy, TQ), the controller and the inline trainer in this process, as ``parkway run --broker``
runs them. The engine is the deterministic one with no delay per token and instant tools, rollouts
of 1 to ``--turns`` turns, so that throughput is as high as this machine allows; the controller
takes a snapshot every ``--snapshot-every`` seconds on its own schedule. Every ``--sample-every``
seconds the benchmark reads the resident memory (RSS, from ``/proc``) of every process (this one is "controller"),
each actor's ``MemoryReport`` (its ``structures``: entries per per-rollout structure, and its ``heap``:
C heap in use and freed-but-kept, Python's blocks) and the controller's own, with this process's
pymalloc arenas. Every published snapshot's step durations come from the
controller's own records (as ``bench/snapshot_pause.py`` reads them).

Reported: RSS after warm-up (the first ``--warmup`` fraction of the rollouts), at the middle and at
the end, per process, and its growth per 100,000 rollouts (a least-squares line through the samples
after warm-up); the medians of the commit and resume steps over the first and the last tenth of the
snapshots, and their ratio; the load average. Then the criteria of the long-run work, one pass/fail
line each: growth under 5 MB per 100,000 rollouts per process, and the last tenth's commit and resume
medians at most 10% above the first tenth's. ``--trace-allocations`` starts tracemalloc in every process
once warm-up is over and reports, at the end, the lines still holding what was allocated since (for
finding what grows; tracing slows the run). Writes ``bench/results/NAME.json`` and ``.png`` (RSS and
step times against rollouts sealed). Not a test: the criteria are printed, nothing raises.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parent))  # bench/ is scripts, not a package

import argparse
import asyncio
import json
import math
import os
import shutil
import statistics
import tempfile
import time
import tracemalloc
import uuid
from typing import Any, TypeVar

import cluster
import common
import msgspec
from parkway.actors.runtime.memory import heap_usage, top_allocations
from parkway.protocol.inspection import MemoryReport, MemoryUsage

CONTROLLER = "controller"  # this process: the controller, the inline trainer, the benchmark's sampler
GROWTH_LIMIT_MB = 5.0  # per 100,000 rollouts per process
STEP_LIMIT = 1.10  # the last tenth's median over the first tenth's
STEPS = ("commit", "resume")
T = TypeVar("T")


def workload(args: argparse.Namespace) -> dict[str, Any]:
    prompts = math.ceil(args.rollouts / args.group_size)
    return {
        "run": f"soak{uuid.uuid4().hex[:6]}",
        "seed": 5,
        "rollout": {"group_size": args.group_size, "max_in_flight": args.in_flight},
        "tasks": {"path": str(cluster.tasks_file(prompts, turns=(1, args.turns)))},
        "policy": {"host": "inline", "per_token_delay_s": 0.0},
        "resources": {"tool_delay_s": 0.0},
        "trainer": {"batch_groups": 1},
        "snapshot_interval_s": args.snapshot_every,
    }


async def ask(c: cluster.Cluster, address: str, request: Any, answer: type[T]) -> T | None:
    """An actor's answer of type ``answer``, or None when it does not answer in time (a busy or
    restarting actor: that sample goes without it)."""
    try:
        reply = await asyncio.wait_for(c.controller.client.request(address, request), 15)
    except Exception:
        return None
    return reply if isinstance(reply, answer) else None


def rss_mb(pid: int) -> float | None:
    """A process's resident memory in MB, from ``/proc`` (Linux; None once it has gone)."""
    try:
        for line in _Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 2)
    except OSError:
        return None
    return None


def cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) a process has used so far: where the machine's time went."""
    try:
        fields = _Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)


def structures_of(thing: object) -> dict[str, int] | None:
    """``structure_sizes()`` of an in-process actor, where the code has them (else None)."""
    sizes = getattr(thing, "structure_sizes", None)
    return dict(sizes()) if callable(sizes) else None


def python_arenas() -> dict[str, int]:
    """This process's pymalloc arenas (1 MiB each, freed only when wholly empty) and the bytes of the
    blocks in them, parsed from ``sys._debugmallocstats`` (it writes to file descriptor 2, redirected
    for the moment: the benchmark's own process only, never an actor's)."""
    held = os.dup(2)
    with tempfile.TemporaryFile() as out:
        os.dup2(out.fileno(), 2)
        try:
            _sys._debugmallocstats()
        finally:
            os.dup2(held, 2)
            os.close(held)
        out.seek(0)
        text = out.read().decode(errors="replace")
    found: dict[str, int] = {}
    for line in text.splitlines():
        for key, name in (
            ("# arenas allocated current", "arenas"),
            ("# bytes in allocated blocks", "block_bytes"),
        ):
            if line.startswith(key):
                found[name] = int(line.split("=")[1].replace(",", "").strip())
    return found


async def sample(c: cluster.Cluster, began: float) -> dict[str, Any]:
    pids = {p.name: p.pid for p in c.processes} | {CONTROLLER: os.getpid()}
    reports = await asyncio.gather(*(memory_report(c, p.name, top=0) for p in c.processes))
    structures = {
        p.name: (dict(r.structures) if r else None) for p, r in zip(c.processes, reports, strict=True)
    }
    structures[CONTROLLER] = structures_of(c.controller)
    heaps = {
        p.name: (msgspec.to_builtins(r.heap) if r and r.heap else None)
        for p, r in zip(c.processes, reports, strict=True)
    }
    heaps[CONTROLLER] = msgspec.to_builtins(heap_usage()) | python_arenas()
    return {
        "t_s": round(time.monotonic() - began, 1),
        "rollouts": c.controller.counts["rollouts_sealed"],
        "load_1m": round(os.getloadavg()[0], 2),
        "rss_mb": {name: rss_mb(pid) for name, pid in pids.items()},
        "cpu_s": {name: cpu_s(pid) for name, pid in pids.items()},
        "structures": structures,
        "heap": heaps,
    }


async def memory_report(c: cluster.Cluster, address: str, **asked: Any) -> MemoryUsage | None:
    """An actor's ``MemoryReport``, or None."""
    request = MemoryReport(
        checkpoint_id=f"soak-mem-{time.monotonic_ns()}", deadline=time.time() + 10, **asked
    )
    return await ask(c, address, request, MemoryUsage)


async def start_tracing(c: cluster.Cluster) -> None:
    """tracemalloc on in every process from now: what it sees at the end is what was allocated after
    warm-up and is still held, by line (slower allocation: a run that traces is for finding, not timing)."""
    await asyncio.gather(*(memory_report(c, p.name, start=True) for p in c.processes))
    if not tracemalloc.is_tracing():
        tracemalloc.start(1)


async def traced_allocations(c: cluster.Cluster, top: int) -> dict[str, list[dict[str, Any]]]:
    """Every process's top ``top`` allocation sites still held, traced since warm-up."""
    reports = await asyncio.gather(*(memory_report(c, p.name, top=top) for p in c.processes))
    found = {
        p.name: [msgspec.to_builtins(a) for a in r.top] if r else []
        for p, r in zip(c.processes, reports, strict=True)
    }
    found[CONTROLLER] = [msgspec.to_builtins(a) for a in top_allocations(top)]
    return found


def new_records(c: cluster.Cluster, seen: int) -> tuple[list[dict[str, Any]], int]:
    """Snapshot records published since ``seen`` were (by the controller's count, which goes on if
    the records themselves are ever bounded)."""
    snapshots = c.controller.snapshots
    if snapshots is None:
        return [], seen
    published = snapshots.metrics.published
    fresh = min(published - seen, len(snapshots.metrics.records))
    records = list(snapshots.metrics.records)[-fresh:] if fresh > 0 else []
    return [dict(r) for r in records], published


class Spool:
    """Samples written to a file as they are taken and read back at the end: the benchmark's own
    records stay out of the process it measures (the controller's), where 400 snapshot records and
    300 samples of every actor's structures were about 2 MB of its growth."""

    def __init__(self, path: _Path) -> None:
        self.path = path
        self.count = 0
        self.last: dict[str, Any] | None = None

    def append(self, item: dict[str, Any]) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps(item) + "\n")
        self.count += 1
        self.last = item

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line]


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    spool = _Path(tempfile.mkdtemp(prefix="parkway-soak-"))
    samples, snapshots = Spool(spool / "samples.jsonl"), Spool(spool / "snapshots.jsonl")
    async with cluster.started(workload(args), "rabbitmq", actor_log_level=args.actor_log_level) as c:
        began = time.monotonic()
        run = asyncio.ensure_future(c.run())
        seen, next_sample, last_line = 0, 0.0, 0.0
        tracing = False
        while not run.done() and (args.max_seconds is None or time.monotonic() - began < args.max_seconds):
            await asyncio.wait({run}, timeout=0.5)
            fresh, seen = new_records(c, seen)
            for record in fresh:
                record["t_s"] = round(time.monotonic() - began, 1)
                record["rollouts_sealed"] = c.controller.counts["rollouts_sealed"]
                snapshots.append(record)
            now = time.monotonic() - began
            sealed = c.controller.counts["rollouts_sealed"]
            if args.trace_allocations and not tracing and sealed >= args.warmup * args.rollouts:
                await start_tracing(c)
                tracing = True
            if now >= next_sample and not run.done():
                samples.append(await sample(c, began))
                next_sample = now + args.sample_every
            if now - last_line >= 60:
                last_line = now
                print(
                    f"  {now:6.0f} s: {sealed} rollouts sealed ({sealed / max(now, 1e-9):.1f}/s), "
                    f"{snapshots.count} snapshots, load {os.getloadavg()[0]:.2f}",
                    file=_sys.stderr,
                )
        fresh, seen = new_records(c, seen)
        for record in fresh:
            snapshots.append(record | {"t_s": round(time.monotonic() - began, 1)})
        samples.append(await sample(c, began))  # the end: the actors still up
        allocations = await traced_allocations(c, 15) if tracing else None
        seconds = time.monotonic() - began
        stopped = not run.done()  # --max-seconds ran out first: what was sealed by then is the run
        if stopped:
            await cluster.cancel(run)
            summary = None
        else:
            summary = run.result()
        failed = c.controller.snapshots.metrics.failed if c.controller.snapshots else 0
    assert samples.last is not None
    sealed = samples.last["rollouts"]
    result = {
        "seconds": round(seconds, 1),
        "rollouts_sealed": sealed,
        "rollouts_per_s": round(sealed / seconds, 2),
        "stopped_at_max_seconds": stopped,
        "summary": msgspec.to_builtins(summary) if summary is not None else None,
        "snapshots_failed": failed,
        "samples": samples.read(),
        "snapshots": snapshots.read(),
        "allocations_since_warmup": allocations,
    }
    shutil.rmtree(spool, ignore_errors=True)
    return result


# -- what the samples say ----------------------------------------------------------------------------


def nearest(samples: list[dict[str, Any]], rollouts: float) -> dict[str, Any]:
    return min(samples, key=lambda s: abs(s["rollouts"] - rollouts))


def growth_per_100k(points: list[tuple[float, float]]) -> float | None:
    """MB per 100,000 rollouts: the slope of a least-squares line through (rollouts, MB)."""
    if len(points) < 3 or len({x for x, _ in points}) < 2:
        return None
    slope, _ = statistics.linear_regression([x for x, _ in points], [y for _, y in points])
    return round(slope * 100_000, 2)


def memory_rows(result: dict[str, Any], warmup: float) -> list[dict[str, Any]]:
    samples = [s for s in result["samples"] if s["rollouts"] > 0]
    total = result["rollouts_sealed"]
    after = [s for s in samples if s["rollouts"] >= warmup * total]
    if not after:
        return []
    first, middle, last = after[0], nearest(after, (after[0]["rollouts"] + total) / 2), after[-1]
    rows = []
    for name in samples[-1]["rss_mb"]:
        points = [(s["rollouts"], s["rss_mb"][name]) for s in after if s["rss_mb"].get(name) is not None]
        structures = {}
        for key in sorted(set().union(*((s["structures"].get(name) or {}) for s in after))):
            values = [(s["structures"].get(name) or {}).get(key) for s in after]
            known = [v for v in values if v is not None]
            structures[key] = {"after_warmup": known[0], "end": known[-1], "max": max(known)}
        rows.append(
            {
                "process": name,
                "rss_mb": {
                    k: s["rss_mb"].get(name)
                    for k, s in (("after_warmup", first), ("middle", middle), ("end", last))
                },
                "growth_mb_per_100k": growth_per_100k(points),
                "structures": structures,
            }
        )
    return rows


HEAP_FIGURES = {  # a heap sample's key -> (what it is, divisor to MB)
    "c_in_use_bytes": ("C heap in use", 1e6),
    "c_free_bytes": ("C heap freed, kept", 1e6),
    "arenas": ("pymalloc arenas", 1 / 1.048576),
    "block_bytes": ("pymalloc blocks", 1e6),
}


def heap_rows(result: dict[str, Any], warmup: float) -> list[dict[str, Any]]:
    """Per process, the growth per 100,000 rollouts of each allocator figure: which allocator the RSS
    growth is in (runs recorded before the samples carried ``heap`` give none)."""
    total = result["rollouts_sealed"]
    after = [s for s in result["samples"] if s["rollouts"] >= warmup * total and s.get("heap")]
    if not after:
        return []
    rows = []
    for name in after[-1]["heap"]:
        row: dict[str, Any] = {"process": name}
        for key, (_, divisor) in HEAP_FIGURES.items():
            points = [
                (s["rollouts"], (s["heap"].get(name) or {})[key] / divisor)
                for s in after
                if key in (s["heap"].get(name) or {})
            ]
            row[key] = growth_per_100k(points)
        rows.append(row)
    return rows


def median_of(records: list[dict[str, Any]], step: str) -> float | None:
    values = [r["steps_ms"][step] for r in records if step in r.get("steps_ms", {})]
    return round(statistics.median(values), 3) if values else None


def step_rows(snapshots: list[dict[str, Any]]) -> list[dict[str, Any]]:
    tenth = max(1, len(snapshots) // 10)
    head, tail = snapshots[:tenth], snapshots[-tenth:]
    rows = []
    for step in (*STEPS, "pause"):
        if step == "pause":
            first = statistics.median(r["pause_ms"] for r in head) if head else None
            last = statistics.median(r["pause_ms"] for r in tail) if tail else None
        else:
            first, last = median_of(head, step), median_of(tail, step)
        ratio = round(last / first, 3) if first and last is not None else None
        rows.append(
            {"step": step, "first_tenth_ms": first, "last_tenth_ms": last, "ratio": ratio, "per_tenth": tenth}
        )
    return rows


def criteria(memory: list[dict[str, Any]], steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    checks = []
    for row in memory:
        growth = row["growth_mb_per_100k"]
        checks.append(
            {
                "check": f"{row['process']}: RSS growth < {GROWTH_LIMIT_MB:g} MB per 100,000 rollouts",
                "value": growth,
                "passed": growth is not None and growth < GROWTH_LIMIT_MB,
            }
        )
    for row in steps:
        if row["step"] in STEPS:
            checks.append(
                {
                    "check": f"{row['step']}: last tenth's median <= {STEP_LIMIT:.2f} x the first tenth's",
                    "value": row["ratio"],
                    "passed": row["ratio"] is not None and row["ratio"] <= STEP_LIMIT,
                }
            )
    return checks


def tables(memory: list[dict[str, Any]], steps: list[dict[str, Any]], checks: list[dict[str, Any]]) -> str:
    def mb(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    grown = [
        [
            r["process"],
            " / ".join(mb(r["rss_mb"][k]) for k in ("after_warmup", "middle", "end")),
            mb(r["growth_mb_per_100k"]),
            ", ".join(
                f"{k} {v['after_warmup']}->{v['end']}"
                for k, v in r["structures"].items()
                if v["end"] > v["after_warmup"]  # what ended larger (the JSON has every one)
            )
            or "-",
        ]
        for r in memory
    ]
    timed = [
        [
            s["step"],
            mb(s["first_tenth_ms"]),
            mb(s["last_tenth_ms"]),
            "-" if s["ratio"] is None else f"{s['ratio']:.3f}",
        ]
        for s in steps
    ]
    lines = [
        common.markdown_table(
            ["process", "RSS after warm-up / middle / end (MB)", "MB per 100k rollouts", "structures"],
            grown,
            "lrrl",
        ),
        "",
        common.markdown_table(["step", "first tenth p50 (ms)", "last tenth p50 (ms)", "ratio"], timed),
        "",
    ]
    lines += [f"{'PASS' if c['passed'] else 'FAIL'}  {c['check']}: {c['value']}" for c in checks]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: _Path, title: str) -> None:
    plt = common.pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 8), sharex=True)
    samples = result["samples"]
    for name in samples[-1]["rss_mb"]:
        points = [(s["rollouts"], s["rss_mb"][name]) for s in samples if s["rss_mb"].get(name) is not None]
        top.plot([x for x, _ in points], [y for _, y in points], "-", lw=1.2, label=name)
    top.set_ylabel("RSS (MB)")
    top.set_title("Resident memory of every process")
    top.grid(True, alpha=0.3)
    top.legend(fontsize=7, ncol=4, loc="upper left")
    snaps = [s for s in result["snapshots"] if "rollouts_sealed" in s]
    for step, style in (("commit", "tab:red"), ("resume", "tab:blue")):
        xs = [s["rollouts_sealed"] for s in snaps if step in s["steps_ms"]]
        ys = [s["steps_ms"][step] for s in snaps if step in s["steps_ms"]]
        bottom.plot(xs, ys, ".", ms=2.5, color=style, alpha=0.5, label=f"{step} (each snapshot)")
        window = max(1, len(ys) // 50)
        rolling = [statistics.median(ys[max(0, i - window) : i + window + 1]) for i in range(len(ys))]
        bottom.plot(xs, rolling, "-", color=style, lw=1.5, label=f"{step}, running median")
    bottom.set_xlabel("rollouts sealed")
    bottom.set_ylabel("step duration (ms)")
    bottom.set_yscale("log")
    bottom.set_title("Snapshot steps over the run (the controller's own measurements)")
    bottom.grid(True, alpha=0.3)
    bottom.legend(fontsize=7, loc="upper left")
    common.save_figure(fig, path, title)


def conclude(result: dict[str, Any], warmup: float) -> dict[str, Any]:
    """The figures and the criteria from a run's samples and snapshot records."""
    memory = memory_rows(result, warmup)
    # The snapshots taken while rollouts ran: once the last one is sealed the run drains, and the
    # snapshots of an idle cluster would flatter the last tenth.
    total = result["rollouts_sealed"]
    running = [r for r in result["snapshots"] if r.get("rollouts_sealed", total) < total]
    steps = step_rows(running or result["snapshots"])
    loads = [s["load_1m"] for s in result["samples"]]
    load = {"p50": statistics.median(loads), "max": max(loads)} if loads else {}
    return {
        "memory": memory,
        "heap": heap_rows(result, warmup),
        "steps": steps,
        "criteria": criteria(memory, steps),
        "load_1m": load,
    }


def report(result: dict[str, Any], figures: dict[str, Any]) -> str:
    load = figures["load_1m"]
    traced = ""
    for name, sites in sorted((result.get("allocations_since_warmup") or {}).items()):
        traced += f"\nheld at the end, allocated after warm-up ({name}, top {min(len(sites), 8)} lines):\n"
        traced += "".join(
            f"  {a['size_bytes'] / 1024:9.1f} KiB {a['count']:7d} blocks  {a['file']}:{a['line']}\n"
            for a in sites[:8]
        )
    heap = ""
    if figures.get("heap"):
        heap = "\nallocator growth after warm-up, MB per 100,000 rollouts (blank: not measured in that process):\n"
        heap += f"  {'process':<14}" + "".join(f"{label:>20}" for label, _ in HEAP_FIGURES.values()) + "\n"
        for row in figures["heap"]:
            heap += (
                f"  {row['process']:<14}"
                + "".join(
                    f"{'' if row[key] is None else format(row[key], '.2f'):>20}" for key in HEAP_FIGURES
                )
                + "\n"
            )
    return (
        f"{result['rollouts_sealed']} rollouts in {result['seconds']:.0f} s ({result['rollouts_per_s']}/s), "
        f"{len(result['snapshots'])} snapshots ({result['snapshots_failed']} failed), "
        f"load average (1 min) p50 {load.get('p50')} max {load.get('max')}\n"
        + tables(figures["memory"], figures["steps"], figures["criteria"])
        + heap
        + traced
    )


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--rollouts", type=int, default=100_000, help="rollouts in the run")
    parser.add_argument("--in-flight", type=int, default=256, help="rollouts dispatched at once")
    parser.add_argument("--turns", type=int, default=1, help="rollouts have 1 to this many turns")
    parser.add_argument("--group-size", type=int, default=16, help="siblings per prompt")
    parser.add_argument("--snapshot-every", type=float, default=3.0, help="seconds between snapshots")
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS samples")
    parser.add_argument("--warmup", type=float, default=0.1, help="fraction of the rollouts before the fit")
    parser.add_argument(
        "--max-seconds", type=float, help="stop the run after this long, whatever is sealed by then"
    )
    parser.add_argument("--actor-log-level", default="warning")
    parser.add_argument(
        "--trace-allocations",
        action="store_true",
        help="tracemalloc in every process from warm-up on; report the lines still holding memory at the end",
    )
    parser.add_argument("--report", type=_Path, help="print the tables of a results JSON again; run nothing")
    common.add_quick(parser, "3,000 rollouts, a sample every 2 s")
    common.add_name(parser, "soak")
    args = parser.parse_args()
    if args.report is not None:
        recorded = json.loads(args.report.read_text())
        print(report(recorded, conclude(recorded, recorded["settings"]["warmup"])))
        return
    if args.quick:
        args.rollouts, args.sample_every = 3000, 2.0
    began = common.machine()
    result = asyncio.run(measure(args))
    figures = conclude(result, args.warmup)
    print(report(result, figures))
    common.write_record(args.name, "soak", began, args, figures, exclude=("name", "report"), **result)
    plot(
        result,
        common.figure_path(args.name),
        f"{result['rollouts_sealed']} rollouts, {args.in_flight} in flight, 1-{args.turns} turns, a snapshot "
        f"every {args.snapshot_every:g} s, {common.machine_line(began)}",
    )


if __name__ == "__main__":
    main()
