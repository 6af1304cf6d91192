"""Values that flow between pipeline blocks: one tensor, or a nested tuple/list/dict of them.

A block takes the previous block's return value as its one argument (as in ``nn.Sequential``),
so a block may pass hidden states together with an attention mask, as a tuple or a dict. Between
stages such a value travels as its tensor *leaves*, one message each, split by rows like a plain
tensor: every tensor leaf must have the micro-batch's rows as dimension 0. Leaves that are not
tensors (``None``, numbers, strings, booleans) are constants of the structure: they travel once,
in the structure's description (:func:`encode_structure`), and must not change afterwards.

Runtime layer: torch, never lightning.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_deepcee._compat import (
    TreeSpec,
    keystr,
    tree_flatten,
    tree_flatten_with_path,
    tree_unflatten,
    treespec_dumps,
    treespec_loads,
)

__all__ = [
    "Structure",
    "cat_values",
    "decode_structure",
    "detach_value",
    "encode_structure",
    "flatten_value",
    "leaf_paths",
    "slice_value",
    "tensor_leaves",
    "value_bytes",
    "value_rows",
]

_CONSTANT_TYPES = (type(None), bool, int, float, str)


@dataclass(frozen=True)
class Structure:
    """How a block value is rebuilt from its tensor leaves.

    Attributes:
        spec: the pytree structure of the whole value (tensor and constant leaves).
        constants: every non-tensor leaf, by its position among all leaves.
        differentiable: per *tensor* leaf, in order: whether the sender's tensor required a
            gradient (only those get one sent back).
    """

    spec: TreeSpec
    constants: dict[int, Any]
    differentiable: tuple[bool, ...]

    @property
    def num_tensors(self) -> int:
        return len(self.differentiable)

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The value with ``tensors`` at the tensor leaves (in order)."""
        it = iter(tensors)
        n = self.spec.num_leaves
        leaves = [self.constants[i] if i in self.constants else next(it) for i in range(n)]
        return tree_unflatten(leaves, self.spec)


def leaf_paths(value: Any) -> list[str]:
    """``value[0]['mask']``-style paths of every leaf, for error messages."""
    return [keystr(path) or "(the value itself)" for path, _ in tree_flatten_with_path(value)[0]]


def flatten_value(value: Any, what: str) -> tuple[list[torch.Tensor], Structure]:
    """Split a block value into its tensor leaves and its :class:`Structure`.

    ``what`` names the value in errors (e.g. ``"the output of block 3"``). Raises ``TypeError``
    for a leaf that is neither a tensor nor a constant.
    """
    leaves, spec = tree_flatten(value)
    tensors: list[torch.Tensor] = []
    constants: dict[int, Any] = {}
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
        elif isinstance(leaf, _CONSTANT_TYPES):
            constants[index] = leaf
        else:
            path = leaf_paths(value)[index]
            raise TypeError(
                f"{what} holds a {type(leaf).__name__} at {path}; values passed between pipeline "
                "blocks are tensors, or tuples, lists and dicts of tensors (None, numbers and "
                "strings allowed as constants)."
            )
    differentiable = tuple(t.requires_grad for t in tensors)
    return tensors, Structure(spec, constants, differentiable)


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors of a block value, in order (no checks)."""
    return [leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, torch.Tensor)]


def value_rows(value: Any, what: str) -> int:
    """Rows of a block value: dimension 0 of its tensors, which must all agree."""
    tensors = tensor_leaves(value)
    if not tensors:
        raise ValueError(f"{what} holds no tensor; a block value needs at least one.")
    rows = {t.shape[0] if t.dim() > 0 else None for t in tensors}
    if len(rows) != 1 or None in rows:
        shapes = ", ".join(
            f"{path}: {tuple(t.shape)}"
            for path, t in zip(leaf_paths(value), tree_flatten(value)[0], strict=True)
            if isinstance(t, torch.Tensor)
        )
        raise ValueError(
            f"{what} has tensors whose first dimension differs ({shapes}); every tensor passed "
            "between pipeline blocks must have the micro-batch's samples as dimension 0 (the "
            "pipeline splits and routes them by rows). Broadcastable extras (a [1, T] position "
            "index) belong inside the block that uses them."
        )
    (n,) = rows
    assert n is not None
    return int(n)


def slice_value(value: Any, start: int, end: int) -> Any:
    """Rows ``[start, end)`` of every tensor of a block value."""
    tensors, structure = flatten_value(value, "a block value")
    return structure.rebuild([t[start:end] for t in tensors])


def cat_values(values: Sequence[Any]) -> Any:
    """Concatenate block values of one structure along the rows, leaf by leaf."""
    if len(values) == 1:
        return values[0]
    flat = [flatten_value(v, "a block value") for v in values]
    structure = flat[0][1]
    columns = zip(*(tensors for tensors, _ in flat), strict=True)
    return structure.rebuild([torch.cat(list(parts)) for parts in columns])


def detach_value(value: Any) -> Any:
    """The value with every tensor detached."""
    tensors, structure = flatten_value(value, "a block value")
    return structure.rebuild([t.detach() for t in tensors])


def value_bytes(value: Any) -> int:
    """Bytes of every tensor of a block value."""
    return sum(t.numel() * t.element_size() for t in tensor_leaves(value))


def encode_structure(structure: Structure) -> torch.Tensor:
    """The structure as a ``uint8`` tensor, to send once ahead of a value's leaves."""
    try:
        spec = treespec_dumps(structure.spec)
    except (TypeError, NotImplementedError) as exc:
        raise TypeError(
            f"a block value's structure cannot be described for the next stage ({exc}); use "
            "tuples, lists and dicts of tensors between pipeline blocks."
        ) from None
    text = json.dumps(
        {
            "spec": spec,
            "constants": [[i, c] for i, c in sorted(structure.constants.items())],
            "differentiable": list(structure.differentiable),
        }
    )
    return torch.tensor(list(text.encode()), dtype=torch.uint8)


def decode_structure(message: torch.Tensor) -> Structure:
    """Inverse of :func:`encode_structure`."""
    data = json.loads(bytes(message.cpu().tolist()).decode())
    return Structure(
        treespec_loads(data["spec"]),
        {int(i): c for i, c in data["constants"]},
        tuple(bool(d) for d in data["differentiable"]),
    )
