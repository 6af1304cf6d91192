"""Point-to-point tensor transport over torch.distributed with a small shape header.

Every message is two sends: a fixed-size ``int64`` header ``[dtype code, ndim, d0, .., d7]`` and
the payload. The receiver allocates from the header, so micro-batch sizes may differ between
micro-batches, between stages and between steps (torch.distributed.pipelining preallocates from
micro-batch 0 and cannot do that). Sends are asynchronous (``isend``) and kept alive until
:meth:`P2PTransport.wait_sends`. Messages between one ordered pair of ranks arrive in the order
they were sent, which the schedule validator guarantees matches the order they are received.
Headers, payload slots and the rest of payloads travel on three tags.

**Receiving ahead** (``prefetch``, gloo only). Gloo moves a message only once the receiver has
posted its receive: the sender's payload waits in a rendezvous until then, however late, and
the receiver's "ready" travels back over the reverse link, where on a pipeline's slow hop it
queues behind the other direction's payloads. A receive posted only when the rank needs the
tensor thus adds that round trip to every transfer and holds senders back. With ``prefetch``,
:meth:`P2PTransport.begin_step` posts every receive of the step at its start: the header, and a
payload *slot* as large as the same message of the last step of the same kind (both ends of a
pair saw that size, so both know the slot without asking). The sender fills the slot (padding a
smaller payload) and sends any bytes beyond it on the third tag, which the receiver then fetches
as before; a message with no slot yet (the first step) goes whole on that tag. Sizes may
therefore change freely; only unchanged sizes are received ahead. Every rank must use the same
setting. A source the step did not announce (its receiver could not yet count its messages) is
received when needed, and its sizes recorded, so that both ends still agree on the next slots.

A payload received ahead arrives while this rank computes, so the rank cannot time it when it
takes it. One *timer* thread per source of the step waits on that source's posted receives in
order (messages of one pair arrive in the order sent) and notes when each header and each slot
completed; ``wire_s`` is the difference, the payload's time on the link, as without receiving
ahead. The main thread waits on the timer's event, never on the receive itself (a gloo receive
may be waited on once). The timers sleep inside ``Work.wait`` without the GIL; a stamp can be
late by the interpreter's switch interval (5 ms), which matters only for sub-10 ms transfers.
On a device short of CPU a stamp can be later still, by as long as the timer or gloo's I/O
thread waited to run; each record carries that wait (``stall_s``,
:mod:`~lightning_deepcee.runtime.stalls`).

**Compression.** A float32 tensor sent to a peer listed in ``compression`` travels as the
method's wire bytes (:mod:`~lightning_deepcee.runtime.compression`), encoded where the tensor is
and decoded on the receiving device; the header's first value carries the method's code beside
the dtype's, and the shape is the tensor's, so the receiver knows the payload's size and how to
decode it without a setting of its own. Records count the bytes on the wire.

Gloo carries host memory only (its send/recv read the tensor's pointer as host memory). A
cluster that mixes GPU and CPU-only devices (cloud GPUs, end-device CPUs) must use gloo, so
CUDA tensors are staged through host memory whenever the group's backend is gloo
(:func:`wire_device`, :func:`all_reduce_`); with NCCL they stay on the GPU.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_deepcee.planner.compression import METHODS, CompressionMethod
from lightning_deepcee.runtime.background import start_thread
from lightning_deepcee.runtime.compression import BY_CODE, decode, encode, encodes
from lightning_deepcee.runtime.stalls import StallReading, process_clock, stalled

__all__ = [
    "MAX_DIMS",
    "P2PTransport",
    "PeerLostError",
    "TransferRecord",
    "all_reduce_",
    "start_all_reduce",
    "wire_device",
]


class PeerLostError(RuntimeError):
    """A transfer with ``peer`` failed: the process died, its link went down, or it timed out."""

    def __init__(self, peer: int, message: str) -> None:
        super().__init__(message)
        self.peer = peer


MAX_DIMS = 8
_HEADER_TAG = 1
_SLOT_TAG = 2
_REST_TAG = 3
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_DTYPE_CODE = {dt: i for i, dt in enumerate(_DTYPES)}


_METHOD_STRIDE = 16
"""A header's first value is ``dtype code + 16 * compression method code``."""


