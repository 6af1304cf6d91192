"""The schema loader (omegaconf structured configs): errors name the file, the key and the type.

Also: every committed config under configs/ loads through its loader.
"""

from __future__ import annotations

import argparse
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from lightning_deepcee.lab.topology import load_topology
from lightning_deepcee.lab.trace import load_trace
from lightning_deepcee.profiler import ClusterProfile
from lightning_deepcee.profiler.schema import describe_type, load_structured, read_yaml
from tests.helpers.benchmarks import load_benchmark
from tests.helpers.paths import ROOT


@dataclass(kw_only=True)
class Disk:
    size_gb: int
    label: str = "data"


@dataclass(frozen=True, kw_only=True, slots=True)
class Machine:
    name: str
    cores: int
    speed: float = 1.0
    tags: tuple[str, ...] = ()
    disks: tuple[Disk, ...] = ()
    mounts: dict[str, Disk] = field(default_factory=dict)
    grid: list[list[float]] = field(default_factory=list)
    note: str | None = None
    raw: list[Any] = field(default_factory=list)
    fast: bool = False

    def __post_init__(self) -> None:
        if self.cores < 1:
            raise ValueError(f"cores: expected at least 1, got {self.cores}")


def _load(data: object, **kwargs: Any) -> Machine:
    return load_structured(Machine, data, source="m.yaml", **kwargs)


def _error(data: object, **kwargs: Any) -> str:
    with pytest.raises(ValueError) as info:
        _load(data, **kwargs)
    return str(info.value)


def test_loads_and_converts_with_the_dataclass_defaults() -> None:
    machine = _load(
        {
            "name": "m1",
            "cores": 4,
            "speed": 2,
            "tags": ["a", "b"],
            "disks": [{"size_gb": 10}],
            "mounts": {"root": {"size_gb": 5, "label": "os"}},
            "grid": [[0, 1.5], [2, 3]],
        }
    )
    assert machine.speed == 2.0 and isinstance(machine.speed, float)
    assert machine.disks == [Disk(size_gb=10)] and machine.mounts == {
        "root": Disk(size_gb=5, label="os")
    }
    assert machine.grid == [[0.0, 1.5], [2.0, 3.0]]
    assert list(machine.tags) == ["a", "b"]
    bare = _load({"name": "m2", "cores": 1})
    assert (bare.speed, bare.tags, bare.disks, bare.note, bare.fast) == (1.0, (), (), None, False)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"name": "m", "cores": "four"},
            "m.yaml: cores: expected int, got str 'four'; write an integer",
        ),
        (
            {"name": "m", "cores": "4"},
            "m.yaml: cores: expected int, got str '4'; write the number without quotes",
        ),
        (
            {"name": "m", "cores": 2.5},
            "m.yaml: cores: expected int, got float 2.5; write an integer",
        ),
        (
            {"name": "m", "cores": True},
            "m.yaml: cores: expected int, got bool True; write an integer",
        ),
        ({"name": "m", "cores": 1, "speed": None}, "m.yaml: speed: expected float, got null"),
        ({"name": 1e5, "cores": 1}, "m.yaml: name: expected str, got float 100000.0; quote it"),
        ({"name": "m", "cores": 1, "fast": "yes"}, "m.yaml: fast: expected bool, got str 'yes'"),
        ({"name": "m", "cores": 1, "tags": "a"}, "m.yaml: tags: expected list[str], got str 'a'"),
        ({"name": "m", "cores": 1, "tags": ["a", 2]}, "m.yaml: tags[1]: expected str, got int 2"),
        (
            {"name": "m", "cores": 1, "grid": [[0.0, 1.0], [2.0, "x"]]},
            "m.yaml: grid[1][1]: expected float, got str 'x'; write a number",
        ),
        (
            {"name": "m", "cores": 1, "grid": [[0.0, [1.0]]]},
            "m.yaml: grid[0][1]: expected float, got list [1.0]",
        ),
        (
            {"name": "m", "cores": 1, "disks": [{"size_gb": 1}, {"size_gb": "big"}]},
            "m.yaml: disks[1].size_gb: expected int, got str 'big'; write an integer",
        ),
        (
            {"name": "m", "cores": 1, "mounts": {"root": {"size_gb": 1.5}}},
            "m.yaml: mounts.root.size_gb: expected int, got float 1.5",
        ),
        (
            {"name": "m", "cores": 1, "disks": ["sda"]},
            "m.yaml: disks[0]: expected a mapping of Disk keys (size_gb, label), got str 'sda'",
        ),
        (
            {"name": "m", "cores": 1, "mounts": {3: {"size_gb": 1}}},
            "m.yaml: mounts.3: expected a text key, got int 3",
        ),
        ([1, 2], "m.yaml: Machine: expected a mapping of Machine keys (name, cores, speed,"),
    ],
)
def test_a_wrong_type_names_the_file_the_key_and_the_type(data: object, message: str) -> None:
    assert _error(data).startswith(message)


