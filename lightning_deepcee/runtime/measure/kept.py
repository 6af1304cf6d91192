"""Figures kept on disk between runs: atomic JSON files, their age, and how an age reads.

The device cache keeps block timings per device, link figures per device set
(``cluster.py``) and the plan that trained per profile (``strategy/setup_plan.py``). A kept
file is written whole or not at all (a temporary file, then a rename), so a run that stops
mid-write leaves the previous figures, never half a file; one that cannot be written or read
only costs the next start a measurement or a search.

Standard library only.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["format_age", "kept_age_s", "read_kept", "write_kept"]


def write_kept(path: Path | None, data: Any) -> bool:
    """Write ``data`` as JSON to ``path`` atomically; whether it was written (``False`` when
    ``path`` is None or the file system refuses)."""
    if path is None:
        return False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}")
        temporary.write_text(json.dumps(data))
        os.replace(temporary, path)
    except OSError:
        return False
    return True


def read_kept(path: Path | None) -> dict[str, Any] | None:
    """A kept JSON object's fields, lists as tuples; None when absent, unreadable or not an
    object."""
    if path is None or not path.is_file():
        return None
    try:
        fields = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(fields, dict):
        return None
    return {k: _tuples(v) if isinstance(v, list) else v for k, v in fields.items()}


def kept_age_s(path: Path | None) -> float | None:
    """Seconds since ``path`` was written (``None`` when it cannot be read)."""
    try:
        return max(0.0, time.time() - path.stat().st_mtime) if path is not None else None
    except OSError:
        return None


def format_age(seconds: float) -> str:
    """An age as a person reads it: ``"42 s"``, ``"3.5 min"``, ``"2.0 h"``, ``"1.5 d"``."""
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def _tuples(value: list[Any]) -> tuple[Any, ...]:
    return tuple(_tuples(v) if isinstance(v, list) else v for v in value)
