"""Whole cluster: every rank's blocks and every link, gathered into one ``ClusterProfile``.

:func:`profile_cluster` checks that every rank holds the same model, times the blocks on each
rank (waiting for the slowest without the process group's timeout), records memory and CPU quota,
measures the network and assembles a :class:`~lightning_deepcee.profiler.DeviceProfile` per rank.

Runtime layer: torch and torch.distributed, never lightning.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_deepcee._compat import tree_flatten, tree_map
from lightning_deepcee.profiler.data import (
    ClusterProfile,
    DeviceProfile,
    capability_score,
    fingerprint,
    fingerprint_cluster,
)
from lightning_deepcee.runtime.cpu_quota import read_cpu_quota
from lightning_deepcee.runtime.liveness import DeviceLostError, default_store, wait_for_ranks
from lightning_deepcee.runtime.measure.blocks import BlockTimings, measure_blocks
from lightning_deepcee.runtime.measure.kept import format_age, kept_age_s, read_kept, write_kept
from lightning_deepcee.runtime.measure.memory import available_memory_bytes
from lightning_deepcee.runtime.measure.network import (
    KEPT_TOLERANCE,
    NetworkMeasurement,
    ProfilingTimeoutError,
    measure_network,
)
from lightning_deepcee.runtime.measure.passes import LossFn
from lightning_deepcee.runtime.transport import wire_device

__all__ = [
    "DEVICE_ENV",
    "DEVICE_KIND_ENV",
    "device_identity",
    "model_fingerprint",
    "profile_cluster",
]

DEVICE_KIND_ENV = "DEEPCEE_DEVICE_KIND"
"""Environment variable naming this device's class (``cloud``, ``edge``, ``end``, ...); when
unset the kind is the torch device type (``cpu``, ``cuda``)."""


def model_fingerprint(blocks: Sequence[nn.Module]) -> str:
    """Fingerprint of the model structure: each block's class and parameter names/shapes/dtypes."""
    return fingerprint(
        [
            {
                "class": f"{type(block).__module__}.{type(block).__qualname__}",
                "parameters": [
                    [name, list(p.shape), str(p.dtype)] for name, p in block.named_parameters()
                ],
            }
            for block in blocks
        ]
    )


DEVICE_ENV = "DEEPCEE_DEVICE"
"""A device's stable name (the lab sets it); its host name otherwise."""


def device_identity() -> str:
    """This device's name across restarts: ``$DEEPCEE_DEVICE``, else the host name.

    Ranks change at every rendezvous of an elastic job; the name is what profiles, checkpoints
    and restart reports use to recognise a device.
    """
    return (
        os.environ.get(DEVICE_ENV, "").strip()
        or os.environ.get("DEEPCEE_LAB_DEVICE", "").strip()
        or socket.gethostname()
    )


def _device_of(blocks: Sequence[nn.Module], device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    for block in blocks:
        for p in block.parameters():
            return p.device
    return torch.device("cpu")


def device_identities(
    blocks: Sequence[nn.Module], group: dist.ProcessGroup | None
) -> tuple[list[str], str]:
    """Gather every rank's host; check that every rank holds the same model."""
    identity = (device_identity(), model_fingerprint(blocks))
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, identity, group=group)
    fingerprints = {fp for _, fp in gathered}
    if len(fingerprints) != 1:
        per_rank = ", ".join(f"rank {r}: {fp}" for r, (_, fp) in enumerate(gathered))
        raise ValueError(
            f"profile_cluster: ranks hold different models (model fingerprints {per_rank}); "
            "every rank must build the same full model before partitioning"
        )
    return [host for host, _ in gathered], identity[1]


