"""The adapter's per-step exchange, packed and read (pure).

Each step every rank adds its figures into one vector that a single all-reduce sums (the
Lightning shim, ``callback.py``, posts it and reads it a step later): per pair of the running
plan the bytes and seconds on the wire this rank received (as read, and each transfer's less
the stamps' error), every rank's step time, number of proposals, compute seconds and compute
probe seconds (the come-back's, on a device it watches) in its own slot, and a flag the
searcher raises when its re-plan search has finished. Every rank reads the same sums, so its
monitors make the same proposals from them and it acts on them at once; the proposal counts
check that (:func:`check_agreement`). Only the ranks with a part to add sum
(:func:`exchange_members`); the others are handed the sums.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, Protocol

__all__ = ["Exchanged", "check_agreement", "exchange_members", "pack", "unpack"]


class _Received(Protocol):
    peer: int
    num_bytes: int
    direction: str
    wire_s: float | None
    stall_s: float


class Exchanged(NamedTuple):
    """One step's exchange, as every rank reads it."""

    step: int
    rows: list[list[Any]]
    """``[src, dst, bytes, wire seconds, optimistic wire seconds]`` per pair of the running
    plan with transfers (the last: each transfer's seconds less ``stamp_error_s`` and less the
    receiver's wait for a CPU in them, at least 0)."""
    slowest_s: float
    """The slowest rank's step time."""
    anyone: bool
    """Some rank made proposals with this exchange (:func:`check_agreement`)."""
    search_done: bool
    """The background re-plan search has finished (on the rank that runs it)."""
    compute_s: tuple[float, ...] = ()
    """Every rank's compute seconds of the step (0 where a rank did not train)."""
    probe_s: tuple[float, ...] = ()
    """Every rank's newest compute probe seconds (0 where none ended since the last step)."""


def exchange_members(
    training: Iterable[int],
    searchers: Iterable[int],
    probed: Iterable[tuple[int, int]],
    watched: Iterable[int],
) -> list[int]:
    """The ranks that sum the exchange, sorted: those that train (transfers, compute), search
    (the done flag), probe a link (either end) or run a compute probe. Any other rank adds only
    zeros and its step time, which the step totals already tie to the others'."""
    ranks = {*training, *searchers, *watched}
    for src, dst in probed:
        ranks.update((src, dst))
    if not ranks:
        raise ValueError("exchange_members: no rank trains, searches or probes")
    return sorted(ranks)


def pack(
    pairs: Sequence[tuple[int, int]],
    records: Iterable[_Received],
    *,
    rank: int,
    world: int,
    min_bytes: int,
    step_s: float,
    count: int,
    search_done: bool,
    compute_s: float = 0.0,
    probe_s: float = 0.0,
    stamp_error_s: float = 0.0,
) -> list[float]:
    """This rank's part of the sum. Only received transfers of at least ``min_bytes`` with a
    wire time count: a receive's blocked time includes waiting for the sender's compute, which a
    split shortens, while the payload's time on the wire is what the link delivers. Each
    transfer's time less ``stamp_error_s`` and less its ``stall_s`` (the receiving side's wait
    for a CPU, which made its stamp late; at least 0) is summed too: a transfer is subtracted
    one stamp error, not a step's sum of them."""
    index = {pair: i for i, pair in enumerate(pairs)}
    n = len(index)
    values = [0.0] * (3 * n + 4 * world + 1)
    for r in records:
        i = index.get((r.peer, rank))
        if i is not None and r.direction == "recv" and r.wire_s and r.num_bytes >= min_bytes:
            values[i] += r.num_bytes
            values[n + i] += r.wire_s
            values[2 * n + i] += max(r.wire_s - stamp_error_s - r.stall_s, 0.0)
    values[3 * n + rank] = step_s
    values[3 * n + world + rank] = float(count)
    values[3 * n + 2 * world + rank] = float(compute_s)
    values[3 * n + 3 * world + rank] = float(probe_s)
    values[-1] = float(search_done)
    return values


def unpack(step: int, pairs: Sequence[tuple[int, int]], world: int, out: list[float]) -> Exchanged:
    """Read the summed vector of ``step``."""
    n = len(pairs)
    rows = [
        [s, d, int(out[i]), out[n + i], out[2 * n + i]]
        for i, (s, d) in enumerate(pairs)
        if out[i] > 0
    ]
    step_times = out[3 * n : 3 * n + world]
    counts = out[3 * n + world : 3 * n + 2 * world]
    compute = out[3 * n + 2 * world : 3 * n + 3 * world]
    probe = out[3 * n + 3 * world : 3 * n + 4 * world]
    return Exchanged(
        step, rows, max(step_times), sum(counts) > 0, out[-1] > 0, tuple(compute), tuple(probe)
    )


def check_agreement(landed: Exchanged, proposed: int) -> None:
    """Every rank acts at once on the proposals its monitors make from the same sums, with no
    collective to agree on them: the exchange that counted them (``landed.anyone``) must agree
    with this rank's own count, ``proposed``, or the ranks' monitors have diverged."""
    if landed.anyone != (proposed > 0):
        raise RuntimeError(
            f"DynamicEnvironmentAdapter: with the exchange of step {landed.step} this rank made "
            f"{proposed} proposal(s) but the ranks' count says "
            f"{'some' if landed.anyone else 'none'}: the ranks' monitors disagree (a state "
            "loaded on some ranks only?); every rank must run the same adapter"
        )
