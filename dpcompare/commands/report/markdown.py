"""The building blocks of report.md: numbered footnotes for n/a cells, Markdown tables and their cells, a plot's
block (the image with its caption, or why it was skipped) and the footnotes section. The sections themselves:
markdown_verdict (is it the same computation?), markdown_cost (what does it cost?), markdown_sweep (one knob at a
time) and markdown_sources (where the numbers come from)."""

from __future__ import annotations

from typing import Any, Callable

from dpcompare import verdict_words as words
from dpcompare.commands.report.derive import num
from dpcompare.result_view import Figure


class Footnotes:
    """n/a cells point at a numbered reason; one number per distinct reason."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}

    def na(self, reason: str) -> str:
        return "n/a" + self.ref(reason)

    def ref(self, reason: str) -> str:
        return f"[^{self._ids.setdefault(reason, len(self._ids) + 1)}]"

    def lines(self) -> list[str]:
        return [f"[^{n}]: {escape(reason)}" for reason, n in self._ids.items()]


def escape(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(escape(c) for c in row) + " |" for row in rows]
    return out


def cell(figure: Figure, notes: Footnotes, fmt: Callable[[Any], str] = num) -> str:
    """A figure, or n/a with its reason as a footnote."""
    return notes.na(figure.reason or "no reason was recorded") if figure.value is None else fmt(figure.value)


def plot_md(name: str, title: str, why: str | None, caption: str) -> list[str]:
    return [f"### {title}", "", *([f"![{title}]({name})", "", caption, ""] if why is None else
                                  [f"Skipped `{name}`: {why}.", ""])]


def verdict_cell(verdict: str) -> str:
    """Bold where the verdict is not a clean pass: the reader's eye goes there first."""
    return f"**{verdict}**" if verdict in words.NOT_A_PASS else verdict


def footnotes_section(notes: Footnotes) -> list[str]:
    footnotes = notes.lines()
    return ["## Why values are n/a", "", *footnotes, ""] if footnotes else []
