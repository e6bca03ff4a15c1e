"""A snapshot's trace as a waterfall: its spans as a tree, the critical path through it, and the text
``parkway trace`` prints (``parkway report`` draws the same rows into its HTML).

The input is span records as the ``parkway`` and ``file`` exporters write them
(``runtime/tracing_sdk.span_record``): one JSON object per finished span, with hex ids, Unix-second
times and the span's attributes. A command's ``queued <Type>`` span and its handling span, siblings
under the sender's span, are drawn as one row: queued, then handled.
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parkway.protocol.tracecontext import checkpoint_trace_id, trace_id_hex

BAR_WIDTH = 40


@dataclass
class Span:
    span_id: str
    parent: str | None
    name: str
    actor: str
    start: float
    end: float
    attrs: dict[str, Any]
    queued_s: float = 0.0  # the ``queued`` sibling folded into this handling span
    children: list[Span] = field(default_factory=list)
    critical: bool = False

    @property
    def duration(self) -> float:
        return max(0.0, self.end - self.start)


@dataclass(frozen=True)
class Row:
    """One line of the waterfall."""

    depth: int
    name: str
    actor: str
    at_s: float  # from the trace's start to the row's start (its queued time's start, if it has one)
    queued_s: float
    handled_s: float
    critical: bool
    phase: str = ""  # the span's ``parkway.phase``: handled, reply (a command's way back), or none


@dataclass(frozen=True)
class Waterfall:
    trace_id: str
    checkpoint_id: str
    rows: tuple[Row, ...]
    total_s: float
    spans: int
    actors: tuple[str, ...]

    @property
    def critical_path(self) -> tuple[Row, ...]:
        return tuple(row for row in self.rows if row.critical)


def spans_of(records: Iterable[dict[str, Any]], trace_id: str) -> list[dict[str, Any]]:
    """The span records of one trace, each span once (a record read twice is the same span)."""
    seen: dict[str, dict[str, Any]] = {}
    for record in records:
        if record.get("event") == "span" and record.get("trace_id") == trace_id:
            span_id = record.get("span_id")
            if isinstance(span_id, str):
                seen.setdefault(span_id, record)
    return list(seen.values())


def build(records: Iterable[dict[str, Any]], checkpoint_id: str) -> Waterfall | None:
    """The waterfall of the snapshot (or restore) ``checkpoint_id``, or None when no span of its trace is
    among ``records``."""
    trace_id = trace_id_hex(checkpoint_trace_id(checkpoint_id))
    found = spans_of(records, trace_id)
    if not found:
        return None
    spans = {r["span_id"]: _span(r) for r in found}
    roots: list[Span] = []
    for span in spans.values():
        parent = spans.get(span.parent) if span.parent else None
        (parent.children if parent is not None else roots).append(span)
    for span in spans.values():
        _fold_queued(span)
    roots = _folded(roots)
    roots.sort(key=lambda s: s.start)
    start = min(s.start - s.queued_s for s in roots)
    end = max(s.end for s in spans.values())
    for root in roots:
        _mark_critical(root)
    rows: list[Row] = []
    for root in roots:
        _rows(root, 0, start, rows)
    actors = tuple(sorted({s.actor for s in spans.values() if s.actor}))
    return Waterfall(trace_id, checkpoint_id, tuple(rows), end - start, len(spans), actors)


def _span(record: dict[str, Any]) -> Span:
    attrs = record.get("attrs") if isinstance(record.get("attrs"), dict) else {}
    return Span(
        span_id=record["span_id"],
        parent=record.get("parent_span_id"),
        name=str(record.get("name", "")),
        actor=str(record.get("actor", "")),
        start=float(record.get("start", 0.0)),
        end=float(record.get("end", 0.0)),
        attrs=attrs or {},
    )


def _fold_queued(span: Span) -> None:
    """Fold each ``queued X`` child into the handling ``X`` child of the same actor and message."""
    span.children = _folded(span.children)


def _folded(spans: list[Span]) -> list[Span]:
    queued = [s for s in spans if s.attrs.get("parkway.phase") == "queued"]
    rest = [s for s in spans if s.attrs.get("parkway.phase") != "queued"]
    for wait in queued:
        match = next(
            (
                s
                for s in rest
                if s.attrs.get("parkway.phase") == "handled"
                and s.actor == wait.actor
                and s.attrs.get("parkway.message_type") == wait.attrs.get("parkway.message_type")
                and s.queued_s == 0.0
                and abs(s.start - wait.end) < 0.05
            ),
            None,
        )
        if match is not None:
            match.queued_s = wait.duration
        else:
            rest.append(wait)  # its handling span is missing (the process died): show the wait alone
    return rest


def _mark_critical(span: Span) -> None:
    """The critical path: this span, then, from its last-ending child back to its start, each child that
    ended last before the one after it on the path began (with its own critical path)."""
    span.critical = True
    children = sorted(span.children, key=lambda s: s.end)
    limit = float("inf")
    while children:
        candidates = [c for c in children if c.end <= limit + 1e-6]
        if not candidates:
            break
        last = candidates[-1]
        _mark_critical(last)
        limit = last.start - last.queued_s
        children = [c for c in candidates[:-1] if c.end <= limit + 1e-6]


def _rows(span: Span, depth: int, start: float, out: list[Row]) -> None:
    out.append(
        Row(
            depth=depth,
            name=span.name,
            actor=span.actor,
            at_s=span.start - span.queued_s - start,
            queued_s=span.queued_s,
            handled_s=span.duration,
            critical=span.critical,
            phase=str(span.attrs.get("parkway.phase", "")),
        )
    )
    for child in sorted(span.children, key=lambda s: (s.start - s.queued_s, s.actor)):
        _rows(child, depth + 1, start, out)


def _bar(row: Row, total_s: float) -> str:
    scale = BAR_WIDTH / total_s if total_s > 0 else 0.0
    first = min(BAR_WIDTH - 1, int(row.at_s * scale))
    queued = round(row.queued_s * scale)
    handled = max(1, round(row.handled_s * scale))
    cells = " " * first + "." * queued + "#" * handled
    return "|" + cells[:BAR_WIDTH].ljust(BAR_WIDTH) + "|"


def render(waterfall: Waterfall, *, critical_only: bool = False) -> str:
    """The waterfall as text: a heading, the critical path in one line, then one row per span (``*``
    marks the critical path; ``.`` is queued time, ``#`` handling time)."""
    ms = 1000.0
    lines = [
        f"trace {waterfall.trace_id}  checkpoint {waterfall.checkpoint_id}: "
        f"{waterfall.total_s * ms:.1f} ms, {waterfall.spans} spans, {len(waterfall.actors)} actors "
        f"({', '.join(waterfall.actors)})",
    ]
    steps = [r for r in waterfall.critical_path if r.depth == 1]
    worst = [r for r in waterfall.critical_path if r.depth == 2]
    if steps:
        lines.append(
            "critical path: " + " > ".join(f"{r.name} {r.handled_s * ms:.1f}" for r in steps) + " (ms)"
        )
    for row in worst:
        if row.phase == "reply":
            lines.append(
                f"  on its way back: {row.name}: {row.handled_s * ms:.1f} ms from its publish to "
                f"{row.actor} opening it"
            )
            continue
        lines.append(
            f"  slowest in its step: {row.name} at {row.actor}: queued {row.queued_s * ms:.1f} ms, "
            f"handled {row.handled_s * ms:.1f} ms"
        )
    lines.append("")
    lines.append(f"{'at ms':>9} {'queued':>8} {'handled':>8}  {'span':<34} {'actor':<14} waterfall")
    for row in waterfall.rows:
        if critical_only and not row.critical:
            continue
        name = ("  " * row.depth + row.name)[:34]
        queued = f"{row.queued_s * ms:.1f}" if row.queued_s else "-"
        lines.append(
            f"{row.at_s * ms:9.1f} {queued:>8} {row.handled_s * ms:8.1f} {'*' if row.critical else ' '}"
            f"{name:<34} {row.actor[:14]:<14} {_bar(row, waterfall.total_s)}"
        )
    return "\n".join(lines)


def slowest(records: Iterable[dict[str, Any]]) -> Waterfall | None:
    """The waterfall of the longest snapshot whose root span is among ``records`` (what ``parkway
    report`` draws), or None when there is none."""
    records = list(records)
    roots = [
        r
        for r in records
        if r.get("event") == "span"
        and str(r.get("name", "")).startswith("snapshot ")
        and not r.get("parent_span_id")
        and isinstance((r.get("attrs") or {}).get("parkway.checkpoint_id"), str)
    ]
    if not roots:
        return None
    root = max(roots, key=lambda r: float(r.get("end", 0.0)) - float(r.get("start", 0.0)))
    return build(records, root["attrs"]["parkway.checkpoint_id"])


def render_html(waterfall: Waterfall) -> str:
    """The waterfall as an HTML table with a bar per row (light: queued, dark: handled)."""
    total = waterfall.total_s or 1.0
    rows = []
    for row in waterfall.rows:
        left, queued, handled = (
            100 * row.at_s / total,
            100 * row.queued_s / total,
            100 * row.handled_s / total,
        )
        bar = (
            f'<div style="position:relative;height:10px;width:400px;background:#fafafa">'
            f'<div style="position:absolute;left:{left:.2f}%;width:{queued:.2f}%;height:10px;background:#f5c77e"></div>'
            f'<div style="position:absolute;left:{left + queued:.2f}%;width:{max(handled, 0.3):.2f}%;height:10px;'
            f'background:{"#c0392b" if row.critical else "#2c7fb8"}"></div></div>'
        )
        name = "&nbsp;" * (2 * row.depth) + html.escape(row.name)
        rows.append(
            f"<tr><td>{row.at_s * 1000:.1f}</td><td>{row.queued_s * 1000:.1f}</td><td>{row.handled_s * 1000:.1f}</td>"
            f"<td>{'*' if row.critical else ''}</td><td>{name}</td><td>{html.escape(row.actor)}</td><td>{bar}</td></tr>"
        )
    return (
        f"<p>Trace {waterfall.trace_id}, checkpoint {html.escape(waterfall.checkpoint_id)}: "
        f"{waterfall.total_s * 1000:.1f} ms, {waterfall.spans} spans. Orange: queued; blue: handled; red: "
        "on the critical path (<code>parkway trace</code> prints the same rows).</p>"
        "<table><tr><th>at ms</th><th>queued ms</th><th>handled ms</th><th>critical</th><th>span</th>"
        f"<th>actor</th><th>waterfall</th></tr>{''.join(rows)}</table>"
    )


def render_png(waterfall: Waterfall, path: Path) -> Path:
    """The waterfall as a picture (matplotlib, the ``report`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = waterfall.rows
    fig, ax = plt.subplots(figsize=(11, 0.22 * len(rows) + 1.2))
    for i, row in enumerate(rows):
        y = len(rows) - 1 - i
        if row.queued_s:
            ax.barh(y, row.queued_s * 1000, left=row.at_s * 1000, color="#f5c77e", height=0.7)
        ax.barh(
            y,
            max(row.handled_s * 1000, waterfall.total_s * 2),
            left=(row.at_s + row.queued_s) * 1000,
            color="#c0392b" if row.critical else "#2c7fb8",
            height=0.7,
        )
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(
        [f"{'  ' * r.depth}{r.name[:40]}  {r.actor if r.depth > 1 else ''}" for r in reversed(rows)],
        fontsize=7,
        family="monospace",
    )
    ax.set_xlabel("ms from the snapshot's start (orange: queued, blue: handled, red: critical path)")
    ax.set_title(f"snapshot {waterfall.checkpoint_id}: {waterfall.total_s * 1000:.1f} ms", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")  # whatever the name ends in
    plt.close(fig)
    return path
