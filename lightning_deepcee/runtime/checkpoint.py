"""Sharded pipeline checkpoints: one file per stage plus ``meta.pt``, and consolidation.

A checkpoint is a directory::

    epoch=0-step=10.ckpt/
        meta.pt        everything Lightning saves except model and optimizer state (rank 0),
                       plus the pipeline layout under "deepcee"
        stage_000.pt   {"state_dict", "optimizer_states", "lr_schedulers"} of stage 0
        stage_001.pt   ...

Stage ``state_dict`` keys are the global parameter names of the unsplit module (other stages'
blocks are ``nn.Identity`` on each rank), so :func:`consolidate_checkpoint` is a plain union that
loads into the unsplit module, and :func:`repartition` can rebuild any other stage's part (its
optimizer state too, through ``optimizer_param_names``) when the cluster changed. A tied
parameter (one used by blocks of several stages) is saved once, by the first stage that uses it,
under its names there; ``meta.pt`` lists every tie's names (``"tied"``), and loading fills the
other names from that one tensor.

Nothing is lost on a crash: the ranks write into a hidden ``.NAME.partial`` directory (each file
under a temporary name, fsynced, renamed), and only when every rank has finished does rank 0 swap
it in place of ``NAME`` (:func:`commit_partial`). An interrupted save leaves the previous
checkpoint untouched; a crash between the two renames of the swap is recovered at load time from
``.NAME.old``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "META_FILE",
    "commit_partial",
    "consolidate_checkpoint",
    "load_meta",
    "load_sharded",
    "newest_checkpoint",
    "partial_dir",
    "repartition",
    "resolve_checkpoint_dir",
    "save_sharded",
    "shard_file",
    "shard_part",
]

META_FILE = "meta.pt"
_SHARD_KEYS = ("state_dict", "optimizer_states", "lr_schedulers", "optimizer_param_names")


def partial_dir(directory: Path) -> Path:
    """Where a save in progress writes before :func:`commit_partial` swaps it in."""
    return directory.with_name(f".{directory.name}.partial")


def _old_dir(directory: Path) -> Path:
    return directory.with_name(f".{directory.name}.old")


def commit_partial(directory: Path) -> None:
    """Replace ``directory`` by its completed partial save (rank 0, after every rank wrote)."""
    partial, old = partial_dir(directory), _old_dir(directory)
    if old.exists():
        shutil.rmtree(old)
    if directory.exists():
        os.replace(directory, old)
    os.replace(partial, directory)
    shutil.rmtree(old, ignore_errors=True)


def resolve_checkpoint_dir(directory: Path) -> Path:
    """``directory``, or the previous checkpoint if a crash hit between the swap's renames."""
    if not directory.exists() and _old_dir(directory).is_dir():
        return _old_dir(directory)
    return directory


