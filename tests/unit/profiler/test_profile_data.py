"""Unit tests for the profile data types: validation, YAML/JSON round trips, fingerprints, cache."""

from __future__ import annotations

import copy
import json
import math
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_deepcee.profiler import (
    ClusterProfile,
    DeviceProfile,
    ProfileCacheWarning,
    capability_score,
    fingerprint,
    fingerprint_cluster,
    load_cached_profile,
)
from tests.helpers.paths import EXAMPLE_PROFILE as EXAMPLE


def _device(rank: int, num_blocks: int = 3, **overrides: Any) -> DeviceProfile:
    fields: dict[str, Any] = {
        "rank": rank,
        "host": f"host-{rank}",
        "kind": "edge",
        "memory_bytes": 8 * 2**30,
        "forward_s": [0.01 * (rank + 1)] * num_blocks,
        "backward_input_s": [0.01] * num_blocks,
        "backward_weight_s": [0.005] * num_blocks,
        "activation_bytes": [1024] * num_blocks,
        "parameter_bytes": [4096] * num_blocks,
        "reference_microbatch_size": 2,
        "capability": 10.0 / (rank + 1),
    }
    fields.update(overrides)
    return DeviceProfile(**fields)


def _profile(num_devices: int = 3, num_blocks: int = 3) -> ClusterProfile:
    latency = [
        [0.0 if i == j else 0.001 * (i + j) for j in range(num_devices)] for i in range(num_devices)
    ]
    bandwidth = [
        [math.inf if i == j else 1e6 * (1 + i + 2 * j) for j in range(num_devices)]
        for i in range(num_devices)
    ]
    return ClusterProfile(
        devices=tuple(_device(rank, num_blocks) for rank in range(num_devices)),
        latency_s=latency,  # type: ignore[arg-type]  # lists are normalised to tuples
        bandwidth_bytes_per_s=bandwidth,  # type: ignore[arg-type]
        num_blocks=num_blocks,
        model_fingerprint=fingerprint({"model": "test"}),
        cluster_fingerprint=fingerprint_cluster([f"host-{r}" for r in range(num_devices)]),
    )


# ------------------------------------------------------------------------------------------
# Round trips
# ------------------------------------------------------------------------------------------


def test_lists_are_normalised_to_tuples_and_profile_is_hashable() -> None:
    profile = _profile()
    assert isinstance(profile.latency_s, tuple) and isinstance(profile.latency_s[0], tuple)
    assert isinstance(profile.devices[0].forward_s, tuple)
    assert hash(profile) == hash(_profile())


def test_dict_round_trip_is_strict_json_with_inf_as_text() -> None:
    profile = _profile()
    data = profile.to_dict()
    assert data["bandwidth_bytes_per_s"][0][0] == "inf"
    text = json.dumps(data, allow_nan=False)  # raises if any inf/nan float leaked through
    assert ClusterProfile.from_dict(json.loads(text)) == profile


@pytest.mark.parametrize("suffix", ["yaml", "json"])
def test_file_round_trip_keeps_inf_bandwidth(tmp_path: Path, suffix: str) -> None:
    profile = _profile(4, 2)
    path = tmp_path / f"profile.{suffix}"
    getattr(profile, f"to_{suffix}")(path)
    loaded = getattr(ClusterProfile, f"from_{suffix}")(path)
    assert loaded == profile
    assert loaded.bandwidth_bytes_per_s[2][2] == math.inf
    assert "Infinity" not in path.read_text()


def test_yaml_keeps_strings_that_look_like_exponent_numbers(tmp_path: Path) -> None:
    # YAML 1.1 leaves "1e5" a plain string, but our loader reads 1e5 as a float: it must be
    # written quoted (hypothesis found host "0e0" coming back as 0.0).
    data = _profile(2, 2).to_dict()
    data["devices"][0]["host"] = "1e5"
    data["model_fingerprint"] = "0e0"
    profile = ClusterProfile.from_dict(data)
    path = tmp_path / "profile.yaml"
    profile.to_yaml(path)
    assert ClusterProfile.from_yaml(path) == profile


