"""Regenerate every results table from the committed JSON in ``benchmarks/results/``.

    python benchmarks/report.py            # rewrite the tables that differ from their JSON
    python benchmarks/report.py --check    # write nothing; exit 1 naming every stale file

What it writes:

- ``benchmarks/results/<name>.md`` for every ``<name>.json`` there, rendered by the benchmark
  that wrote the JSON (``lab_bench.render``, ``adapter_bench.render``, ``tta_bench.render``,
  ``elastic_bench.render``, ``planner_cases.render``, ``plan_scaling.render``,
  ``codec_speed.render``, ``profile_lab.report``); a JSON with ``rows`` is data for
  ``fit_cpu_floor.py`` and has no table. ``profile_spread.md`` is ``profile_spread.py`` run on
  the ``CURRENT`` benchmarks.
- In ``README.md`` and ``docs/*.md``, the text between ``<!-- report:NAME -->`` and
  ``<!-- /report:NAME -->``: NAME is a table above (by file stem, without its ``#`` title) or
  one of the summaries of ``SUMMARIES``. Links inside a block are relative to its document.
  ``strategy_args`` is ``DeepCEEStrategy``'s argument table (``strategy_doc.py``), made from
  its signature and docstring rather than from a JSON.

The PNG charts are not regenerated here (their bytes depend on matplotlib's version): the
benchmarks' own ``--report-only`` rebuilds them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import adapter_bench  # noqa: E402
import codec_speed  # noqa: E402
import elastic_bench  # noqa: E402
import fit_cpu_floor  # noqa: E402
import lab_bench  # noqa: E402
import plan_scaling  # noqa: E402
import planner_cases  # noqa: E402
import profile_lab  # noqa: E402
import profile_spread  # noqa: E402
import strategy_doc  # noqa: E402
import tta_bench  # noqa: E402

__all__ = ["ADAPTER", "CURRENT", "SUMMARIES", "THROUGHPUT", "check", "expected_files", "main"]

CURRENT = (
    "cee6_gpt5m",
    "cee7_farend_gpt5m",
    "cee6_fastedge_gpt5m",
    "cee6_cnn",
    "cee6p10_gpt5m",
    "lan4_gpt5m",
)
"""The lab benchmarks of the current code: the summaries and ``profile_spread.md`` read these."""
THROUGHPUT = ("cee6_gpt5m", "cee6_layout_check", "cee7_farend_gpt5m", "cee6_fastedge_gpt5m")
"""The headline rows: lab benchmarks whose systems ran interleaved in one invocation with a
recorded date and commit (the older ``CURRENT`` files predate that and device choice)."""
ADAPTER = (
    "adapter_cee6_tenth",
    "adapter_cee7_farend_tenth",
    "adapter_cee6_planned",
    "adapter_cee7_farend_planned",
)
"""The adapter's headline rows: the planner's plan, the arms interleaved in one invocation."""
ADAPTER_ORACLE = ("adapter_cee6_tenth",)
"""The rows with an oracle arm (the README's summary)."""
TOLERANCE = 0.15
"""The cost model's target: a planned run's predicted step within 15% of the measured one."""
_RESULTS = "benchmarks/results"
_BLOCK = re.compile(
    r"<!-- report:(?P<name>[\w.-]+) -->\n(?P<body>.*?)<!-- /report:(?P=name) -->", re.S
)
_OPENING = re.compile(r"<!-- report:(?P<name>[\w.-]+) -->")


def _render(data: dict[str, Any]) -> str | None:
    """The Markdown table of one results JSON, by the benchmark that wrote it."""
    if "rows" in data:
        return None
    if "cases" in data:
        return planner_cases.render(data)
    if "plan_search_s" in data:
        return plan_scaling.render(data)
    if "adam_s_per_byte" in data:
        return codec_speed.render(data)
    if "modes" in data:
        return adapter_bench.render(data)
    if "arms" in data:
        return elastic_bench.render(data)
    if "tolerance" in data:
        return profile_lab.report(data)
    if "target" in data.get("config", {}):
        return tta_bench.render(data)
    if "systems" in data:
        return lab_bench.render(data)
    raise ValueError(f"no table for a JSON with keys {sorted(data)}: add its renderer to report.py")


def expected_files(root: Path) -> dict[Path, str]:
    """Every results table under ``root`` and the text its JSON gives."""
    results = root / _RESULTS
    tables: dict[Path, str] = {}
    for path in sorted(results.glob("*.json")):
        try:
            text = _render(json.loads(path.read_text()))
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        if text is not None:
            tables[path.with_suffix(".md")] = text
    spread = [f"{_RESULTS}/{name}.json" for name in CURRENT]
    tables[results / "profile_spread.md"] = profile_spread.header(
        spread, f"{_RESULTS}/profile_spread.md"
    ) + profile_spread.sections([root / p for p in spread])
    return tables


# ----------------------------------------------------------------------------- summaries
def _lab(root: Path) -> dict[str, dict[str, Any]]:
    return {name: json.loads((root / _RESULTS / f"{name}.json").read_text()) for name in CURRENT}


def _label(name: str, data: dict[str, Any], doc_dir: Path, root: Path) -> str:
    cfg = data["config"]
    link = os.path.relpath(root / _RESULTS / f"{name}.md", doc_dir)
    return (
        f"[{Path(cfg['topology']).stem}, {cfg.get('model', 'gpt').upper()} `{cfg['size']}`]({link})"
    )


def _best(data: dict[str, Any], keep: Callable[[str], bool]) -> str:
    """``median (min-max) system`` of the fastest system whose name ``keep`` accepts, or ``-``."""
    best: tuple[dict[str, float], str] | None = None
    for system, entry in data["systems"].items():
        stats = lab_bench._stats(entry["runs"])
        if (
            stats is not None
            and keep(system)
            and (best is None or stats["median"] > best[0]["median"])
        ):
            best = (stats, system)
    return "-" if best is None else f"{_spread(best[0])} `{best[1]}`"


def _spread(stats: dict[str, float]) -> str:
    """``median (min-max)`` over the runs."""
    return f"{stats['median']:.2f} ({stats['min']:.2f}-{stats['max']:.2f})"


def _plans(data: dict[str, Any], system: str) -> int:
    """How many different layouts the runs of ``system`` trained."""
    cfg = data["config"]
    runs = data["systems"].get(system, {}).get("runs", [])
    return len({lab_bench._layout(cfg, r) for r in runs if "samples_per_s" in r})


def _throughput(root: Path, doc_dir: Path) -> str:
    """Samples/s, median (min-max) over the runs: DeepCEE against the best alternative of the
    same invocation, on every benchmark of :data:`THROUGHPUT`."""
    lines = [
        "| benchmark | `deepcee` | plans | best alternative | `deepcee` / best | alternatives run "
        "| DDP, every device | best torch pipelining | measured |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in THROUGHPUT:
        data = json.loads((root / _RESULTS / f"{name}.json").read_text())
        cfg = data["config"]
        if "date" not in cfg or "commit" not in cfg:
            raise ValueError(f"{name}.json has no date and commit: it cannot be a headline row")
        ours = lab_bench._stats(data["systems"].get("deepcee", {}).get("runs", []))
        best = lab_bench.best_alternative(data)
        if ours is None or best is None:
            raise ValueError(f"{name}.json: a headline row needs deepcee and an alternative")
        st = best[1]
        ratio = (
            f"{ours['median'] / st['median']:.2f}x "
            f"({ours['min'] / st['max']:.2f}-{ours['max'] / st['min']:.2f}x)"
        )
        others = [s for s in data["systems"] if lab_bench.split_system(s)[0] not in
                  lab_bench.DEEPCEE_SYSTEMS]  # fmt: skip
        cells = [
            _spread(ours),
            str(_plans(data, "deepcee")),
            f"{_spread(st)} `{best[0]}`",
            ratio,
            str(len(others)),
            _best(data, lambda s: s == "ddp"),
            _best(data, lambda s: s.split("@")[0] in lab_bench.PIPE_SYSTEMS),
            f"{cfg['date']}, `{cfg['commit']}`",
        ]
        link = os.path.relpath(root / _RESULTS / f"{name}.md", doc_dir)
        model = f"{cfg.get('model', 'gpt').upper()} `{cfg['size']}`"
        lines.append(f"| [`{name}`]({link}), {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _adapter(root: Path, doc_dir: Path, names: tuple[str, ...] = ADAPTER) -> str:
    """The adapter's arms on every benchmark of ``names``: samples/s while the link is
    cut and on/off in every phase, median (min-max) over the runs; where an oracle arm ran, its
    samples/s while cut and the adapter's share of its gain (settled medians)."""
    lines = [
        "| benchmark | link cut | off, cut | on, cut | oracle, cut | share "
        "| on/off: before | cut | after | measured |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        data = json.loads((root / _RESULTS / f"{name}.json").read_text())
        if "date" not in data or "commit" not in data:
            raise ValueError(f"{name}.json has no date and commit: it cannot be a headline row")
        cfg = data["config"]
        off_runs = adapter_bench.mode_runs(data, "off")
        on_runs = adapter_bench.mode_runs(data, "on")
        phases = adapter_bench._phases(cfg["trace"], cfg["end_s"])
        if [p[0] for p in phases] != ["normal", "degraded", "recovered"]:
            raise ValueError(f"{name}.json: expected a trace that cuts one link and restores it")

        def values(runs: list[dict[str, Any]], phase: str) -> list[float]:
            return [r["phases"][phase]["samples_per_s"] for r in runs]

        def spread(v: list[float]) -> str:
            return _spread(dict(median=statistics.median(v), min=min(v), max=max(v)))

        ratios = []
        for phase, _, _ in phases:
            off, on = values(off_runs, phase), values(on_runs, phase)
            per_run = [b / a for a, b in zip(off, on, strict=True)]
            ratios.append(
                f"{statistics.median(on) / statistics.median(off):.2f}x "
                f"({min(per_run):.2f}-{max(per_run):.2f}x)"
            )
        cut = cfg["trace"][0]
        _, start, end = phases[1]
        oracle_runs = adapter_bench.mode_runs(data, "oracle")
        share = "-"
        if oracle_runs:
            share = adapter_bench.oracle_share(*(
                adapter_bench.phase_median(runs, "degraded", "settled_samples_per_s")
                for runs in (off_runs, on_runs, oracle_runs)
            ))  # fmt: skip
        cells = [
            f"{'-'.join(cut['link'])} at {cut['bandwidth_mbit']:g} Mbit/s, {start:g}-{end:g} s",
            spread(values(off_runs, "degraded")),
            spread(values(on_runs, "degraded")),
            spread(values(oracle_runs, "degraded")) if oracle_runs else "-",
            share,
            *ratios,
            f"{data['date']}, `{data['commit']}`",
        ]
        link = os.path.relpath(root / _RESULTS / f"{name}.md", doc_dir)
        lines.append(f"| [`{name}`]({link}) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _errors(data: dict[str, Any]) -> dict[str, list[float]]:
    """Cost-model error (predicted / measured mean step - 1) of every planned run, by system."""
    out: dict[str, list[float]] = {}
    for system, entry in data["systems"].items():
        for run in entry["runs"]:
            if "predicted_step_s" in run and "samples_per_s" in run:
                measured = run["global_batch"] / run["samples_per_s"]
                out.setdefault(system, []).append(run["predicted_step_s"] / measured - 1)
    return out


def _cost_model(root: Path, doc_dir: Path) -> str:
    """Every planned run's predicted step against its measured mean step."""
    lines = [
        "| benchmark | system | error per run (predicted / measured - 1) | within 15% |",
        "|---|---|---|---|",
    ]
    every: list[float] = []
    for name, data in _lab(root).items():
        for system, errors in _errors(data).items():
            every += errors
            within = sum(abs(e) <= TOLERANCE for e in errors)
            lines.append(
                f"| {_label(name, data, doc_dir, root)} | `{system}` | "
                + ", ".join(f"{e:+.1%}" for e in errors)
                + f" | {within} of {len(errors)} |"
            )
    within = sum(abs(e) <= TOLERANCE for e in every)
    lines += [
        "",
        f"{within} of {len(every)} planned runs within 15%; mean error "
        f"{statistics.fmean(every):+.1%}, mean absolute error "
        f"{statistics.fmean(abs(e) for e in every):.1%}.",
    ]
    return "\n".join(lines) + "\n"


def _cpu_floor_fit(root: Path, doc_dir: Path) -> str:
    """``fit_cpu_floor.py`` on its rows file and on the current benchmarks' runs."""
    rows_file = root / _RESULTS / fit_cpu_floor.ROWS_FILE.name
    return fit_cpu_floor.render(
        {
            f"`{rows_file.name}` (what the defaults were fitted to)": fit_cpu_floor.load_rows(
                [rows_file]
            ),
            "the current benchmarks' runs": fit_cpu_floor.load_rows(
                [root / _RESULTS / f"{name}.json" for name in CURRENT]
            ),
        }
    )


SUMMARIES: dict[str, Callable[[Path, Path], str]] = {
    "throughput": _throughput,
    "adapter": _adapter,
    "adapter_oracle": lambda root, doc_dir: _adapter(root, doc_dir, ADAPTER_ORACLE),
    "cost_model": _cost_model,
    "cpu_floor_fit": _cpu_floor_fit,
    "strategy_args": lambda root, doc_dir: strategy_doc.render(),
}
"""Blocks that summarise several results files: name -> render(root, document's folder)."""


# ----------------------------------------------------------------------------- documents
def _documents(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _fill(doc: Path, text: str, root: Path, tables: dict[Path, str]) -> str:
    """``text`` with every report block of ``doc`` regenerated."""
    closed = {m.group("name") for m in _BLOCK.finditer(text)}
    for m in _OPENING.finditer(text):
        if m.group("name") not in closed:
            raise ValueError(f"{doc}: <!-- report:{m.group('name')} --> has no closing marker")

    def block(m: re.Match[str]) -> str:
        name = m.group("name")
        if name in SUMMARIES:
            body = SUMMARIES[name](root, doc.parent)
        elif (path := root / _RESULTS / f"{name}.md") in tables:
            body = re.sub(r"\A# .*\n\n?", "", tables[path])
        else:
            known = sorted([*SUMMARIES, *(p.stem for p in tables)])
            raise ValueError(f"{doc}: unknown report block {name!r}; known: {', '.join(known)}")
        return f"<!-- report:{name} -->\n\n{body.strip()}\n\n<!-- /report:{name} -->"

    return _BLOCK.sub(block, text)


def check(root: Path) -> dict[Path, str]:
    """Every file under ``root`` whose committed text differs from what the JSON gives, with
    the text it should have."""
    tables = expected_files(root)
    wanted = dict(tables)
    for doc in _documents(root):
        if doc.exists():
            wanted[doc] = _fill(doc, doc.read_text(), root, tables)
    return {
        path: text for path, text in wanted.items() if not path.exists() or path.read_text() != text
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a table is stale")
    parser.add_argument("--root", type=Path, default=HERE.parent, help="the repository root")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    try:
        stale = check(root)
    except ValueError as e:
        print(f"report.py: {e}", file=sys.stderr)
        return 2
    for path, text in stale.items():
        name = path.relative_to(root)
        if args.check:
            print(f"stale: {name} (run: python benchmarks/report.py)", file=sys.stderr)
        else:
            path.write_text(text)
            print(f"wrote {name}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
