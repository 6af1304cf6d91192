"""Freezing Python's garbage collector for training: one full collection, then ``gc.freeze``.

A full collection walks every tracked object; on a device at a tenth of a core that stalls a
pipeline step for everyone. Freezing what survives set-up (the model, Lightning, the data
pipeline) leaves later collections only the objects made while training.
"""

from __future__ import annotations

import gc
import time

from lightning.pytorch.utilities.rank_zero import rank_zero_info

__all__ = ["GcFreeze"]


class GcFreeze:
    """Freezes once (:meth:`freeze`) and undoes it (:meth:`unfreeze`); both idempotent."""

    def __init__(self) -> None:
        self.frozen = False

    def freeze(self, verbose: bool) -> None:
        if self.frozen:
            return
        started = time.perf_counter()
        gc.collect()
        gc.freeze()
        self.frozen = True
        if verbose:
            rank_zero_info(
                f"DeepCEE: froze {gc.get_freeze_count():,} objects for the garbage collector "
                f"({time.perf_counter() - started:.2f} s); later collections skip them"
            )

    def unfreeze(self) -> None:
        if self.frozen:
            gc.unfreeze()
            self.frozen = False
