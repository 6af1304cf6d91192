"""The whole cluster's profile: every device and every link, with YAML/JSON round trips.

Files are checked by :func:`.schema.load_structured` (keys, required keys, scalar types; errors
name the file and the key, e.g. ``p.yaml: devices[2].memory_bytes: expected int, got str
'8G'``); value checks no type can express (an N x N matrix, ranks 0..N-1, positive
bandwidths) run in ``__post_init__``, on direct construction too.

Pure: numpy, pyyaml, omegaconf and the standard library (no torch). Units are in the field
names: seconds (``_s``), bytes per second (``_bytes_per_s``).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import yaml

from lightning_deepcee.profiler import _checks as check
from lightning_deepcee.profiler.device import PROFILE_ARRAYS, DeviceProfile
from lightning_deepcee.profiler.schema import load_structured, read_yaml

__all__ = ["ClusterProfile"]

# Infinite bandwidth (a device to itself, or two processes on one host) is written as this string
# so that ``to_dict`` output is strict JSON; YAML's ``.inf`` and the float ``inf`` also read back.
_INF_TEXT = "inf"
_ARRAYS_KEPT = 8
"""Link matrices :func:`_as_array` keeps converted (the planner reads each subset's several
times; a 1024-device matrix takes some 25 ms to convert from tuples)."""
_ARRAYS: dict[int, tuple[tuple[tuple[float, ...], ...], npt.NDArray[np.float64]]] = {}


def _as_array(
    rows: tuple[tuple[float, ...], ...], array: npt.NDArray[np.float64] | None = None
) -> npt.NDArray[np.float64]:
    """``rows`` as a fresh float array; the conversion (or ``array``, already equal to it) is
    kept for the next call on the same tuple object, which the entry holds (so its id cannot
    be reused while it is kept)."""
    kept = _ARRAYS.get(id(rows))
    if kept is None or kept[0] is not rows:
        if array is None:
            array = np.array(rows, dtype=np.float64)
        if len(_ARRAYS) >= _ARRAYS_KEPT:
            del _ARRAYS[next(iter(_ARRAYS))]  # the oldest
        kept = _ARRAYS[id(rows)] = (rows, array)
    return kept[1].copy()


class _YamlLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also reads ``1.25e8`` as a float.

    PyYAML follows YAML 1.1, where a float needs a dot and a signed exponent (``1.25e+8``);
    ``1.25e8`` would load as a *string*. Hand-written profiles write bandwidths that way, so the
    YAML 1.2 form is added. Still safe: only plain scalars are resolved differently.
    """


class _YamlDumper(yaml.SafeDumper):
    """``yaml.SafeDumper`` that quotes strings :class:`_YamlLoader` would read as floats.

    A host named ``1e5`` is a plain string to YAML 1.1, so the stock dumper leaves it unquoted;
    the loader above would then read it back as the number 100000.0.
    """


for _cls in (_YamlLoader, _YamlDumper):
    _cls.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)[eE][-+]?[0-9]+$"),
        list("-+.0123456789"),
    )