@pytest.mark.parametrize("text", [".inf", "inf", "'inf'", ".Inf"])
def test_yaml_inf_spellings_are_read(tmp_path: Path, text: str) -> None:
    data = _profile(2, 1).to_dict()
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data).replace("- inf", f"- {text}"))
    assert ClusterProfile.from_yaml(path).bandwidth_bytes_per_s[1][1] == math.inf


def test_yaml_exponent_without_dot_or_sign_is_a_number(tmp_path: Path) -> None:
    # PyYAML (YAML 1.1) reads "1.25e8" as a string; hand-written files use that form.
    data = _profile(2, 1).to_dict()
    text = yaml.safe_dump(data, default_flow_style=None)
    text = text.replace("3000000.0", "3e6").replace("2000000.0", "2.0e6")
    path = tmp_path / "p.yaml"
    path.write_text(text)
    assert "3e6" in text
    loaded = ClusterProfile.from_yaml(path)
    assert loaded == _profile(2, 1)


finite_seconds = st.floats(min_value=0.0, max_value=1e3, allow_nan=False, allow_infinity=False)
bandwidths = st.one_of(st.floats(min_value=1e-3, max_value=1e12), st.just(math.inf))


@st.composite
def cluster_profiles(draw: st.DrawFn) -> ClusterProfile:
    num_devices = draw(st.integers(1, 5))
    num_blocks = draw(st.integers(1, 4))
    per_block = st.lists(finite_seconds, min_size=num_blocks, max_size=num_blocks)
    sizes = st.lists(st.integers(0, 2**40), min_size=num_blocks, max_size=num_blocks)
    devices = tuple(
        DeviceProfile(
            rank=rank,
            host=draw(st.text(min_size=1, max_size=8).filter(str.strip)),
            kind=draw(st.sampled_from(["cloud", "edge", "end", "cpu"])),
            memory_bytes=draw(st.integers(0, 2**45)),
            forward_s=tuple(draw(per_block)),
            backward_input_s=tuple(draw(per_block)),
            backward_weight_s=tuple(draw(per_block)),
            activation_bytes=tuple(draw(sizes)),
            parameter_bytes=tuple(draw(sizes)),
            reference_microbatch_size=draw(st.integers(1, 64)),
            capability=draw(st.floats(min_value=1e-6, max_value=1e6)),
        )
        for rank in range(num_devices)
    )
    row = st.lists(bandwidths, min_size=num_devices, max_size=num_devices)
    lat_row = st.lists(finite_seconds, min_size=num_devices, max_size=num_devices)
    return ClusterProfile(
        devices=devices,
        latency_s=tuple(tuple(draw(lat_row)) for _ in range(num_devices)),
        bandwidth_bytes_per_s=tuple(tuple(draw(row)) for _ in range(num_devices)),
        num_blocks=num_blocks,
        model_fingerprint=draw(st.text(min_size=1, max_size=16).filter(str.strip)),
        cluster_fingerprint=fingerprint_cluster([d.host for d in devices]),
    )


@settings(max_examples=40, deadline=None)
@given(profile=cluster_profiles())
def test_random_profiles_round_trip_through_yaml_and_json(profile: ClusterProfile) -> None:
    assert ClusterProfile.from_dict(profile.to_dict()) == profile
    with tempfile.TemporaryDirectory() as directory:
        for suffix in ("yaml", "json"):
            path = Path(directory) / f"p.{suffix}"
            getattr(profile, f"to_{suffix}")(path)
            assert getattr(ClusterProfile, f"from_{suffix}")(path) == profile


# ------------------------------------------------------------------------------------------
# Malformed input: the error names the field path
# ------------------------------------------------------------------------------------------


