"""Network: latency and bandwidth of every ordered pair of ranks, in rounds of disjoint pairs.

Why rounds of disjoint pairs: measuring one pair at a time needs ``N(N-1)/2`` sequential steps;
measuring all pairs at once makes every rank's NIC carry ``N-1`` streams, so each link looks
``N-1`` times slower than it is. A round-robin tournament (the circle method) splits the pairs
into ``N-1`` rounds (``N`` for odd ``N``, one rank idle per round) in which every rank talks to
at most one peer, so each measurement sees an otherwise quiet link and the whole matrix costs
about ``N`` pair measurements of wall time. Pairs across network groups are the exception: they
may share a WAN link, so they run one at a time, and only a few per pair of groups (the others
take their figures, :func:`representative_pairs`).

Each direction of a pair is measured on its own, so asymmetric links (a slow uplink) show: the
initiator sends a ``small_bytes`` ping and gets a ``small_bytes`` pong (latency = round trip / 2),
then sends a large ping and gets a ``small_bytes`` pong (the large size is chosen per link by a
warm-up round: about 0.2 s of transfer, at most ``large_bytes``, and each repeat resizes the next
to the rate it showed). The two round trips differ only by the extra bytes going one way, so
``bandwidth = (large - small) / (rtt_large - rtt_small)``; echoing the large message back would
average both directions. Noise only ever adds time (a process throttled by its CPU quota, a round
trip that waited for a scheduler slot, another pair's traffic on the shared cores), so the
small round trip keeps its *minimum* over ``repeats`` and the bandwidth its fastest repeat: the
one that saw the link alone, as in ping's and BBR's min-RTT filters. A median keeps a stalled
small round trip as often as a stalled large one, and a stall on the small one makes the
difference, and so the bandwidth, too high. A pair stops repeating once its two fastest readings
agree (within ``_AGREE``): pairs across groups run one at a time, and every repeat of one costs
every rank its time.

Time limits (a slow or dead device must never hang setup silently):

- ``budget_s`` bounds the whole network measurement. The initiator of each pair checks it before
  every ping and tells its peer in the ping itself; at the end of each round all ranks exchange
  which pair (if any) ran out, so *every* rank raises :class:`ProfilingTimeoutError` naming that
  pair, instead of some ranks waiting forever for a peer that gave up.
- A device that never answers is bounded by ``op_timeout_s`` if given, else by the process
  group's timeout (``init_process_group(timeout=...)``, 30 min by default for gloo). The error
  from ``torch.distributed`` is re-raised as ``ProfilingTimeoutError`` naming the silent peer's
  rank and host. The other ranks then fail in the next collective, also within the timeout.

Runtime layer: torch and torch.distributed, never lightning.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_deepcee.profiler.grouping import group_by_network
from lightning_deepcee.runtime.measure.passes import (
    sync_device,
)

__all__ = [
    "KEPT_TOLERANCE",
    "NetworkMeasurement",
    "ProfilingTimeoutError",
    "check_pairs",
    "kept_agrees",
    "measure_network",
    "representative_pairs",
    "round_robin_rounds",
]

# Ping header: byte 0 of every small ping says whether the initiator goes on; bytes 1-8 carry
# the size of the large message that follows (int64), which the initiator adapts to the link.
_CONTINUE = 1
_STOP = 2
_DONE = 3
_AGREE = 0.1
"""A pair's repeats end early once its two fastest readings lie within this fraction of each
other: a further repeat could only confirm them (noise only ever adds time)."""
_HEADER_BYTES = 9
_PROBE_BYTES = 256 * 2**10
"""The warm-up round sends at most this much; its time sizes the measured messages."""
_TARGET_S = 0.2
"""Measured large messages are sized to take about this long on the link (at most
``large_bytes``): a fixed 4 MiB message would take 1.7 s on a 20 Mbit/s WAN link, and
the measurement sends ``2 * repeats`` of them per pair. Shorter is faster but reads high: a
shorter message fits in a traffic shaper's burst allowance and measures the burst, not the rate."""


