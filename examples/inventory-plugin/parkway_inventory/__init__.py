"""parkway-inventory: an inventory ledger whose rows live in a database (SQLite or PostgreSQL), and
``stocker``, the agent program that trades in it. Both register as parkway plugins (pyproject.toml)."""
