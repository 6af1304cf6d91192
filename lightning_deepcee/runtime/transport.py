"""Point-to-point tensor transport over torch.distributed with a small shape header.

Every message is two sends: a fixed-size ``int64`` header ``[dtype code, ndim, d0, .., d7]`` and
the payload. The receiver allocates from the header, so micro-batch sizes may differ between
micro-batches, between stages and between steps (torch.distributed.pipelining preallocates from
micro-batch 0 and cannot do that). Sends are asynchronous (``isend``) and kept alive until
:meth:`P2PTransport.wait_sends`; receives block. Messages between one ordered pair of ranks
arrive in the order they were sent, which the schedule validator guarantees matches the order
they are received; no tags are needed.

Gloo carries host memory only (its send/recv read the tensor's pointer as host memory). A
cluster that mixes GPU and CPU-only devices (cloud GPUs, end-device CPUs) must use gloo, so
CUDA tensors are staged through host memory whenever the group's backend is gloo
(:func:`wire_device`, :func:`all_reduce_`); with NCCL they stay on the GPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

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
    """Seconds this rank was blocked: for a receive, waiting for the sender too."""
    direction: str  # "send" or "recv"
    wire_s: float | None = None
    """Receives only: seconds from the shape header's arrival to the payload's. The sender posts
    both back to back, so this is the payload's time on the link, without the wait for the
    sender to reach its send (which ``seconds`` includes). What link monitoring should read."""


@dataclass
class P2PTransport:
    """Sends and receives tensors of any shape between ranks of ``group`` (global ranks)."""

    device: torch.device
    group: dist.ProcessGroup | None = None
    _pending: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)
    records: list[TransferRecord] = field(default_factory=list)
    _wire: torch.device | None = field(default=None, init=False, repr=False)

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
        for msg in (header, payload):
            work = dist.isend(msg, dst, group=self.group)
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
        wire = self._wire_device()
        header = torch.empty(2 + MAX_DIMS, dtype=torch.int64, device=wire)
        try:
            dist.recv(header, src, group=self.group)
            arrived = time.perf_counter()
            values = header.tolist()
            dtype = _DTYPES[values[0]]
            shape = values[2 : 2 + values[1]]
            buf = torch.empty(shape, dtype=dtype, device=wire)
            dist.recv(buf, src, group=self.group)
        except RuntimeError as exc:
            raise PeerLostError(
                src,
                f"receiving from rank {src} failed after {time.perf_counter() - start:.1f} s"
                f": {exc}",
            ) from exc
        done = time.perf_counter()
        self.records.append(
            TransferRecord(
                src, buf.numel() * buf.element_size(), done - start, "recv", done - arrived
            )
        )
        return buf.to(self.device)

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
