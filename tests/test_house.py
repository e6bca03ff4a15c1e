"""The house rules, checked: sizes a newcomer can read, and the folders being the architecture.

No module over 600 lines, no class over 400, no more than 12 modules at the top of ``actors/`` (the
packages under it hold the rest), and every folder of Python code a package the wheel picks up.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = [ROOT / "actors", ROOT / "protocol", ROOT / "brokers"]
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 400
MAX_ACTORS_TOP_MODULES = 12


def modules() -> list[Path]:
    return sorted(p for top in SOURCE for p in top.rglob("*.py") if "__pycache__" not in p.parts)


def test_there_is_code_to_check() -> None:
    assert len(modules()) > 50


def test_no_module_is_over_600_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in modules()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"split these by what they do: {long}"


def test_no_class_is_over_400_lines() -> None:
    big = {}
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    big[f"{path.relative_to(ROOT)}:{node.name}"] = lines
    assert not big, f"give these classes' jobs to smaller ones: {big}"


def test_actors_has_few_modules_at_its_top() -> None:
    top = sorted(p.name for p in (ROOT / "actors").glob("*.py"))
    assert len(top) <= MAX_ACTORS_TOP_MODULES, top


def test_every_folder_of_code_is_a_package() -> None:
    """setup.py finds packages by their __init__.py: a folder without one would be left out of the wheel."""
    missing = sorted(
        str(folder.relative_to(ROOT))
        for top in SOURCE
        for folder in {p.parent for p in top.rglob("*.py") if "__pycache__" not in p.parts}
        if not (folder / "__init__.py").exists()
    )
    assert not missing, f"add an __init__.py to: {missing}"


def test_every_type_ignore_says_why() -> None:
    """The type checker's exceptions are few and each is explained: on its line after the ignore, or
    in a comment right above it."""
    unexplained = []
    for path in modules():
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines):
            if "type: ignore" not in line:
                continue
            after = line.split("type: ignore", 1)[1].split("]", 1)[-1]
            above = lines[number - 1].strip() if number else ""
            if "#" not in after and not above.startswith("#"):
                unexplained.append(f"{path.relative_to(ROOT)}:{number + 1}")
    assert not unexplained, f"say why the checker is wrong here: {unexplained}"
