"""The model contract and the construction of one rank's pipeline stage.

A LightningModule takes part in a pipeline by adding one method::

    def configure_pipeline(self) -> PipelineSpec:
        return PipelineSpec(
            blocks=[self.embed, *self.blocks, self.head],
            loss_fn=lambda logits, batch: F.cross_entropy(logits.flatten(0, 1), batch[1].flatten()),
        )

``blocks`` are the model's sub-modules in execution order; each takes the previous block's return
value (a tensor, or a tuple/list/dict of tensors: :mod:`~lightning_deepcee.runtime.values`), and
every trainable parameter belongs to a block. A parameter may belong to several blocks (tied
embeddings): :func:`tied_parameters` finds them, and stages holding copies keep them equal.
The first block receives ``input_fn(micro_batch)`` (by default the first element of a
tuple/list batch, or ``batch["input"]`` of a dict). ``loss_fn(output, micro_batch)`` must
return the *mean* loss over the samples of the micro-batch: the runtime weights each micro-batch
by its share of the batch, so the step applies the gradient of the whole-batch mean, exactly as
a single device would.

:func:`build_stage` replaces the blocks other stages own by ``nn.Identity`` inside the module, so
the rank's ``state_dict`` keeps the global parameter names (shards merge by plain dict union) and
``configure_optimizers`` sees only local parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_deepcee.runtime.rows import split_sizes

__all__ = [
    "IDLE",
    "PipelineSpec",
    "Stage",
    "TiedParameter",
    "build_stage",
    "default_input_fn",
    "get_pipeline_spec",
    "split_batch",
    "split_sizes",
    "tied_parameters",
]


IDLE = -1
"""The stage index of a rank that holds no stage (a plan's ``idle_ranks``)."""


def default_input_fn(batch: Any) -> torch.Tensor:
    """First element of a tuple/list batch, ``batch["input"]`` of a dict, or the batch itself."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, (tuple, list)) and batch:
        return default_input_fn(batch[0])
    if isinstance(batch, Mapping) and "input" in batch:
        return batch["input"]
    raise TypeError(
        f"Cannot find the model input in a batch of type {type(batch).__name__}; pass "
        "PipelineSpec(input_fn=...) that returns the tensor the first block takes."
    )


@dataclass(frozen=True, kw_only=True)
class PipelineSpec:
    """How a LightningModule splits into a pipeline; returned by ``configure_pipeline()``.

    Attributes:
        blocks: sub-modules in execution order; each is called with the previous block's return
            value: a tensor, or a tuple/list/dict of tensors with the samples as dimension 0.
        loss_fn: ``loss_fn(output_of_last_block, micro_batch) -> scalar`` mean over the samples.
        input_fn: ``input_fn(micro_batch)``: the value fed to the first block.
        tokens_fn: optional ``tokens_fn(batch) -> int`` counting tokens, for tokens/s.
        metrics_fn: optional ``metrics_fn(output_of_last_block, micro_batch) -> {name: mean}``,
            the module's own metrics as means over the micro-batch's samples (e.g.
            ``torchmetrics.functional.accuracy``). Called without gradients on the last stage;
            the strategy logs each as ``train_<name>`` / ``val_<name>`` / ``test_<name>``,
            weighted by rows into the whole batch's mean, what one device computes. Metrics
            that are not means (perplexity) derive from logged means (``exp(val_loss)``).
    """

    blocks: Sequence[nn.Module]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    input_fn: Callable[[Any], Any] = default_input_fn
    tokens_fn: Callable[[Any], int] | None = None
    metrics_fn: Callable[[Any, Any], Mapping[str, torch.Tensor | float]] | None = None


_CONTRACT_HINT = """\
Add one method to {name}:

    def configure_pipeline(self) -> lightning_deepcee.PipelineSpec:
        return lightning_deepcee.PipelineSpec(
            blocks=[self.embed, *self.layers, self.head],   # sub-modules in execution order
            loss_fn=lambda output, batch: F.cross_entropy(output, batch[1]),  # mean over samples
        )

Each block takes the previous block's return value (a tensor, or a tuple/list/dict of tensors);
every parameter belongs to a block."""


def get_pipeline_spec(module: nn.Module) -> PipelineSpec:
    """Call ``module.configure_pipeline()`` and check the result; errors say what to add."""
    name = type(module).__name__
    configure = getattr(module, "configure_pipeline", None)
    if configure is None:
        raise TypeError(
            f"DeepCEEStrategy cannot split {name} into pipeline stages: it has no "
            f"`configure_pipeline` method.\n" + _CONTRACT_HINT.format(name=name)
        )
    spec = configure()
    if not isinstance(spec, PipelineSpec):
        raise TypeError(
            f"{name}.configure_pipeline() returned {type(spec).__name__}, expected PipelineSpec.\n"
            + _CONTRACT_HINT.format(name=name)
        )
    blocks = list(spec.blocks)
    if not blocks:
        raise ValueError(f"{name}.configure_pipeline() returned no blocks.")
    _check_blocks(module, blocks, name)
    return spec


def _check_blocks(module: nn.Module, blocks: list[nn.Module], name: str) -> None:
    ids = {id(m): qual for qual, m in module.named_modules()}
    seen: set[int] = set()
    for i, block in enumerate(blocks):
        if not isinstance(block, nn.Module):
            raise TypeError(f"{name}: block {i} is a {type(block).__name__}, not an nn.Module.")
        if id(block) not in ids or ids[id(block)] == "":
            raise ValueError(
                f"{name}: block {i} ({type(block).__name__}) is not a sub-module of {name}; "
                "assign it as an attribute (or inside an nn.ModuleList) before returning it."
            )
        if id(block) in seen:
            raise ValueError(f"{name}: block {i} ({ids[id(block)]}) appears twice in the blocks.")
        seen.add(id(block))
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    outside = [n for n, p in module.named_parameters() if id(p) not in in_blocks]
    if outside:
        raise ValueError(
            f"{name}: parameters {outside[:5]}{' ...' if len(outside) > 5 else ''} belong to no "
            "pipeline block, so no stage would train them. Put the modules that own them into "
            "PipelineSpec.blocks."
        )


@dataclass(frozen=True)
class TiedParameter:
    """A parameter that several blocks use (tied weights, e.g. GPT-2's embedding and head).

    Attributes:
        names: every name it has in the unsplit module's ``state_dict``; the first is the one
            ``named_parameters()`` reports (the canonical name, under which checkpoints keep it).
        blocks: indices of the blocks that use it, ascending.
    """

    names: tuple[str, ...]
    blocks: tuple[int, ...]

    def stages(self, ranges: Sequence[tuple[int, int]]) -> tuple[int, ...]:
        """The stages whose blocks use it under ``ranges`` (ascending)."""
        return tuple(s for s, (a, b) in enumerate(ranges) if any(a <= i < b for i in self.blocks))


def tied_parameters(module: nn.Module, blocks: Sequence[nn.Module]) -> list[TiedParameter]:
    """Every parameter used by more than one block of ``blocks`` (call on the unsplit module)."""
    users: dict[int, list[int]] = {}
    for index, block in enumerate(blocks):
        for p in block.parameters():
            users.setdefault(id(p), []).append(index)
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [
        TiedParameter(tuple(names[pid]), tuple(used))
        for pid, used in users.items()
        if len(used) > 1
    ]


@dataclass
class Stage:
    """The blocks one rank runs, in order, and their parameters."""

    stage_index: int
    num_stages: int
    block_range: tuple[int, int]
    blocks: list[nn.Module]

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def parameters(self) -> list[nn.Parameter]:
        """Trainable parameters of the stage, each once (a tied one may appear in two blocks)."""
        seen: set[int] = set()
        params = []
        for block in self.blocks:
            for p in block.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        return params

    def forward(self, x: Any) -> Any:
        """Run the blocks in order, each on the previous one's return value."""
        for block in self.blocks:
            x = block(x)
        return x


def build_stage(
    module: nn.Module,
    spec: PipelineSpec,
    ranges: Sequence[tuple[int, int]],
    stage_index: int,
) -> Stage:
    """Keep the blocks of ``stage_index`` in ``module``; replace all others by ``nn.Identity``.

    ``stage_index=IDLE``: a rank the plan leaves idle keeps no block.
    """
    blocks = list(spec.blocks)
    start, end = ranges[stage_index] if stage_index != IDLE else (0, 0)
    names = {id(m): qual for qual, m in module.named_modules()}
    for i, block in enumerate(blocks):
        if start <= i < end:
            continue
        parent_name, _, attr = names[id(block)].rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, nn.Identity())
    return Stage(stage_index, len(ranges), (start, end), blocks[start:end])


def split_batch(batch: Any, sizes: Sequence[int]) -> list[Any]:
    """Split every tensor of a (nested tuple/list/dict) batch along dim 0 into ``sizes``."""
    if isinstance(batch, torch.Tensor):
        return list(torch.split(batch, list(sizes)))
    if isinstance(batch, (tuple, list)):
        parts = [split_batch(b, sizes) for b in batch]
        return [type(batch)(p[i] for p in parts) for i in range(len(sizes))]
    if isinstance(batch, Mapping):
        split = {k: split_batch(v, sizes) for k, v in batch.items()}
        return [{k: v[i] for k, v in split.items()} for i in range(len(sizes))]
    return [batch for _ in sizes]


def batch_size_of(batch: Any) -> int:
    """Number of samples in a batch: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    items = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(items, (tuple, list)) or isinstance(batch, Mapping):
        for item in items:
            try:
                return batch_size_of(item)
            except TypeError:
                continue
    raise TypeError(f"Cannot find a tensor in a batch of type {type(batch).__name__}.")
