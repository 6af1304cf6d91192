"""The argument table of docs/strategy.md, generated from ``DeepCEEStrategy`` itself.

    python benchmarks/report.py            # rewrites the <!-- report:strategy_args --> block
    python benchmarks/strategy_doc.py      # prints the table

Every parameter of ``DeepCEEStrategy.__init__`` (``inspect.signature``: its type annotation and
default) with its description from the class docstring's ``Args:`` section. The parameters that
Lightning's own ``DDPStrategy`` takes and the Trainer normally fills in are described in
:data:`LIGHTNING_ARGUMENTS` instead. A parameter described in neither is an error
(:func:`missing_descriptions`), so a new argument cannot reach the docs without a description.
"""

from __future__ import annotations

import inspect
import re
import sys
from typing import Any

__all__ = ["LIGHTNING_ARGUMENTS", "docstring_arguments", "missing_descriptions", "render"]

LIGHTNING_ARGUMENTS = {
    "accelerator": "Lightning's: the Trainer passes its accelerator (`Trainer(accelerator=...)`).",
    "parallel_devices": "Lightning's: the Trainer passes its devices (`Trainer(devices=...)`).",
    "cluster_environment": "Lightning's: where ranks and addresses come from (torchrun, SLURM, "
    "...); the Trainer detects it.",
    "checkpoint_io": "Lightning's: accepted and passed on; the strategy writes its sharded "
    "checkpoints (one file per stage) itself, not through it.",
    "precision_plugin": "Lightning's: set by `Trainer(precision=...)`; replaced by a "
    "pipeline-aware plugin (see Precision below), other plugins are refused.",
    "process_group_backend": 'Lightning\'s: `"nccl"` or `"gloo"`; `None` takes NCCL on CUDA and '
    'gloo on CPU. A cluster mixing GPU and CPU-only devices passes `"gloo"`.',
}
"""Parameters of Lightning's ``DDPStrategy`` that ``DeepCEEStrategy`` passes on unchanged."""

_ENTRY = re.compile(r"^    (?P<name>\w+): (?P<text>.*)$")
_MORE = re.compile(r"^        (?P<text>\S.*)$")


def _strategy() -> type:
    from lightning_deepcee import DeepCEEStrategy

    return DeepCEEStrategy


def docstring_arguments(cls: type) -> dict[str, str]:
    """``name -> description`` from the ``Args:`` section of ``cls``'s docstring (Google style:
    ``name: text`` indented 4 spaces, continued at 8)."""
    doc = inspect.getdoc(cls) or ""
    lines = doc.splitlines()
    if "Args:" not in lines:
        return {}
    out: dict[str, str] = {}
    name = None
    for line in lines[lines.index("Args:") + 1 :]:
        if (m := _ENTRY.match(line)) is not None:
            name = m.group("name")
            out[name] = m.group("text")
        elif name is not None and (m := _MORE.match(line)) is not None:
            out[name] += " " + m.group("text")
        elif line.strip():
            break  # the next section
    return out


def _parameters(cls: type) -> list[inspect.Parameter]:
    params = inspect.signature(cls.__init__).parameters.values()  # type: ignore[misc]
    return [p for p in params if p.name != "self"]


def missing_descriptions(cls: type) -> list[str]:
    """Parameters of ``cls.__init__`` described neither in its docstring nor as Lightning's."""
    described = docstring_arguments(cls)
    return [
        p.name
        for p in _parameters(cls)
        if p.name not in described and p.name not in LIGHTNING_ARGUMENTS
    ]


def _default(value: Any) -> str:
    if value is inspect.Parameter.empty:
        return "required"
    return f"`{value!r}`"


def _cell(text: str) -> str:
    """``text`` fit for one Markdown table cell: rST literals as code, no bare pipes."""
    return text.replace("``", "`").replace("|", "\\|")


def render(cls: type | None = None) -> str:
    """The Markdown table: argument, type, default, description."""
    cls = _strategy() if cls is None else cls
    missing = missing_descriptions(cls)
    if missing:
        raise ValueError(
            f"{cls.__name__}.__init__ has no description for {', '.join(missing)}: describe "
            f"each in the class docstring's Args: section"
        )
    described = docstring_arguments(cls)
    lines = ["| argument | type | default | what it does |", "|---|---|---|---|"]
    for p in _parameters(cls):
        kind = (
            p.annotation
            if isinstance(p.annotation, str)
            else inspect.formatannotation(p.annotation)
        )
        text = described.get(p.name) or LIGHTNING_ARGUMENTS[p.name]
        lines.append(
            f"| `{p.name}` | `{_cell(kind)}` | {_cell(_default(p.default))} | {_cell(text)} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
