"""What every benchmark shares: the options its command line has in common, the machine it ran on, the
table it prints (markdown), and the JSON record and figure it writes under ``bench/results/``.

Standard library only (matplotlib is imported when a figure is drawn), so a script can import it
before it pays for parkway's imports (``restore_time.py`` times those).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("embedded", "rabbitmq")


# -- the command line --------------------------------------------------------------------------------


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's parser, described by the first paragraph of its module docstring."""
    return argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])


def add_name(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--name", default=default, help="results file name")


def add_quick(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument("--quick", action="store_true", help=help)


def add_modes(parser: argparse.ArgumentParser, default: Sequence[str] = MODES) -> None:
    """``--modes``: where the cluster runs (``embedded``: one process; ``rabbitmq``: every actor its own
    process on the local RabbitMQ)."""
    parser.add_argument("--modes", nargs="+", default=list(default), choices=MODES)


def add_engine(parser: argparse.ArgumentParser, *, delay: float, tool_delay: float) -> None:
    """How fast the default engine and the tools answer."""
    parser.add_argument("--delay", type=float, default=delay, help="engine seconds per token")
    parser.add_argument("--tool-delay", type=float, default=tool_delay, help="seconds every tool call takes")


def settings(args: argparse.Namespace, exclude: Iterable[str] = ("name",)) -> dict[str, Any]:
    """The options a result was measured with, as its record keeps them."""
    left_out = set(exclude)
    return {k: v for k, v in vars(args).items() if k not in left_out}


# -- the machine -------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    """Where and when a figure was taken (2 shared cores: load matters)."""
    load = os.getloadavg()
    return {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpus": os.cpu_count(),
        "loadavg_1m_at_start": round(load[0], 2),
        "python": sys.version.split()[0],
    }


def load_1m() -> float:
    """The 1-minute load average now (a point's load is taken before it and after it)."""
    return round(os.getloadavg()[0], 2)


def process_tree_cpu_s(pids: Iterable[int]) -> dict[int, float | None]:
    """CPU seconds (user and system) each process of ``pids`` and its descendants have used so far (an
    engine's compute process counts with the policy that started it); None for one that is gone."""
    ticks = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    used: dict[int, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        pid = int(stat.parent.name)
        parent[pid] = int(fields[1])
        used[pid] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime: the stat's 14th and 15th
    totals: dict[int, float | None] = {}
    for root in pids:
        if root not in used:
            totals[root] = None
            continue
        total = 0.0
        for pid, cpu in used.items():
            ancestor = pid
            while ancestor > 1 and ancestor != root:
                ancestor = parent.get(ancestor, 0)
            if ancestor == root:
                total += cpu
        totals[root] = round(total, 3)
    return totals


def machine_line(began: dict[str, Any]) -> str:
    """``machine()`` in a figure's title: when, cores, load."""
    return f"{began['when']}, {began['cpus']} shared cores (load {began['loadavg_1m_at_start']})"


def medians_by(
    runs: Sequence[dict[str, Any]],
    variants: Sequence[str],
    variant_of: Callable[[dict[str, Any]], str],
    keys: Sequence[str],
) -> dict[str, dict[str, float]]:
    """Per variant, in the order of ``variants``, the median of each key over its runs."""
    return {
        v: {key: statistics.median(r[key] for r in runs if variant_of(r) == v) for key in keys}
        for v in variants
    }


def runs_line(began: dict[str, Any], runs: Sequence[dict[str, Any]]) -> str:
    """``machine_line`` and the range of the 1-minute load the runs recorded (``load_1m``)."""
    loads = [r["load_1m"] for r in runs]
    return f"{machine_line(began)}; load during the runs {min(loads)}-{max(loads)}"


# -- what a benchmark writes -------------------------------------------------------------------------


def write_json(name: str, record: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def write_record(
    name: str,
    bench: str,
    began: dict[str, Any],
    args: argparse.Namespace,
    results: Any,
    *,
    exclude: Iterable[str] = ("name",),
    **more: Any,
) -> Path:
    """``bench/results/NAME.json``: the benchmark, the machine, the settings, the results, and ``more``."""
    record = {"bench": bench, **began, "settings": settings(args, exclude), "results": results, **more}
    return write_json(name, record)


def figure_path(name: str) -> Path:
    RESULTS.mkdir(exist_ok=True)
    return RESULTS / f"{name}.png"


def pyplot() -> Any:
    """matplotlib, imported late, on the Agg backend (no display here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, title: str, *, dpi: int = 110) -> None:
    """Title, tight layout, PNG, and the figure closed (a benchmark draws one per run)."""
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]], align: str = "") -> str:
    """A markdown table, padded to line up in a terminal too. ``align`` has one letter per column, ``l``
    or ``r`` (default: the first column left, the others right, as numbers read best)."""
    table = [[str(cell) for cell in row] for row in rows]
    columns = len(headers)
    for row in table:
        if len(row) != columns:
            raise ValueError(f"a row of {len(row)} cells under {columns} headers: {row}")
    sides = (align or "l" + "r" * (columns - 1)).ljust(columns, "r")
    widths = [max(3, len(h), *(len(r[i]) for r in table)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        padded = [
            c.ljust(w) if s == "l" else c.rjust(w) for c, w, s in zip(cells, widths, sides, strict=True)
        ]
        return "| " + " | ".join(padded) + " |"

    rule = ["-" * w if s == "l" else "-" * (w - 1) + ":" for w, s in zip(widths, sides, strict=True)]
    return "\n".join([line(list(headers)), line(rule), *(line(r) for r in table)])