def profile_cluster(
    blocks: Sequence[nn.Module],
    sample_input: Any,
    *,
    loss_fn: LossFn | None = None,
    sample_batch: Any = None,
    device: torch.device | str | None = None,
    group: dist.ProcessGroup | None = None,
    repeats: int = 5,
    warmup: int = 2,
    small_bytes: int = 1024,
    large_bytes: int = 4 * 2**20,
    network_repeats: int = 2,
    budget_s: float = 60.0,
    op_timeout_s: float | None = None,
    rounds: int = 3,
    device_cache: str | os.PathLike[str] | None = None,
    block_budget_s: float | None = None,
    parts: dict[str, float] | None = None,
    progress: Callable[[str], None] | None = None,
) -> ClusterProfile:
    """Measure every rank's blocks and every link; every rank returns the same profile.

    Collective over ``group``. ``blocks`` is the full model (every rank holds all of it before
    partitioning), already on ``device`` (default: the device of the first parameter).
    ``sample_input`` is the first block's input value for one reference micro-batch (its tensors
    moved to ``device``; ``sample_batch``, read only by ``loss_fn``, is not moved). ``budget_s``
    bounds the network measurement (:func:`measure_network`); ``rounds`` is
    :func:`measure_blocks`' (the median of that many measurements); the device kind comes from
    ``$DEEPCEE_DEVICE_KIND`` (default: the torch device type). With ``device_cache`` (a
    directory on each device), a device reuses its own block timings from an earlier profile of
    the same model, micro-batch and CPU quota (an elastic restart measures only the devices that
    are new), and rank 0 keeps the link figures of the same device set: the next profile
    measures one pair between every two network groups and reuses them while those agree
    (:func:`measure_network`'s ``kept``). ``block_budget_s`` bounds each device's block
    timings (:func:`measure_blocks`' ``budget_s``: a slow device takes fewer rounds and repeats).
    ``parts``, when given, receives the wall seconds of the slowest device's block timings
    (``"blocks"``) and of the network measurement (``"network"``), the same on every rank.
    ``progress``, when given, gets a line on rank 0 as each device finishes its block timings
    (``blocks 3/8: edge-0 (rank 2), 21.4 s``, seconds since the timings began) and when the
    links are measured.
    """
    device = _device_of(blocks, device)
    hosts, model_fp = device_identities(blocks, group)
    moved = tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, sample_input)
    cached = _cache_file(device_cache, model_fp, moved, device)
    began = time.perf_counter()
    timings = _load_timings(cached)
    kept_s = kept_age_s(cached) if timings is not None else None
    if timings is None:
        timings = measure_blocks(
            blocks,
            moved,
            loss_fn=loss_fn,
            sample_batch=sample_batch,
            repeats=repeats,
            warmup=warmup,
            rounds=rounds,
            budget_s=block_budget_s,
        )
        write_kept(cached, dataclasses.asdict(timings))
    blocks_s = time.perf_counter() - began
    world, rank_zero = dist.get_world_size(group), dist.get_rank(group) == 0
    counted = itertools.count(1)

    def arrived(rank: int, _waited_s: float) -> None:
        if progress is not None:  # only passed on when it is set
            seconds = time.perf_counter() - began
            progress(
                f"DeepCEE: blocks {next(counted)}/{world}: {hosts[rank]} (rank {rank}), "
                f"{seconds:.1f} s"
            )

    _wait_for_slowest_rank(group, "blocks", arrived if rank_zero and progress else None)
    links_file = _links_file(device_cache, hosts, network_repeats) if rank_zero else None
    local = {
        "kept_links": _load_links(links_file),
        "kind": os.environ.get(DEVICE_KIND_ENV, "").strip() or device.type,
        "memory_bytes": available_memory_bytes(device),
        "timings": timings,
        "cpu_quota": _cpu_quota(device),
        "blocks_s": blocks_s,
        "kept_s": kept_s,
    }
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    if rank_zero and progress is not None:
        kept = kept_line([record.get("kept_s") for record in gathered], hosts)
        if kept:
            progress(kept)
        progress(f"DeepCEE: measuring the links of {world} devices (at most {budget_s:g} s)")
    kept_links: tuple[NetworkMeasurement, float] | None = gathered[0]["kept_links"]
    network = measure_network(
        kept=kept_links[0] if kept_links is not None else None,
        group=group,
        small_bytes=small_bytes,
        large_bytes=large_bytes,
        repeats=network_repeats,
        budget_s=budget_s,
        op_timeout_s=op_timeout_s,
        device=wire_device(device, group),
        hosts=hosts,
    )
    if rank_zero and kept_links is not None and progress is not None:
        progress(_kept_links_line(network.kept, kept_links[1], network.elapsed_s))
    if not network.kept:
        write_kept(links_file, dataclasses.asdict(network))
    devices = [_device_profile(rank, hosts[rank], record) for rank, record in enumerate(gathered)]
    if parts is not None:
        parts["blocks"] = max(float(record.get("blocks_s", 0.0)) for record in gathered)
        parts["network"] = network.elapsed_s
    return ClusterProfile(
        devices=tuple(devices),
        latency_s=network.latency_s,
        bandwidth_bytes_per_s=network.bandwidth_bytes_per_s,
        num_blocks=len(blocks),
        model_fingerprint=model_fp,
        cluster_fingerprint=fingerprint_cluster(hosts),
    )


_WAITS = itertools.count()
"""Numbers the waits of this process; every rank makes the same ones, so they agree."""


def _wait_for_slowest_rank(
    group: dist.ProcessGroup | None,
    phase: str,
    on_arrival: Callable[[int, float], None] | None = None,
) -> None:
    """Wait, without the process group's timeout, until every rank has finished ``phase``.

    The block timings take as long as the slowest device needs, which on a throttled device can
    exceed the timeout ``DeepCEEStrategy`` gives its process group, and the other ranks, waiting
    in the gather that follows, would fail. So the ranks meet in the store first
    (:func:`~lightning_deepcee.runtime.liveness.wait_for_ranks`: as long as the slow rank's
    heartbeat advances). A sub-group, or a run without a store, keeps the gather's timeout.
    """
    store = default_store()
    world = dist.get_world_size()
    if store is None or world == 1 or dist.get_world_size(group) != world:
        return
    try:
        wait_for_ranks(
            store,
            dist.get_rank(),
            world,
            f"profile/{phase}/{next(_WAITS)}",
            on_arrival=on_arrival,
        )
    except DeviceLostError as exc:
        raise ProfilingTimeoutError(f"profile_cluster: {exc}") from exc


