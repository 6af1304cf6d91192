"""Point-to-point tensor transport over torch.distributed with a small shape header.

Every message is two sends: a fixed-size ``int64`` header ``[dtype code, ndim, d0, .., d7]`` and
the payload. The receiver allocates from the header, so micro-batch sizes may differ between
micro-batches, between stages and between steps (torch.distributed.pipelining preallocates from
micro-batch 0 and cannot do that). Sends are asynchronous (``isend``) and kept alive until
:meth:`P2PTransport.wait_sends`. Messages between one ordered pair of ranks arrive in the order
they were sent, which the schedule validator guarantees matches the order they are received;
headers and payloads travel on two tags so that a header can be received ahead of the payload
before it.

**Receiving ahead.** Gloo moves a message only once the receiver has posted its receive (the
sender's payload waits in a rendezvous: a 50 MB send to a receiver that posts 5 s late completes
after 5 s). A receive posted only when the schedule reaches it therefore serialises every
transfer with the receiver's compute, and on a slow link the pipeline waits for each message
twice. :meth:`P2PTransport.expect` takes the step's receives in schedule order and, for each
peer, starts a thread that receives them one after another (header, then the payload sized from
it) as soon as the sender sends; :meth:`P2PTransport.recv` then only takes the next arrived
tensor. ``Work.is_completed()`` of a gloo receive does not change until ``wait()``, so a polling
loop in the main thread cannot do this; a blocked ``wait()`` releases the GIL. Used for gloo
only (NCCL has its own progress engine and its receives belong on the compute stream). Off by
default: on the lab (2 shared cores, end devices at 12% of a core) the same plan ran at
26.2 and 34.3 samples/s with it and 30.5, 31.9 and 33.9 without, no gain beyond the noise;
the threads' wake-ups cost CPU that quota'd devices lack.

Gloo carries host memory only (its send/recv read the tensor's pointer as host memory). A
cluster that mixes GPU and CPU-only devices (cloud GPUs, end-device CPUs) must use gloo, so
CUDA tensors are staged through host memory whenever the group's backend is gloo
(:func:`wire_device`, :func:`all_reduce_`); with NCCL they stay on the GPU.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "MAX_DIMS",
    "P2PTransport",
    "PeerLostError",
    "TransferRecord",
    "all_reduce_",
    "wire_device",
]


class PeerLostError(RuntimeError):
    """A transfer with ``peer`` failed: the process died, its link went down, or it timed out."""

    def __init__(self, peer: int, message: str) -> None:
        super().__init__(message)
        self.peer = peer


MAX_DIMS = 8
_HEADER_TAG = 1
_PAYLOAD_TAG = 2
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
    wire = wire_device(tensor.device, group)
    if wire == tensor.device:
        dist.all_reduce(tensor, group=group)
    else:
        staged = tensor.to(wire)
        dist.all_reduce(staged, group=group)
        tensor.copy_(staged)
    return tensor


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
    sender to reach its send. What link monitoring should read. Received ahead, it may exceed
    ``seconds``."""


