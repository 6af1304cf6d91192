"""A link probe: one pair of ranks times messages of known size in background threads.

The adapter's come-back (``callbacks/comeback.py``) probes the wide-area links a re-plan moved
away from, which no training transfer crosses any more. On a process group of the two ranks
alone, the sender's thread sends a header and then a payload of ``num_bytes``; the receiver's
thread stamps the header's arrival and the payload's, as the transport stamps a training
transfer (the difference is the payload's time on the wire), and answers with a one-byte ack.
The sender then rests ``rest_factor`` times the round's duration, so the probe takes at most
``1 / (1 + rest_factor)`` of the link (a quarter by default), and sizes its next payload from the
round's rate (``resize``), so that a message holds the link as it runs now for a bounded time and
the small messages that still cross it (the adapter's per-step all-reduce) are not queued behind
it for long.

:meth:`LinkProbe.close` stops both threads cleanly: the sender finishes its round and sends a
stop header, which the receiver's thread takes as its last message, so no receive is left
posted. Both ends call it at the same step (the adapter closes its probes on every rank
together).

Runtime layer: torch and torch.distributed, never lightning.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_deepcee.runtime.transport import TransferRecord

__all__ = ["LinkProbe", "open_link_probe"]


class LinkProbe:
    """One end of a probed pair ``(src, dst)`` (see the module docstring)."""

    def __init__(
        self,
        src: int,
        dst: int,
        rank: int,
        num_bytes: int,
        group: Any,
        *,
        rest_factor: float = 3.0,
        resize: Callable[[float], int] | None = None,
    ) -> None:
        if rank not in (src, dst) or src == dst:
            raise ValueError(f"LinkProbe: rank {rank} is not an end of the pair {src}->{dst}")
        if num_bytes < 1:
            raise ValueError(f"LinkProbe: num_bytes must be positive, got {num_bytes}")
        self.src, self.dst, self.rank = src, dst, rank
        self.num_bytes = int(num_bytes)
        self.group = group
        self.rest_factor = float(rest_factor)
        self.resize = resize
        """The next payload's size from the last round's rate (bytes/s); ``None``: fixed."""
        self.error: BaseException | None = None
        """What ended the thread early (a lost peer), if anything."""
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._records: list[TransferRecord] = []
        body = self._send_loop if rank == src else self._receive_loop
        self._thread = threading.Thread(target=body, name=f"deepcee-probe-{src}-{dst}", daemon=True)
        self._thread.start()

    def take(self) -> list[TransferRecord]:
        """The receiver's samples since the last call (none on the sender)."""
        with self._lock:
            records, self._records = self._records, []
        return records

    def close(self, timeout_s: float = 60.0) -> bool:
        """Stop both ends (call on both at the same step) and, when the thread ended cleanly,
        destroy the pair's group (its connections and threads); False if the thread did not
        end within ``timeout_s`` (a peer lost or a link stalled: it is left as a daemon)."""
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return False
        if self.error is None and self.group is not None:  # both ends done: free its group
            dist.destroy_process_group(self.group)
            self.group = None
        return True

    # ------------------------------------------------------------------------- threads
    def _send_loop(self) -> None:
        num_bytes = self.num_bytes
        ack = torch.zeros(1, dtype=torch.uint8)
        try:
            while not self._stop.is_set():
                started = time.perf_counter()
                header = torch.tensor([1, num_bytes], dtype=torch.int64)
                dist.send(header, self.dst, group=self.group)
                dist.send(torch.zeros(num_bytes, dtype=torch.uint8), self.dst, group=self.group)
                dist.recv(ack, self.dst, group=self.group)
                round_s = time.perf_counter() - started
                if self.resize is not None and round_s > 0:
                    num_bytes = max(1, int(self.resize(num_bytes / round_s)))
                self._stop.wait(self.rest_factor * round_s)
            dist.send(torch.zeros(2, dtype=torch.int64), self.dst, group=self.group)
        except BaseException as exc:  # a lost peer: the probe ends, training decides
            self.error = exc

    def _receive_loop(self) -> None:
        header = torch.zeros(2, dtype=torch.int64)
        ack = torch.ones(1, dtype=torch.uint8)
        try:
            while True:
                dist.recv(header, self.src, group=self.group)
                arrived = time.perf_counter()
                if int(header[0]) == 0:
                    return
                payload = torch.empty(int(header[1]), dtype=torch.uint8)
                dist.recv(payload, self.src, group=self.group)
                wire_s = time.perf_counter() - arrived
                with self._lock:
                    self._records.append(
                        TransferRecord(self.src, payload.numel(), wire_s, "recv", wire_s)
                    )
                dist.send(ack, self.src, group=self.group)
        except BaseException as exc:
            self.error = exc


def open_link_probe(
    pair: tuple[int, int],
    rank: int,
    num_bytes: int,
    *,
    resize: Callable[[float], int] | None = None,
) -> LinkProbe | None:
    """Make the pair's process group (a collective: every rank calls it, in the same order) and,
    on the pair's two ranks, start their ends of a :class:`LinkProbe` (first payload
    ``num_bytes``, the next ones sized by ``resize``)."""
    from lightning_deepcee.runtime.stage_groups import unbound_gloo_default_group

    src, dst = pair
    with unbound_gloo_default_group():  # host tensors: gloo, whatever training's backend
        group = dist.new_group(sorted((src, dst)), backend="gloo")
    if rank not in (src, dst):
        return None
    return LinkProbe(src, dst, rank, num_bytes, group, resize=resize)