def _set_path(data: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    target: Any = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value


def _delete_path(data: dict[str, Any], path: tuple[Any, ...]) -> None:
    target: Any = data
    for key in path[:-1]:
        target = target[key]
    del target[path[-1]]


_MISSING = object()


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (
            ("devices", 2, "memory_bytes"),
            -5,
            "devices[2].memory_bytes: expected a non-negative integer, got -5",
        ),
        (
            ("devices", 1, "host"),
            _MISSING,
            "devices[1].host: missing required key of DeviceProfile; add it (host: <str>)",
        ),
        (
            ("num_blocks",),
            _MISSING,
            "num_blocks: missing required key of ClusterProfile; add it (num_blocks: <int>)",
        ),
        (
            ("colour",),
            "blue",
            "colour: unknown key of ClusterProfile; remove it or fix its spelling (allowed: "
            "devices, latency_s, bandwidth_bytes_per_s, num_blocks, model_fingerprint, "
            "cluster_fingerprint)",
        ),
        (
            ("devices", 0, "gpu"),
            "a100",
            "devices[0].gpu: unknown key of DeviceProfile; remove it or fix its spelling "
            "(allowed: rank, host, kind, memory_bytes, forward_s,",
        ),
        (
            ("bandwidth_bytes_per_s", 0, 1),
            -1.0e6,
            "bandwidth_bytes_per_s[0][1]: expected a positive",
        ),
        (("bandwidth_bytes_per_s", 2, 0), 0.0, "bandwidth_bytes_per_s[2][0]: expected a positive"),
        (("bandwidth_bytes_per_s", 1, 2), float("nan"), "bandwidth_bytes_per_s[1][2]: expected"),
        (("bandwidth_bytes_per_s", 1, 2), "fast", "bandwidth_bytes_per_s[1][2]: expected"),
        (("latency_s", 1, 0), -0.001, "latency_s[1][0]: expected a non-negative finite latency"),
        (("latency_s", 1, 0), "inf", "latency_s[1][0]: expected a non-negative finite latency"),
        (("latency_s", 2), [0.0, 0.1], "latency_s[2]: expected 3 entries (one per device), got 2"),
        (("devices", 1, "rank"), 0, "devices[1].rank: expected 1"),
        (("devices", 0, "rank"), -1, "devices[0].rank: expected a non-negative integer, got -1"),
        (
            ("devices", 0, "memory_bytes"),
            True,
            "devices[0].memory_bytes: expected int, got bool True; write an integer",
        ),
        (
            ("devices", 0, "memory_bytes"),
            1.5,
            "devices[0].memory_bytes: expected int, got float 1.5; write an integer",
        ),
        (
            ("devices", 0, "memory_bytes"),
            "8G",
            "devices[0].memory_bytes: expected int, got str '8G'; write an integer",
        ),
        (
            ("devices", 0, "memory_bytes"),
            "8",
            "devices[0].memory_bytes: expected int, got str '8'; write the number without quotes",
        ),
        (("devices", 1, "forward_s", 2), -0.1, "devices[1].forward_s[2]: expected a non-negative"),
        (
            ("devices", 1, "backward_weight_s"),
            [0.1],
            "devices[1].backward_weight_s: expected 3 entries",
        ),
        (
            ("devices", 2, "capability"),
            0.0,
            "devices[2].capability: expected a positive finite score",
        ),
        (("devices", 2, "host"), "", "devices[2].host: expected a non-empty string"),
        (("devices", 0, "reference_microbatch_size"), 0, "devices[0].reference_microbatch_size"),
        (("devices",), [], "devices: expected at least one device"),
        (
            ("devices", 1),
            "not a device",
            "devices[1]: expected a mapping of DeviceProfile keys (rank, host, kind,",
        ),
        (("devices",), {"a": 1}, "devices: expected list[DeviceProfile], got dict {'a': 1}"),
        (("num_blocks",), 0, "num_blocks: expected a positive number of blocks, got 0"),
        (("devices", 0, "fixed_s"), [0.01], "devices[0].fixed_s: expected 3 entries"),
        (("devices", 0, "fixed_s"), [0.01, 1.0, 0.0], "devices[0].fixed_s[1]: 1.0 s is more"),
        (("devices", 0, "fixed_s"), [0.0, -0.01, 0.0], "devices[0].fixed_s[1]: expected a non-"),
        (
            ("model_fingerprint",),
            123,
            "model_fingerprint: expected str, got int 123; quote it if it is text",
        ),
        (("model_fingerprint",), " ", "model_fingerprint: expected a non-empty string, got ' '"),
        (
            ("devices", 0, "optimizer_s_per_byte"),
            -1e-9,
            "devices[0].optimizer_s_per_byte: expected a non-negative",
        ),
        (("devices", 1, "cpu_share"), 0.0, "devices[1].cpu_share: expected a fraction of a core"),
        (("devices", 1, "cpu_share"), 1.5, "devices[1].cpu_share: expected a fraction of a core"),
        (("devices", 1, "cpu_period_s"), -0.1, "devices[1].cpu_period_s: expected a non-negative"),
        (("devices", 0, "backward_s"), [0.01], "devices[0].backward_s: expected 3 entries"),
        (("devices", 0, "backward_s"), [0.0, -0.01, 0.0], "devices[0].backward_s[1]: expected"),
    ],
)
def test_from_dict_errors_name_the_field(path: tuple[Any, ...], value: Any, message: str) -> None:
    data = copy.deepcopy(_profile(3, 3).to_dict())
    if value is _MISSING:
        _delete_path(data, path)
    else:
        _set_path(data, path, value)
    with pytest.raises(ValueError) as info:
        ClusterProfile.from_dict(data)
    assert str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda text: text.replace("host: host-1", "host: 1e5"),
            "devices[1].host: expected str, got float 100000.0; quote it if it is text",
        ),
        (
            lambda text: text.replace("num_blocks: 3", "num_blocks: three"),
            "num_blocks: expected int, got str 'three'; write an integer",
        ),
        (
            lambda text: text.replace("num_blocks: 3", "num_blocks: 3\nnum_block: 3"),
            "num_block: unknown key of ClusterProfile; remove it or fix its spelling",
        ),
        (
            lambda text: text.replace("  kind: edge\n", "", 1),
            "devices[0].kind: missing required key of DeviceProfile; add it (kind: <str>)",
        ),
    ],
)
def test_yaml_errors_name_the_file_the_key_and_the_type(
    tmp_path: Path, edit: Any, message: str
) -> None:
    path = tmp_path / "p.yaml"
    _profile(3, 3).to_yaml(path)
    path.write_text(edit(path.read_text()))
    with pytest.raises(ValueError) as info:
        ClusterProfile.from_yaml(path)
    assert str(info.value).startswith(f"{path}: {message}"), str(info.value)