def newest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete DeepCEE checkpoint in ``directory`` (by its ``meta.pt``), or ``None``.

    Complete means committed: a save in progress (``.NAME.partial``) never counts, and a crash
    between the two renames of a swap counts as the previous checkpoint (``.NAME.old``).
    """
    directory = Path(directory)
    if not directory.is_dir():
        return None
    found: list[tuple[float, Path]] = []
    for entry in directory.iterdir():
        name = entry.name
        if name.startswith(".") and name.endswith(".old"):
            entry = entry.with_name(name[1 : -len(".old")])
            if entry.exists():
                continue  # the swap finished; the new checkpoint is listed by its own name
        elif name.startswith("."):
            continue
        meta = resolve_checkpoint_dir(entry) / META_FILE
        if meta.is_file():
            found.append((meta.stat().st_mtime, entry))
    return max(found, key=lambda item: (item[0], item[1].name))[1] if found else None


def shard_file(stage_index: int) -> str:
    """File name of one stage's shard."""
    return f"stage_{stage_index:03d}.pt"


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(obj, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_sharded(
    checkpoint: dict[str, Any],
    directory: Path,
    *,
    stage_index: int,
    write_shard: bool,
    write_meta: bool,
    layout: dict[str, Any],
) -> None:
    """Write this rank's part of ``checkpoint`` (Lightning's dict) under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    shard = {k: checkpoint[k] for k in _SHARD_KEYS if k in checkpoint}
    if write_shard:
        _atomic_save(shard, directory / shard_file(stage_index))
    if write_meta:
        meta = {k: v for k, v in checkpoint.items() if k not in _SHARD_KEYS}
        meta["deepcee"] = dict(layout)
        _atomic_save(meta, directory / META_FILE)


def _load(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(
            f"Pipeline checkpoint file {path} is missing; a DeepCEE checkpoint is a directory "
            f"with {META_FILE} and one stage_NNN.pt per stage."
        )
    return torch.load(path, map_location="cpu", weights_only=False)


def load_meta(directory: Path) -> dict[str, Any]:
    """``meta.pt`` alone: what a rank that holds no stage restores."""
    return _load(resolve_checkpoint_dir(directory) / META_FILE)


def load_sharded(
    directory: Path,
    *,
    stage_index: int,
    expected_ranges: Sequence[tuple[int, int]],
    fill_tied: Mapping[int, Sequence[str]] | None = None,
) -> dict[str, Any]:
    """Read ``meta.pt`` and this stage's shard back into one Lightning checkpoint dict.

    ``fill_tied`` (``{owner stage: names}``): tied parameters this stage holds but another
    stage saved; they are read from that stage's shard under ``names``. When the checkpoint was
    saved under another partition, every shard is returned under ``"deepcee_shards"`` instead,
    for :func:`repartition`.
    """
    directory = resolve_checkpoint_dir(directory)
    if not directory.is_dir():
        raise ValueError(
            f"{directory} is not a DeepCEE pipeline checkpoint directory (it should contain "
            f"{META_FILE} and stage_NNN.pt files)."
        )
    checkpoint = _load(directory / META_FILE)
    saved = [tuple(r) for r in checkpoint.get("deepcee", {}).get("ranges", [])]
    if saved != [tuple(r) for r in expected_ranges]:
        checkpoint["deepcee_shards"] = [
            _load(directory / shard_file(s)) for s in range(len(saved))
        ]  # the caller re-partitions them onto this run's layout (see repartition)
        return checkpoint
    checkpoint.update(_load(directory / shard_file(stage_index)))
    tied = checkpoint.get("deepcee", {}).get("tied", [])
    for owner, names in (fill_tied or {}).items():
        saved_weights = _load(directory / shard_file(owner))["state_dict"]
        for name in names:
            group = next((g for g in tied if name in g), [name])
            source = next((n for n in group if n in saved_weights), None)
            if source is None:
                raise ValueError(
                    f"The checkpoint lacks the tied parameter {name}: stage {owner} did not save "
                    f"it ({directory})."
                )
            checkpoint["state_dict"][name] = saved_weights[source]
    return checkpoint


def shard_part(shard: dict[str, Any], keep: Callable[[str], bool]) -> dict[str, Any]:
    """The part of a checkpoint shard whose global names ``keep`` accepts: those weights, and
    those parameters' optimizer state and names (each param group keeps its settings); a shard
    all the same for :func:`repartition`."""
    states, kept_names = [], []
    for opt_state, names in zip(
        shard["optimizer_states"], shard["optimizer_param_names"], strict=True
    ):
        indices = [i for g in opt_state["param_groups"] for i in g["params"]]
        kept = {i for i, name in zip(indices, names, strict=True) if keep(name)}
        groups = [
            {**g, "params": [i for i in g["params"] if i in kept]}
            for g in opt_state["param_groups"]
        ]
        state = {i: s for i, s in opt_state["state"].items() if i in kept}
        states.append({"state": state, "param_groups": groups})
        kept_names.append([n for i, n in zip(indices, names, strict=True) if i in kept])
    weights = {k: v for k, v in shard["state_dict"].items() if keep(k)}
    return {
        **shard,
        "state_dict": weights,
        "optimizer_states": states,
        "optimizer_param_names": kept_names,
    }


def repartition(
    shards: Sequence[dict[str, Any]],
    local_keys: Sequence[str],
    optimizers_and_names: Sequence[tuple[dict[str, Any], list[str]]],
    tied: Sequence[Sequence[str]] = (),
) -> dict[str, Any]:
    """Rebuild one rank's part of a checkpoint saved under another partition.

    Args:
        shards: every saved stage's shard (``state_dict``, ``optimizer_states``,
            ``optimizer_param_names``, ``lr_schedulers``).
        local_keys: this rank's ``state_dict`` keys (global names of its blocks).
        optimizers_and_names: for each local optimizer, its fresh ``state_dict()`` and the global
            names of its parameters in optimizer order.
        tied: the names of each tied parameter; whichever of them a shard saved stands for all.

    Returns the ``state_dict``, ``optimizer_states`` and ``lr_schedulers`` entries to load.
    """
    weights: dict[str, Any] = {}
    named_state: dict[str, Any] = {}
    named_group: dict[str, dict[str, Any]] = {}
    for shard in shards:
        weights.update(shard["state_dict"])
        names_per_opt = shard.get("optimizer_param_names")
        if names_per_opt is None:
            raise ValueError(
                "This checkpoint has no optimizer_param_names (saved by an older version); it "
                "can only resume on the same partition."
            )
        for opt_state, names in zip(shard["optimizer_states"], names_per_opt, strict=True):
            indices = [i for g in opt_state["param_groups"] for i in g["params"]]
            group_of = {i: g for g in opt_state["param_groups"] for i in g["params"]}
            for index, name in zip(indices, names, strict=True):
                if index in opt_state["state"]:
                    named_state[name] = opt_state["state"][index]
                named_group[name] = {k: v for k, v in group_of[index].items() if k != "params"}
    _alias_tied(weights, tied)
    missing = [k for k in local_keys if k not in weights]
    if missing:
        raise ValueError(f"The checkpoint lacks {missing[:5]}: it is not of this model.")
    optimizer_states = []
    for fresh, names in optimizers_and_names:
        indices = [i for g in fresh["param_groups"] for i in g["params"]]
        by_index = dict(zip(indices, names, strict=True))
        groups = []
        for g in fresh["param_groups"]:
            first = by_index[g["params"][0]] if g["params"] else None
            saved_group = named_group.get(first, {}) if first is not None else {}
            groups.append({**g, **saved_group, "params": g["params"]})
        state = {i: named_state[n] for i, n in by_index.items() if n in named_state}
        optimizer_states.append({"state": state, "param_groups": groups})
    return {
        "state_dict": {k: weights[k] for k in local_keys},
        "optimizer_states": optimizer_states,
        "lr_schedulers": shards[0].get("lr_schedulers", []),
    }


def consolidate_checkpoint(directory: str | Path) -> dict[str, torch.Tensor]:
    """Merge every stage's weights into one ``state_dict`` for the unsplit module."""
    directory = Path(directory)
    meta = _load(directory / META_FILE)
    num_stages = int(meta["deepcee"]["num_stages"])
    merged: dict[str, torch.Tensor] = {}
    for s in range(num_stages):
        state = _load(directory / shard_file(s))["state_dict"]
        overlap = merged.keys() & state.keys()
        if overlap:
            raise ValueError(f"Stages overlap in {sorted(overlap)[:5]}: not a DeepCEE checkpoint.")
        merged.update(state)
    _alias_tied(merged, meta["deepcee"].get("tied", []))
    return merged


def _alias_tied(weights: dict[str, Any], tied: Sequence[Sequence[str]]) -> None:
    """Give every name of a tied parameter the one tensor saved under any of them (one object,
    so ``torch.save`` of the result stores it once, as it does for the unsplit module)."""
    for names in tied:
        saved = next((weights[n] for n in names if n in weights), None)
        if saved is not None:
            for name in names:
                weights[name] = saved