def _cpu_quota(device: torch.device) -> tuple[float, float]:
    """``(cpu_share, cpu_period_s)`` of a CPU device under a CFS quota; ``(1.0, 0.0)`` if none.

    The share is of the speed the compute threads reach unthrottled: ``quota cores / threads``
    (a device computing on 2 threads under a 1-core quota sustains half its burst speed). A
    GPU's compute does not run on the quota's CPU time, so no quota is recorded for it.
    """
    if device.type != "cpu":
        return 1.0, 0.0
    quota = read_cpu_quota()
    if quota is None:
        return 1.0, 0.0
    share = quota.cores / max(1, torch.get_num_threads())
    if share >= 1.0:
        return 1.0, 0.0
    return share, quota.period_s


_TIMING_FIELDS = (
    "forward_s",
    "backward_input_s",
    "backward_weight_s",
    "activation_bytes",
    "parameter_bytes",
    "saved_bytes",
    "transient_bytes",
    "fixed_s",
    "backward_s",
    "optimizer_s_per_byte",
)
"""The :class:`BlockTimings` fields a :class:`DeviceProfile` takes over under the same name."""


def _device_profile(rank: int, host: str, record: dict[str, Any]) -> DeviceProfile:
    """One rank's profile from what it gathered: its measured block timings, memory and quota."""
    timings: BlockTimings = record["timings"]
    cpu_share, cpu_period_s = record.get("cpu_quota", (1.0, 0.0))
    return DeviceProfile(
        rank=rank,
        host=host,
        kind=record["kind"],
        memory_bytes=record["memory_bytes"],
        **{name: getattr(timings, name) for name in _TIMING_FIELDS},
        reference_microbatch_size=timings.microbatch_size,
        cpu_share=cpu_share,
        cpu_period_s=cpu_period_s,
        capability=capability_score(
            timings.forward_s, timings.backward_input_s, timings.backward_weight_s
        ),
    )


_TIMINGS_METHOD = 2
"""Goes up whenever :func:`measure_blocks` changes what its figures mean, so that a device does
not reuse timings kept from an older method (2: the merged backward, the sustained factor from
the timed calls)."""


def _cache_file(
    directory: str | os.PathLike[str] | None, model_fp: str, sample: Any, device: torch.device
) -> Path | None:
    """Where this device keeps its block timings for this model, micro-batch and CPU quota."""
    if directory is None:
        return None
    shapes = [tuple(v.shape) for v in tree_flatten(sample)[0] if isinstance(v, torch.Tensor)]
    key = json.dumps(
        [device_identity(), model_fp, str(device), shapes, _cpu_quota(device),
         torch.get_num_threads(), os.environ.get(DEVICE_KIND_ENV, ""), _TIMINGS_METHOD]
    )  # fmt: skip
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(directory) / f"{device_identity()}-{digest}.json"


def _links_file(
    directory: str | os.PathLike[str] | None, hosts: Sequence[str], repeats: int
) -> Path | None:
    """Where rank 0 keeps the link figures of this device set (hosts in rank order)."""
    if directory is None:
        return None
    key = json.dumps([list(hosts), repeats, _TIMINGS_METHOD])
    return Path(directory) / f"links-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _load_links(path: Path | None) -> tuple[NetworkMeasurement, float] | None:
    """Kept link figures and their age in seconds, or None (none kept, or unreadable)."""
    try:
        fields = read_kept(path)
        return None if fields is None else (NetworkMeasurement(**fields), kept_age_s(path) or 0.0)
    except (ValueError, TypeError):
        return None  # from another version: measure again


def _kept_links_line(reused: bool, age_s: float, seconds: float) -> str:
    """The console line on kept link figures: reused after the probes, or measured again."""
    if reused:
        return (
            f"DeepCEE: links kept from an earlier profile ({format_age(age_s)} old): a pair "
            f"between every two network groups within {KEPT_TOLERANCE:g}x of them "
            f"({seconds:.1f} s); not measured again"
        )
    return (
        "DeepCEE: links measured again: a pair between two network groups is more than "
        f"{KEPT_TOLERANCE:g}x off the kept figures"
    )


def kept_line(kept_s: Sequence[float | None], hosts: Sequence[str]) -> str:
    """The console line that names the devices whose block timings came from ``device_cache``
    and how old they are (``kept_s[rank]``: seconds, ``None`` where measured now); empty when
    every device measured."""
    kept = [(rank, age) for rank, age in enumerate(kept_s) if age is not None]
    if not kept:
        return ""

    listed = ", ".join(f"{hosts[rank]} (rank {rank}) {format_age(s)} old" for rank, s in kept)
    return (
        f"DeepCEE: block timings kept from an earlier profile (device_cache) on {len(kept)} of "
        f"{len(kept_s)} devices: {listed}; the others measured now, every link measured now"
    )


def _load_timings(path: Path | None) -> BlockTimings | None:
    try:
        fields = read_kept(path)
        return None if fields is None else BlockTimings(**fields)
    except (ValueError, TypeError):
        return None  # unreadable or from another version: measure again
