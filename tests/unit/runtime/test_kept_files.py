"""Kept files of the device cache: written whole or not at all, read back, aged, and refused
gracefully (a file that cannot be written or read costs a measurement, never a crash)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from lightning_deepcee.runtime.measure.kept import format_age, kept_age_s, read_kept, write_kept


def test_a_kept_file_round_trips_with_lists_as_tuples(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "links-abc.json"
    assert write_kept(path, {"a": [[1, 2], [3]], "b": 1.5, "c": "x"})
    assert read_kept(path) == {"a": ((1, 2), (3,)), "b": 1.5, "c": "x"}
    # The temporary file is renamed into place: nothing else is left beside it.
    assert [p.name for p in path.parent.iterdir()] == ["links-abc.json"]
    assert write_kept(path, {"a": 2})  # replaced whole
    assert read_kept(path) == {"a": 2}


def test_absent_unreadable_or_non_object_files_read_as_none(tmp_path: Path) -> None:
    assert read_kept(None) is None
    assert read_kept(tmp_path / "missing.json") is None
    (tmp_path / "half.json").write_text('{"a": [1, 2')
    assert read_kept(tmp_path / "half.json") is None
    (tmp_path / "list.json").write_text(json.dumps([1, 2]))
    assert read_kept(tmp_path / "list.json") is None


def test_a_refused_write_returns_false_and_keeps_the_old_file(tmp_path: Path) -> None:
    assert not write_kept(None, {"a": 1})
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    assert not write_kept(blocked / "plan.json", {"a": 1})
    path = tmp_path / "plan.json"
    assert write_kept(path, {"a": 1})
    with pytest.raises(TypeError):
        write_kept(path, {"a": object()})  # not JSON: a programming error, not a disk one
    assert read_kept(path) == {"a": 1}


def test_ages(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    assert kept_age_s(path) is None and kept_age_s(None) is None
    assert write_kept(path, {})
    hour_ago = time.time() - 3600
    os.utime(path, (hour_ago, hour_ago))
    age = kept_age_s(path)
    assert age is not None and 3599 <= age <= 3700
    assert [format_age(s) for s in (42, 90, 7200, 1.5 * 86400)] == [
        "42 s", "1.5 min", "2.0 h", "1.5 d",
    ]  # fmt: skip