@dataclass
class P2PTransport:
    """Sends and receives tensors of any shape between ranks of ``group`` (global ranks)."""

    device: torch.device
    group: dist.ProcessGroup | None = None
    _pending: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)
    records: list[TransferRecord] = field(default_factory=list)
    prefetch: bool = False
    """Receive ahead on gloo (see the module docstring); ``False`` keeps receives blocking."""
    _wire: torch.device | None = field(default=None, init=False, repr=False)
    _inbox: dict[int, queue.SimpleQueue[Any]] = field(default_factory=dict, init=False, repr=False)
    _left: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    _threads: list[threading.Thread] = field(default_factory=list, init=False, repr=False)

    def _wire_device(self) -> torch.device:
        """:func:`wire_device` of this transport, looked up once (the group's backend is fixed)."""
        if self._wire is None:
            self._wire = wire_device(self.device, self.group)
        return self._wire

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Start sending ``tensor`` to global rank ``dst``; returns before it is delivered."""
        if tensor.dtype not in _DTYPE_CODE:
            raise TypeError(f"Cannot send a tensor of dtype {tensor.dtype} between stages.")
        if tensor.dim() > MAX_DIMS:
            raise ValueError(f"Cannot send a tensor with {tensor.dim()} > {MAX_DIMS} dimensions.")
        start = time.perf_counter()
        wire = self._wire_device()
        payload = tensor.detach().to(wire).contiguous()
        header = torch.zeros(2 + MAX_DIMS, dtype=torch.int64)
        header[0] = _DTYPE_CODE[payload.dtype]
        header[1] = payload.dim()
        header[2 : 2 + payload.dim()] = torch.tensor(payload.shape, dtype=torch.int64)
        header = header.to(wire)
        for msg, tag in ((header, _HEADER_TAG), (payload, _PAYLOAD_TAG)):
            work = dist.isend(msg, dst, group=self.group, tag=tag)
            if work is not None:
                self._pending.append((work, msg))
        self.records.append(
            TransferRecord(
                dst, payload.numel() * payload.element_size(), time.perf_counter() - start, "send"
            )
        )

    def expect(self, sources: Sequence[int]) -> None:
        """Start receiving this step's messages ahead: ``sources`` are their senders, in order.

        One thread per peer receives that peer's messages in order as soon as they are sent;
        :meth:`recv` takes them. Only on gloo with ``prefetch``; otherwise nothing happens and
        :meth:`recv` blocks as usual. Every expected message must be taken before the next call.
        """
        if not self.prefetch or dist.get_backend(self.group) != dist.Backend.GLOO:
            return
        if any(self._left.values()):
            raise RuntimeError(
                f"P2PTransport.expect: messages of the last step were never received: {self._left}"
            )
        self.join()
        counts: dict[int, int] = {}
        for src in sources:
            counts[src] = counts.get(src, 0) + 1
        wire = self._wire_device()
        for src, count in counts.items():
            inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
            self._inbox[src], self._left[src] = inbox, count
            thread = threading.Thread(
                target=self._receive_ahead,
                args=(src, count, wire, inbox),
                name=f"deepcee-recv-from-{src}",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)

    def _receive_ahead(
        self, src: int, count: int, wire: torch.device, inbox: queue.SimpleQueue[Any]
    ) -> None:
        for _ in range(count):
            try:
                inbox.put(self._receive(src, wire))
            except BaseException as exc:  # handed to the main thread by recv()
                inbox.put(exc)
                return

    def _receive(self, src: int, wire: torch.device) -> tuple[torch.Tensor, float, float]:
        """Header then payload from ``src``: ``(payload, header arrival, payload arrival)``."""
        header = torch.empty(2 + MAX_DIMS, dtype=torch.int64, device=wire)
        dist.recv(header, src, group=self.group, tag=_HEADER_TAG)
        arrived = time.perf_counter()
        values = header.tolist()
        buf = torch.empty(values[2 : 2 + values[1]], dtype=_DTYPES[values[0]], device=wire)
        dist.recv(buf, src, group=self.group, tag=_PAYLOAD_TAG)
        return buf, arrived, time.perf_counter()

    def recv(self, src: int) -> torch.Tensor:
        """Block until the next tensor from global rank ``src`` has arrived and return it."""
        start = time.perf_counter()
        try:
            if self._left.get(src, 0) > 0:
                self._left[src] -= 1
                item = self._inbox[src].get()
                if isinstance(item, BaseException):
                    raise item
                buf, arrived, done = item
            else:
                buf, arrived, done = self._receive(src, self._wire_device())
        except RuntimeError as exc:
            raise PeerLostError(
                src,
                f"receiving from rank {src} failed after {time.perf_counter() - start:.1f} s"
                f": {exc}",
            ) from exc
        blocked = time.perf_counter() - start
        # wire_s: the payload's time on the link, from its header's arrival (both are sent back
        # to back), whether the receive ran ahead or blocked here.
        self.records.append(
            TransferRecord(
                src, buf.numel() * buf.element_size(), blocked, "recv", max(0.0, done - arrived)
            )
        )
        return buf.to(self.device)

    def join(self) -> None:
        """Wait for the receive-ahead threads of the last step (they end with their messages)."""
        for thread in self._threads:
            thread.join()
        self._threads.clear()

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
