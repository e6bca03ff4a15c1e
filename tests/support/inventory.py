"""The outside plugin package ``examples/inventory-plugin`` for tests: importing it from its folder (unit
tests), installing it as a user would (entry points), the databases it runs on (SQLite; PostgreSQL
at 127.0.0.1:5432 where one answers), each test under its own table prefix, and reading the rows back
without the plugin's code (what the database itself says)."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.paths import ROOT

PLUGIN = ROOT / "examples" / "inventory-plugin"
POSTGRES_DSN = os.environ.get(
    "PARKWAY_TEST_POSTGRES_DSN", "host=127.0.0.1 port=5432 dbname=test user=postgres connect_timeout=3"
)
TABLES = ("sessions", "stock", "journal", "verdicts")


def importable() -> None:
    """Make ``parkway_inventory`` importable from its source folder (no entry points this way)."""
    if str(PLUGIN) not in sys.path:
        sys.path.insert(0, str(PLUGIN))


def install(target: Path) -> Path:
    """``pip install --no-deps --no-build-isolation`` of the package (offline: setuptools is here) into
    ``target``, which is then put first on this process's path and on its children's PYTHONPATH. It
    builds from a copy, so the build leaves nothing in the repository's folder."""
    source = target / "source"
    shutil.copytree(PLUGIN, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = target / "site"
    done = subprocess.run(
        [
            sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
            "--no-index", "--target", str(target), str(source),
        ],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"installing {PLUGIN} failed:\n{done.stdout}\n{done.stderr}"
    # The installed copy from now on, not the source folder a unit test may have imported it from.
    sys.path[:] = [p for p in sys.path if p != str(PLUGIN)]
    for name in [m for m in sys.modules if m == "parkway_inventory" or m.startswith("parkway_inventory.")]:
        del sys.modules[name]
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))
    return target


def postgres_problem() -> str | None:
    """Why PostgreSQL cannot be used here, or None."""
    try:
        import psycopg
    except ImportError:
        return "psycopg is not installed (pip install 'psycopg[binary]')"
    try:
        psycopg.connect(POSTGRES_DSN).close()
    except psycopg.Error as exc:
        return f"no PostgreSQL at {POSTGRES_DSN}: {exc}"
    return None


@dataclass(frozen=True)
class Database:
    """Where one test's inventory lives: the ``PARKWAY_INVENTORY_*`` variables that name it."""

    kind: str  # sqlite | postgres
    variables: dict[str, str]

    @property
    def prefix(self) -> str:
        return self.variables["PARKWAY_INVENTORY_PREFIX"]

    def rows(self, table: str, order: str = "rollout_id") -> list[tuple[Any, ...]]:
        """Every row of one of the inventory's tables, read with the database's own driver."""
        assert table in TABLES
        sql = f"SELECT * FROM {self.prefix}{table} ORDER BY {order}"
        if self.kind == "postgres":
            import psycopg

            with psycopg.connect(self.variables["PARKWAY_INVENTORY_DSN"]) as connection:
                return [tuple(r) for r in connection.execute(sql).fetchall()]
        with sqlite3.connect(self.variables["PARKWAY_INVENTORY_DB"]) as connection:
            return [tuple(r) for r in connection.execute(sql).fetchall()]

    def journal(self) -> dict[str, list[tuple[int, int, str, dict[str, Any]]]]:
        """Applied calls by rollout, in call order: (attempt, call_index, tool, arguments)."""
        found: dict[str, list[tuple[int, int, str, dict[str, Any]]]] = {}
        for rollout, attempt, index, tool, arguments, ok, _ in self.rows("journal", "rollout_id, call_index"):
            if ok:
                found.setdefault(rollout, []).append((attempt, index, tool, json.loads(arguments)))
        return found

    def stock(self) -> dict[str, dict[str, int]]:
        found: dict[str, dict[str, int]] = {}
        for rollout, item, qty in self.rows("stock"):
            found.setdefault(rollout, {})[item] = qty
        return found

    def drop(self) -> None:
        if self.kind != "postgres":
            return
        import psycopg

        with psycopg.connect(self.variables["PARKWAY_INVENTORY_DSN"], autocommit=True) as connection:
            for table in TABLES:
                connection.execute(f"DROP TABLE IF EXISTS {self.prefix}{table}")


def database(kind: str, directory: Path) -> Database:
    """A database of ``kind`` of the test's own: a fresh SQLite file, or a unique table prefix in PostgreSQL."""
    prefix = f"t{uuid.uuid4().hex[:12]}_"
    if kind == "postgres":
        return Database(kind, {"PARKWAY_INVENTORY_DSN": POSTGRES_DSN, "PARKWAY_INVENTORY_PREFIX": prefix})
    directory.mkdir(parents=True, exist_ok=True)
    return Database(
        kind,
        {"PARKWAY_INVENTORY_DB": str(directory / "inventory.sqlite3"), "PARKWAY_INVENTORY_PREFIX": prefix},
    )
