"""The HTML page of a run: one self-contained file with the picture inline as SVG (each bar, band and
line carries its hover title), then the tables: snapshots, restores, crashes, totals, every rollout,
process starts, notable events and the log lines read.
"""

from __future__ import annotations

import html
import io
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from parkway.actors.tools.report.figure import Drawing, load_matplotlib
from parkway.actors.tools.report.layout import heading, row_order
from parkway.actors.tools.report.model import Timeline


def _svg(drawing: Drawing) -> str:
    matplotlib, _ = load_matplotlib()
    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "parkway"}):
        drawing.figure.savefig(buffer, format="svg")
    svg = buffer.getvalue()
    svg = svg[svg.index("<svg") :]  # inline: no XML declaration, no DOCTYPE
    svg = re.sub(r"<metadata>.*?</metadata>", "", svg, flags=re.S)

    def titled(match: re.Match[str]) -> str:
        text = drawing.titles.get(match.group(1))
        return match.group(0) + (f"<title>{html.escape(text)}</title>" if text else "")

    return re.sub(r'<g id="(pk\d+)">', titled, svg)


def _ms(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "-"


def _table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _snapshots(timeline: Timeline) -> str:
    t0 = timeline.start
    return _table(
        ["#", "checkpoint id", "snapshot", "at (s)", "pause (ms)", "outcome"],
        (
            (n, p.checkpoint_id, p.snapshot or "-", f"{p.start - t0:.3f}", _ms(p.ms), p.outcome)
            for n, p in enumerate(timeline.pauses, 1)
        ),
    )


def _restores(timeline: Timeline) -> str:
    t0 = timeline.start
    return _table(
        ["restore id", "snapshot", "saved checkpoint id", "at (s)", "took (ms)", "continued", "outcome"],
        (
            (
                r.checkpoint_id,
                r.snapshot,
                r.saved_checkpoint or "-",
                f"{r.start - t0:.3f}",
                _ms(((r.end or r.start) - r.start) * 1000),
                "-" if r.continued is None else r.continued,
                r.outcome,
            )
            for r in timeline.restores
        ),
    )


def _crashes(timeline: Timeline) -> str:
    t0 = timeline.start
    return _table(
        ["at (s)", "what", "how known"],
        (
            (
                f"{c.ts - t0:.3f}",
                c.detail,
                "inferred: the controller started again" if c.inferred else "run_aborted",
            )
            for c in timeline.crashes
        ),
    )


def _processes(timeline: Timeline) -> str:
    t0 = timeline.start
    return _table(
        ["at (s)", "actor", "pid", "restart"],
        ((f"{p.ts - t0:.3f}", p.actor, p.pid or "-", "yes" if p.restart else "") for p in timeline.processes),
    )


def _rollouts(timeline: Timeline) -> str:
    return _table(
        ["rollout", "group", "attempts", "turns", "kept", "sealed attempt", "outcomes"],
        (
            (
                r.rollout_id,
                r.group_id,
                len(r.attempts),
                r.turns,
                sum(a.kept_turns for a in r.attempts.values()),
                "-" if r.sealed_attempt is None else r.sealed_attempt,
                ", ".join(
                    f"{a.index}:{a.outcome}{'/' + a.code if a.code else ''}" for a in r.attempts.values()
                ),
            )
            for r in sorted(timeline.rollouts.values(), key=row_order)
        ),
    )


def _events(timeline: Timeline) -> str:
    t0 = timeline.start
    return _table(
        ["at (s)", "actor", "level", "event", "detail"],
        ((f"{e.ts - t0:.3f}", e.actor, e.level, e.event, e.detail) for e in timeline.events),
    )


def _totals(summary: dict[str, Any]) -> str:
    return _table(
        ["what", "value"],
        (
            (k, json.dumps(v) if isinstance(v, dict) else v)
            for k, v in summary.items()
            if k not in ("lines", "run")
        ),
    )


def render_html(timeline: Timeline, drawing: Drawing, path: Path, *, trace: str = "") -> Path:
    """One self-contained file: the picture as inline SVG (hover a bar for its times), then tables."""
    title, counts = heading(timeline)
    summary = timeline.summary()
    lines = _table(["lines", "count"], summary["lines"].items())
    hidden = (
        f"<p class=warn>{drawing.hidden_rows} of {len(timeline.rollouts)} rollouts are not drawn; "
        "the rollout table below lists every one.</p>"
        if drawing.hidden_rows
        else ""
    )
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>parkway report: {html.escape(timeline.run)}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }}
h1 {{ font-size: 1.4em; margin-bottom: 0.2em; }} h2 {{ font-size: 1.1em; margin-top: 1.6em; }}
.counts {{ color: #555; margin-top: 0; }} .warn {{ color: #a00; }}
.figure svg {{ width: 100%; height: auto; }} img {{ max-width: 100%; }}
table {{ border-collapse: collapse; font-size: 12px; }}
th, td {{ border: 1px solid #ddd; padding: 2px 6px; text-align: left; font-family: ui-monospace, monospace; }}
th {{ background: #f4f4f4; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<p class="counts">{html.escape(counts)}</p>
<p>One row per rollout, grouped by prompt group; bars are turns (from the model call to the next
boundary), coloured by attempt; grey bands are snapshot pauses (the controller's admission gate
closed); a red line is a crash, a green one the end of a restore. Hover a bar or a band for its times.</p>
{hidden}
<div class="figure">{_svg(drawing)}</div>
<h2>Snapshots ({len(timeline.pauses)} pauses)</h2>{_snapshots(timeline)}
{f"<h2>The longest snapshot's trace</h2>{trace}" if trace else ""}
<h2>Restores</h2>{_restores(timeline)}
<h2>Crashes</h2>{_crashes(timeline)}
<h2>Summary</h2>{_totals(summary)}
<details><summary>Rollouts ({len(timeline.rollouts)})</summary>{_rollouts(timeline)}</details>
<details><summary>Process starts ({len(timeline.processes)})</summary>{_processes(timeline)}</details>
<details><summary>Notable events ({len(timeline.events)})</summary>{_events(timeline)}</details>
<details><summary>Log lines read</summary>{lines}</details>
</body></html>
"""
    path.write_text(page, encoding="utf-8")
    return path