class ProfilingTimeoutError(RuntimeError):
    """Profiling ran past its time budget, or a peer did not answer within the timeout."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NetworkMeasurement:
    """Link matrices indexed ``[src_rank][dst_rank]`` (ranks of the measured group)."""

    latency_s: tuple[tuple[float, ...], ...]
    """One-way latency of a ``small_bytes`` message, seconds; 0 on the diagonal."""
    bandwidth_bytes_per_s: tuple[tuple[float, ...], ...]
    """Bytes per second from ``src`` to ``dst``; ``inf`` on the diagonal."""
    num_rounds: int
    """Rounds of pairs used: the probe rounds (``N - 1`` for even ``N``, ``N`` for odd ``N``),
    then the measured rounds: those rounds' pairs inside network groups, and one round per
    measured pair across groups (:func:`representative_pairs`)."""
    elapsed_s: float
    """Wall seconds this rank spent in :func:`measure_network`."""
    kept: bool = False
    """Whether the matrices are ``kept``'s, reused because a check of its WAN links agreed."""


KEPT_TOLERANCE = 1.5
"""Kept link figures are reused while a short measurement of one pair between every two network
groups lies within this factor of the kept figure, each way: a WAN link that lost or gained a
third has changed."""


def _message_sizes(bandwidth: torch.Tensor, small_bytes: int, large_bytes: int) -> list[list[int]]:
    """Bytes of each pair's measured message: what ``bandwidth`` carries in ``_TARGET_S``,
    within ``(small_bytes, large_bytes]``."""
    sizes = (bandwidth * _TARGET_S).clamp(min=small_bytes + 1, max=large_bytes)
    sized: list[list[int]] = sizes.cpu().long().tolist()
    return sized


def check_pairs(kept: NetworkMeasurement) -> list[tuple[int, int]]:
    """The pairs a kept measurement is checked on: the first rank of each network group (of
    its bandwidth) with the first of every later group. Links inside a group are fast and seldom
    what a plan waits for; one pair stands for the WAN link between two groups."""
    groups = group_by_network(kept.bandwidth_bytes_per_s)
    return [(a[0], b[0]) for a, b in itertools.combinations(groups, 2)]


def kept_agrees(
    kept: NetworkMeasurement,
    bandwidth: Sequence[Sequence[float]],
    pairs: Sequence[tuple[int, int]],
    tolerance: float = KEPT_TOLERANCE,
) -> bool:
    """Whether ``bandwidth`` (measured now on ``pairs``, both ways) lies within ``tolerance``
    times ``kept``'s figure for every such direction."""
    then = kept.bandwidth_bytes_per_s
    return all(
        then[i][j] / tolerance <= bandwidth[i][j] <= then[i][j] * tolerance
        for low, high in pairs
        for i, j in ((low, high), (high, low))
    )


