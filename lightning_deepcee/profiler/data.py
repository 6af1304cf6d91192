"""Profile data types: what the profiler measured about each device and each link.

This module owns the plain, typed, serialisable records that flow from measurement to planning:

- :class:`DeviceProfile`: one device's memory, per-block compute times and a capability score.
- :class:`ClusterProfile`: all devices plus the latency and bandwidth of every ordered device pair,
  with YAML/JSON round-trips.
- :func:`fingerprint`, :func:`fingerprint_cluster`: short hashes that tie a saved profile to the
  model structure and the set of devices it was measured on.
- :func:`load_cached_profile`: reuse a saved profile only when both fingerprints match; otherwise
  warn and return ``None`` so the caller re-measures. A stale profile is never reused silently.
- :func:`capability_score`: the single speed score of a device (DeepCEE's ``pc = sum_i w_i/t_i``).

Pure: numpy, pyyaml and the standard library only (no torch, no lightning). Units are in the
field names: seconds (``_s``), bytes (``_bytes``), bytes per second (``_bytes_per_s``).

Every check raises ``ValueError`` with ``<field path>: expected <what>, got <value>``, e.g.
``devices[2].memory_bytes: expected a non-negative integer, got -5``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import numbers
import os
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import yaml

__all__ = [
    "ClusterProfile",
    "DeviceProfile",
    "ProfileCacheWarning",
    "capability_score",
    "fingerprint",
    "fingerprint_cluster",
    "load_cached_profile",
]

_T = TypeVar("_T")

# Infinite bandwidth (a device to itself, or two processes on one host) is written as this string
# so that ``to_dict`` output is strict JSON; YAML's ``.inf`` and the float ``inf`` also read back.
_INF_TEXT = "inf"


class _YamlLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also reads ``1.25e8`` as a float.

    PyYAML follows YAML 1.1, where a float needs a dot and a signed exponent (``1.25e+8``);
    ``1.25e8`` would load as a *string*. Hand-written profiles write bandwidths that way, so we
    add the YAML 1.2 form. Still safe: only plain scalars are resolved differently.
    """


class _YamlDumper(yaml.SafeDumper):
    """``yaml.SafeDumper`` that quotes strings :class:`_YamlLoader` would read as floats.

    A host named ``1e5`` is a plain string to YAML 1.1, so the stock dumper leaves it unquoted;
    our loader would then read it back as the number 100000.0.
    """


for _cls in (_YamlLoader, _YamlDumper):
    _cls.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)[eE][-+]?[0-9]+$"),
        list("-+.0123456789"),
    )


class ProfileCacheWarning(UserWarning):
    """A cached profile exists but was not reused; the cluster will be measured again."""


# --------------------------------------------------------------------------------------------
# Scalar checks shared by __post_init__ and from_dict. Each returns the normalised value.
# --------------------------------------------------------------------------------------------


def _fail(name: str, expected: str, value: object) -> ValueError:
    return ValueError(f"{name}: expected {expected}, got {value!r}")


def _int(name: str, value: object, *, minimum: int, expected: str) -> int:
    # bool is an int subclass; `True` as a rank or a byte count is always a mistake.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise _fail(name, expected, value)
    return int(value)


def _float(
    name: str,
    value: object,
    *,
    expected: str,
    minimum: float = 0.0,
    strict: bool = False,
    allow_inf: bool = False,
) -> float:
    """A real number >= ``minimum`` (> if ``strict``); ``"inf"`` text is read when ``allow_inf``."""
    number: float
    if isinstance(value, str) and allow_inf and value.strip().lower() in {"inf", ".inf", "+inf"}:
        number = math.inf
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(name, expected, value)
    else:
        number = float(value)
    if math.isnan(number) or (math.isinf(number) and not allow_inf):
        raise _fail(name, expected, value)
    if number < minimum or (strict and number == minimum):
        raise _fail(name, expected, value)
    return number


