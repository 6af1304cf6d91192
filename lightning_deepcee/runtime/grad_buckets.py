"""A shared stage's gradients summed over its devices in buckets, started while backward runs.

Devices that share a stage (data-parallel copies) sum their gradients after every step. Summed
in one flat all-reduce after the schedule, the sum waits for the whole backward and the whole
backward's compute waits for nothing: the two add up. :class:`BucketedGradSync` is DDP's reducer
for a stage's copies: its parameters fall into buckets in reverse order (the order backward
finishes them), and during this rank's last backward of the step (:meth:`~BucketedGradSync.arm`)
each parameter's post-accumulate-grad hook marks it ready; a bucket whose parameters are all
ready starts its all-reduce at once (asynchronously, on the stage's own group) while backward
goes on with the blocks before it. :meth:`~BucketedGradSync.finish` starts what has not started,
waits for every bucket and gives each parameter its summed gradient.

Buckets start strictly in index order on every rank (a ready bucket waits for the ones before
it), so the ranks of the group issue the same collectives in the same order whatever their
backward did: a rank without rows this step, a parameter without a gradient (zeros are summed)
or a backward split into B and W (whose weight gradients are written at once, without hooks:
every bucket then starts in :meth:`finish`). Buckets first follow the reverse of the
parameters' order; after the first step they follow the order that step's backward completed
the parameters in, those without a gradient last (the group's first device's order, broadcast
once, so that all agree): a parameter the backward reaches late, or never, would otherwise hold
back every bucket after it.

Bucket size: a bucket's all-reduce pays the link latency once per ring step, so buckets are
large enough that the latency stays a tenth of the transfer on the group's slowest link
(:func:`bucket_bytes_for`), between 1 MiB and DDP's 25 MiB (25 MiB without a profile).
``$DEEPCEE_GRAD_BUCKET_MB`` sets the cap instead (``inf``: one bucket, started when the step's
backward is over: the sum without overlap, for an ablation).

Runtime layer: torch and torch.distributed, never lightning.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_deepcee._compat import flatten_dense_tensors, unflatten_dense_tensors
from lightning_deepcee.profiler.data import ClusterProfile
from lightning_deepcee.runtime.transport import start_all_reduce

__all__ = [
    "BUCKET_ENV",
    "MAX_BUCKET_BYTES",
    "MIN_BUCKET_BYTES",
    "BucketedGradSync",
    "bucket_bytes_for",
]

BUCKET_ENV = "DEEPCEE_GRAD_BUCKET_MB"
"""Environment variable that sets the bucket cap in MiB (``inf``: one bucket)."""

MIN_BUCKET_BYTES = 2**20
MAX_BUCKET_BYTES = 25 * 2**20
"""DDP's default ``bucket_cap_mb``."""
LATENCY_SHARE = 0.1
"""The share of a bucket's all-reduce that the link latency may take."""


def bucket_bytes_for(profile: ClusterProfile | None, ranks: Sequence[int]) -> int:
    """Bucket cap for the group of ``ranks``: a ring all-reduce of ``B`` bytes over ``n`` devices
    takes ``2(n-1)`` latencies and moves ``2(n-1)/n * B`` bytes over the slowest link, so the
    latency is :data:`LATENCY_SHARE` of it when ``B = n * latency * bandwidth / share`` (the
    group's largest latency, its smallest bandwidth), clamped to 1-25 MiB;
    ``$DEEPCEE_GRAD_BUCKET_MB`` when set."""
    setting = os.environ.get(BUCKET_ENV, "").strip()
    if setting:
        try:
            mib = float(setting)
        except ValueError:
            mib = math.nan
        if not mib > 0:
            raise ValueError(
                f"${BUCKET_ENV}: expected a positive number of MiB or inf, got {setting!r}"
            )
        return sys.maxsize if math.isinf(mib) else max(1, int(mib * 2**20))
    if profile is None or len(ranks) < 2:
        return MAX_BUCKET_BYTES
    pairs = [(a, b) for a in ranks for b in ranks if a != b]
    latency = max(profile.latency_s[a][b] for a, b in pairs)
    bandwidth = min(profile.bandwidth_bytes_per_s[a][b] for a, b in pairs)
    wanted = len(ranks) * latency * bandwidth / LATENCY_SHARE
    return int(min(MAX_BUCKET_BYTES, max(MIN_BUCKET_BYTES, wanted)))


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    ready: int = 0
    grads: list[torch.Tensor] = field(default_factory=list)
    """What was summed (the shapes to unflatten into)."""
    finish: Callable[[], torch.Tensor] | None = None


