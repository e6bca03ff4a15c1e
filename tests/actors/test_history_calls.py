"""Every ``history.record("kind", ...)`` call still in the source names a kind and only its fields.

The controller still records with the transitional form (a kind and file-named keyword fields) until
its calls pass typed records. That form is checked when it runs; this reads every such call in the
source, so one that no test reaches is checked too. Once no call uses the form, it checks nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

import msgspec
import parkway.actors
from parkway.protocol.history import KINDS


def transitional_calls() -> list[tuple[str, int, str, set[str]]]:
    """(file, line, kind, keywords) of every ``<something>.record("kind", **fields)`` call."""
    found = []
    root = Path(parkway.actors.__file__).parent
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "record"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                continue
            assert all(k.arg is not None for k in node.keywords), f"{path}:{node.lineno}: **fields"
            found.append(
                (
                    str(path.relative_to(root)),
                    node.lineno,
                    node.args[0].value,
                    {str(k.arg) for k in node.keywords},
                )
            )
    return found


def test_every_transitional_record_call_matches_its_kind() -> None:
    problems = []
    for where, line, kind, keywords in transitional_calls():
        cls = KINDS.get(kind)
        if cls is None:
            problems.append(f"{where}:{line}: unknown kind {kind!r}")
            continue
        fields = msgspec.structs.fields(cls)
        unknown = keywords - {f.encode_name for f in fields}
        missing = {f.encode_name for f in fields if f.required} - keywords
        if unknown or missing:
            problems.append(
                f"{where}:{line}: {kind} with unknown {sorted(unknown)}, missing {sorted(missing)}"
            )
    assert not problems, "\n".join(problems)


def test_the_transitional_calls_are_the_controllers_alone() -> None:
    outside = [
        f"{where}:{line}"
        for where, line, _, _ in transitional_calls()
        if not where.startswith("roles/controller/")
    ]
    assert not outside, "every other actor records typed records"
