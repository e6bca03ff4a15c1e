"""Where the agents' round trip of a snapshot (its ``prepare`` step, and its ``prepared`` step where the
save sequence has one) spends its time, hop by hop, from a trace file.

Run a benchmark with tracing to a file, then read it:

    OTEL_TRACES_EXPORTER=file PARKWAY_TRACE_FILE=/tmp/spans.jsonl \\
        python bench/snapshot_pause.py --variants n16-rate256 n1024-rate256 --rounds 1 --name traced
    python bench/prepare_hops.py /tmp/spans.jsonl

For each agent's ``Prepare`` in each snapshot, the round trip in five parts (ms):

- ``out``: from the step's start to the command's publish (the controller making and signing it);
- ``queued``: from that publish to the agent's handler starting (the broker, the agent's loop);
- ``handled``: the agent's handler;
- ``after``: from the handler's end to the reply's publish (reply cache, counters, the signature);
- ``back``: from the reply's publish to the controller having opened it (the broker, its loop);

and ``rest``: from the last reply opened to the step's end. Snapshots more than 30 s apart are
different benchmark points (each point is a cluster of its own); each point's medians are printed.
``--each`` prints every snapshot instead, with what the slowest agent finished (its spans of any
trace: turns, model and tool calls) while its ``Prepare`` was queued: the data work its event loop
ran ahead of the command.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PARTS = ("out", "queued", "handled", "after", "back", "rest", "step")
POINT_GAP_S = 30.0


@dataclass(frozen=True)
class Slowest:
    """One snapshot's prepare step: its start, the parts of the agent whose reply came last, that
    agent, and when its ``Prepare`` was queued (from the controller's publish to its handler)."""

    at: float
    parts: dict[str, float]
    agent: str
    queued_from: float
    queued_to: float


def hops(records: list[dict[str, Any]]) -> list[tuple[float, dict[str, float]]]:
    """(the step's start, the slowest agent's parts) for every snapshot's prepare step in ``records``."""
    return [(s.at, s.parts) for s in slowest(records)]


def slowest(records: list[dict[str, Any]]) -> list[Slowest]:
    """Every snapshot's prepare step in ``records``, with its slowest agent, in time order."""
    by_trace: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        if record.get("event") == "span":
            by_trace[record["trace_id"]].append(record)
    found = []
    for spans in by_trace.values():
        steps = [s for s in spans if s["name"] == "prepare" and s["actor"].startswith("controller")]
        if len(steps) != 1:
            continue
        [step] = steps
        # Since the window ends at the cut's instant, the answers are collected in a step of their own
        # (``prepared``): the round trip runs from one's start to the other's end.
        answers = [s for s in spans if s["name"] == "prepared" and s["actor"].startswith("controller")]
        t0, t1 = step["start"], (answers[0] if len(answers) == 1 else step)["end"]
        inside = [s for s in spans if t0 <= s["start"] <= t1]
        per_agent = []
        last_back = t0
        for back in (s for s in inside if s["name"].startswith("reply Prepared from agent/")):
            agent = back["attrs"]["parkway.replier"]
            mine = [s for s in inside if s["attrs"].get("parkway.actor") == agent]
            queued = [s for s in mine if s["attrs"].get("parkway.phase") == "queued"]
            handled = [s for s in mine if s["attrs"].get("parkway.phase") == "handled"]
            if len(queued) != 1 or len(handled) != 1:
                continue
            q, h = queued[0], handled[0]
            last_back = max(last_back, back["end"])
            per_agent.append(
                {
                    "out": q["start"] - t0,
                    "queued": q["end"] - q["start"],
                    "handled": h["end"] - h["start"],
                    "after": back["start"] - h["end"],
                    "back": back["end"] - back["start"],
                    "end": back["end"],
                    "agent": agent,
                    "queued_from": q["start"],
                    "queued_to": q["end"],
                }
            )
        if not per_agent:
            continue
        last = max(per_agent, key=lambda p: p["end"])
        parts = {k: last[k] for k in PARTS[:5]}
        parts["rest"] = t1 - last_back
        parts["step"] = t1 - t0
        found.append(Slowest(t0, parts, last["agent"], last["queued_from"], last["queued_to"]))
    return sorted(found, key=lambda f: f.at)


def work_while_queued(records: list[dict[str, Any]], step: Slowest) -> Counter[str]:
    """What the slowest agent finished while its ``Prepare`` was queued: its spans (any trace) that
    ended in that interval, by kind (``turn``, ``tool call``, ``model call``...): the work its loop
    ran ahead of the command."""
    done: Counter[str] = Counter()
    for record in records:
        if record.get("event") != "span" or record["attrs"].get("parkway.actor") != step.agent:
            continue
        if "Prepare" in record["name"] or not step.queued_from <= record["end"] <= step.queued_to:
            continue
        done[" ".join(w for w in record["name"].split() if not any(c.isdigit() for c in w))] += 1
    return done


def points(found: list[tuple[float, dict[str, float]]]) -> list[list[dict[str, float]]]:
    groups: list[list[dict[str, float]]] = []
    last = None
    for at, parts in found:
        if last is None or at - last > POINT_GAP_S:
            groups.append([])
        groups[-1].append(parts)
        last = at
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="span files (PARKWAY_TRACE_FILE)")
    parser.add_argument(
        "--each",
        action="store_true",
        help="every snapshot on a line of its own, with what the slowest agent finished while its "
        "Prepare was queued",
    )
    args = parser.parse_args()
    records = [json.loads(line) for f in args.files for line in f.read_text().splitlines() if line.strip()]
    if args.each:
        for step in slowest(records):
            parts = "  ".join(f"{p} {1000 * step.parts[p]:.1f}" for p in PARTS)
            work = ", ".join(f"{n} {kind}" for kind, n in work_while_queued(records, step).most_common())
            print(f"{step.agent}  {parts}  (ms); finished while queued: {work or 'nothing'}")
        return
    groups = points(hops(records))
    if not groups:
        raise SystemExit("no prepare step with its agents' spans in these files (was tracing on?)")
    print("point  snapshots  " + "  ".join(f"{p:>7}" for p in PARTS) + "   (ms, medians; the slowest agent)")
    for i, group in enumerate(groups):
        medians = [1000 * statistics.median(g[p] for g in group) for p in PARTS]
        print(f"{i:>5}  {len(group):>9}  " + "  ".join(f"{m:7.1f}" for m in medians))


if __name__ == "__main__":
    main()
