"""Activation memory: what autograd keeps for backward, and what a block needs beyond it.

- :class:`SavedTensorsMeter` counts the bytes held by the tensors autograd saves for backward
  (``torch.autograd.graph.saved_tensors_hooks``) while they are held, and their peak: what a
  stage keeps per in-flight micro-batch. The executor reads it as ``StepStats.peak_saved_bytes``.
- :func:`block_memory_bytes` measures, per block and per sample, the bytes a block's forward saves
  (``saved_bytes``) and the transient peak beyond them during its forward and backward
  (``transient_bytes``). The planner charges the first for every micro-batch a stage holds, the
  second once, for the micro-batch it is computing.

A block's output alone undercounts badly: a transformer layer saves its attention scores, the
hidden layer of its MLP and every normalisation's input, many times the bytes it sends on.

Runtime layer: torch, never lightning.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_deepcee._compat import TorchDispatchMode, tree_flatten
from lightning_deepcee.runtime.measure.passes import LossFn
from lightning_deepcee.runtime.values import flatten_value, tensor_leaves

__all__ = ["SavedTensorsMeter", "block_memory_bytes"]

_Key = tuple[str, int]
"""A storage: its device and its address (unique while the storage is alive)."""


def _storage(tensor: torch.Tensor) -> tuple[_Key, int] | None:
    """``(key, nbytes)`` of the storage under ``tensor``; ``None`` for one without a storage
    (a tensor subclass without data) or with no bytes."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    nbytes = storage.nbytes()
    if nbytes == 0:
        return None
    return (str(tensor.device), storage.data_ptr()), nbytes


class _StorageCounter:
    """Bytes of the storages referenced by counted references, each storage once, and the peak.

    Every time a storage starts or stops being counted is logged, so that storages found later
    to be charged elsewhere (weight gradients: :meth:`exclude`) can be left out of the peak
    afterwards (:meth:`peak_bytes_excluding`). Thread-safe: autograd may drop saved tensors on
    its own threads (CUDA backward).
    """

    def __init__(self, excluded: Iterable[torch.Tensor] = (), *, log: bool = False) -> None:
        self.current_bytes = 0
        self.peak_bytes = 0
        self._refs: dict[_Key, list[int]] = {}  # key -> [references, nbytes, lifetime id]
        self._excluded_keys = {found[0] for t in excluded if (found := _storage(t)) is not None}
        self._log: list[tuple[int, int]] | None = [] if log else None  # (lifetime id, +-bytes)
        self._excluded_lifetimes: set[int] = set()
        self._lifetimes = 0
        self._lock = threading.Lock()

    def hold(self, tensor: torch.Tensor, owner: object) -> None:
        """Count ``tensor``'s storage until ``owner`` is garbage (a weakref finalizer)."""
        found = _storage(tensor)
        if found is None or found[0] in self._excluded_keys:
            return
        key, nbytes = found
        with self._lock:
            entry = self._refs.get(key)
            if entry is None:
                self._lifetimes += 1
                entry = self._refs[key] = [0, nbytes, self._lifetimes]
                self.current_bytes += nbytes
                self.peak_bytes = max(self.peak_bytes, self.current_bytes)
                if self._log is not None:
                    self._log.append((entry[2], nbytes))
            entry[0] += 1
        weakref.finalize(owner, self._release, key)

    def exclude(self, tensor: torch.Tensor) -> None:
        """Leave ``tensor``'s storage, as counted now, out of :meth:`peak_bytes_excluding`."""
        found = _storage(tensor)
        with self._lock:
            entry = None if found is None else self._refs.get(found[0])
            if entry is not None:
                self._excluded_lifetimes.add(entry[2])

    def peak_bytes_excluding(self) -> int:
        """The peak, replayed from the log without the storages passed to :meth:`exclude`."""
        assert self._log is not None, "made without log=True"
        current = peak = 0
        with self._lock:
            for lifetime, change in self._log:
                if lifetime not in self._excluded_lifetimes:
                    current += change
                    peak = max(peak, current)
        return peak

    def _release(self, key: _Key) -> None:
        with self._lock:
            entry = self._refs[key]
            entry[0] -= 1
            if entry[0] == 0:
                del self._refs[key]
                self.current_bytes -= entry[1]
                if self._log is not None:
                    self._log.append((entry[2], -entry[1]))


class _Saved:
    """What the pack hook returns: the saved tensor, in an object a finalizer can watch."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedTensorsMeter:
    """Context manager: bytes held by the tensors autograd saves for backward, and their peak.

    Every tensor saved while the context is active counts its whole storage (a saved view holds
    all of it), once however many saved tensors share it, from when it is saved until autograd
    releases it (after the backward that used it, or when its graph is dropped), even after the
    context has exited. The storages of ``exclude`` (a module's parameters and buffers, held
    anyway) are not counted. Only the innermost ``saved_tensors_hooks`` apply: tensors saved
    inside activation checkpointing are not seen.

    Roughly::

        with SavedTensorsMeter(exclude=model.parameters()) as meter:
            losses = [model(x).sum() for x in microbatches]  # graphs kept in flight
        meter.current_bytes, meter.peak_bytes
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._counter = _StorageCounter(exclude)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    @property
    def current_bytes(self) -> int:
        """Bytes of saved tensors held now."""
        return self._counter.current_bytes

    @property
    def peak_bytes(self) -> int:
        """The most bytes of saved tensors held at once since the meter was made."""
        return self._counter.peak_bytes

    def __enter__(self) -> SavedTensorsMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        # Kept detached: a saved output held with its grad_fn would make a cycle through its own
        # node (node -> packed -> tensor -> node) that nothing frees when the node is not released
        # by a backward (a split backward's B runs with retain_graph=True).
        saved = _Saved(tensor.detach())
        self._counter.hold(tensor, saved)
        return saved

    @staticmethod
    def _unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor


