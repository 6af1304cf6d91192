"""One device's profile: memory, per-block compute times and a capability score.

Pure: the standard library and omegaconf (through :mod:`.schema`), no torch. Units are in the
field names: seconds (``_s``), bytes (``_bytes``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_deepcee.profiler import _checks as check
from lightning_deepcee.profiler.schema import load_structured

__all__ = ["PROFILE_ARRAYS", "DeviceProfile", "capability_score"]

PER_BLOCK_FIELDS = (
    "forward_s",
    "backward_input_s",
    "backward_weight_s",
    "activation_bytes",
    "parameter_bytes",
)

OPTIONAL_PER_BLOCK_FIELDS = ("fixed_s", "backward_s", "saved_bytes", "transient_bytes")
"""Per-block fields a profile may leave empty (hand-written, or measured before they existed)."""

PROFILE_ARRAYS = frozenset(
    {*PER_BLOCK_FIELDS, *OPTIONAL_PER_BLOCK_FIELDS, "latency_s", "bandwidth_bytes_per_s"}
)
"""Fields the profile types check entry by entry themselves; the schema loader passes them on
unconverted (omegaconf would build one node per number)."""


def capability_score(
    forward_s: Sequence[float],
    backward_input_s: Sequence[float],
    backward_weight_s: Sequence[float],
    *,
    block_weights: Sequence[float] | None = None,
) -> float:
    """One number for how fast a device trains this model: weighted blocks per second.

    DeepCEE scores a device as ``pc = sum_i w_i / t_i`` over weighted benchmark tasks. Here the
    task is one training pass (forward + input-gradient + weight-gradient) through every block
    at the reference micro-batch size, with weight ``sum_b w_b``::

        capability = sum_b w_b / sum_b (forward_s[b] + backward_input_s[b] + backward_weight_s[b])

    ``block_weights`` defaults to 1 per block. Higher is faster; only ratios between devices
    matter. Blocks are not scored as separate tasks (``sum_b w_b / t_b``) because a nearly free
    block (an embedding, a reshape) would dominate the sum with its noisiest measurement.
    """
    forward = check.sequence("forward_s", forward_s, check.seconds)
    backward_input = check.sequence("backward_input_s", backward_input_s, check.seconds)
    backward_weight = check.sequence("backward_weight_s", backward_weight_s, check.seconds)
    num_blocks = len(forward)
    if num_blocks == 0 or len(backward_input) != num_blocks or len(backward_weight) != num_blocks:
        raise ValueError(
            "capability_score: expected three non-empty per-block lists of equal length, got "
            f"{num_blocks}, {len(backward_input)} and {len(backward_weight)} entries"
        )
    weights = (1.0,) * num_blocks
    if block_weights is not None:
        weights = check.sequence(
            "block_weights",
            block_weights,
            lambda name, v: check.real(name, v, expected="a non-negative finite weight"),
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
    """Bytes of each block's output activation, per sample: what a stage sends to the next one
    (and, where ``saved_bytes`` is empty, the planner's estimate of what a block keeps)."""
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
    backward_s: tuple[float, ...] = ()
    """Seconds of each block's whole backward in one call (``B`` and ``W`` in one pass over its
    graph, as a ``BW`` action of 1F1B or GPipe, and a first stage, run it), at most its
    ``B + W``. Empty (the default, e.g. a hand-written profile) means ``B + W``; see
    :attr:`merged_backward_s`."""
    optimizer_s_per_byte: float = 0.0
    """Seconds per parameter byte of an optimizer step on this device (the profiler times
    ``torch.optim.Adam`` on a block's parameters, at the sustained speed). 0 (the default, and
    hand-written profiles) means not measured: the planner then uses
    ``CostModelConfig.optimizer_s_per_byte``."""
    saved_bytes: tuple[int, ...] = ()
    """Bytes per sample that autograd keeps from each block's forward until its backward
    (intermediates, the block's input when saved; parameters and buffers not counted): what a
    stage holds for every micro-batch in flight. Empty (the default, e.g. a hand-written profile
    or one measured without it) means ``activation_bytes``."""
    transient_bytes: tuple[int, ...] = ()
    """Bytes per sample each block needs beyond ``saved_bytes`` at the peak of its forward and
    backward (the output, its gradient, intermediate gradients), held only while it computes.
    Empty (the default) means 0."""
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
        set_field = check.set_field
        set_field(
            self,
            "rank",
            check.integer("rank", self.rank, minimum=0, expected="a non-negative integer"),
        )
        set_field(self, "host", check.text("host", self.host))
        set_field(self, "kind", check.text("kind", self.kind))
        set_field(self, "memory_bytes", check.byte_count("memory_bytes", self.memory_bytes))
        for name in ("forward_s", "backward_input_s", "backward_weight_s"):
            set_field(self, name, check.sequence(name, getattr(self, name), check.seconds))
        for name in ("activation_bytes", "parameter_bytes"):
            set_field(self, name, check.sequence(name, getattr(self, name), check.byte_count))
        if not self.forward_s:
            raise check.fail("forward_s", "at least one block", list(self.forward_s))
        for name in PER_BLOCK_FIELDS[1:]:
            length = len(getattr(self, name))
            if length != len(self.forward_s):
                raise ValueError(
                    f"{name}: expected {len(self.forward_s)} entries (one per block, like "
                    f"forward_s), got {length}"
                )
        set_field(
            self,
            "reference_microbatch_size",
            check.integer(
                "reference_microbatch_size",
                self.reference_microbatch_size,
                minimum=1,
                expected="a positive integer (samples)",
            ),
        )
        set_field(
            self,
            "capability",
            check.real(
                "capability", self.capability, expected="a positive finite score", strict=True
            ),
        )
        self._check_fixed_s()
        merged = check.sequence("backward_s", self.backward_s, check.seconds)
        if merged and len(merged) != len(self.forward_s):
            raise ValueError(
                f"backward_s: expected {len(self.forward_s)} entries (one per block, like "
                f"forward_s) or none, got {len(merged)}"
            )
        set_field(self, "backward_s", merged)
        for name in ("saved_bytes", "transient_bytes"):
            values = check.sequence(name, getattr(self, name), check.byte_count)
            if values and len(values) != len(self.forward_s):
                raise ValueError(
                    f"{name}: expected {len(self.forward_s)} entries (one per block, like "
                    f"forward_s) or none, got {len(values)}"
                )
            set_field(self, name, values)
        set_field(
            self,
            "optimizer_s_per_byte",
            check.real(
                "optimizer_s_per_byte",
                self.optimizer_s_per_byte,
                expected="a non-negative finite number of seconds per byte",
            ),
        )
        share = check.real(
            "cpu_share", self.cpu_share, expected="a fraction of a core in (0, 1]", strict=True
        )
        if share > 1.0:
            raise check.fail("cpu_share", "a fraction of a core in (0, 1]", self.cpu_share)
        set_field(self, "cpu_share", share)
        set_field(self, "cpu_period_s", check.seconds("cpu_period_s", self.cpu_period_s))

    def renumbered(self, rank: int) -> DeviceProfile:
        """This device under another rank (a device subset's profile numbers its devices
        ``0..k-1``). The other fields were checked when this profile was built, so they are
        reused as they are: the planner renumbers every device of every subset it scores."""
        copy = object.__new__(DeviceProfile)
        for field in dataclasses.fields(DeviceProfile):
            check.set_field(copy, field.name, getattr(self, field.name))
        check.set_field(
            copy, "rank", check.integer("rank", rank, minimum=0, expected="a non-negative integer")
        )
        return copy

    def _check_fixed_s(self) -> None:
        """``fixed_s``: none (zeros) or one share per block, each at most that block's time."""
        fixed = check.sequence("fixed_s", self.fixed_s, check.seconds)
        fixed = fixed or (0.0,) * len(self.forward_s)
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
        check.set_field(self, "fixed_s", fixed)

    @property
    def has_cpu_quota(self) -> bool:
        """Whether a CPU quota is modelled for this device (``cpu_share < 1`` with a period)."""
        return self.cpu_share < 1.0 and self.cpu_period_s > 0.0

    @property
    def num_blocks(self) -> int:
        """Number of model blocks this profile covers."""
        return len(self.forward_s)

    @property
    def held_bytes(self) -> tuple[int, ...]:
        """Bytes per sample each block holds per micro-batch in flight: ``saved_bytes`` where
        measured, else ``activation_bytes``."""
        return self.saved_bytes or self.activation_bytes

    @property
    def merged_backward_s(self) -> tuple[float, ...]:
        """Seconds of each block's backward in one call: ``backward_s`` where measured, else
        ``B + W``."""
        return self.backward_s or tuple(
            b + w for b, w in zip(self.backward_input_s, self.backward_weight_s, strict=True)
        )

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
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "") -> DeviceProfile:
        """Inverse of :meth:`to_dict`. Unknown or missing keys and wrong types are errors that
        name the key (and ``source``, a file name, when given)."""
        return load_structured(cls, data, source=source, passthrough=PROFILE_ARRAYS)