def test_an_unknown_key_is_named_with_the_allowed_ones() -> None:
    assert _error({"name": "m", "cores": 1, "colour": "red"}) == (
        "m.yaml: colour: unknown key of Machine; remove it or fix its spelling (allowed: name, "
        "cores, speed, tags, disks, mounts, grid, note, raw, fast)"
    )
    assert _error({"name": "m", "cores": 1, "disks": [{"size_gb": 1, "rpm": 7200}]}) == (
        "m.yaml: disks[0].rpm: unknown key of Disk; remove it or fix its spelling (allowed: "
        "size_gb, label)"
    )
    hint = _error({"name": "m", "cores": 1, "gpu": 1}, unknown_key_hint=lambda k: f"no {k} here")
    assert hint == "m.yaml: gpu: no gpu here"


def test_a_missing_required_key_is_named() -> None:
    assert _error({"name": "m"}) == (
        "m.yaml: cores: missing required key of Machine; add it (cores: <int>)"
    )
    assert _error({"name": "m", "cores": 1, "mounts": {"root": {"label": "x"}}}) == (
        "m.yaml: mounts.root.size_gb: missing required key of Disk; add it (size_gb: <int>)"
    )


def test_checks_of_the_dataclass_get_the_file_and_key_prefix() -> None:
    assert _error({"name": "m", "cores": 0}) == "m.yaml: cores: expected at least 1, got 0"
    with pytest.raises(ValueError, match=r"^cores: expected at least 1, got 0$"):
        load_structured(Machine, {"name": "m", "cores": 0})  # no source: the key comes first
    with pytest.raises(ValueError, match=r"^m\.yaml: box\[2\]\.cores: expected at least 1"):
        load_structured(Machine, {"name": "m", "cores": 0}, source="m.yaml", key="box[2]")


def test_text_is_literal_and_passthrough_is_unconverted() -> None:
    machine = _load({"name": "${oops}", "cores": 1, "note": "???", "tags": ["${a", "b}"]})
    assert (machine.name, machine.note, list(machine.tags)) == ("${oops}", "???", ["${a", "b}"])
    raw = [1, "inf", {"a": [None]}]
    assert _load({"name": "m", "cores": 1, "raw": raw}, passthrough={"raw"}).raw is raw
    assert _load({"name": "m", "cores": 1, "note": None}).note is None


def test_no_omegaconf_warnings() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        machine = _load({"name": "m", "cores": 1, "speed": 3, "grid": [[1, 2]], "tags": ("a",)})
    assert [str(w.message) for w in caught] == []
    assert (machine.speed, list(map(list, machine.grid)), list(machine.tags)) == (
        3,
        [[1, 2]],
        ["a"],
    )


def test_describe_type() -> None:
    assert describe_type(list[list[float]]) == "list[list[float]]"
    assert describe_type(str | None) == "str or null"
    assert describe_type(dict[str, Disk]) == "mapping of str to Disk"


def test_read_yaml_names_the_file_on_a_syntax_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(
        ValueError,
        match=r"bad\.yaml: not valid YAML at line 2, column 1: expected ',' or '\]', but got "
        r"'<stream end>' \(while parsing a flow sequence\); fix the syntax there$",
    ):
        read_yaml(bad)
    with pytest.raises(FileNotFoundError):
        read_yaml(tmp_path / "missing.yaml")


