"""The plan search at set-up, with its independent calls spread over every rank.

Every rank waits for the plan at set-up, and the search's costliest steps are independent calls
of pure functions (:class:`~lightning_deepcee.planner.candidates.MapFn`: the device sets' quick
searches, then the finalist sets' full searches, one call each). Rank 0 runs the search; at
each such step it broadcasts the function and its items, every rank makes the calls assigned to
it (costliest first, each to the device that would finish it first by the profile's
capability), and rank 0 gathers the results in order. The plan is the serial search's: the same
pure functions on the same arguments. A failure on any rank reaches every rank as an error,
never as a wait.

Strategy layer: torch.distributed and the planner's public API.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

from lightning_deepcee.planner import Plan, plan_search
from lightning_deepcee.planner.candidates import MapFn, serial_map
from lightning_deepcee.profiler.data import ClusterProfile

__all__ = ["assign_calls", "spread", "spread_plan_search"]

T = TypeVar("T")


def spread_plan_search(profile: ClusterProfile, **options: Any) -> Plan:
    """``plan_search(profile, **options)`` run by rank 0 with its independent calls spread over
    every rank of the default group, weighted by the devices' measured capability (the device
    sets' quick searches in waves of one per rank, then one call per finalist set's full
    search); every rank returns the plan
    (``options["alternatives"]``, when given, is filled on rank 0 only)."""
    weights = [device.capability for device in sorted(profile.devices, key=lambda d: d.rank)]

    width = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def search(map_fn: MapFn) -> dict[str, Any]:
        return plan_search(profile, map_fn=map_fn, map_width=width, **options).to_dict()

    return Plan.from_dict(spread(search, weights))


def spread(work: Callable[[MapFn], T], weights: Sequence[float]) -> T:
    """``work(map_fn)`` on rank 0, whose ``map_fn`` hands each call to a rank (``weights``: one
    per rank, higher is faster); every rank returns rank 0's result, or raises when ``work``
    failed on rank 0 or a call failed anywhere. Without a process group of two or more ranks,
    ``work(serial_map)``."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return work(serial_map)
    if len(weights) != dist.get_world_size() or not all(w > 0 for w in weights):
        raise ValueError(
            f"weights: expected {dist.get_world_size()} positive figures (one per rank), "
            f"got {list(weights)}"
        )
    if dist.get_rank() != 0:
        return _serve()
    try:
        result = work(_SpreadMap(weights))
    except Exception as error:
        _broadcast(("done", None, f"{type(error).__name__}: {error}"))
        raise
    _broadcast(("done", result, None))
    return result


def assign_calls(costs: Sequence[float], weights: Sequence[float]) -> list[int]:
    """The rank of each call of relative cost ``costs[i]``: costliest first, each to the rank
    where it would finish first (``(load + cost) / weight`` smallest, the lowest rank on ties;
    longest-processing-time-first list scheduling)."""
    load = [0.0] * len(weights)
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        cost = costs[index]
        rank = min(range(len(weights)), key=lambda r: ((load[r] + cost) / weights[r], r))
        load[rank] += cost
        owners[index] = rank
    return owners


class _SpreadMap:
    """Rank 0's :class:`~lightning_deepcee.planner.candidates.MapFn`: announce the calls, make
    its own, gather the others'."""

    def __init__(self, weights: Sequence[float]) -> None:
        self.weights = list(weights)

    def __call__(
        self,
        fn: Callable[[Any], Any],
        items: Sequence[Any],
        costs: Sequence[float] | None = None,
    ) -> list[Any]:
        items = list(items)
        owners = assign_calls([1.0] * len(items) if costs is None else costs, self.weights)
        _broadcast(("map", fn, items, owners))
        return _call_and_gather(fn, items, owners)


def _serve() -> Any:
    """A rank other than 0: make the calls rank 0 announces until it sends the result."""
    while True:
        message = _broadcast(None)
        if message[0] == "map":
            _, fn, items, owners = message
            _call_and_gather(fn, items, owners)
            continue
        _, result, error = message
        if error is not None:
            raise RuntimeError(f"DeepCEE: the plan search failed on rank 0: {error}")
        return result


def _call_and_gather(
    fn: Callable[[Any], Any], items: Sequence[Any], owners: Sequence[int]
) -> list[Any]:
    """This rank's calls; on rank 0 every rank's results in item order (others get [])."""
    rank = dist.get_rank()
    mine: list[tuple[int, Any]] = []
    failure: str | None = None
    for index, (item, owner) in enumerate(zip(items, owners, strict=True)):
        if owner != rank:
            continue
        try:
            mine.append((index, fn(item)))
        except Exception as error:  # reported to rank 0, which stops every rank
            failure = f"rank {rank}: {type(error).__name__}: {error}"
            break
    gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object((mine, failure), gathered, dst=0)
    if gathered is None:
        return []
    results: list[Any] = [None] * len(items)
    for part, failed in gathered:
        if failed is not None:
            raise RuntimeError(f"DeepCEE: a plan-search call failed on {failed}")
        for index, value in part:
            results[index] = value
    return results


def _broadcast(message: Any) -> Any:
    """Rank 0's ``message`` on every rank."""
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]
