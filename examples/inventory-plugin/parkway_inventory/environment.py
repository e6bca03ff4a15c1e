"""The inventory: a store room whose shelves are rows in a database, one set of rows per rollout.

Its state lives outside the tool server's process (``state_lives_in = "database"``), so it keeps
parkway's environment contract itself (docs/environments.md in parkway):

- exactly once: each mutating call writes a journal row unique on (rollout, attempt, call_index) in the
  same transaction as its stock update; a call delivered again, to this tool server or to one started
  after it died, finds its row and is answered from it, never applied twice.
- a fresh session (``reset``) puts the rollout's rows back to its seed's and empties its journal.
- ``export`` reads the rollout's rows (stock and journal) at the boundary; ``restore`` replaces the
  rollout's rows with exactly those, so nothing a dead timeline did after the snapshot survives.
- ``verify`` scores from the database: the stock must equal a replay of the agent's record, and the
  journal's applied calls must be exactly the record's mutations.
"""

from __future__ import annotations

import json
from typing import Any

from parkway.actors.sdk import CallAnswer, CallKey, Environment, Record, ToolError, ToolSpec

from parkway_inventory.store import DuplicateKey, Store, open_store

ITEMS = ("bolts", "nuts", "gears")
_ITEM = "choice:" + "|".join(ITEMS)
MAX_QTY = 50