# ------------------------------------------------------------------------------------------
# Bench configs (benchmarks/lab_bench.py parse_with_config)
# ------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench")
    p.add_argument("--config", type=Path)
    p.add_argument("--topology", type=Path)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--end-s", type=float, default=1.0)
    p.add_argument("--receive-ahead", default="on", choices=["on", "off"])
    p.add_argument("--fresh", action="store_true")
    return p


def _bench_error(tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]) -> str:
    config = tmp_path / "bench.yaml"
    config.write_text(text)
    with pytest.raises(SystemExit):
        load_benchmark("lab_bench").parse_with_config(_parser(), ["--config", str(config)])
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_bench_config_supplies_defaults_that_the_command_line_overrides(tmp_path: Path) -> None:
    config = tmp_path / "bench.yaml"
    config.write_text("topology: t.yaml\nruns: 5\nend-s: 220\nreceive_ahead: 'off'\nfresh: true\n")
    parse = load_benchmark("lab_bench").parse_with_config
    args = parse(_parser(), ["--config", str(config), "--runs", "1"])
    assert args.topology == Path("t.yaml") and args.runs == 1 and args.end_s == 220.0
    assert args.receive_ahead == "off" and args.fresh is True
    assert parse(_parser(), ["--runs", "2"]).runs == 2
    config.write_text("# nothing set\n")
    assert parse(_parser(), ["--config", str(config)]).runs == 3


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("runs: three\n", "bench.yaml: runs: expected int or null, got str 'three'"),
        ("run: 3\n", "bench.yaml: run: unknown key of BenchConfig; remove it or fix its spelling"),
        ("receive_ahead: off\n", "bench.yaml: receive_ahead: expected str or null, got bool False"),
        ("receive_ahead: maybe\n", "bench.yaml: receive_ahead: expected one of ['on', 'off']"),
        ("- runs\n", "bench.yaml: BenchConfig: expected a mapping of BenchConfig keys"),
        ("runs: [3\n", "bench.yaml: not valid YAML at line 2"),
    ],
)
def test_bench_config_errors_name_the_file_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    assert message in _bench_error(tmp_path, text, capsys)


class _Parsed(Exception):
    pass


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "bench").glob("*.yaml")), ids=str)
def test_committed_bench_configs_load(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lab_bench = load_benchmark("lab_bench")
    prefixes = ("adapter", "tta", "elastic")
    script = path.stem.split("_")[0] if path.stem.startswith(prefixes) else "lab"
    module = load_benchmark(f"{script}_bench")
    parse = lab_bench.parse_with_config
    parsed: dict[str, Any] = {}

    def capture(p: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
        parsed.update(vars(parse(p, argv)))
        raise _Parsed

    monkeypatch.setattr(lab_bench, "parse_with_config", capture)
    with pytest.raises(_Parsed):
        module.harness_main(["--config", str(path)])
    written = yaml.safe_load(path.read_text())
    for key, value in written.items():
        got = parsed[key.replace("-", "_")]
        assert str(got) == str(value) if isinstance(got, Path) else got == value, key


# ------------------------------------------------------------------------------------------
# Every committed topology, trace and profile loads
# ------------------------------------------------------------------------------------------


def test_committed_lab_configs_and_profiles_load() -> None:
    topologies = {}
    for path in sorted((ROOT / "configs" / "lab").glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        if isinstance(data, dict) and "regions" in data:
            topologies[path.stem] = load_topology(path)
    assert {"cee3_small", "cee6", "cee6_p10", "cee8", "lan4"} <= set(topologies)
    assert topologies["cee6_p10"].cpu_period_ms == 10.0
    assert len(load_trace(ROOT / "configs/lab/trace_wan_dip.yaml", topologies["cee6"]).events) == 4
    halve = load_trace(ROOT / "configs/lab/trace_wan_halve.yaml", topologies["cee3_small"])
    assert [e.bandwidth_mbit for e in halve.events] == [10.0, 20.0]
    for path in sorted((ROOT / "configs" / "profiles").glob("*.yaml")):
        profile = ClusterProfile.from_yaml(path)
        assert math.isinf(profile.bandwidth_bytes_per_s[0][0])