def test_json_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    data = _profile(2, 1).to_dict()
    data["devices"][1]["rank"] = "1"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"p\.json: devices\[1\]\.rank: expected int, got str '1'"):
        ClusterProfile.from_json(path)
    path.write_text("{")
    with pytest.raises(ValueError, match=r"p\.json: not valid JSON"):
        ClusterProfile.from_json(path)


def test_wrong_matrix_size_is_reported_with_expected_shape() -> None:
    data = _profile(3, 3).to_dict()
    data["bandwidth_bytes_per_s"] = data["bandwidth_bytes_per_s"][:2]
    with pytest.raises(
        ValueError, match=r"^bandwidth_bytes_per_s: expected a 3x3 matrix .* got 2 rows"
    ):
        ClusterProfile.from_dict(data)


def test_block_count_must_match_num_blocks() -> None:
    data = _profile(2, 3).to_dict()
    data["num_blocks"] = 4
    with pytest.raises(
        ValueError, match=r"^devices\[0\]\.forward_s: expected 4 entries \(num_blocks\), got 3"
    ):
        ClusterProfile.from_dict(data)


def test_non_mapping_top_level_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"^ClusterProfile: expected a mapping"):
        ClusterProfile.from_dict(None)  # type: ignore[arg-type]


def test_direct_construction_validates_too() -> None:
    with pytest.raises(ValueError, match=r"^forward_s\[1\]: expected a non-negative finite"):
        _device(0, forward_s=[0.1, math.inf, 0.1])
    with pytest.raises(ValueError, match=r"^activation_bytes: expected 3 entries"):
        _device(0, activation_bytes=[1, 2])
    with pytest.raises(ValueError, match=r"^forward_s: expected at least one block"):
        _device(0, num_blocks=0)
    with pytest.raises(ValueError, match=r"^devices\[0\]: expected a DeviceProfile"):
        ClusterProfile(
            devices=({"rank": 0},),  # type: ignore[arg-type]
            latency_s=((0.0,),),
            bandwidth_bytes_per_s=((math.inf,),),
            num_blocks=1,
            model_fingerprint="m",
            cluster_fingerprint="c",
        )


