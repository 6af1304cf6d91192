"""A compute probe: a device times one fixed piece of compute now and then, in a thread.

The adapter's come-back (``callbacks/comeback.py``) watches a device that a re-plan left idle
because it computed slower (another tenant, a lowered CPU quota): nothing trains there any more
to show its recovery. Its process times a fixed piece of work (matrix products) every
``interval_s``; the wall seconds include whatever holds the device back (a quota's stalls, a
tenant's time slices), so their ratio over time is the device's speed-up. The work is sized once,
at the first probe, to take about ``first_s`` on the device as it is then (slowed); a device
back at full speed runs it several times faster, which the adapter's watch
(``adapter/comeback.py``: ``DeviceWatch``) compares. The matrices grow first until one product
takes ``op_s``: each product releases the interpreter's lock while it runs and takes it back
after, so on a device that also trains, few and long products time the device, where many short
ones would mostly time how long the training thread holds the lock.

Runtime layer: torch, never lightning.
"""

from __future__ import annotations

import threading
import time

import torch

__all__ = ["ComputeProbe"]

_MAX_REPEATS = 2**16
_MAX_SIZE = 1024


class ComputeProbe:
    """Times a fixed piece of compute every ``interval_s`` in a daemon thread (see the module
    docstring); :meth:`take` hands over the newest figure."""

    def __init__(
        self,
        *,
        first_s: float = 0.25,
        interval_s: float = 1.0,
        size: int = 128,
        op_s: float = 0.005,
    ) -> None:
        if not (first_s > 0 and interval_s >= 0 and size >= 1 and op_s >= 0):
            raise ValueError(
                f"ComputeProbe: needs first_s > 0, interval_s >= 0, size >= 1 and op_s >= 0, "
                f"got {first_s}, {interval_s}, {size}, {op_s}"
            )
        self.first_s = first_s
        self.interval_s = interval_s
        self.op_s = op_s
        self.size = size
        """The matrices' side, grown at the first probe until one product takes ``op_s``."""
        self._a, self._b = _matrices(size)
        self.repeats: int | None = None
        """Matrix products per probe, once sized."""
        self._latest = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deepcee-compute-probe", daemon=True)
        self._thread.start()

    def _time(self, repeats: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            for _ in range(repeats):
                torch.mm(self._a, self._b)
        return time.perf_counter() - start

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.repeats is None:
                self._time(1)  # the first product pays for the kernel's set-up
                while self._time(4) / 4 < self.op_s and self.size < _MAX_SIZE:
                    self.size = min(2 * self.size, _MAX_SIZE)
                    self._a, self._b = _matrices(self.size)
                repeats, seconds = 1, self._time(1)
                while seconds < self.first_s and repeats < _MAX_REPEATS:
                    repeats *= 2
                    seconds = self._time(repeats)
                self.repeats = repeats
            else:
                seconds = self._time(self.repeats)
            with self._lock:
                self._latest = seconds
            self._stop.wait(self.interval_s)

    def take(self) -> float:
        """The newest probe's wall seconds not taken yet, or 0.0 when none ended since."""
        with self._lock:
            seconds, self._latest = self._latest, 0.0
        return seconds

    def close(self, timeout_s: float = 30.0) -> bool:
        """Stop the thread (after the probe in progress); True when it ended in time."""
        self._stop.set()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


def _matrices(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return (
        torch.randn(size, size, generator=generator),
        torch.randn(size, size, generator=generator),
    )
