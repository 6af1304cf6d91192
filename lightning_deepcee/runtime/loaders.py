"""Data loaders of a DeepCEE run: resumable mid-epoch, and read only where a stage uses them.

:class:`TrainLoader` and :class:`StepLoader` wrap the train and evaluation loaders that
``DeepCEEStrategy.process_dataloader`` sees:

- **Resume.** The train loader follows Lightning's ``state_dict`` protocol of loaders: a
  checkpoint records how many batches of the running epoch were trained, and the first epoch
  after a resume skips them, so every later step sees the batch the uninterrupted run saw.
- **Idle ranks read no data.** A rank the plan leaves idle computes nothing, so it need not read
  its batches (a slow end device behind a thin link would otherwise load, or download, every
  batch). While the rank is idle the loader walks the batch sampler's indices, which keeps its
  place in the epoch, and yields a stand-in for each batch: the first batch it read, cut to the
  real batch's row count. Hooks see a batch of the real structure and size, the step's sample
  count is exact, and the data is read once per loader (again only for a longer batch). When a
  re-plan makes the rank active mid-epoch, the next batches are read in this process
  (``dataset[i]`` and ``collate_fn``); Lightning fetches one batch ahead, so a stand-in can
  reach an active rank's step: the strategy asks :meth:`TrainLoader.take` for each batch and
  reads the real one then.
- A loader without a batch sampler over a map-style dataset (an ``IterableDataset``, a custom
  iterable) cannot skip a batch without reading it: it is read as before.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from torch.utils.data import IterableDataset

from lightning_deepcee.runtime.stage import batch_size_of, split_batch

__all__ = ["StepLoader", "TrainLoader", "real_batch", "stand_in_warning", "stands_in"]

_END = object()


def stands_in(loader: Any) -> bool:
    """Whether ``loader`` can yield stand-ins: a batch sampler over a map-style dataset."""
    dataset = getattr(loader, "dataset", None)
    return (
        getattr(loader, "batch_sampler", None) is not None
        and callable(getattr(loader, "collate_fn", None))
        and dataset is not None
        and not isinstance(dataset, IterableDataset)
        and callable(getattr(dataset, "__getitem__", None))
    )


class StepLoader:
    """A loader that stands in for batches while this rank is idle (module docstring); the
    evaluation loaders' wrapper (a rank cannot turn active while they run).

    Args:
        loader: the loader Lightning prepared (its distributed sampler injected).
        idle: whether this rank is idle now (asked at every batch).

    Everything else (``len``, ``sampler``, ``dataset``, ``worker_init_fn``, ...) is the wrapped
    loader's, read and set.
    """

    _OWN = frozenset(
        {"loader", "_idle", "_epoch", "_trained", "_skip", "_stand_in", "_pending", "reads"}
    )

    def __init__(self, loader: Any, idle: Callable[[], bool]) -> None:
        self.loader = loader
        self._idle = idle
        self._epoch: Callable[[], int] | None = None
        self._skip = 0
        self._stand_in: Any = None
        self._pending: collections.deque[list[int] | None] = collections.deque()
        self.reads = 0
        """Samples this process has read through the loader."""

    def __getattr__(self, name: str) -> Any:
        if name in StepLoader._OWN:
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # Lightning sets loader attributes (``worker_init_fn``): they belong to the loader.
        if name in StepLoader._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.loader, name, value)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        if self._epoch is not None:
            # The epoch's shuffle first: Lightning sets it only after a resumed fit has built
            # its first iterator, which would then draw the order of epoch 0.
            for attribute in ("batch_sampler", "sampler"):
                set_epoch = getattr(getattr(self.loader, attribute, None), "set_epoch", None)
                if callable(set_epoch):
                    set_epoch(self._epoch())
        skip, self._skip = self._skip, 0
        self._pending.clear()
        if self._idle() and stands_in(self.loader):
            return self._standing_in(skip)
        return self._reading(skip)

    def _reading(self, skip: int) -> Iterator[Any]:
        iterator = iter(self.loader)
        for _ in range(skip):
            if next(iterator, _END) is _END:
                return
        for batch in iterator:
            self.reads += _rows(batch)
            self._note(None)
            yield batch

    def _standing_in(self, skip: int) -> Iterator[Any]:
        for n, indices in enumerate(self.loader.batch_sampler):
            if n < skip:
                continue
            indices = list(indices)
            if self._idle():
                self._note(indices)
                yield self._stand_in_for(indices)
            else:  # a re-plan made this rank active: read the rest of the epoch here
                self._note(None)
                yield self.read(indices)

    def _note(self, indices: list[int] | None) -> None:
        """Record what the next batch is (its indices when a stand-in); see :class:`TrainLoader`."""

    def _stand_in_for(self, indices: Sequence[int]) -> Any:
        rows = len(indices)
        held = None if self._stand_in is None else batch_size_of(self._stand_in)
        if held is None or held < rows:
            self._stand_in = self.read(indices)
            return self._stand_in
        if held == rows:
            return self._stand_in
        return split_batch(self._stand_in, [rows, held - rows])[0]

    def read(self, indices: Sequence[int]) -> Any:
        """The batch of ``indices``, read as the loader's fetcher does (in this process)."""
        dataset = self.loader.dataset
        many = getattr(dataset, "__getitems__", None)
        samples = many(list(indices)) if callable(many) else [dataset[i] for i in indices]
        self.reads += len(indices)
        return self.loader.collate_fn(samples)


