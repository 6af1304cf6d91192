"""Every private torch and Lightning name the package uses, in one place.

Private names can change in any release; keeping them here makes an upgrade one file to check.
Each import says what it is for and why the public API does not do.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

# One flat all-reduce per dtype for a shared stage's gradients (what DDP's buckets do); there is
# no public flatten/unflatten pair.
from torch._utils import _flatten_dense_tensors as flatten_dense_tensors
from torch._utils import _unflatten_dense_tensors as unflatten_dense_tensors

# B/W split of a stage's backward: torch.distributed.pipelining's own zero-bubble helpers. The
# public pipelining API runs them only inside its schedules, which cannot carry per-message shapes.
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

# The base class of every batch-statistics normalisation (BatchNorm1d/2d/3d, their lazy forms,
# SyncBatchNorm): the one type that says "normalises over the batch dimension".
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase

# Every tensor an operator returns, while it runs: the live bytes of a block's forward and
# backward where no allocator keeps statistics (CPU). The dispatch-mode base class is not public.
from torch.utils._python_dispatch import TorchDispatchMode

# Nested containers of tensors (block values of any structure, and the description of their
# structure that travels to the next stage once): torch's pytree, which has no public module.
from torch.utils._pytree import (
    TreeSpec,
    keystr,
    tree_flatten,
    tree_flatten_with_path,
    tree_map,
    tree_unflatten,
    treespec_dumps,
    treespec_loads,
)

# Lightning's path type for checkpoint hooks (``lightning.fabric.utilities.types._PATH``), spelled
# out so that the runtime, which uses this module too, does not load Lightning.
PATH = str | Path

__all__ = [
    "PATH",
    "BatchNormBase",
    "TorchDispatchMode",
    "TreeSpec",
    "checkpoint_dir_of",
    "default_process_group",
    "default_store",
    "fit_dataloader",
    "flatten_dense_tensors",
    "keystr",
    "mock_optimizer",
    "optimizers_to_device",
    "set_default_timeout",
    "stage_backward_input",
    "stage_backward_weight",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_map",
    "tree_unflatten",
    "treespec_dumps",
    "treespec_loads",
    "unflatten_dense_tensors",
]


def default_process_group() -> Any:
    """The default process group object (its ``bound_device_id`` is not public API)."""
    return dist.distributed_c10d._get_default_group()


def default_store() -> Any | None:
    """The default process group's rendezvous store (heartbeats live there), or None.

    None when there is no process group (one process) or the group has no store.
    """
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except (RuntimeError, ValueError, ImportError):
        return None


def set_default_timeout(timeout: timedelta) -> None:
    """Set the default process group's timeout, and its store's, after the group has formed
    (``_set_pg_timeout``: a group takes its timeout when it is made, and there is no public way
    to form it with one timeout and run it with another)."""
    dist.distributed_c10d._set_pg_timeout(timeout)
    store = default_store()
    if store is not None:
        store.set_timeout(timeout)


def optimizers_to_device(optimizers: Any, device: Any) -> None:
    """Move optimizer state to ``device`` after (re)building the optimizers, as Lightning's own
    strategies do (``lightning.fabric.utilities.optimizer._optimizers_to_device``; no public
    equivalent). Imported on call so the runtime can use this module without Lightning."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def fit_dataloader(trainer: Any) -> Any:
    """The training dataloader before the fit loop has set it up (profiling needs one batch at
    ``setup``, and Lightning builds the loaders only after the strategy's setup)."""
    return trainer.fit_loop._data_source.dataloader()


def mock_optimizer() -> Any:
    """What Lightning trains with when ``configure_optimizers`` returns None
    (``lightning.pytorch.core.optimizer._MockOptimizer``): a rank the plan leaves idle has no
    parameters, and this keeps its loop, and the collectives in it, in step with the others."""
    from lightning.pytorch.core.optimizer import _MockOptimizer

    return _MockOptimizer()


def checkpoint_dir_of(callback: Any, trainer: Any) -> str:
    """A ``ModelCheckpoint``'s directory, resolved as Lightning resolves it (``dirpath`` or
    ``<default_root_dir>/checkpoints``), before the callback's own setup has run: ``"last"`` is
    looked up before it (the resolver is private, name-mangled ``__resolve_ckpt_dir``)."""
    return str(callback._ModelCheckpoint__resolve_ckpt_dir(trainer))
