"""A compute probe: a device times one fixed piece of compute now and then, in a thread.

The adapter's come-back (``callbacks/comeback.py``) watches a device that a re-plan left idle
because it computed slower (another tenant, a lowered CPU quota): nothing trains there any more
to show its recovery. Its process times a fixed piece of work (matrix products) every
``interval_s``; the wall seconds include whatever holds the device back (a quota's stalls, a
tenant's time slices), so their ratio over time is the device's speed-up. The work is sized once,
at the first probe, to take about ``first_s`` on the device as it is then (slowed); a device
back at full speed runs it several times faster, which the adapter's watch
(``adapter/comeback.py``: ``DeviceWatch``) compares.

Runtime layer: torch, never lightning.
"""

from __future__ import annotations

import threading
import time

import torch

__all__ = ["ComputeProbe"]

_MAX_REPEATS = 2**16


class ComputeProbe:
    """Times a fixed piece of compute every ``interval_s`` in a daemon thread (see the module
    docstring); :meth:`take` hands over the newest figure."""

    def __init__(self, *, first_s: float = 0.25, interval_s: float = 1.0, size: int = 128) -> None:
        if not (first_s > 0 and interval_s >= 0 and size >= 1):
            raise ValueError(
                f"ComputeProbe: needs first_s > 0, interval_s >= 0 and size >= 1, got "
                f"{first_s}, {interval_s}, {size}"
            )
        self.first_s = first_s
        self.interval_s = interval_s
        generator = torch.Generator().manual_seed(0)
        self._a = torch.randn(size, size, generator=generator)
        self._b = torch.randn(size, size, generator=generator)
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
