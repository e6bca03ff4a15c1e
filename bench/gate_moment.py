"""Whether a slow progress check before the gate closes foretells a long window.

    python bench/gate_moment.py [--min-rollouts 900] [FILES ...]

Reads the per-snapshot records that ``bench/snapshot_pause.py`` keeps in its result files (default:
every ``bench/results/snapshot_pause*.json``), takes the snapshots that saved at least
``--min-rollouts`` rollouts, and prints, for checks (the ``instant`` step, ``close_gate`` in files
written before it replaced that step) over each quantile, how
often the window that followed was in the slowest tenth of all those windows. Reads files only;
it runs nothing. What it found, and what was tried with it: docs/benchmarks.md, "A snapshot's gate
closed after a quiet progress check".
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
QUANTILES = (0.0, 0.5, 0.8, 0.9, 0.95)


def records_of(paths: list[Path], min_rollouts: int) -> list[tuple[float, float]]:
    """(check ms, window ms) of each snapshot of at least ``min_rollouts`` rollouts."""
    found = []
    for path in paths:
        data: dict[str, Any] = json.loads(path.read_text())
        for point in data.get("points", []):
            for record in point.get("records", []):
                steps = record.get("steps_ms", {})
                close = steps.get("instant", steps.get("close_gate"))
                if close is not None and record.get("rollouts", 0) >= min_rollouts:
                    found.append((float(close), float(record["pause_ms"])))
    return found


def long_from(found: list[tuple[float, float]]) -> float:
    """The shortest window in the slowest tenth of all windows."""
    windows = sorted(w for _, w in found)
    return windows[int(len(windows) * 0.9)]


def foretold(found: list[tuple[float, float]]) -> list[dict[str, float]]:
    """Per quantile of the checks: how many windows followed one over it, and the share of those in
    the slowest tenth of all windows."""
    long = long_from(found)
    checks = sorted(c for c, _ in found)
    rows = []
    for q in QUANTILES:
        over = checks[int(len(checks) * q)] if q else -1.0
        after = [w for c, w in found if c > over]
        rows.append(
            {
                "quantile": q,
                "check_over_ms": max(over, 0.0),
                "windows": len(after),
                "long_share": sum(w >= long for w in after) / len(after) if after else 0.0,
                "window_p50_ms": statistics.median(after) if after else 0.0,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path)
    parser.add_argument("--min-rollouts", type=int, default=900)
    args = parser.parse_args()
    paths = args.files or sorted(RESULTS.glob("snapshot_pause*.json"))
    found = records_of(paths, args.min_rollouts)
    if len(found) < 20:
        raise SystemExit(f"{len(found)} snapshots of >= {args.min_rollouts} rollouts: too few to tell")
    print(f"{len(found)} snapshots from {len(paths)} files; a long window: >= {long_from(found):.1f} ms")
    print("| checks over | ms | windows after | in the slowest tenth | window p50 ms |")
    print("|---|---|---|---|---|")
    for r in foretold(found):
        label = "all" if not r["quantile"] else f"q{r['quantile']:g}"
        print(
            f"| {label} | {r['check_over_ms']:.1f} | {r['windows']} | {r['long_share']:.2f} "
            f"| {r['window_p50_ms']:.1f} |"
        )


if __name__ == "__main__":
    main()
