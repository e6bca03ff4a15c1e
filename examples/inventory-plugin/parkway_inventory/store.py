"""The database under the inventory: SQLite by default, PostgreSQL when ``PARKWAY_INVENTORY_DSN`` is set.

Where:
- ``PARKWAY_INVENTORY_DSN``: a PostgreSQL connection string (``host=127.0.0.1 dbname=test user=postgres``);
  needs the ``postgres`` extra (psycopg).
- otherwise ``PARKWAY_INVENTORY_DB``: an SQLite file (default ``parkway-inventory.sqlite3`` in the
  working directory), shared safely by several tool-server processes (WAL, immediate transactions).
- ``PARKWAY_INVENTORY_PREFIX``: the tables' name prefix (default ``inventory_``), so several runs or
  tests can share one database without meeting.

One connection per process and target: a tool server handles a call in one step of its event loop
(no await inside), so a transaction is never interleaved with another in the same process.
"""

from __future__ import annotations

import os
import re
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

DEFAULT_DB = "parkway-inventory.sqlite3"
DEFAULT_PREFIX = "inventory_"
_PREFIX = re.compile(r"^[a-z_][a-z0-9_]{0,40}$")

Row = tuple[Any, ...]


class StoreError(Exception):
    """The database cannot be used as configured (a bad prefix, a missing driver)."""


class DuplicateKey(Exception):
    """An insert met a row with its unique key: another writer got there first."""


def _schema(p: str) -> list[str]:
    # A seed is any Python int (a run's seeds are 64-bit unsigned): kept as text, which both databases
    # hold exactly.
    return [
        f"CREATE TABLE IF NOT EXISTS {p}sessions (rollout_id TEXT PRIMARY KEY, seed TEXT NOT NULL, "
        "attempt INTEGER NOT NULL)",
        f"CREATE TABLE IF NOT EXISTS {p}stock (rollout_id TEXT NOT NULL, item TEXT NOT NULL, "
        "qty INTEGER NOT NULL, PRIMARY KEY (rollout_id, item))",
        # The journal: one row per mutating call, unique on the call's key, written in the mutation's
        # own transaction. A call delivered again finds its row and is answered from it.
        f"CREATE TABLE IF NOT EXISTS {p}journal (rollout_id TEXT NOT NULL, attempt INTEGER NOT NULL, "
        "call_index INTEGER NOT NULL, tool TEXT NOT NULL, arguments TEXT NOT NULL, ok INTEGER NOT NULL, "
        "output TEXT NOT NULL, PRIMARY KEY (rollout_id, attempt, call_index))",
        f"CREATE TABLE IF NOT EXISTS {p}verdicts (rollout_id TEXT NOT NULL, attempt INTEGER NOT NULL, "
        "reward DOUBLE PRECISION NOT NULL, record TEXT NOT NULL, PRIMARY KEY (rollout_id, attempt))",
    ]


class Store:
    """One database connection with the inventory's tables; ``t(name)`` is a table's full name."""

    def __init__(self, *, dsn: str | None, path: str | None, prefix: str) -> None:
        if not _PREFIX.match(prefix):
            raise StoreError(f"PARKWAY_INVENTORY_PREFIX {prefix!r} must match {_PREFIX.pattern}")
        self.prefix = prefix
        self.postgres = dsn is not None
        self._depth = 0
        if dsn is not None:
            try:
                import psycopg
            except ImportError:
                raise StoreError(
                    "PARKWAY_INVENTORY_DSN is set but psycopg is not installed: "
                    "pip install 'parkway-inventory[postgres]'"
                ) from None
            self._pg = psycopg.connect(dsn, autocommit=True)
            self._unique = psycopg.errors.UniqueViolation
        else:
            assert path is not None
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            # isolation_level=None: no implicit transactions; ``transaction`` opens them explicitly.
            self._lite = sqlite3.connect(path, timeout=60, isolation_level=None)
            self._lite.execute("PRAGMA journal_mode=WAL")
            self._lite.execute("PRAGMA synchronous=FULL")
        with self.transaction():
            for statement in _schema(prefix):
                self.execute(statement)

    def t(self, name: str) -> str:
        return f"{self.prefix}{name}"

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """One transaction; nested uses join the outer one. ``DuplicateKey`` for a unique violation."""
        if self._depth:
            yield
            return
        self._depth += 1
        try:
            if self.postgres:
                try:
                    with self._pg.transaction():
                        yield
                except self._unique as exc:
                    raise DuplicateKey(str(exc)) from None
            else:
                self._lite.execute("BEGIN IMMEDIATE")  # the write lock now: no upgrade deadlock later
                try:
                    yield
                except BaseException:
                    self._lite.execute("ROLLBACK")
                    raise
                self._lite.execute("COMMIT")
        finally:
            self._depth -= 1

    def execute(self, sql: str, parameters: Sequence[Any] = ()) -> None:
        if self.postgres:
            self._pg.execute(sql.replace("?", "%s"), tuple(parameters))
            return
        try:
            self._lite.execute(sql, tuple(parameters))
        except sqlite3.IntegrityError as exc:
            if "UNIQUE" in str(exc) or "PRIMARY KEY" in str(exc):
                raise DuplicateKey(str(exc)) from None
            raise

    def rows(self, sql: str, parameters: Sequence[Any] = ()) -> list[Row]:
        if self.postgres:
            return [tuple(r) for r in self._pg.execute(sql.replace("?", "%s"), tuple(parameters)).fetchall()]
        return [tuple(r) for r in self._lite.execute(sql, tuple(parameters)).fetchall()]

    def close(self) -> None:
        if self.postgres:
            self._pg.close()
        else:
            self._lite.close()


_OPEN: dict[tuple[str | None, str | None, str], Store] = {}


def where() -> tuple[str | None, str | None, str]:
    """(dsn, sqlite path, prefix) as this process's environment names them."""
    dsn = os.environ.get("PARKWAY_INVENTORY_DSN") or None
    path = None if dsn else os.environ.get("PARKWAY_INVENTORY_DB") or DEFAULT_DB
    return dsn, path, os.environ.get("PARKWAY_INVENTORY_PREFIX", DEFAULT_PREFIX)


def open_store() -> Store:
    """This process's store for the current configuration, opened once."""
    key = where()
    store = _OPEN.get(key)
    if store is None:
        store = _OPEN[key] = Store(dsn=key[0], path=key[1], prefix=key[2])
    return store


def close_all() -> None:
    """Close every store this process opened (tests; a process that exits needs not)."""
    while _OPEN:
        _OPEN.popitem()[1].close()
