"""The picture of a run (matplotlib): one row per rollout, turns as bars coloured by attempt, snapshot
pauses as grey bands, crashes and restores as vertical lines; and writing it as a PNG.

matplotlib is imported only when drawing, so the rest of parkway runs without it
(``pip install 'parkway[report]'`` brings it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from parkway.actors.tools.report.layout import drawn_rows, heading
from parkway.actors.tools.report.model import Attempt, Rollout, Timeline

# Attempt colours: blues and oranges first; red and green are kept for the crash and the restore.
ATTEMPT_COLORS = ("#4C72B0", "#DD8452", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C", "#CCB974", "#64B5CD")
PAUSE_COLOR = "#7f7f7f"
CRASH_COLOR = "#d62728"
RESTORE_COLOR = "#2ca02c"
REPLICA_RESTART_COLOR = "#ff7f0e"
INSTALL_HINT = "pip install 'parkway[report]'"


class ReportError(Exception):
    """Nothing to draw, or nothing to draw with; the message says which."""


def load_matplotlib() -> Any:
    """``(matplotlib, Figure)``, or a ``ReportError`` naming the extra to install."""
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ReportError(f"drawing the report needs matplotlib: {INSTALL_HINT} ({exc})") from None
    return matplotlib, Figure


@dataclass
class Drawing:
    """The figure and what each drawn piece means (hover titles in the HTML)."""

    figure: Any
    titles: dict[str, str]
    hidden_rows: int


class _Canvas:
    """The axes in seconds since the run's start, and the hover title of every piece tagged on it."""

    def __init__(self, ax: Any, t0: float, min_width: float) -> None:
        self.ax = ax
        self.t0 = t0
        self.min_width = min_width
        self.titles: dict[str, str] = {}

    def tag(self, artist: Any, text: str) -> None:
        """Give ``artist`` an SVG id the HTML page attaches ``text`` to as a hover title."""
        gid = f"pk{len(self.titles)}"
        artist.set_gid(gid)
        self.titles[gid] = text

    def top_label(self, x: float, text: str, color: str, *, right: bool) -> None:
        self.ax.annotate(
            text,
            (x, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(-2 if right else 2, 2),
            textcoords="offset points",
            ha="right" if right else "left",
            va="bottom",
            color=color,
            fontsize=8,
            fontweight="bold",
            annotation_clip=False,
        )


@dataclass
class _Drawn:
    """What the rollout rows hold, for the legend (an entry only for what is there) and the end marks."""

    attempts: set[int] = field(default_factory=set)
    any_cut: bool = False
    any_kept: bool = False
    lives: list[list[tuple[float, float]]] = field(default_factory=list)
    life_colors: list[str] = field(default_factory=list)
    marks: dict[str, tuple[list[float], list[float]]] = field(
        default_factory=lambda: {"sealed": ([], []), "failed": ([], [])}
    )


def draw(timeline: Timeline, *, max_rows: int = 150) -> Drawing:
    """The figure: one row per rollout (by group), turns as bars, pauses as bands, crash and restore lines."""
    _, Figure = load_matplotlib()
    from matplotlib.collections import LineCollection

    rows, hidden = drawn_rows(timeline, max_rows)
    t0 = timeline.start
    span = max(timeline.end - t0, 1e-3)
    min_width = span / 1500  # about a pixel: a 20 ms pause in an hour-long run still shows
    height = min(3.4 + 0.24 * max(len(rows), 1), 60.0)
    training = 3.2 if timeline.training else 0.0  # a panel of reward and loss per train step
    figure = Figure(figsize=(14, height + training), dpi=100, layout="constrained")
    if timeline.training:
        ax, train_ax = figure.subplots(2, 1, height_ratios=[height, training])
        _training(train_ax, timeline)
    else:
        ax = figure.add_subplot()
    canvas = _Canvas(ax, t0, min_width)
    y_of = {r.rollout_id: i for i, r in enumerate(rows)}
    _group_stripes(ax, rows, y_of)
    _run_events(canvas, timeline)
    # Rollouts: a thin line for each attempt's life, a bar per turn, a mark for how it ended.
    drawn = _Drawn()
    for rollout in rows:
        for attempt in rollout.attempts.values():
            _attempt(canvas, rollout, attempt, y_of[rollout.rollout_id], drawn)
    ax.add_collection(LineCollection(drawn.lives, colors=drawn.life_colors, linewidths=1, zorder=2))
    ax.plot(*drawn.marks["sealed"], ls="", marker="o", color="black", ms=3.5, zorder=5)
    ax.plot(*drawn.marks["failed"], ls="", marker="x", color="black", ms=5, mew=1.2, zorder=5)
    _axes(figure, ax, timeline, rows, span)
    _legend(ax, timeline, drawn)
    if hidden:
        ax.set_title(
            f"{hidden} of {len(timeline.rollouts)} rollouts not drawn (--max-rows {max_rows}); "
            "those with a failed attempt, more attempts, or not sealed are drawn first",
            fontsize=8,
            color="#aa0000",
            loc="left",
        )
    return Drawing(figure, canvas.titles, hidden)


def render_png(drawing: Drawing, path: Path) -> Path:
    drawing.figure.savefig(path, format="png", dpi=100)
    return path


def _group_stripes(ax: Any, rows: list[Rollout], y_of: dict[str, int]) -> None:
    """Prompt groups: alternate stripes behind their rows."""
    groups: dict[str, list[int]] = {}
    for r in rows:
        groups.setdefault(r.group_id, []).append(y_of[r.rollout_id])
    for n, ys in enumerate(groups.values()):
        if n % 2:
            ax.axhspan(min(ys) - 0.5, max(ys) + 0.5, color="#f0f0f0", zorder=0, lw=0)


def _run_events(canvas: _Canvas, timeline: Timeline) -> None:
    """Snapshot pauses, restores, crashes, agent replicas that came back: across every row."""
    ax, t0 = canvas.ax, canvas.t0
    for pause in timeline.pauses:
        end = pause.end if pause.end is not None else pause.start
        band = ax.axvspan(
            pause.start - t0,
            pause.start - t0 + max(end - pause.start, canvas.min_width),
            color=PAUSE_COLOR,
            alpha=0.35,
            lw=0,
            zorder=3.5,  # over the bars: a turn held by the pause shows it
        )
        where = f" -> {pause.snapshot}" if pause.snapshot else f" ({pause.outcome})"
        canvas.tag(band, f"snapshot pause {pause.checkpoint_id}: {pause.ms or 0:.1f} ms{where}")
    for restore in timeline.restores:
        end = restore.end if restore.end is not None else restore.start
        if end > restore.start:
            band = ax.axvspan(restore.start - t0, end - t0, color=RESTORE_COLOR, alpha=0.15, lw=0, zorder=1)
            canvas.tag(band, f"restoring {restore.snapshot} ({restore.checkpoint_id})")
        if restore.outcome in ("done", "fallback"):
            line = ax.axvline(end - t0, color=RESTORE_COLOR, lw=2, zorder=4)
            canvas.tag(
                line,
                f"restored {restore.snapshot} ({restore.checkpoint_id}), {restore.continued} rollouts continued",
            )
            canvas.top_label(end - t0, f"restore {restore.snapshot}", RESTORE_COLOR, right=False)
    for crash in timeline.crashes:
        line = ax.axvline(crash.ts - t0, color=CRASH_COLOR, lw=2, zorder=4)
        canvas.tag(line, f"crash: {crash.detail}")
        canvas.top_label(crash.ts - t0, "crash", CRASH_COLOR, right=True)
    for event in timeline.replica_restarts:
        line = ax.axvline(event.ts - t0, color=REPLICA_RESTART_COLOR, lw=1.5, ls="--", zorder=4)
        canvas.tag(line, f"agent replica restarted: {event.detail}")


def _attempt(canvas: _Canvas, rollout: Rollout, attempt: Attempt, y: int, drawn: _Drawn) -> None:
    """One attempt on its rollout's row: its life (collected, drawn as one collection), its turns, a
    marker where it continued from a snapshot, and where it was sealed or failed (collected)."""
    from matplotlib.patches import Rectangle

    ax, t0 = canvas.ax, canvas.t0
    color = ATTEMPT_COLORS[attempt.index % len(ATTEMPT_COLORS)]
    begin = attempt.started if attempt.started is not None else attempt.dispatched
    if begin is not None and attempt.ended is not None:
        drawn.lives.append([(begin - t0, y), (attempt.ended - t0, y)])
        drawn.life_colors.append(color)
    for turn in (*attempt.superseded, *attempt.turns):
        if turn.replayed or turn.end is None:
            continue  # a kept turn took no time: the marker at the attempt's start says how many
        drawn.any_cut |= turn.cut
        drawn.attempts.add(attempt.index)
        bar = Rectangle(
            (turn.start - t0, y - 0.31),
            max(turn.end - turn.start, canvas.min_width),
            0.62,
            facecolor=color,
            edgecolor="white",
            linewidth=0.4,
            hatch="////" if turn.cut else None,
            alpha=0.5 if turn.cut else 1.0,
            zorder=3,
        )
        ax.add_patch(bar)
        canvas.tag(
            bar,
            f"{rollout.rollout_id} attempt {attempt.index} turn {turn.index}: "
            f"{turn.start - t0:.3f}-{turn.end - t0:.3f} s ({(turn.end - turn.start) * 1000:.1f} ms)"
            + (", never finished" if turn.cut else ""),
        )
    if attempt.continuing and attempt.started is not None:
        drawn.any_kept = True
        ax.plot(attempt.started - t0, y, marker=">", color=color, ms=6, mec="black", mew=0.5, zorder=5)
    if attempt.kept_turns and attempt.started is not None:
        ax.annotate(
            f"{attempt.kept_turns} kept",
            (attempt.started - t0, y),
            xytext=(4, 4),
            textcoords="offset points",
            fontsize=6.5,
            color="#333333",
            zorder=6,
        )
    kind = "sealed" if attempt.sealed else "failed" if attempt.outcome == "failed" else None
    if kind is not None and attempt.ended is not None:
        drawn.marks[kind][0].append(attempt.ended - t0)
        drawn.marks[kind][1].append(y)


def _training(ax: Any, timeline: Timeline) -> None:
    """Mean reward (left axis) and the trainer's loss (right axis) per train step."""
    steps = [p.step for p in timeline.training]
    rewards = [(p.step, p.mean_reward) for p in timeline.training if p.mean_reward is not None]
    losses = [(p.step, p.loss) for p in timeline.training if p.loss is not None]
    if rewards:
        ax.plot(*zip(*rewards, strict=True), marker="o", ms=3, color="#1f77b4", label="mean reward")
    ax.set_xlabel("train step")
    ax.set_ylabel("mean reward", color="#1f77b4")
    ax.set_xlim(min(steps) - 0.5, max(steps) + 0.5)
    ax.grid(color="#dddddd", lw=0.6)
    if losses:
        loss_ax = ax.twinx()
        loss_ax.plot(*zip(*losses, strict=True), marker="s", ms=3, color="#d62728", label="loss")
        loss_ax.set_ylabel("loss", color="#d62728")


def _axes(figure: Any, ax: Any, timeline: Timeline, rows: list[Rollout], span: float) -> None:
    """Limits, the rollout ids down the side, seconds along the bottom, and the heading."""
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_yticks(range(len(rows)), [r.rollout_id for r in rows], fontsize=8 if len(rows) <= 60 else 5.5)
    ax.set_xlim(0, span * 1.01)
    started = datetime.fromtimestamp(timeline.start, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    ax.set_xlabel(f"seconds since the controller's first line ({started})")
    ax.set_ylabel("rollout (grouped by prompt group)")
    ax.grid(axis="x", color="#dddddd", lw=0.6)
    ax.set_axisbelow(True)
    title, counts = heading(timeline)
    figure.suptitle(f"{title}\n{counts}", fontsize=11, x=0.01, ha="left")


def _legend(ax: Any, timeline: Timeline, drawn: _Drawn) -> None:
    """An entry for each kind of thing drawn, and only for those."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles: list[Any] = [
        Patch(color=ATTEMPT_COLORS[i % len(ATTEMPT_COLORS)], label=f"turn, attempt {i}")
        for i in sorted(drawn.attempts)
    ]
    if drawn.any_cut:
        handles.append(
            Patch(
                facecolor="#999999", alpha=0.5, hatch="////", edgecolor="white", label="turn never finished"
            )
        )
    if drawn.any_kept:
        handles.append(
            Line2D(
                [],
                [],
                marker=">",
                color="#999999",
                mec="black",
                mew=0.5,
                ls="",
                label="continued from a snapshot",
            )
        )
    if drawn.marks["sealed"][0]:
        handles.append(Line2D([], [], marker="o", color="black", ms=3.5, ls="", label="sealed"))
    if drawn.marks["failed"][0]:
        handles.append(Line2D([], [], marker="x", color="black", ms=5, ls="", label="attempt failed"))
    if timeline.pauses:
        handles.append(Patch(color=PAUSE_COLOR, alpha=0.35, label="snapshot pause\n(admission closed)"))
    if timeline.crashes:
        handles.append(Line2D([], [], color=CRASH_COLOR, lw=2, label="crash"))
    if timeline.restores:
        handles.append(Line2D([], [], color=RESTORE_COLOR, lw=2, label="restore done"))
    if timeline.replica_restarts:
        handles.append(
            Line2D([], [], color=REPLICA_RESTART_COLOR, lw=1.5, ls="--", label="agent replica restarted")
        )
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