def initial_stock(seed: int) -> dict[str, int]:
    return {"bolts": 10 + seed % 7, "nuts": 5 + (seed // 7) % 7, "gears": 3 + (seed // 49) % 5}


def replay(seed: int, mutations: list[tuple[str, dict[str, Any]]]) -> dict[str, int] | None:
    """The stock that applying ``mutations`` once each to the seed's gives; None if one cannot apply."""
    stock = initial_stock(seed)
    for tool, arguments in mutations:
        item, qty = arguments.get("item"), arguments.get("qty")
        if item not in stock or not isinstance(qty, int) or not 1 <= qty <= MAX_QTY:
            return None
        if tool == "restock":
            stock[item] += qty
        elif tool == "sell" and stock[item] >= qty:
            stock[item] -= qty
        else:
            return None
    return stock


def _dump(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


class Inventory(Environment):
    """Three shelves (bolts, nuts, gears): restock adds, sell takes (never below zero), stock reads."""

    name = "inventory"
    tools = (
        ToolSpec("restock", (("item", _ITEM), ("qty", "int"))),
        ToolSpec("sell", (("item", _ITEM), ("qty", "int"))),
        ToolSpec("stock", (("item", _ITEM),), mutates=False),
    )
    state_lives_in = "database"

    # -- where the rows are ----------------------------------------------------------------------
    @property
    def store(self) -> Store:
        return open_store()  # opened on first use: constructing the class (a set-up check) needs no database

    def _rollout(self) -> str:
        if self.rollout_id is None:
            raise ToolError("this inventory session is not bound to a rollout (the tool server binds it)")
        return self.rollout_id

    # -- the session's life ------------------------------------------------------------------------
    def reset(self) -> None:
        rollout, db = self._rollout(), self.store
        with db.transaction():
            self._drop_rows(db, rollout)
            db.execute(
                f"INSERT INTO {db.t('sessions')} (rollout_id, seed, attempt) VALUES (?, ?, ?)",
                (rollout, str(self.seed), self.attempt),
            )
            for item, qty in initial_stock(self.seed).items():
                db.execute(
                    f"INSERT INTO {db.t('stock')} (rollout_id, item, qty) VALUES (?, ?, ?)",
                    (rollout, item, qty),
                )

    def reattach(self) -> tuple[int, ...] | None:
        rollout, db = self._rollout(), self.store
        held = db.rows(f"SELECT seed, attempt FROM {db.t('sessions')} WHERE rollout_id = ?", (rollout,))
        if not held or (held[0][0], held[0][1]) != (str(self.seed), self.attempt):
            return None
        return tuple(int(row[0]) for row in self._journal(db, rollout))

    def call(self, key: CallKey, tool: str, arguments: dict[str, Any]) -> CallAnswer:
        if not self.spec(tool).mutates:
            return CallAnswer(self.apply(tool, arguments))
        db = self.store
        try:
            with db.transaction():
                seen = self._journaled(db, key)
                if seen is None:
                    try:
                        output, ok = self.apply(tool, arguments), True
                    except ToolError as err:
                        output, ok = {"error": err.message}, False
                    db.execute(
                        f"INSERT INTO {db.t('journal')} (rollout_id, attempt, call_index, tool, arguments, ok, "
                        "output) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (*_key(key), tool, _dump(arguments), int(ok), _dump(output)),
                    )
                    # The continuing attempt of a restored session becomes the one the store holds.
                    db.execute(
                        f"UPDATE {db.t('sessions')} SET attempt = ? WHERE rollout_id = ? AND attempt < ?",
                        (key.attempt, key.rollout_id, key.attempt),
                    )
        except DuplicateKey:  # another writer journaled this key first: its answer is the answer
            with db.transaction():
                seen = self._journaled(db, key)
            assert seen is not None, f"{key} violated the journal's key but is not in it"
        if seen is not None:
            ok, output = seen
        if not ok:
            raise ToolError(output["error"])
        return CallAnswer(output, from_journal=seen is not None)

    # -- tools (inside ``call``'s transaction) ----------------------------------------------------
    def tool_restock(self, item: str, qty: int) -> dict[str, Any]:
        if not 1 <= qty <= MAX_QTY:
            raise ToolError(f"restock {qty} {item}: 'qty' must be between 1 and {MAX_QTY}")
        return {"item": item, "qty": self._shift(item, qty)}

    def tool_sell(self, item: str, qty: int) -> dict[str, Any]:
        if not 1 <= qty <= MAX_QTY:
            raise ToolError(f"sell {qty} {item}: 'qty' must be between 1 and {MAX_QTY}")
        have = self._on_shelf(item)
        if have < qty:
            raise ToolError(f"sell {qty} {item}: only {have} on the shelf")
        return {"item": item, "qty": self._shift(item, -qty)}

    def tool_stock(self, item: str) -> dict[str, Any]:
        return {"item": item, "qty": self._on_shelf(item)}

    def _on_shelf(self, item: str) -> int:
        db = self.store
        rows = db.rows(
            f"SELECT qty FROM {db.t('stock')} WHERE rollout_id = ? AND item = ?", (self._rollout(), item)
        )
        if not rows:
            raise ToolError(f"{self._rollout()} has no inventory rows (its session was never opened)")
        return int(rows[0][0])

    def _shift(self, item: str, by: int) -> int:
        db, now = self.store, self._on_shelf(item) + by
        db.execute(
            f"UPDATE {db.t('stock')} SET qty = ? WHERE rollout_id = ? AND item = ?",
            (now, self._rollout(), item),
        )
        return now

    # -- scoring -------------------------------------------------------------------------------------
    def verify(self, calls: Record) -> float:
        """1.0 when the database's stock equals a replay of the record's mutations and its journal's
        applied calls are exactly those mutations, in order; the verdict is written down too."""
        mutations = [(tool, arguments) for tool, arguments, _ in calls if self.spec(tool).mutates]
        rollout, db = self._rollout(), self.store
        journal = [(tool, json.loads(arguments)) for _, tool, arguments in self._journal(db, rollout)]
        expected = replay(self.seed, mutations)
        reward = 1.0 if expected is not None and expected == self.shelves() and journal == mutations else 0.0
        with db.transaction():
            db.execute(
                f"DELETE FROM {db.t('verdicts')} WHERE rollout_id = ? AND attempt = ?",
                (rollout, self.attempt),
            )
            db.execute(
                f"INSERT INTO {db.t('verdicts')} (rollout_id, attempt, reward, record) VALUES (?, ?, ?, ?)",
                (rollout, self.attempt, reward, _dump([[t, a] for t, a in mutations])),
            )
        return reward

    def shelves(self) -> dict[str, int]:
        db = self.store
        rows = db.rows(f"SELECT item, qty FROM {db.t('stock')} WHERE rollout_id = ?", (self._rollout(),))
        return {item: int(qty) for item, qty in rows}

    # -- persistence -------------------------------------------------------------------------------
    def export(self, *, copy_state: bool = True) -> dict[str, Any]:
        """The rollout's rows as they are now (the agents' boundary): its stock and its journal."""
        rollout, db = self._rollout(), self.store
        journal = db.rows(
            f"SELECT attempt, call_index, tool, arguments, ok, output FROM {db.t('journal')} "
            "WHERE rollout_id = ? ORDER BY call_index, attempt",
            (rollout,),
        )
        return {
            "env": self.name,
            "seed": self.seed,
            "rollout_id": rollout,
            "attempt": self.attempt,
            "stock": sorted([item, int(qty)] for item, qty in self.shelves().items()),
            "journal": [[int(a), int(c), t, args, int(ok), out] for a, c, t, args, ok, out in journal],
        }

    @classmethod
    def restore(cls, data: dict[str, Any]) -> Inventory:
        """Replace the rollout's rows with exactly the exported ones, in one transaction."""
        try:
            seed, rollout, attempt = data["seed"], data["rollout_id"], data["attempt"]
            stock = [(str(item), int(qty)) for item, qty in data["stock"]]
            journal = [tuple(row) for row in data["journal"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"saved inventory session is malformed: {exc!r}") from None
        if data.get("env") != cls.name or not isinstance(seed, int) or not isinstance(rollout, str):
            raise ValueError(f"cannot restore {data.get('env')!r} as {cls.name}")
        env = cls(seed)
        env.bind(rollout, attempt)
        db = env.store
        with db.transaction():
            env._drop_rows(db, rollout)
            db.execute(
                f"INSERT INTO {db.t('sessions')} (rollout_id, seed, attempt) VALUES (?, ?, ?)",
                (rollout, str(seed), attempt),
            )
            for item, qty in stock:
                db.execute(
                    f"INSERT INTO {db.t('stock')} (rollout_id, item, qty) VALUES (?, ?, ?)",
                    (rollout, item, qty),
                )
            for row in journal:
                db.execute(
                    f"INSERT INTO {db.t('journal')} (rollout_id, attempt, call_index, tool, arguments, ok, "
                    "output) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (rollout, *row),
                )
        return env

    # -- plumbing ----------------------------------------------------------------------------------
    @staticmethod
    def _drop_rows(db: Store, rollout: str) -> None:
        for table in ("sessions", "stock", "journal", "verdicts"):
            db.execute(f"DELETE FROM {db.t(table)} WHERE rollout_id = ?", (rollout,))

    @staticmethod
    def _journaled(db: Store, key: CallKey) -> tuple[bool, dict[str, Any]] | None:
        rows = db.rows(
            f"SELECT ok, output FROM {db.t('journal')} WHERE rollout_id = ? AND attempt = ? AND call_index = ?",
            _key(key),
        )
        return (bool(rows[0][0]), json.loads(rows[0][1])) if rows else None

    @staticmethod
    def _journal(db: Store, rollout: str) -> list[tuple[Any, ...]]:
        """The rollout's applied calls in call order: (call_index, tool, arguments as JSON)."""
        return db.rows(
            f"SELECT call_index, tool, arguments FROM {db.t('journal')} WHERE rollout_id = ? AND ok = 1 "
            "ORDER BY call_index",
            (rollout,),
        )


def _key(key: CallKey) -> tuple[str, int, int]:
    return (key.rollout_id, key.attempt, key.call_index)