def test_cpu_quota_round_trips_and_defaults_to_none() -> None:
    plain = _device(0)
    assert (plain.cpu_share, plain.cpu_period_s, plain.has_cpu_quota) == (1.0, 0.0, False)
    limited = _device(0, cpu_share=0.48, cpu_period_s=0.1)
    assert limited.has_cpu_quota
    assert DeviceProfile.from_dict(json.loads(json.dumps(limited.to_dict()))) == limited
    # A share without a period (or a whole core) models no quota.
    assert not _device(0, cpu_share=0.5).has_cpu_quota
    assert not _device(0, cpu_share=1.0, cpu_period_s=0.1).has_cpu_quota
    # Profiles saved before these fields existed still load.
    old = plain.to_dict()
    del old["cpu_share"], old["cpu_period_s"]
    assert DeviceProfile.from_dict(old) == plain


def test_device_from_dict_round_trip_and_derived_values() -> None:
    device = _device(1)
    assert DeviceProfile.from_dict(device.to_dict()) == device
    # fixed_s is optional (profiles written before it existed, hand-written ones): zeros.
    data = device.to_dict()
    del data["fixed_s"]
    assert DeviceProfile.from_dict(data).fixed_s == (0.0, 0.0, 0.0)
    data["fixed_s"] = [0.01, 0.0, 0.035]
    assert DeviceProfile.from_dict(data).fixed_s == (0.01, 0.0, 0.035)
    assert device.num_blocks == 3
    assert device.block_seconds == pytest.approx((0.035, 0.035, 0.035))
    # backward_s (the whole backward in one call) is optional: B + W where not measured.
    assert "backward_s" in data and device.backward_s == ()
    assert device.merged_backward_s == pytest.approx((0.015, 0.015, 0.015))
    merged = _device(1, backward_s=[0.012, 0.011, 0.013])
    assert merged.merged_backward_s == (0.012, 0.011, 0.013)
    assert DeviceProfile.from_dict(merged.to_dict()) == merged


# ------------------------------------------------------------------------------------------
# Derived quantities
# ------------------------------------------------------------------------------------------


def test_transfer_time_is_latency_plus_size_over_bandwidth() -> None:
    profile = _profile(3)
    # bandwidth[1][2] = 1e6 * (1 + 1 + 4) = 6e6, latency[1][2] = 0.003
    assert profile.transfer_time_s(1, 2, 6e6) == pytest.approx(0.003 + 1.0)
    assert profile.transfer_time_s(2, 1, 0) == pytest.approx(0.003)
    assert profile.transfer_time_s(2, 2, 1e9) == 0.0
    with pytest.raises(ValueError, match=r"^dst: expected a rank in 0\.\.2, got 3"):
        profile.transfer_time_s(0, 3, 1)
    with pytest.raises(ValueError, match=r"^num_bytes: expected a non-negative"):
        profile.transfer_time_s(0, 1, -1)


def test_infinite_off_diagonal_bandwidth_costs_only_latency() -> None:
    data = _profile(2).to_dict()
    data["bandwidth_bytes_per_s"][0][1] = "inf"
    assert ClusterProfile.from_dict(data).transfer_time_s(0, 1, 1e12) == pytest.approx(0.001)


def test_numpy_views() -> None:
    profile = _profile(3)
    bandwidth = profile.bandwidth_matrix()
    assert bandwidth.shape == (3, 3) and np.isinf(bandwidth[0, 0])
    assert bandwidth[0, 1] == 3e6  # 1e6 * (1 + 0 + 2 * 1)
    assert profile.latency_matrix()[2, 1] == pytest.approx(0.003)
    np.testing.assert_allclose(profile.capability_vector(), [10.0, 5.0, 10.0 / 3])
    assert profile.num_devices == 3


def test_capability_score_is_weighted_blocks_per_second() -> None:
    assert capability_score([0.1, 0.3], [0.2, 0.2], [0.1, 0.1]) == pytest.approx(2 / 1.0)
    assert capability_score([1.0, 1.0], [0, 0], [0, 0], block_weights=[3, 1]) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="equal length"):
        capability_score([0.1], [0.1, 0.1], [0.1])
    with pytest.raises(ValueError, match="sum to 0 s"):
        capability_score([0.0], [0.0], [0.0])
    with pytest.raises(ValueError, match=r"^block_weights: expected 2"):
        capability_score([0.1, 0.1], [0.1, 0.1], [0.1, 0.1], block_weights=[1.0])


