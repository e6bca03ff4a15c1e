"""The test tree's own rules: tests share code only through ``tests/support`` (and conftest files), the
tree mirrors the source tree, and every folder is a package (so equal file names in two folders are two
modules, not a collision)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.paths import ROOT

TESTS = ROOT / "tests"


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports, absolute names; a relative import is given as ``.name``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, "." * node.level + (node.module or "")))
    return found


def test_no_test_module_imports_another() -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in sorted(TESTS.rglob("*.py"))
        for line, name in imported_modules(path)
        if name.startswith(".") or (name.startswith("tests") and not name.startswith("tests.support"))
    ]
    assert wrong == [], "share it through tests/support instead:\n" + "\n".join(wrong)


def test_the_test_tree_mirrors_the_source_tree() -> None:
    # tests/actors/roles/controller/ tests actors/roles/controller/, and so on down.
    folders = [p for p in sorted(TESTS.rglob("*")) if p.is_dir() and p.name != "__pycache__"]
    unmatched = [
        str(folder.relative_to(ROOT))
        for folder in folders
        if folder.relative_to(TESTS).parts[0] in ("actors", "protocol", "brokers")
        and not (ROOT / folder.relative_to(TESTS) / "__init__.py").is_file()
    ]
    assert unmatched == [], f"test folders with no package of that path: {unmatched}"
    for top in ("actors", "protocol", "brokers"):
        assert (TESTS / top).is_dir(), top


def test_every_test_folder_is_a_package() -> None:
    missing = [
        str(folder.relative_to(ROOT))
        for folder in sorted({p.parent for p in TESTS.rglob("*.py")})
        if not (folder / "__init__.py").is_file()
    ]
    assert missing == []