def round_robin_rounds(num_ranks: int) -> list[list[tuple[int, int]]]:
    """Split all pairs of ``num_ranks`` ranks into rounds where each rank is in at most one pair.

    Circle method: rank 0 stays put, the others rotate one place per round. An odd count gets a
    phantom rank whose partner sits the round out, so there are ``N - 1`` rounds for even ``N``
    and ``N`` for odd ``N`` (none for a single rank). Pairs are ``(low, high)``, sorted.
    """
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks: expected a positive integer, got {num_ranks!r}")
    if num_ranks == 1:
        return []
    slots = num_ranks + num_ranks % 2
    circle = list(range(slots))
    rounds = []
    for _ in range(slots - 1):
        pairs = [
            (min(circle[i], circle[-1 - i]), max(circle[i], circle[-1 - i]))
            for i in range(slots // 2)
        ]
        rounds.append(sorted(pair for pair in pairs if pair[1] < num_ranks))
        circle = [circle[0], circle[-1], *circle[1:-1]]
    return rounds


def measure_network(
    *,
    group: dist.ProcessGroup | None = None,
    small_bytes: int = 1024,
    large_bytes: int = 4 * 2**20,
    repeats: int = 3,
    budget_s: float = 60.0,
    op_timeout_s: float | None = None,
    device: torch.device | str = "cpu",
    hosts: Sequence[str] | None = None,
    kept: NetworkMeasurement | None = None,
    kept_tolerance: float = KEPT_TOLERANCE,
) -> NetworkMeasurement:
    """Latency and bandwidth of every ordered pair of ranks in ``group``; collective.

    Every rank of ``group`` must call it with the same arguments; every rank returns the same
    full matrices. ``device`` holds the message buffers (``cuda`` for NCCL). ``hosts`` (one per
    rank) only improves error messages. Raises :class:`ProfilingTimeoutError` on every rank when
    ``budget_s`` runs out, naming the pair being measured; see the module docstring for the
    per-operation timeout (``op_timeout_s``, default: the process group's timeout).

    ``kept`` (the same on every rank): figures of an earlier measurement of these ranks' links.
    One pair between every two of its network groups is measured first, each way, once, with
    messages sized as ``kept`` would size them (:func:`check_pairs`); when every such figure
    lies within ``kept_tolerance`` times ``kept``'s (:func:`kept_agrees`) its matrices are
    returned (``kept=True``, a second or two per WAN link), else the whole measurement runs.
    """
    for name, value, minimum in (
        ("small_bytes", small_bytes, _HEADER_BYTES),
        ("large_bytes", large_bytes, 1),
        ("repeats", repeats, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")
    if large_bytes <= small_bytes:
        raise ValueError(
            f"large_bytes: expected more than small_bytes ({small_bytes}) so that the difference "
            f"measures bandwidth, got {large_bytes}"
        )
    if not (isinstance(budget_s, (int, float)) and budget_s > 0 and math.isfinite(budget_s)):
        raise ValueError(
            f"budget_s: expected a positive finite number of seconds, got {budget_s!r}"
        )
    if op_timeout_s is not None and not op_timeout_s > 0:
        raise ValueError(f"op_timeout_s: expected None or positive seconds, got {op_timeout_s!r}")
    return _measure_network(
        group=group,
        small_bytes=small_bytes,
        large_bytes=large_bytes,
        repeats=repeats,
        budget_s=float(budget_s),
        op_timeout_s=op_timeout_s,
        device=torch.device(device),
        hosts=hosts,
        kept=kept,
        kept_tolerance=kept_tolerance,
    )


@dataclass(kw_only=True, slots=True)
class _PairContext:
    """What one rank needs to run its pair of the current round."""

    rank: int
    peer: int
    peer_global: int
    group: dist.ProcessGroup | None
    device: torch.device
    op_timeout: timedelta | None
    hosts: Sequence[str] | None
    deadline: float

    def name(self, rank: int) -> str:
        return f"rank {rank}" + (f" ({self.hosts[rank]})" if self.hosts else "")

    def send(self, tensor: torch.Tensor) -> None:
        self._wait(dist.isend(tensor, self.peer_global, group=self.group), "send to")

    def recv(self, tensor: torch.Tensor) -> None:
        self._wait(dist.irecv(tensor, self.peer_global, group=self.group), "receive from")

    def _wait(self, work: Any, what: str) -> None:
        try:
            if self.op_timeout is None:
                work.wait()
            else:
                work.wait(self.op_timeout)
            sync_device(self.device)
        except RuntimeError as exc:
            raise ProfilingTimeoutError(
                f"{self.name(self.rank)}: could not {what} {self.name(self.peer)} while measuring "
                f"their link ({exc}). The peer is unreachable or stopped answering; the limit is "
                "op_timeout_s, else the process group timeout (init_process_group(timeout=...))."
            ) from exc


def _measure_network(
    *,
    group: dist.ProcessGroup | None,
    small_bytes: int,
    large_bytes: int,
    repeats: int,
    budget_s: float,
    op_timeout_s: float | None,
    device: torch.device,
    hosts: Sequence[str] | None,
    kept: NetworkMeasurement | None,
    kept_tolerance: float,
) -> NetworkMeasurement:
    start = time.perf_counter()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if hosts is not None and len(hosts) != world:
        raise ValueError(f"hosts: expected {world} names (one per rank), got {len(hosts)}")
    if kept is not None and len(kept.bandwidth_bytes_per_s) == world:
        pairs = check_pairs(kept)
        sizes = _message_sizes(torch.tensor(kept.bandwidth_bytes_per_s), small_bytes, large_bytes)
        _, bandwidth = _run_rounds(
            [([pair], "checking kept figures") for pair in pairs],
            rank=rank, group=group, device=device, op_timeout_s=op_timeout_s, hosts=hosts,
            small_bytes=small_bytes, large_bytes=large_bytes, repeats=1,
            sizes=sizes, budget_s=budget_s, start=start, first_round=0, total_rounds=len(pairs),
        )  # fmt: skip
        if kept_agrees(kept, bandwidth.cpu().tolist(), pairs, kept_tolerance):
            return dataclasses.replace(
                kept, num_rounds=len(pairs), elapsed_s=time.perf_counter() - start, kept=True
            )
    rounds = round_robin_rounds(world)
    # Phase 1: one sizing probe each way for every pair, in rounds of disjoint pairs.
    _, probe_bandwidth = _run_rounds(
        [(pairs, "probe") for pairs in rounds],
        rank=rank, group=group, device=device, op_timeout_s=op_timeout_s, hosts=hosts,
        small_bytes=small_bytes, large_bytes=large_bytes, repeats=0, sizes=None,
        budget_s=budget_s, start=start, first_round=0, total_rounds=None,
    )  # fmt: skip
    # Phase 2: the measured figures. Pairs inside a network group run concurrently (a switch
    # carries disjoint pairs at full rate); pairs across groups run one at a time, because they
    # may share one WAN link (pairs crossing it at once would each see only part of it).
    members = group_by_network(probe_bandwidth.cpu().numpy())
    group_of = {r: g for g, ranks in enumerate(members) for r in ranks}
    inside = [[p for p in pairs if group_of[p[0]] == group_of[p[1]]] for pairs in rounds]
    across = [p for pairs in rounds for p in pairs if group_of[p[0]] != group_of[p[1]]]
    stand_ins = representative_pairs(across, group_of, probe_bandwidth.cpu().tolist())
    schedule = [(pairs, "inside groups") for pairs in inside if pairs]
    schedule += [([pair], "across groups") for pair in across if pair not in stand_ins]
    latency, bandwidth = _run_rounds(
        schedule,
        rank=rank, group=group, device=device, op_timeout_s=op_timeout_s, hosts=hosts,
        small_bytes=small_bytes, large_bytes=large_bytes, repeats=repeats,
        sizes=_message_sizes(probe_bandwidth, small_bytes, large_bytes), budget_s=budget_s,
        start=start,
        first_round=len(rounds), total_rounds=len(rounds) + len(schedule),
    )  # fmt: skip
    for (low, high), alike in stand_ins.items():  # each way, the slowest alike reading
        for i, j, (a, b) in ((low, high, (0, 1)), (high, low, (1, 0))):
            u, v = min(((r[a], r[b]) for r in alike), key=lambda uv: float(bandwidth[uv]))
            latency[i, j], bandwidth[i, j] = latency[u, v], bandwidth[u, v]
    bandwidth.fill_diagonal_(math.inf)
    return NetworkMeasurement(
        latency_s=tuple(tuple(row) for row in latency.cpu().tolist()),
        bandwidth_bytes_per_s=tuple(tuple(row) for row in bandwidth.cpu().tolist()),
        num_rounds=len(rounds) + len(schedule),
        elapsed_s=time.perf_counter() - start,
    )


def representative_pairs(
    across: Sequence[tuple[int, int]],
    group_of: dict[int, int],
    probe_bandwidth: Sequence[Sequence[float]],
    *,
    per_link: int = 1,
    tolerance: float = 3.0,
) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """Pairs ``(low, high)`` across network groups that need no measurement of their own, each
    mapped to the measured pairs that stand in for it, oriented alike: a stand-in's first rank
    is in ``low``'s group.

    Pairs across groups are measured one at a time (they may share a WAN link), so every pair
    between two large groups would cost minutes. Devices of one network group reach another
    group over the same links, so ``per_link`` pairs per pair of groups are measured (one by
    default: a measured message takes long enough that a shaper's burst does not show, and a
    reading that may have is dropped, :func:`_rates`), and each other pair is stood in for by
    those whose sizing probes are alike: the slower direction of each within ``tolerance``
    times the other's. The slower direction, because a short probe often rides a shaper's
    burst one way (reading several times the link's rate) and seldom both ways; the caller
    takes, each way, the slowest reading of the stand-ins. A pair that matches none is
    measured too: a device behind its own slower access link, either way, keeps its figure.
    """
    measured: dict[tuple[int, int], list[tuple[int, int]]] = {}
    stand_ins: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for low, high in across:
        # Oriented lower group first, so that both orders of two groups share their figures.
        swap = group_of[low] > group_of[high]
        x, y = (high, low) if swap else (low, high)
        mine = measured.setdefault((group_of[x], group_of[y]), [])

        def alike(a: int, b: int, x: int = x, y: int = y) -> bool:
            mine_s = min(probe_bandwidth[x][y], probe_bandwidth[y][x])
            theirs = min(probe_bandwidth[a][b], probe_bandwidth[b][a])
            return mine_s <= tolerance * theirs and theirs <= tolerance * mine_s

        matches = [(b, a) if swap else (a, b) for a, b in mine if alike(a, b)]
        if not matches or len(mine) < per_link:
            mine.append((x, y))
        else:
            stand_ins[(low, high)] = matches
    return stand_ins


def _run_rounds(
    schedule: Sequence[tuple[Sequence[tuple[int, int]], str]],
    *,
    rank: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    op_timeout_s: float | None,
    hosts: Sequence[str] | None,
    small_bytes: int,
    large_bytes: int,
    repeats: int,
    sizes: Sequence[Sequence[int]] | None,
    budget_s: float,
    start: float,
    first_round: int,
    total_rounds: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Measure each round's disjoint pairs concurrently; every rank returns the full matrices.

    ``sizes[i][j]`` is the large message from ``i`` to ``j``; ``None`` sizes it with a probe
    (and with ``repeats=0`` the probe is the measurement: the phase-1 figures).
    """
    world = dist.get_world_size(group)
    latency = torch.zeros(world, world, dtype=torch.float64, device=device)
    bandwidth = torch.zeros(world, world, dtype=torch.float64, device=device)
    total = total_rounds if total_rounds is not None else first_round + len(schedule)
    for index, (pairs, phase) in enumerate(schedule):
        stopped: tuple[int, int] | None = None
        for low, high in pairs:
            if rank not in (low, high):
                continue
            peer = high if rank == low else low
            context = _PairContext(
                rank=rank,
                peer=peer,
                peer_global=peer if group is None else dist.get_global_rank(group, peer),
                group=group,
                device=device,
                op_timeout=None if op_timeout_s is None else timedelta(seconds=op_timeout_s),
                hosts=hosts,
                deadline=start + budget_s,
            )
            size = None if sizes is None else (sizes[low][high], sizes[high][low])
            result = _measure_pair(context, low, high, small_bytes, large_bytes, repeats, size)
            if result is None:
                stopped = (low, high)
            else:
                latency[rank, peer], bandwidth[rank, peer] = result
        where = f"round {first_round + index + 1} of {total} ({phase})"
        _raise_if_any_stopped(stopped, group, device, hosts, budget_s, start, where)
    dist.all_reduce(latency, group=group)
    dist.all_reduce(bandwidth, group=group)
    return latency, bandwidth


def _measure_pair(
    context: _PairContext,
    low: int,
    high: int,
    small_bytes: int,
    large_bytes: int,
    repeats: int,
    sizes: tuple[int, int] | None,
) -> tuple[float, float] | None:
    """Measure ``low -> high`` then ``high -> low``; return this rank's outgoing direction.

    Returns ``(latency_s, bandwidth_bytes_per_s)`` from this rank to its peer, or ``None`` when
    the budget ran out (both ranks of the pair agree, because the initiator says so in its ping).
    ``sizes`` are the large messages ``low -> high`` and ``high -> low`` (``None``: probe first).
    """
    small = torch.zeros(small_bytes, dtype=torch.uint8, device=context.device)
    large = torch.zeros(large_bytes, dtype=torch.uint8, device=context.device)
    iterations = repeats if sizes is not None else repeats + 1
    mine: tuple[float, float] | None = None
    for initiator, size in zip((low, high), sizes or (None, None), strict=True):
        if context.rank == initiator:
            mine = _initiate(context, small, large, iterations, size)
            if mine is None:
                return None
        elif not _respond(context, small, large, iterations):
            return None
    return mine


def _initiate(
    context: _PairContext,
    small: torch.Tensor,
    large: torch.Tensor,
    iterations: int,
    size: int | None,
) -> tuple[float, float] | None:
    """``iterations`` ping-pairs; without ``size`` the first is a probe that sizes the rest.

    With a single probe iteration the probe's own figures are returned (phase 1). Each measured
    large message after the first is sized to take about ``_TARGET_S`` at the rate the one
    before it showed: a size taken from a probe that a shaper's burst sped up (or that shared a
    WAN link in its round) would otherwise take seconds, or too little time, in every repeat.
    """
    small_rtt: list[float] = []
    timed: list[tuple[int, float]] = []  # (large message bytes, its round trip)
    probe = size is None
    if size is None:
        size = max(len(small) + 1, min(len(large), _PROBE_BYTES))
    for iteration in range(iterations):
        if not probe and _agree(timed, min(small_rtt, default=0.0), len(small)):
            small[0] = _DONE  # the responder stops waiting for more repeats
            context.send(small)
            break
        go = time.perf_counter() < context.deadline
        small[0] = _CONTINUE if go else _STOP
        small[1:_HEADER_BYTES] = torch.tensor([size], dtype=torch.int64).view(torch.uint8)
        begin = time.perf_counter()
        context.send(small)
        if not go:
            return None
        context.recv(small)
        middle = time.perf_counter()
        context.send(large[:size])
        context.recv(small)
        end = time.perf_counter()
        small_rtt.append(middle - begin)
        timed.append((size, end - middle))
        if probe and iteration == 0 and iterations == 1:
            break  # the probe is the measurement
        if probe and iteration == 0:
            small_rtt.clear()
            timed.clear()
        # Size the next message to take about _TARGET_S at the rate this one showed.
        rough = size / max(end - middle - (middle - begin), 1e-6)
        size = int(min(len(large), max(len(small) + 1, rough * _TARGET_S)))
    small_s = min(small_rtt)  # noise only adds time: see the module docstring
    return small_s / 2, max(_rates(timed, small_s, len(small)))


def _rates(timed: Sequence[tuple[int, float]], small_s: float, small_bytes: int) -> list[float]:
    """Each large message's rate: its extra bytes over the time they added to the small round
    trip ``small_s``; the fastest is the one that saw the link alone. Noise on a very fast link
    can make that time <= 0: then the lower bound "the whole message fit in its round trip".
    Only messages that took half of ``_TARGET_S`` or more count when there are any: a shorter
    one may have ridden a traffic shaper's burst, the fastest reading of all and a wrong one."""
    long = [(sent, rtt) for sent, rtt in timed if rtt - small_s >= _TARGET_S / 2] or timed
    return [
        (sent - small_bytes) / (rtt - small_s) if rtt > small_s else sent / max(rtt, 1e-9)
        for sent, rtt in long
    ]


def _agree(timed: Sequence[tuple[int, float]], small_s: float, small_bytes: int) -> bool:
    """Whether the two fastest readings so far lie within ``_AGREE`` of each other."""
    rates = sorted(_rates(timed, small_s, small_bytes), reverse=True)
    return len(rates) >= 2 and rates[1] >= rates[0] * (1 - _AGREE)


def _respond(
    context: _PairContext, small: torch.Tensor, large: torch.Tensor, iterations: int
) -> bool:
    for _ in range(iterations):
        context.recv(small)
        if int(small[0]) == _DONE:
            return True
        if int(small[0]) == _STOP:
            return False
        size = int(small[1:_HEADER_BYTES].clone().view(torch.int64)[0])
        context.send(small)
        context.recv(large[:size])
        context.send(small)
    return True


def _raise_if_any_stopped(
    stopped: tuple[int, int] | None,
    group: dist.ProcessGroup | None,
    device: torch.device,
    hosts: Sequence[str] | None,
    budget_s: float,
    start: float,
    where: str,
) -> None:
    """End of a round: every rank learns which pairs ran out of budget and raises alike."""
    world = dist.get_world_size(group)
    status = torch.full((2,), -1, dtype=torch.int64, device=device)
    if stopped is not None:
        status[0], status[1] = stopped
    gathered = [torch.empty_like(status) for _ in range(world)]
    dist.all_gather(gathered, status, group=group)
    pairs = sorted({(int(t[0]), int(t[1])) for t in gathered if int(t[0]) >= 0})
    if not pairs:
        return

    def name(rank: int) -> str:
        return f"rank {rank}" + (f" ({hosts[rank]})" if hosts else "")

    described = ", ".join(f"{name(a)} <-> {name(b)}" for a, b in pairs)
    raise ProfilingTimeoutError(
        f"network profiling ran past budget_s={budget_s:g} s after "
        f"{time.perf_counter() - start:.3f} s, in {where} while measuring {described}. A link "
        "this slow may be the problem; otherwise raise budget_s or lower large_bytes / repeats."
    )