@given(
    times=st.lists(st.floats(1e-4, 10.0), min_size=1, max_size=6),
    slowdown=st.floats(1.01, 100.0),
)
def test_a_uniformly_slower_device_scores_proportionally_lower(
    times: list[float], slowdown: float
) -> None:
    fast = capability_score(times, times, times)
    slow_times = [t * slowdown for t in times]
    slow = capability_score(slow_times, slow_times, slow_times)
    assert fast / slow == pytest.approx(slowdown, rel=1e-9)


def test_fingerprint_is_canonical_and_short() -> None:
    a = fingerprint({"b": [1, 2], "a": "x"})
    assert a == fingerprint({"a": "x", "b": (1, 2)})
    assert len(a) == 16 and all(c in "0123456789abcdef" for c in a)
    assert a != fingerprint({"a": "x", "b": [2, 1]})
    assert fingerprint_cluster(["a", "b"]) != fingerprint_cluster(["b", "a"])
    with pytest.raises(TypeError):
        fingerprint({"a": object()})


def test_example_profile_cluster_fingerprint_matches_its_hosts() -> None:
    profile = ClusterProfile.from_yaml(EXAMPLE)
    assert profile.num_devices == 6 and profile.num_blocks == 8
    assert profile.cluster_fingerprint == fingerprint_cluster([d.host for d in profile.devices])
    # Hand-written capabilities agree with the documented formula.
    for device in profile.devices:
        expected = capability_score(
            device.forward_s, device.backward_input_s, device.backward_weight_s
        )
        assert device.capability == pytest.approx(expected)
    # cloud -> end: 40 ms + 1 MB at 20 Mbit/s (2.5e6 bytes/s)
    assert profile.transfer_time_s(0, 5, 1e6) == pytest.approx(0.04 + 0.4)


# ------------------------------------------------------------------------------------------
# Cache
# ------------------------------------------------------------------------------------------


def _load(path: Path, profile: ClusterProfile, **overrides: str) -> ClusterProfile | None:
    fingerprints = {
        "model_fingerprint": profile.model_fingerprint,
        "cluster_fingerprint": profile.cluster_fingerprint,
    }
    fingerprints.update(overrides)
    return load_cached_profile(path, **fingerprints)


def test_missing_cache_file_is_silent(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _load(tmp_path / "absent.yaml", _profile()) is None


@pytest.mark.parametrize("suffix", ["yaml", "json"])
def test_matching_cache_is_reused_without_warning(tmp_path: Path, suffix: str) -> None:
    profile = _profile()
    path = tmp_path / f"cache.{suffix}"
    getattr(profile, f"to_{suffix}")(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _load(path, profile) == profile


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        ({"model_fingerprint": "0000000000000000"}, "model structure changed"),
        ({"cluster_fingerprint": "ffffffffffffffff"}, "hosts or ranks changed"),
    ],
)
def test_fingerprint_mismatch_warns_and_returns_none(
    tmp_path: Path, override: dict[str, str], reason: str
) -> None:
    profile = _profile()
    path = tmp_path / "cache.yaml"
    profile.to_yaml(path)
    with pytest.warns(ProfileCacheWarning, match=reason) as record:
        assert _load(path, profile, **override) is None
    message = str(record[0].message)
    assert "re-measuring" in message and str(path) in message
    assert next(iter(override.values())) in message


@pytest.mark.parametrize(
    ("name", "text", "reason"),
    [
        ("bad.yaml", "devices: [unclosed\n", "could not be read"),
        ("bad.json", "{not json", "could not be read"),
        ("empty.yaml", "", "expected a mapping"),
        ("neg.yaml", None, "devices[0].memory_bytes: expected a non-negative integer"),
    ],
)
def test_malformed_cache_warns_and_returns_none(
    tmp_path: Path, name: str, text: str | None, reason: str
) -> None:
    profile = _profile()
    if text is None:
        data = profile.to_dict()
        data["devices"][0]["memory_bytes"] = -1
        text = yaml.safe_dump(data)
    path = tmp_path / name
    path.write_text(text)
    with pytest.warns(ProfileCacheWarning, match="re-measuring") as record:
        assert _load(path, profile) is None
    assert reason in str(record[0].message)