def _str(name: str, value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _fail(name, "a non-empty string", value)
    return value


def _seq(name: str, value: object, item: Callable[[str, object], _T]) -> tuple[_T, ...]:
    """A list or tuple (not a string), each entry checked by ``item(name[i], entry)``."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise _fail(name, "a list", value)
    return tuple(item(f"{name}[{index}]", entry) for index, entry in enumerate(value))


def _seconds(name: str, value: object) -> float:
    return _float(name, value, expected="a non-negative finite number of seconds")


def _byte_count(name: str, value: object) -> int:
    return _int(name, value, minimum=0, expected="a non-negative integer")


def _set(obj: object, name: str, value: object) -> None:
    # Frozen dataclasses normalise their own fields (lists -> tuples) in __post_init__.
    object.__setattr__(obj, name, value)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _check_keys(data: object, cls: type, path: str) -> Mapping[str, Any]:
    """``data`` must be a mapping with exactly the dataclass's fields."""
    where = path or cls.__name__
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a mapping of {cls.__name__} fields, got {data!r}")
    fields = dataclasses.fields(cls)
    names = [field.name for field in fields]
    optional = {
        field.name
        for field in fields
        if field.default is not dataclasses.MISSING
        or field.default_factory is not dataclasses.MISSING
    }
    for key in data:
        if key not in names:
            raise ValueError(
                f"{_join(path, str(key))}: unknown field of {cls.__name__} "
                f"(expected only: {', '.join(names)})"
            )
    for name in names:
        if name not in data and name not in optional:
            raise ValueError(f"{_join(path, name)}: missing required field of {cls.__name__}")
    return data


def _with_path(path: str, build: Callable[[], _T]) -> _T:
    """Run ``build`` and prefix the field path of any ValueError it raises."""
    try:
        return build()
    except ValueError as exc:
        if not path:
            raise
        raise ValueError(_join(path, str(exc))) from None


def _jsonable_float(value: float) -> float | str:
    return _INF_TEXT if math.isinf(value) else value


# --------------------------------------------------------------------------------------------
# Public helpers
# --------------------------------------------------------------------------------------------


def capability_score(
    forward_s: Sequence[float],
    backward_input_s: Sequence[float],
    backward_weight_s: Sequence[float],
    *,
    block_weights: Sequence[float] | None = None,
) -> float:
    """One number for how fast a device trains this model: weighted blocks per second.

    DeepCEE scores a device as ``pc = sum_i w_i / t_i`` over weighted benchmark tasks. Here the
    benchmark task is one training pass (forward + input-gradient + weight-gradient) through every
    block at the reference micro-batch size, with weight ``sum_b w_b``, so::

        capability = sum_b w_b / sum_b (forward_s[b] + backward_input_s[b] + backward_weight_s[b])

    ``block_weights`` defaults to 1 per block, so the score is "model passes per second times
    ``num_blocks``". Higher is faster; only ratios between devices matter to grouping. We do not
    score each block as its own task (``sum_b w_b / t_b``) because a nearly free block (an
    embedding, a reshape) would dominate the sum with its noisiest measurement.
    """
    forward = _seq("forward_s", forward_s, _seconds)
    backward_input = _seq("backward_input_s", backward_input_s, _seconds)
    backward_weight = _seq("backward_weight_s", backward_weight_s, _seconds)
    num_blocks = len(forward)
    if num_blocks == 0 or len(backward_input) != num_blocks or len(backward_weight) != num_blocks:
        raise ValueError(
            "capability_score: expected three non-empty per-block lists of equal length, got "
            f"{num_blocks}, {len(backward_input)} and {len(backward_weight)} entries"
        )
    weights = (1.0,) * num_blocks
    if block_weights is not None:
        weights = _seq(
            "block_weights",
            block_weights,
            lambda name, v: _float(name, v, expected="a non-negative finite weight"),
        )
        if len(weights) != num_blocks or sum(weights) <= 0:
            raise ValueError(
                f"block_weights: expected {num_blocks} non-negative weights with a positive sum, "
                f"got {list(weights)!r}"
            )
    total_s = sum(forward) + sum(backward_input) + sum(backward_weight)
    if total_s <= 0:
        raise ValueError(
            "capability_score: the per-block times sum to 0 s; a device cannot be infinitely fast "
            "(measure with a larger reference micro-batch)"
        )
    return sum(weights) / total_s


def fingerprint(obj: Any) -> str:
    """First 16 hex digits of the sha256 of ``obj`` as canonical JSON (sorted keys, no spaces).

    ``obj`` must be JSON-serialisable (dicts, lists, tuples, strings, numbers, bools, None); a
    ``TypeError`` says otherwise. Used for both ``model_fingerprint`` (a description of the model
    structure) and ``cluster_fingerprint`` (see :func:`fingerprint_cluster`).
    """
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def fingerprint_cluster(hosts_by_rank: Sequence[str]) -> str:
    """Fingerprint of the device set: the host of each rank, in rank order."""
    hosts = _seq("hosts_by_rank", hosts_by_rank, _str)
    return fingerprint([{"rank": rank, "host": host} for rank, host in enumerate(hosts)])


# --------------------------------------------------------------------------------------------
# DeviceProfile
# --------------------------------------------------------------------------------------------

_PER_BLOCK_FIELDS = (
    "forward_s",
    "backward_input_s",
    "backward_weight_s",
    "activation_bytes",
    "parameter_bytes",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceProfile:
    """What one device (one rank) can do. Lists are per model block, in block order."""

    rank: int
    """Global rank of the process that runs on this device (0..N-1)."""
    host: str
    """Host name or address; with ``rank`` it identifies the device set (cluster fingerprint)."""
    kind: str
    """Free-form device class, e.g. ``"cloud"``, ``"edge"``, ``"end"``, ``"cpu"``."""
    memory_bytes: int
    """Memory available for training on this device (after the runtime's own use), in bytes."""
    forward_s: tuple[float, ...]
    """Seconds for the forward of each block at ``reference_microbatch_size``."""
    backward_input_s: tuple[float, ...]
    """Seconds for each block's gradient with respect to its input (``B``)."""
    backward_weight_s: tuple[float, ...]
    """Seconds for each block's gradient with respect to its weights (``W``)."""
    activation_bytes: tuple[int, ...]
    """Bytes of each block's output activation, per sample."""
    parameter_bytes: tuple[int, ...]
    """Bytes of each block's parameters."""
    reference_microbatch_size: int
    """Micro-batch size (samples) at which the ``*_s`` times were measured."""
    capability: float
    """Speed score, higher is faster; see :func:`capability_score`."""
    fixed_s: tuple[float, ...] = ()
    """Of each block's F+B+W seconds at ``reference_microbatch_size``, the part that does not
    shrink with the micro-batch (kernel launches, Python dispatch, per-call allocations): the
    intercept of an affine fit ``t(n) = fixed + slope * n`` measured at two micro-batch sizes.
    Empty (the default, e.g. a hand-written profile) means 0 for every block: compute is then
    linear in the micro-batch size."""
    optimizer_s_per_byte: float = 0.0
    """Seconds per parameter byte of an optimizer step on this device (the profiler times
    ``torch.optim.Adam`` on a block's parameters, at the sustained speed). 0 (the default, and
    hand-written profiles) means not measured: the planner then uses
    ``CostModelConfig.optimizer_s_per_byte``."""
    cpu_share: float = 1.0
    """Under a CPU quota (a container's CPU limit, a Linux cgroup's CFS quota), the fraction of
    a core the device may use on average: ``quota / period``, at most 1. The ``*_s`` times above
    are what the device sustains under that quota; an action that finds the quota unspent runs
    faster (see ``cpu_period_s``). 1 (the default) means no quota."""
    cpu_period_s: float = 0.0
    """The quota's period in seconds (Linux CFS: 0.1 by default). Each period the device may run
    ``cpu_share * cpu_period_s`` seconds at full speed; what it does not use while it waits for
    a message lets its next actions run at full speed. 0 (the default, and every hand-written
    profile) means no quota is modelled: every action takes its ``*_s`` time."""

    def __post_init__(self) -> None:
        _set(self, "rank", _int("rank", self.rank, minimum=0, expected="a non-negative integer"))
        _set(self, "host", _str("host", self.host))
        _set(self, "kind", _str("kind", self.kind))
        _set(self, "memory_bytes", _byte_count("memory_bytes", self.memory_bytes))
        for name in ("forward_s", "backward_input_s", "backward_weight_s"):
            _set(self, name, _seq(name, getattr(self, name), _seconds))
        for name in ("activation_bytes", "parameter_bytes"):
            _set(self, name, _seq(name, getattr(self, name), _byte_count))
        if not self.forward_s:
            raise _fail("forward_s", "at least one block", list(self.forward_s))
        for name in _PER_BLOCK_FIELDS[1:]:
            length = len(getattr(self, name))
            if length != len(self.forward_s):
                raise ValueError(
                    f"{name}: expected {len(self.forward_s)} entries (one per block, like "
                    f"forward_s), got {length}"
                )
        _set(
            self,
            "reference_microbatch_size",
            _int(
                "reference_microbatch_size",
                self.reference_microbatch_size,
                minimum=1,
                expected="a positive integer (samples)",
            ),
        )
        _set(
            self,
            "capability",
            _float("capability", self.capability, expected="a positive finite score", strict=True),
        )
        fixed = _seq("fixed_s", self.fixed_s, _seconds) or (0.0,) * len(self.forward_s)
        if len(fixed) != len(self.forward_s):
            raise ValueError(
                f"fixed_s: expected {len(self.forward_s)} entries (one per block, like "
                f"forward_s) or none, got {len(fixed)}"
            )
        for index, (value, total) in enumerate(zip(fixed, self.block_seconds, strict=True)):
            if value > total * (1 + 1e-9):
                raise ValueError(
                    f"fixed_s[{index}]: {value!r} s is more than block {index}'s whole F+B+W "
                    f"time {total!r} s; the fixed part is a share of that time"
                )
        _set(self, "fixed_s", fixed)
        _set(
            self,
            "optimizer_s_per_byte",
            _float(
                "optimizer_s_per_byte",
                self.optimizer_s_per_byte,
                expected="a non-negative finite number of seconds per byte",
            ),
        )
        share = _float(
            "cpu_share", self.cpu_share, expected="a fraction of a core in (0, 1]", strict=True
        )
        if share > 1.0:
            raise _fail("cpu_share", "a fraction of a core in (0, 1]", self.cpu_share)
        _set(self, "cpu_share", share)
        _set(
            self,
            "cpu_period_s",
            _seconds("cpu_period_s", self.cpu_period_s),
        )

    @property
    def has_cpu_quota(self) -> bool:
        """Whether a CPU quota is modelled for this device (``cpu_share < 1`` with a period)."""
        return self.cpu_share < 1.0 and self.cpu_period_s > 0.0

    @property
    def num_blocks(self) -> int:
        """Number of model blocks this profile covers."""
        return len(self.forward_s)

    @property
    def block_seconds(self) -> tuple[float, ...]:
        """Forward + input-gradient + weight-gradient seconds of each block."""
        return tuple(
            f + b + w
            for f, b, w in zip(
                self.forward_s, self.backward_input_s, self.backward_weight_s, strict=True
            )
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-safe dict (lists instead of tuples)."""
        result: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            result[field.name] = list(value) if isinstance(value, tuple) else value
        return result

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceProfile:
        """Inverse of :meth:`to_dict`; unknown or missing fields are errors."""
        return cls._from_dict(data, path="")

    @classmethod
    def _from_dict(cls, data: object, *, path: str) -> DeviceProfile:
        fields = _check_keys(data, cls, path)
        return _with_path(path, lambda: cls(**fields))


# --------------------------------------------------------------------------------------------
# ClusterProfile
# --------------------------------------------------------------------------------------------


def _matrix(
    name: str, value: object, size: int, entry: Callable[[str, object, bool], float]
) -> tuple[tuple[float, ...], ...]:
    """An ``size x size`` matrix; ``entry(name, value, on_diagonal)`` checks each cell."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise _fail(name, f"a {size}x{size} matrix (list of rows)", value)
    if len(value) != size:
        raise ValueError(
            f"{name}: expected a {size}x{size} matrix (one row and one column per device), "
            f"got {len(value)} rows"
        )
    rows = []
    for i, row in enumerate(value):
        row_name = f"{name}[{i}]"
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
            raise _fail(row_name, f"a row of {size} numbers", row)
        if len(row) != size:
            raise ValueError(
                f"{row_name}: expected {size} entries (one per device), got {len(row)}"
            )
        rows.append(tuple(entry(f"{row_name}[{j}]", cell, i == j) for j, cell in enumerate(row)))
    return tuple(rows)


def _latency_entry(name: str, value: object, on_diagonal: bool) -> float:
    return _float(name, value, expected="a non-negative finite latency in seconds")


def _bandwidth_entry(name: str, value: object, on_diagonal: bool) -> float:
    if on_diagonal:
        # A device to itself: ignored, conventionally inf; 0 is tolerated.
        return _float(
            name, value, expected="a non-negative bandwidth or inf on the diagonal", allow_inf=True
        )
    return _float(
        name,
        value,
        expected="a positive bandwidth in bytes/s (inf allowed) between distinct devices",
        strict=True,
        allow_inf=True,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterProfile:
    """All devices and all links of one training job; the planner's whole view of the hardware.

    Matrices are indexed ``[src_rank][dst_rank]`` for the ordered pair (links may be asymmetric);
    devices are listed in rank order, so ``devices[r].rank == r``.
    """

    devices: tuple[DeviceProfile, ...]
    """One profile per rank, in rank order."""
    latency_s: tuple[tuple[float, ...], ...]
    """One-way latency of a (minimal) message from ``src`` to ``dst``, seconds; diagonal ignored."""
    bandwidth_bytes_per_s: tuple[tuple[float, ...], ...]
    """Throughput of a large message from ``src`` to ``dst``, bytes/s; diagonal ignored (inf)."""
    num_blocks: int
    """Number of model blocks; every device's per-block lists have this length."""
    model_fingerprint: str
    """Hash of the model structure (see :func:`fingerprint`); a changed model invalidates this."""
    cluster_fingerprint: str
    """Hash of the device set (see :func:`fingerprint_cluster`)."""

    def __post_init__(self) -> None:
        devices = _seq("devices", self.devices, _device)
        if not devices:
            raise _fail("devices", "at least one device", [])
        _set(self, "devices", devices)
        num_blocks = _int(
            "num_blocks", self.num_blocks, minimum=1, expected="a positive number of blocks"
        )
        _set(self, "num_blocks", num_blocks)
        for index, device in enumerate(devices):
            if device.rank != index:
                raise ValueError(
                    f"devices[{index}].rank: expected {index} (devices are listed in rank order "
                    f"0..{len(devices) - 1}, each rank once), got {device.rank}"
                )
            if device.num_blocks != num_blocks:
                raise ValueError(
                    f"devices[{index}].forward_s: expected {num_blocks} entries (num_blocks), "
                    f"got {device.num_blocks}"
                )
        size = len(devices)
        _set(self, "latency_s", _matrix("latency_s", self.latency_s, size, _latency_entry))
        _set(
            self,
            "bandwidth_bytes_per_s",
            _matrix("bandwidth_bytes_per_s", self.bandwidth_bytes_per_s, size, _bandwidth_entry),
        )
        _set(self, "model_fingerprint", _str("model_fingerprint", self.model_fingerprint))
        _set(self, "cluster_fingerprint", _str("cluster_fingerprint", self.cluster_fingerprint))

    @property
    def num_devices(self) -> int:
        """Number of devices (= world size)."""
        return len(self.devices)

    def transfer_time_s(self, src: int, dst: int, num_bytes: float) -> float:
        """Seconds to move ``num_bytes`` from rank ``src`` to rank ``dst``: latency + size/bw."""
        for name, rank in (("src", src), ("dst", dst)):
            if (
                isinstance(rank, bool)
                or not isinstance(rank, int)
                or not 0 <= rank < self.num_devices
            ):
                raise _fail(name, f"a rank in 0..{self.num_devices - 1}", rank)
        size = _float("num_bytes", num_bytes, expected="a non-negative finite number of bytes")
        if src == dst:
            return 0.0
        return self.latency_s[src][dst] + size / self.bandwidth_bytes_per_s[src][dst]

    def latency_matrix(self) -> npt.NDArray[np.float64]:
        """``latency_s`` as an N x N float array (a fresh copy)."""
        return np.array(self.latency_s, dtype=np.float64)

    def bandwidth_matrix(self) -> npt.NDArray[np.float64]:
        """``bandwidth_bytes_per_s`` as an N x N float array (a fresh copy; inf kept)."""
        return np.array(self.bandwidth_bytes_per_s, dtype=np.float64)

    def capability_vector(self) -> npt.NDArray[np.float64]:
        """Each device's capability score, indexed by rank."""
        return np.array([device.capability for device in self.devices], dtype=np.float64)

    def to_dict(self) -> dict[str, Any]:
        """Plain, strict-JSON-safe dict; infinite bandwidth is written as the string ``"inf"``."""
        return {
            "devices": [device.to_dict() for device in self.devices],
            "latency_s": [list(row) for row in self.latency_s],
            "bandwidth_bytes_per_s": [
                [_jsonable_float(cell) for cell in row] for row in self.bandwidth_bytes_per_s
            ],
            "num_blocks": self.num_blocks,
            "model_fingerprint": self.model_fingerprint,
            "cluster_fingerprint": self.cluster_fingerprint,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterProfile:
        """Inverse of :meth:`to_dict`; errors name the field path (``devices[2].memory_bytes``)."""
        fields = dict(_check_keys(data, cls, ""))
        raw_devices = fields["devices"]
        if isinstance(raw_devices, Sequence) and not isinstance(raw_devices, (str, bytes)):
            fields["devices"] = tuple(
                DeviceProfile._from_dict(item, path=f"devices[{index}]")
                for index, item in enumerate(raw_devices)
            )
        return cls(**fields)

    def to_yaml(self, path: str | os.PathLike[str]) -> None:
        """Write as YAML (block style, one flow-style list per matrix row)."""
        text = yaml.dump(
            self.to_dict(),
            Dumper=_YamlDumper,
            sort_keys=False,
            default_flow_style=None,
            width=100,
        )
        Path(path).write_text(text, encoding="utf-8")

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> ClusterProfile:
        """Read a file written by :meth:`to_yaml` or by hand."""
        return cls.from_dict(yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_YamlLoader))

    def to_json(self, path: str | os.PathLike[str]) -> None:
        """Write as strict JSON (no ``Infinity`` token)."""
        text = json.dumps(self.to_dict(), indent=2, allow_nan=False)
        Path(path).write_text(text + "\n", encoding="utf-8")

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> ClusterProfile:
        """Read a file written by :meth:`to_json`."""
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


def _device(name: str, value: object) -> DeviceProfile:
    if not isinstance(value, DeviceProfile):
        raise _fail(name, "a DeviceProfile (use ClusterProfile.from_dict for plain dicts)", value)
    return value


# --------------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------------


def load_cached_profile(
    path: str | os.PathLike[str], *, model_fingerprint: str, cluster_fingerprint: str
) -> ClusterProfile | None:
    """Return the profile saved at ``path`` if it was measured for this model and device set.

    - No file: ``None``, silently (first run).
    - Unreadable or malformed file, or either fingerprint differs: a :class:`ProfileCacheWarning`
      saying why, then ``None`` so the caller re-measures. A stale profile is never reused.

    ``.json`` files are read as JSON, anything else as YAML.
    """
    file = Path(path)
    if not file.exists():
        return None
    try:
        if file.suffix.lower() == ".json":
            profile = ClusterProfile.from_json(file)
        else:
            profile = ClusterProfile.from_yaml(file)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        warnings.warn(
            f"Cached cluster profile {str(file)!r} could not be read ({exc}); ignoring it and "
            "re-measuring the cluster. Delete or fix the file to silence this warning.",
            ProfileCacheWarning,
            stacklevel=2,
        )
        return None
    mismatches = []
    if profile.model_fingerprint != model_fingerprint:
        mismatches.append(
            f"model_fingerprint is {profile.model_fingerprint!r} but the current model's is "
            f"{model_fingerprint!r} (the model structure changed)"
        )
    if profile.cluster_fingerprint != cluster_fingerprint:
        mismatches.append(
            f"cluster_fingerprint is {profile.cluster_fingerprint!r} but the current cluster's is "
            f"{cluster_fingerprint!r} (the hosts or ranks changed)"
        )
    if mismatches:
        warnings.warn(
            f"Cached cluster profile {str(file)!r} does not match this run: "
            f"{'; '.join(mismatches)}. Ignoring it and re-measuring the cluster.",
            ProfileCacheWarning,
            stacklevel=2,
        )
        return None
    return profile
