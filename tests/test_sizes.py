"""Size limit of the library's code: no function over 80 lines in dpcompare/ and adapters/.

Checked against: every Python file under both trees, read with `ast` (a function's lines run from its `def` to its
last statement, nested functions and methods each counted on their own, and inside their enclosing one). A function
that outgrows the limit is split into smaller ones. A module has no line limit: what decides where code goes is the
rule of docs/ARCHITECTURE.md ("Where a new module goes"): a module serves one concern, in the package of that concern,
and grows as long as that concern needs; a metric is written in the measure/ module of what it measures (time,
memory, communication), never in a shared summary. Negative: the scanner run on planted files finds a function one
line over the limit and passes one at it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREES = ("dpcompare", "adapters")
FUNCTION_LINES = 80


def oversized(path: Path, function_lines: int = FUNCTION_LINES) -> list[str]:
    """The functions in the file at `path` over the limit (def to last line)."""
    source = path.read_text(encoding="utf-8")
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    found = []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > function_lines:
                found.append(f"{shown}:{node.lineno}: {node.name} is {length} lines (the limit is {function_lines})")
    return found


def test_no_function_of_the_library_is_over_the_limit() -> None:
    files = [p for tree in TREES for p in sorted((ROOT / tree).rglob("*.py"))]
    assert len(files) > 50  # the trees were found
    found = [line for p in files for line in oversized(p)]
    assert not found, "split into smaller functions:\n" + "\n".join(found)


def _function(name: str, body_lines: int, indent: str = "") -> str:
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(body_lines - 2))
    return f"{indent}def {name}():\n{body}{indent}    return None\n"


def test_the_scanner_finds_a_planted_long_function(tmp_path: Path) -> None:
    at_limit = tmp_path / "at_limit.py"
    at_limit.write_text(_function("fits", FUNCTION_LINES))
    assert len(at_limit.read_text().splitlines()) == FUNCTION_LINES
    assert oversized(at_limit) == []

    long_function = tmp_path / "long_function.py"
    long_function.write_text("class Holder:\n" + _function("too_long", FUNCTION_LINES + 1, indent="    "))
    found = oversized(long_function)
    assert len(found) == 1 and f"too_long is {FUNCTION_LINES + 1} lines" in found[0], found