class TrainLoader(StepLoader):
    """The train loader: stands in on idle ranks, resumes mid-epoch, and records which batches
    it stood in for (:meth:`take`), since Lightning fetches one batch ahead of the step.

    Args:
        loader: the loader Lightning prepared.
        idle: whether this rank is idle now.
        epoch: the epoch whose order the next iterator draws (``set_epoch``).
        trained: batches of the running epoch trained so far (for :meth:`state_dict`).
    """

    def __init__(
        self,
        loader: Any,
        idle: Callable[[], bool],
        *,
        epoch: Callable[[], int],
        trained: Callable[[], int],
    ) -> None:
        super().__init__(loader, idle)
        self._epoch = epoch
        self._trained = trained

    def _note(self, indices: list[int] | None) -> None:
        self._pending.append(indices)

    def take(self) -> list[int] | None:
        """For the batch the loop hands to the next training step: its indices when it is a
        stand-in, ``None`` when it is the real batch. Call once per training step, in order."""
        return self._pending.popleft() if self._pending else None

    def state_dict(self) -> dict[str, int]:
        """Batches of the running epoch trained so far (0 once the epoch is complete)."""
        return {"batches_done": self._trained()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._skip = int(state.get("batches_done", 0))


def _rows(batch: Any) -> int:
    try:
        return batch_size_of(batch)
    except TypeError:  # a batch without tensors: the strategy will say so at its step
        return 0


def real_batch(
    train_loaders: Any, batch: Any, idle: bool, to_device: Callable[[Any], Any]
) -> tuple[Any, Callable[[], Any] | None]:
    """The batch a training step runs on: ``batch``, or, when it is a stand-in and the rank is
    active now (a re-plan brought it in), the real batch, read here and moved by ``to_device``;
    and, when the step runs on a stand-in (the rank is idle), what reads its real batch later
    (a replay after a lost device may make the rank active), else ``None``.

    ``train_loaders`` is ``trainer.train_dataloader`` (one loader, or a collection of them).
    Call once per training step: it takes the step's record from every :class:`TrainLoader`.

    Raises:
        RuntimeError: a stand-in reached an active rank's step from one of several train
            loaders, whose combined batch cannot be rebuilt here.
    """
    loaders = [leaf for leaf in _leaves(train_loaders) if isinstance(leaf, TrainLoader)]
    stood = [(loader, indices) for loader in loaders if (indices := loader.take()) is not None]
    if not stood:
        return batch, None
    if len(loaders) != 1:
        reread: Callable[[], Any] = functools.partial(_cannot_reread, len(loaders))
    else:
        loader, indices = stood[0]
        reread = functools.partial(_reread, loader, indices, to_device)
    return (batch, reread) if idle else (reread(), None)


def _reread(loader: TrainLoader, indices: list[int], to_device: Callable[[Any], Any]) -> Any:
    return to_device(loader.read(indices))


def _cannot_reread(count: int) -> Any:
    raise RuntimeError(
        "DeepCEE: a re-plan made this idle rank active while it stood in for the batches of "
        f"{count} train dataloaders, whose combined batch cannot be read here. Train "
        "from one dataloader, or re-plan at an epoch boundary."
    )


def _leaves(iterables: Any) -> list[Any]:
    if isinstance(iterables, Mapping):
        return [leaf for value in iterables.values() for leaf in _leaves(value)]
    if isinstance(iterables, (list, tuple)):
        return [leaf for value in iterables for leaf in _leaves(value)]
    return [iterables]


_MODULE_HOOKS = (
    "on_train_batch_start",
    "on_train_batch_end",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_before_batch_transfer",
    "transfer_batch_to_device",
    "on_after_batch_transfer",
)
_CALLBACK_HOOKS = _MODULE_HOOKS[:6]


def stand_in_warning(
    idle_ranks: Sequence[int], module: Any, callbacks: Sequence[Any]
) -> str | None:
    """The setup warning for a plan with idle ranks whose batch hooks are the user's: on those
    ranks the hooks see stand-ins. Callbacks of Lightning and of this package read no batch
    content beyond its size; ``None`` when nothing else overrides a batch hook."""
    if not idle_ranks:
        return None
    from lightning.pytorch import Callback, LightningModule

    found = [
        f"{type(module).__name__}.{hook}"
        for hook in _MODULE_HOOKS
        if getattr(type(module), hook, None) is not getattr(LightningModule, hook)
    ]
    for callback in callbacks:
        if type(callback).__module__.split(".")[0] in ("lightning", "lightning_deepcee"):
            continue
        found += [
            f"{type(callback).__name__}.{hook}"
            for hook in _CALLBACK_HOOKS
            if getattr(type(callback), hook, None) is not getattr(Callback, hook)
        ]
    if not found:
        return None
    ranks = ", ".join(str(r) for r in idle_ranks)
    return (
        f"DeepCEE: the plan leaves rank(s) {ranks} idle, and an idle rank reads no data: its "
        "batches are stand-ins (the first batch it read, cut to each batch's rows). These hooks "
        f"see them there: {', '.join(found)}. Active ranks run them on the real batches; make "
        "the hooks read only the batch's size where trainer.strategy.is_idle is True."
    )