def _matrix(
    name: str, value: object, size: int, entry: Callable[[str, object, bool], float]
) -> tuple[tuple[float, ...], ...]:
    """An ``size x size`` matrix; ``entry(name, value, on_diagonal)`` checks each cell."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise check.fail(name, f"a {size}x{size} matrix (list of rows)", value)
    if len(value) != size:
        raise ValueError(
            f"{name}: expected a {size}x{size} matrix (one row and one column per device), "
            f"got {len(value)} rows"
        )
    rows = []
    for i, row in enumerate(value):
        row_name = f"{name}[{i}]"
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
            raise check.fail(row_name, f"a row of {size} numbers", row)
        if len(row) != size:
            raise ValueError(
                f"{row_name}: expected {size} entries (one per device), got {len(row)}"
            )
        rows.append(tuple(entry(f"{row_name}[{j}]", cell, i == j) for j, cell in enumerate(row)))
    return tuple(rows)


def _fast_matrix(
    value: object, size: int, valid: Callable[[npt.NDArray[np.float64]], bool]
) -> tuple[tuple[float, ...], ...] | None:
    """``value`` as a matrix when it is ``size`` rows of ``size`` plain floats (or ints) that
    ``valid`` accepts as a whole; ``None`` sends it to the cell-by-cell check, which names the
    first bad cell. A 1024-device matrix has a million cells: checking each in Python costs
    seconds, and the planner builds one per device subset it scores."""
    if not isinstance(value, (list, tuple)) or len(value) != size:
        return None
    if not all(type(row) in (list, tuple) and len(row) == size for row in value):
        return None
    if not {type(cell) for row in value for cell in row} <= {float, int}:
        return None
    array = np.array(value, dtype=np.float64).reshape(size, size)
    if np.isnan(array).any() or not valid(array):
        return None
    return tuple(map(tuple, array.tolist()))


def _latency_valid(array: npt.NDArray[np.float64]) -> bool:
    return bool(np.isfinite(array).all() and (array >= 0).all())


def _bandwidth_valid(array: npt.NDArray[np.float64]) -> bool:
    off_diagonal = ~np.eye(len(array), dtype=bool)
    return bool((array >= 0).all() and (array[off_diagonal] > 0).all())


def _latency_entry(name: str, value: object, on_diagonal: bool) -> float:
    return check.real(name, value, expected="a non-negative finite latency in seconds")


def _bandwidth_entry(name: str, value: object, on_diagonal: bool) -> float:
    if on_diagonal:
        # A device to itself: ignored, conventionally inf; 0 is tolerated.
        return check.real(
            name, value, expected="a non-negative bandwidth or inf on the diagonal", allow_inf=True
        )
    return check.real(
        name,
        value,
        expected="a positive bandwidth in bytes/s (inf allowed) between distinct devices",
        strict=True,
        allow_inf=True,
    )


def _device(name: str, value: object) -> DeviceProfile:
    if not isinstance(value, DeviceProfile):
        raise check.fail(
            name, "a DeviceProfile (use ClusterProfile.from_dict for plain dicts)", value
        )
    return value


def _jsonable_float(value: float) -> float | str:
    return _INF_TEXT if math.isinf(value) else value


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
    """Hash of the model structure (see :func:`.fingerprint`); a changed model invalidates this."""
    cluster_fingerprint: str
    """Hash of the device set (see :func:`.fingerprint_cluster`)."""

    def __post_init__(self) -> None:
        devices = check.sequence("devices", self.devices, _device)
        if not devices:
            raise check.fail("devices", "at least one device", [])
        check.set_field(self, "devices", devices)
        num_blocks = check.integer(
            "num_blocks", self.num_blocks, minimum=1, expected="a positive number of blocks"
        )
        check.set_field(self, "num_blocks", num_blocks)
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
        latency = _fast_matrix(self.latency_s, size, _latency_valid) or _matrix(
            "latency_s", self.latency_s, size, _latency_entry
        )
        check.set_field(self, "latency_s", latency)
        bandwidth = _fast_matrix(self.bandwidth_bytes_per_s, size, _bandwidth_valid) or _matrix(
            "bandwidth_bytes_per_s", self.bandwidth_bytes_per_s, size, _bandwidth_entry
        )
        check.set_field(self, "bandwidth_bytes_per_s", bandwidth)
        for name in ("model_fingerprint", "cluster_fingerprint"):
            check.set_field(self, name, check.text(name, getattr(self, name)))

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
                raise check.fail(name, f"a rank in 0..{self.num_devices - 1}", rank)
        size = check.real("num_bytes", num_bytes, expected="a non-negative finite number of bytes")
        if src == dst:
            return 0.0
        return self.latency_s[src][dst] + size / self.bandwidth_bytes_per_s[src][dst]

    def subset(
        self,
        ranks: Sequence[int],
        matrices: tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]] | None = None,
    ) -> ClusterProfile:
        """The profile of ``ranks`` alone, renumbered ``0..len(ranks)-1`` in the given order,
        fingerprints kept (a plan made on it is lifted back onto this cluster).

        Its fields come from this checked profile, so they are not checked again: the planner
        takes a subset per device set it scores, and re-checking a 1024-device link matrix
        cell by cell costs a second. ``matrices`` (``latency_matrix()``,
        ``bandwidth_matrix()``) saves converting them on every call."""
        chosen = [check.integer("ranks", r, minimum=0, expected="a rank") for r in ranks]
        if not chosen or len(set(chosen)) != len(chosen) or max(chosen) >= self.num_devices:
            raise check.fail("ranks", f"distinct ranks of 0..{self.num_devices - 1}", ranks)
        latency, bandwidth = matrices or (self.latency_matrix(), self.bandwidth_matrix())
        index = np.ix_(chosen, chosen)
        fields = {
            "devices": tuple(self.devices[r].renumbered(i) for i, r in enumerate(chosen)),
            "latency_s": tuple(map(tuple, latency[index].tolist())),
            "bandwidth_bytes_per_s": tuple(map(tuple, bandwidth[index].tolist())),
            "num_blocks": self.num_blocks,
            "model_fingerprint": self.model_fingerprint,
            "cluster_fingerprint": self.cluster_fingerprint,
        }
        copy = object.__new__(ClusterProfile)
        for name, value in fields.items():
            check.set_field(copy, name, value)
        _as_array(copy.latency_s, latency[index])
        _as_array(copy.bandwidth_bytes_per_s, bandwidth[index])
        return copy

    def latency_matrix(self) -> npt.NDArray[np.float64]:
        """``latency_s`` as an N x N float array (a fresh copy)."""
        return _as_array(self.latency_s)

    def bandwidth_matrix(self) -> npt.NDArray[np.float64]:
        """``bandwidth_bytes_per_s`` as an N x N float array (a fresh copy; inf kept)."""
        return _as_array(self.bandwidth_bytes_per_s)

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
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "") -> ClusterProfile:
        """Inverse of :meth:`to_dict`. Errors name the key (``devices[2].memory_bytes``) and,
        when given, ``source`` (the file it came from)."""
        return load_structured(cls, data, source=source, passthrough=PROFILE_ARRAYS)

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
        """Read a file written by :meth:`to_yaml` or by hand; errors name the file."""
        return cls.from_dict(read_yaml(path, _YamlLoader), source=str(path))

    def to_json(self, path: str | os.PathLike[str]) -> None:
        """Write as strict JSON (no ``Infinity`` token)."""
        text = json.dumps(self.to_dict(), indent=2, allow_nan=False)
        Path(path).write_text(text + "\n", encoding="utf-8")

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> ClusterProfile:
        """Read a file written by :meth:`to_json`; errors name the file."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from None
        return cls.from_dict(data, source=str(path))
