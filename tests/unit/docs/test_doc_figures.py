"""Every measured figure quoted in README.md and docs/ comes from a committed results file.

A figure is a ratio (``1.42x``, ``1.31-1.52x``) or a throughput (``78.25 samples/s``,
``72.9-74.7 samples/s``). Inside the generated blocks (``<!-- report:NAME -->``) every figure
is made from the committed JSON, which ``tests/unit/benchmarks/test_report.py`` checks
(``report.py --check``). Outside them, each number of a figure must appear in a committed file
under ``benchmarks/results/`` (the JSON or the Markdown tables made from it) or in a summary
block ``report.py`` renders from them; the few figures that are not measurements are listed in
:data:`NOT_MEASURED` with the reason.
"""

from __future__ import annotations

import itertools
import re
from functools import cache
from pathlib import Path

import pytest

from tests.helpers.benchmarks import load_benchmark
from tests.helpers.paths import ROOT

NOT_MEASURED = {
    "1.25x": "a setting of the search (planner.md: orders within 1.25x of the best are refined)",
    "1.5x": "a setting of the compact fit (planner.md: counts within 1.5x of the winner)",
}
"""Figures that are not measurements, each with why it needs no results file."""

_BLOCK = re.compile(r"<!-- report:(?P<name>[\w.-]+) -->\n.*?<!-- /report:(?P=name) -->", re.S)
_NUMBER = r"\d+(?:\.\d+)?"
FIGURE = re.compile(
    rf"(?<![\w.])(?P<low>{_NUMBER})(?:-(?P<high>{_NUMBER}))?"
    rf"(?:(?P<x>x)(?![\w])| samples/s)"
)


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def figures(text: str) -> list[tuple[str, list[str]]]:
    """``(figure, its numbers)`` of every figure outside the generated blocks of ``text``; a
    ratio without a decimal point (``2x``, a rule of thumb) is not counted."""
    found = []
    for m in FIGURE.finditer(_BLOCK.sub("", text)):
        numbers = [n for n in (m.group("low"), m.group("high")) if n is not None]
        if m.group("x") and not any("." in n for n in numbers):
            continue
        found.append((m.group(0), numbers))
    return found


@cache
def sources(root: Path = ROOT) -> str:
    """The committed results files' text, and every summary report.py renders from them."""
    results = root / "benchmarks" / "results"
    texts = [p.read_text() for p in sorted(results.glob("*.json"))]
    texts += [p.read_text() for p in sorted(results.glob("*.md"))]
    report = load_benchmark("report")
    texts += [render(root, root) for name, render in report.SUMMARIES.items()
              if name != "strategy_args"]  # fmt: skip
    return "\n".join(texts)


def unsourced(text: str, source: str) -> list[str]:
    """The figures of ``text`` whose numbers ``source`` does not hold (nor NOT_MEASURED)."""
    missing = []
    for figure, numbers in figures(text):
        if figure in NOT_MEASURED:
            continue
        if not all(re.search(rf"(?<![\d.]){re.escape(n)}(?![\d])", source) for n in numbers):
            missing.append(figure)
    return missing


@pytest.mark.parametrize("doc", documents(), ids=lambda p: p.name)
def test_every_figure_comes_from_a_committed_file(doc: Path) -> None:
    missing = unsourced(doc.read_text(), sources())
    assert not missing, (
        f"{doc.relative_to(ROOT)} quotes {missing}, which no file under benchmarks/results/ "
        "holds: quote a committed result, put it in a generated block, or (not a measurement) "
        "add it to NOT_MEASURED with the reason"
    )


def _unused(source: str, start: int, decimals: int) -> str:
    """The first number from ``start / 10**decimals`` up that ``source`` does not hold (the
    committed results hold many numbers; a made-up figure must be none of them)."""
    for i in itertools.count(start):
        value = f"{i / 10**decimals:.{decimals}f}"
        if not re.search(rf"(?<![\d.]){re.escape(value)}(?![\d])", source):
            return value
    raise AssertionError("unreachable")


def test_a_made_up_figure_fails() -> None:
    source = sources()
    text = (ROOT / "README.md").read_text()
    assert unsourced(text, source) == []
    ratio, speed = _unused(source, 187, 2), _unused(source, 9317, 2)
    low, high = _unused(source, 713, 1), _unused(source, 889, 1)
    made_up = text + f"\nDeepCEE ran {ratio}x DDP ({speed} samples/s, {low}-{high} samples/s).\n"
    assert unsourced(made_up, source) == [
        f"{ratio}x",
        f"{speed} samples/s",
        f"{low}-{high} samples/s",
    ]
    # Inside a generated block a figure is report.py's to check, not this test's.
    block = "<!-- report:throughput -->\n| 1.87x |\n<!-- /report:throughput -->\n"
    assert unsourced(text + block, source) == []


def test_figures_are_found_in_their_forms() -> None:
    text = "at 1.42x and 1.31-1.52x; 78.25 samples/s and 25-29 samples/s; 2x and 4x; v1.2.3x"
    assert figures(text) == [
        ("1.42x", ["1.42"]),
        ("1.31-1.52x", ["1.31", "1.52"]),
        ("78.25 samples/s", ["78.25"]),
        ("25-29 samples/s", ["25", "29"]),
    ]