class _LiveTensors(TorchDispatchMode):
    """Bytes of the storages of every tensor an operator returns while active, while alive.

    A tensor's Python object lives as long as its C++ tensor (torch preserves it), so a weakref
    finalizer on each operator output sees when autograd or the caller drops it.
    """

    def __init__(self, counter: _StorageCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                self.counter.hold(leaf, leaf)
        return out


def block_memory_bytes(
    blocks: Sequence[nn.Module],
    inputs: Sequence[Any],
    loss_fn: LossFn | None,
    sample_batch: Any,
    rows: int,
    *,
    only: Collection[int] | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(saved_bytes, transient_bytes)``: per block, bytes per sample (rounded up); with
    ``only``, zeros for the blocks not in it (not run).

    ``inputs`` are the blocks' input values (:func:`~.passes.block_inputs`) at ``rows`` samples.
    Each block runs one forward (the last with ``loss_fn`` when given) and one backward from a
    random output gradient (from the loss), inputs needing a gradient as in
    :func:`~.passes.time_pass`; weight gradients are computed, not accumulated.

    - ``saved_bytes``: what :class:`SavedTensorsMeter` holds after the forward: every storage
      autograd saved, the block's input among them when it is saved; parameters and buffers
      excluded (they are ``parameter_bytes``, held once, not per micro-batch).
    - ``transient_bytes``: the peak of live tensor bytes during forward and backward beyond
      ``saved_bytes``: the block's input, every operator's output (intermediates, the output,
      its gradient, intermediate gradients) while alive, weight gradients excluded (the planner
      charges them with the parameters). Counted from the operators' outputs
      (:class:`_LiveTensors`), so scratch memory inside a kernel is not seen; on CUDA the
      allocator's peak (``torch.cuda.max_memory_allocated``, whose peak statistics this resets)
      less the weight gradients is also read, and the larger figure kept.

    The caller restores the model's state and forks the RNG (``RestoredState``).
    """
    saved_per_block: list[int] = []
    transient_per_block: list[int] = []
    last = len(blocks) - 1
    for index, block in enumerate(blocks):
        if only is not None and index not in only:
            saved_per_block.append(0)
            transient_per_block.append(0)
            continue
        loss = loss_fn if index == last else None
        saved, transient = _one_block(block, inputs[index], index, loss, sample_batch)
        saved_per_block.append(math.ceil(saved / rows))
        transient_per_block.append(math.ceil(transient / rows))
    return tuple(saved_per_block), tuple(transient_per_block)


def _one_block(
    block: nn.Module, value: Any, index: int, loss_fn: LossFn | None, sample_batch: Any
) -> tuple[int, int]:
    """``(saved, transient)`` bytes of one forward and backward of ``block`` on ``value``."""
    leaves, structure = flatten_value(value, f"the input of blocks[{index}]")
    xs = [t.detach().requires_grad_(index > 0 and t.is_floating_point()) for t in leaves]
    static = [*block.parameters(), *block.buffers()]
    params = [p for p in block.parameters() if p.requires_grad]
    device = leaves[0].device
    cuda = device.type == "cuda"
    live = _StorageCounter(static, log=True)
    for x in xs:
        live.hold(x, x)
    handles = [p.register_hook(_excluding(live)) for p in params]
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    try:
        with _LiveTensors(live), SavedTensorsMeter(exclude=static) as meter:
            output = block(structure.rebuild(xs))
            loss = None if loss_fn is None else loss_fn(output, sample_batch)
            saved = meter.current_bytes
            if loss is None:
                roots = [t for t in tensor_leaves(output) if t.requires_grad]
                grads: list[torch.Tensor] | None = [torch.randn_like(root) for root in roots]
            else:
                roots, grads = ([loss] if loss.requires_grad else []), None
            wrt = [x for x in xs if x.requires_grad] + params
            results = torch.autograd.grad(roots, wrt, grads, allow_unused=True) if roots else ()
            weight_grads = sum(_nbytes(g) for g in results[len(wrt) - len(params) :])
            del output, loss, roots, grads, results
    finally:
        for handle in handles:
            handle.remove()
    transient = live.peak_bytes_excluding() - saved
    if cuda:
        torch.cuda.synchronize(device)
        inputs = sum(_nbytes(x) for x in xs)
        allocated = torch.cuda.max_memory_allocated(device) - base + inputs - weight_grads
        transient = max(transient, allocated - saved)
    return saved, max(0, transient)


def _excluding(counter: _StorageCounter) -> Any:
    """A parameter hook that takes the weight gradient out of ``counter``."""

    def hook(grad: torch.Tensor) -> None:
        counter.exclude(grad)

    return hook


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()
