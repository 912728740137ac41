"""docs/ARCHITECTURE.md kept true: every module of dpcompare/ and adapters/ is named in its map ("Where each file is"),
and every public member of the Adapter contract is named in its contract table.

Each check is a function of the document's text and the tree, so its negative test runs it on a planted module or a
planted Adapter member that the document does not name.
"""

from __future__ import annotations

import re
from pathlib import Path

from dpcompare.contract.adapter import Adapter

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ARCHITECTURE.md"


def _words(text: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))


def _map(doc: str) -> str:
    """The fenced tree under "Where each file is"."""
    return doc.split("## Where each file is", 1)[1].split("```", 2)[1]


def _contract_table(doc: str) -> str:
    return doc.split("## The adapter contract", 1)[1].split("\n## ", 1)[0]


def unnamed_modules(doc: str, roots: list[Path]) -> list[str]:
    """The modules (package __init__ files aside) whose name the map does not hold."""
    named = _words(_map(doc))
    return [str(p.relative_to(ROOT)) for root in roots for p in sorted(root.rglob("*.py"))
            if p.name != "__init__.py" and p.stem not in named]


def unnamed_members(doc: str, cls: type) -> list[str]:
    """The public members of `cls` and of its dpcompare bases that the contract table does not name."""
    named = _words(_contract_table(doc))
    members = {n for c in cls.__mro__ if c.__module__.startswith("dpcompare") for n in vars(c) if not n.startswith("_")}
    return sorted(n for n in members if n not in named)


def test_every_module_is_named_in_the_map() -> None:
    missing = unnamed_modules(DOC.read_text(), [ROOT / "dpcompare", ROOT / "adapters"])
    assert not missing, f"docs/ARCHITECTURE.md's map does not name: {missing}"


def test_every_public_adapter_member_is_in_the_contract_table() -> None:
    missing = unnamed_members(DOC.read_text(), Adapter)
    assert not missing, f"docs/ARCHITECTURE.md's adapter contract table does not name: {missing}"


def test_a_module_the_map_does_not_name_is_caught(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    (tmp_path / "dpcompare" / "verify").mkdir(parents=True)
    (tmp_path / "dpcompare" / "verify" / "equivalence.py").write_text("")
    (tmp_path / "dpcompare" / "verify" / "a_planted_module.py").write_text("")
    assert unnamed_modules(DOC.read_text(), [tmp_path / "dpcompare"]) == ["dpcompare/verify/a_planted_module.py"]


def test_a_member_the_table_does_not_name_is_caught() -> None:
    planted = type("PlantedAdapter", (Adapter,), {"__module__": "dpcompare.contract.planted",
                                                  "a_planted_method": lambda self: None})
    assert unnamed_members(DOC.read_text(), planted) == ["a_planted_method"]