def _parse(header: torch.Tensor) -> tuple[torch.dtype, list[int], CompressionMethod]:
    """The dtype, shape and compression method a header announces."""
    values = header.tolist()
    method, dtype = divmod(values[0], _METHOD_STRIDE)
    return _DTYPES[dtype], values[2 : 2 + values[1]], BY_CODE[method]


def _wire_bytes(dtype: torch.dtype, shape: Sequence[int], method: CompressionMethod) -> int:
    """Payload bytes of a message with this header."""
    if method.code:
        return method.wire_bytes(math.prod(shape))
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _unpack(
    raw: torch.Tensor, dtype: torch.dtype, shape: list[int], method: CompressionMethod
) -> torch.Tensor:
    """The tensor a payload's bytes carry (decoded when it was compressed)."""
    if method.code:
        return decode(method, raw, shape)
    return raw.view(dtype).reshape(shape)


def wire_device(device: torch.device, group: dist.ProcessGroup | None = None) -> torch.device:
    """Where tensors of ``device`` must be while ``group``'s backend moves them.

    ``device`` itself, except CUDA tensors on a gloo group, which go through host memory.
    """
    if device.type == "cuda" and dist.get_backend(group) == dist.Backend.GLOO:
        return torch.device("cpu")
    return device


def all_reduce_(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum ``tensor`` in place over ``group``, staging it through host memory for gloo.

    Staging also keeps every rank of a mixed GPU/CPU gloo group on gloo's host algorithm
    (its CUDA and host all-reduce paths are separate implementations).
    """
    return start_all_reduce(tensor, group)()


def start_all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup | None = None
) -> Callable[[], torch.Tensor]:
    """Post :func:`all_reduce_` of ``tensor`` without waiting; the returned callable waits, puts
    the sum in ``tensor`` and returns it.

    A rank that knows its part early posts it and goes on computing, so the collective does not
    hold it until the slowest rank arrives; ``group`` should be one of the caller's own, so that
    no other message queues behind the pending sum.
    """
    wire = wire_device(tensor.device, group)
    staged = tensor if wire == tensor.device else tensor.to(wire)
    work = dist.all_reduce(staged, group=group, async_op=True)

    def finish() -> torch.Tensor:
        if work is not None:
            work.wait()
        if staged is not tensor:
            tensor.copy_(staged)
        return tensor

    return finish


@dataclass(slots=True)
class TransferRecord:
    """One completed transfer as seen by this rank: peer, bytes and seconds spent blocked."""

    peer: int
    num_bytes: int
    seconds: float
    """Seconds this rank was blocked: for a receive, waiting for the sender too (received ahead,
    only what was not hidden behind this rank's compute)."""
    direction: str  # "send" or "recv"
    wire_s: float | None = None
    """Receives only: seconds from the shape header's arrival to the payload's. The sender posts
    both back to back, so this is the payload's time on the link, without the wait for the
    sender to reach its send. What link monitoring should read. For a payload received ahead
    the arrivals are stamped by the step's timer thread (see the module docstring)."""
    stall_s: float = 0.0
    """Receives only: seconds of ``wire_s`` that the stamping thread or gloo's I/O threads
    waited for a CPU (:func:`~lightning_deepcee.runtime.stalls.stalled`): ``wire_s`` less it is
    a lower bound of the payload's time on the link."""


@dataclass
class _Posted:
    """A receive posted at the start of the step: its header and its payload slot.

    The source's timer thread waits on both works, stamps their completion (``header_at``,
    ``slot_at``, ``time.perf_counter``) with the receiving side's wait for a CPU between them
    (``stall_s``) and sets ``done``; a failure is kept in ``error``.
    """

    header: torch.Tensor
    header_work: Any
    slot: torch.Tensor | None
    slot_work: Any
    key: tuple[str, str, int, int]
    done: threading.Event = field(default_factory=threading.Event)
    header_at: float | None = None
    slot_at: float | None = None
    stall_s: float = 0.0
    error: BaseException | None = None


def _stall_since(before: StallReading) -> float:
    """The receiving side's wait for a CPU since ``before`` (read on this thread)."""
    return stalled(before, process_clock().read())


def _stamp_arrivals(posted: Sequence[_Posted]) -> None:
    """Timer thread body: wait for each posted receive in order and stamp its arrival.

    After a failure the rest of the entries get the same error (the pair is broken).
    """
    error: BaseException | None = None
    clock = process_clock()
    for entry in posted:
        if error is None:
            try:
                entry.header_work.wait()
                entry.header_at = time.perf_counter()
                if entry.slot_work is not None:
                    before = clock.read()
                    entry.slot_work.wait()
                    entry.slot_at = time.perf_counter()
                    entry.stall_s = stalled(before, clock.read())
            except BaseException as exc:  # handed to the main thread, which re-raises it
                error = exc
        entry.error = error
        entry.done.set()


@dataclass
class P2PTransport:
    """Sends and receives tensors of any shape between ranks of ``group`` (global ranks)."""

    device: torch.device
    group: dist.ProcessGroup | None = None
    _pending: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)
    records: list[TransferRecord] = field(default_factory=list)
    prefetch: bool = False
    """Post receives ahead on gloo (see the module docstring); every rank must agree."""
    compression: dict[int, str] = field(default_factory=dict)
    """The compression method of float32 tensors sent to each peer (global rank; absent: sent
    as is). Receivers need no setting: the header names the method."""
    _wire: torch.device | None = field(default=None, init=False, repr=False)
    _step: str | None = field(default=None, init=False, repr=False)
    _sizes: dict[tuple[str, str, int, int], int] = field(
        default_factory=dict, init=False, repr=False
    )
    """Payload bytes of each message of the last step, by (step kind, direction, peer, index):
    both ends of a pair record the same figures, so both know the next step's slot sizes."""
    _counts: dict[tuple[str, int], int] = field(default_factory=dict, init=False, repr=False)
    _posted: dict[int, deque[_Posted]] = field(default_factory=dict, init=False, repr=False)
    _announced: set[int] = field(default_factory=set, init=False, repr=False)
    _timers: list[threading.Thread] = field(default_factory=list, init=False, repr=False)

    def _wire_device(self) -> torch.device:
        """:func:`wire_device` of this transport, looked up once (the group's backend is fixed)."""
        if self._wire is None:
            self._wire = wire_device(self.device, self.group)
        return self._wire

    def _slotted(self) -> bool:
        return self._step is not None

    def _next_key(self, direction: str, peer: int) -> tuple[str, str, int, int]:
        assert self._step is not None
        index = self._counts.get((direction, peer), 0)
        self._counts[(direction, peer)] = index + 1
        return (self._step, direction, peer, index)

    def begin_step(self, kind: str, sources: Sequence[int], *, post: bool = True) -> None:
        """Start a step of ``kind`` that receives from ``sources`` (in order); post them all.

        With ``prefetch`` on gloo, every expected message gets its header receive and, when the
        same message of the last step of this ``kind`` had ``n`` payload bytes, an ``n``-byte
        payload slot, posted now; senders fill the slot (bytes beyond it follow separately).
        Without ``prefetch`` (or on NCCL), or with ``post=False`` (every rank alike, e.g. on a
        first step whose messages nobody can count yet), nothing is posted and receives block as
        they come. Sources missing from ``sources`` are received as they come too.
        """
        self._counts.clear()
        self._posted.clear()
        self._announced = set(sources)
        process_clock().refresh()  # gloo's I/O threads, whose waits for a CPU delay the stamps
        if not post or not self.prefetch or dist.get_backend(self.group) != dist.Backend.GLOO:
            self._step = None
            return
        self._step = kind
        for src in sources:
            self._posted.setdefault(src, deque()).append(self._post(src))
        self._counts.clear()  # the receives' keys are in the posted entries; sends count anew
        for src, entries in self._posted.items():
            timer = start_thread(_stamp_arrivals, list(entries), name=f"deepcee-recv-timer-{src}")
            self._timers.append(timer)

    def end_step(self) -> None:
        """Check that every posted receive was taken (a schedule bug otherwise)."""
        left = {src: len(q) for src, q in self._posted.items() if q}
        if left:
            raise RuntimeError(f"P2PTransport: posted receives never taken: {left}")
        for timer in self._timers:  # all their receives were taken: they have finished
            timer.join()
        self._timers.clear()

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Start sending ``tensor`` to global rank ``dst``; returns before it is delivered."""
        if tensor.dtype not in _DTYPE_CODE:
            raise TypeError(f"Cannot send a tensor of dtype {tensor.dtype} between stages.")
        if tensor.dim() > MAX_DIMS:
            raise ValueError(f"Cannot send a tensor with {tensor.dim()} > {MAX_DIMS} dimensions.")
        start = time.perf_counter()
        wire = self._wire_device()
        method = METHODS[self.compression.get(dst, "off")]
        if not encodes(method, tensor):
            method = METHODS["off"]
        header = torch.zeros(2 + MAX_DIMS, dtype=torch.int64)
        header[0] = _DTYPE_CODE[tensor.dtype] + _METHOD_STRIDE * method.code
        header[1] = tensor.dim()
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        if method.code:  # encoded where the tensor is: a GPU stages only the smaller payload
            payload = encode(method, tensor).to(wire)
        else:
            payload = tensor.detach().to(wire).contiguous()
        messages = [(header.to(wire), _HEADER_TAG)]
        if self._slotted():
            key = self._next_key("send", dst)
            raw = payload.reshape(-1).view(torch.uint8)
            size, slot = raw.numel(), self._sizes.get(key, 0)
            self._sizes[key] = size
            if slot > 0:
                if size == slot:
                    part = raw
                else:  # the slot's size is fixed by the last step: pad it, or fill it
                    part = torch.zeros(slot, dtype=torch.uint8, device=wire)
                    part[: min(size, slot)] = raw[: min(size, slot)]
                messages.append((part, _SLOT_TAG))
            if size > slot or slot == 0:  # no slot: the whole payload, even when empty
                messages.append((raw[slot:], _REST_TAG))
        else:
            messages.append((payload, _REST_TAG))
        for msg, tag in messages:
            work = dist.isend(msg, dst, group=self.group, tag=tag)
            if work is not None:
                self._pending.append((work, msg))
        self.records.append(
            TransferRecord(
                dst, payload.numel() * payload.element_size(), time.perf_counter() - start, "send"
            )
        )

    def recv(self, src: int) -> torch.Tensor:
        """Block until the next tensor from global rank ``src`` has arrived and return it."""
        start = time.perf_counter()
        try:
            if self._slotted() and src in self._announced:
                buf, header, wire_s, stall_s = self._take_posted(src)
            elif self._slotted():
                buf, header, wire_s, stall_s = self._receive_unannounced(src)
            else:
                buf, header, wire_s, stall_s = self._receive(src)
        except RuntimeError as exc:
            raise PeerLostError(
                src,
                f"receiving from rank {src} failed after {time.perf_counter() - start:.1f} s"
                f": {exc}",
            ) from exc
        done = time.perf_counter()
        # wire_s: from the header's arrival to the payload's (sent back to back).
        self.records.append(
            TransferRecord(src, buf.numel(), done - start, "recv", wire_s, min(stall_s, wire_s))
        )
        return _unpack(buf.to(self.device), *_parse(header))

    def _receive(self, src: int) -> tuple[torch.Tensor, torch.Tensor, float, float]:
        """Receive header then payload now: the payload's bytes, the header, the payload's
        seconds on the wire and the wait for a CPU in them."""
        wire = self._wire_device()
        header = torch.empty(2 + MAX_DIMS, dtype=torch.int64, device=wire)
        dist.recv(header, src, group=self.group, tag=_HEADER_TAG)
        arrived, before = time.perf_counter(), process_clock().read()
        dtype, shape, method = _parse(header)
        if method.code:
            buf = torch.empty(method.wire_bytes(math.prod(shape)), dtype=torch.uint8, device=wire)
        else:  # typed as sent: NCCL matches a send and its receive by dtype and count
            buf = torch.empty(shape, dtype=dtype, device=wire)
        dist.recv(buf, src, group=self.group, tag=_REST_TAG)
        wire_s = time.perf_counter() - arrived
        return buf.reshape(-1).view(torch.uint8), header, wire_s, _stall_since(before)

    def _post(self, src: int) -> _Posted:
        """Post the next message from ``src``: its header and, when the same message of the last
        step of this kind had ``n`` payload bytes, an ``n``-byte payload slot."""
        key = self._next_key("recv", src)
        wire = self._wire_device()
        header = torch.empty(2 + MAX_DIMS, dtype=torch.int64, device=wire)
        header_work = dist.irecv(header, src, group=self.group, tag=_HEADER_TAG)
        size = self._sizes.get(key, 0)
        slot, slot_work = None, None
        if size > 0:
            slot = torch.empty(size, dtype=torch.uint8, device=wire)
            slot_work = dist.irecv(slot, src, group=self.group, tag=_SLOT_TAG)
        return _Posted(header, header_work, slot, slot_work, key)

    def _receive_unannounced(self, src: int) -> tuple[torch.Tensor, torch.Tensor, float, float]:
        """A message from a source the step did not announce: the sender may still use a slot
        (from an earlier step's size), so it is received as a posted one would be, now."""
        entry = self._post(src)
        _stamp_arrivals([entry])
        self._posted.setdefault(src, deque()).append(entry)
        return self._take_posted(src)

    def _take_posted(self, src: int) -> tuple[torch.Tensor, torch.Tensor, float, float]:
        """Take the next posted receive from ``src``: the payload's bytes, the header, the
        payload's seconds on the wire and the wait for a CPU in them."""
        queue_ = self._posted.get(src)
        if not queue_:
            raise RuntimeError(f"a receive from rank {src} that the step did not announce")
        posted = queue_.popleft()
        posted.done.wait()
        if posted.error is not None:
            raise RuntimeError(str(posted.error)) from posted.error
        assert posted.header_at is not None
        size = _wire_bytes(*_parse(posted.header))
        self._sizes[posted.key] = size
        slot = posted.slot
        if slot is not None and size <= slot.numel():
            assert posted.slot_at is not None
            # A padded slot carried slot.numel() bytes: scale to the payload's share of them.
            share = size / slot.numel()
            wire_s = (posted.slot_at - posted.header_at) * share
            return slot[:size], posted.header, wire_s, posted.stall_s * share
        # No slot, or the payload outgrew it: the rest is received now, and timed from here
        # (its rendezvous included, as without receiving ahead).
        rest = torch.empty(size - (0 if slot is None else slot.numel()), dtype=torch.uint8)
        rest = rest.to(self._wire_device())
        posted_at, before = time.perf_counter(), process_clock().read()
        dist.recv(rest, src, group=self.group, tag=_REST_TAG)
        raw = rest if slot is None else torch.cat([slot, rest])
        return raw, posted.header, time.perf_counter() - posted_at, _stall_since(before)

    def wait_sends(self) -> float:
        """Wait for every outstanding send; returns the seconds spent waiting."""
        start = time.perf_counter()
        try:
            for work, _ in self._pending:
                work.wait()
        except RuntimeError as exc:
            raise PeerLostError(-1, f"a send did not complete: {exc}") from exc
        finally:
            self._pending.clear()
        return time.perf_counter() - start