class BucketedGradSync:
    """Sums ``params``' gradients over ``group`` in buckets (see the module docstring)."""

    def __init__(self, params: Sequence[nn.Parameter], group: Any, *, bucket_bytes: int) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes: expected a positive size, got {bucket_bytes}")
        self.group = group
        self.bucket_bytes = bucket_bytes
        self._params = [p for p in params if p.requires_grad]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[int, int] = {}
        self._fill(list(reversed(range(len(self._params)))))
        self._ordered = False
        """Whether the buckets follow the order the first step's backward finished them in."""
        self._seen: list[int] = []
        self._hooks: list[Any] = []
        self._next = self._early = 0
        self.started_early = 0
        """Buckets of the last step whose all-reduce started during its backward (the rest
        started in :meth:`finish`)."""

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def arm(self) -> None:
        """Call right before this rank's last backward of the step: from then on each parameter
        whose gradient is complete marks itself ready."""
        self._disarm()
        for bucket in self._buckets:
            bucket.ready, bucket.grads, bucket.finish = 0, [], None
        self._next = self._early = 0
        self._seen = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_ready) for p in self._params]

    def finish(self) -> None:
        """After the step's backward: start the buckets not started (in order), wait for every
        bucket, and set each parameter's gradient to the sum over the group. After the first
        step the buckets are rebuilt in the order that step's backward finished the parameters
        (the group's first device's order, so that all agree)."""
        self._disarm()
        self.started_early, self._early = self._early, 0
        while self._next < len(self._buckets):
            self._start(self._next)
        for bucket in self._buckets:
            assert bucket.finish is not None
            flat = bucket.finish()
            for p, summed in zip(
                bucket.params, unflatten_dense_tensors(flat, bucket.grads), strict=True
            ):
                p.grad = summed
            bucket.grads, bucket.finish = [], None
        self._next = 0
        if not self._ordered:
            self._ordered = True
            self._reorder()

    def _reorder(self) -> None:
        """Rebuild the buckets in the first device's observed order (when it saw one): the
        parameters in the order their gradients completed, then those that got none."""
        seen = list(dict.fromkeys(self._seen))
        rest = [i for i in reversed(range(len(self._params))) if i not in set(seen)]
        order: list[Any] = [seen + rest if seen else []]
        dist.broadcast_object_list(order, src=dist.get_global_rank(self.group, 0), group=self.group)
        if order[0]:
            self._fill(order[0])

    def _fill(self, order: Sequence[int]) -> None:
        """Buckets of the parameters in ``order`` (indices), each at most ``bucket_bytes`` (a
        larger parameter alone), one dtype and device per bucket."""
        self._buckets, self._bucket_of = [], {}
        size = 0
        for index in order:
            p = self._params[index]
            last = self._buckets[-1] if self._buckets else None
            nbytes = p.numel() * p.element_size()
            if (
                last is None
                or last.params[-1].dtype != p.dtype
                or last.params[-1].device != p.device
                or size + nbytes > self.bucket_bytes
            ):
                last, size = _Bucket([]), 0
                self._buckets.append(last)
            last.params.append(p)
            size += nbytes
            self._bucket_of[id(p)] = len(self._buckets) - 1

    def _on_ready(self, param: torch.Tensor) -> None:
        self._seen.append(self._index[id(param)])
        bucket = self._buckets[self._bucket_of[id(param)]]
        bucket.ready += 1
        while self._next < len(self._buckets) and self._buckets[self._next].ready == len(
            self._buckets[self._next].params
        ):
            self._start(self._next)
            self._early += 1

    def _start(self, index: int) -> None:
        bucket = self._buckets[index]
        bucket.grads = [
            p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params
        ]
        bucket.finish = start_all_reduce(flatten_dense_tensors(bucket.grads), self.group)
        self._next = index + 1

    def _disarm(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
