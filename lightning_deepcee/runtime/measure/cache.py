"""Profile cache: reuse a profile on disk when model and devices match, else measure and write it.

Runtime layer: torch and torch.distributed, never lightning.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from lightning_deepcee.profiler.data import ClusterProfile, fingerprint_cluster, load_cached_profile
from lightning_deepcee.runtime.measure.cluster import (
    device_identities,
    profile_cluster,
)

__all__ = ["profile_or_load"]


def profile_or_load(
    path: str | os.PathLike[str],
    blocks: Sequence[nn.Module],
    sample_input: Any,
    *,
    group: dist.ProcessGroup | None = None,
    **options: Any,
) -> ClusterProfile:
    """Reuse the profile cached at ``path`` when it matches this model and device set; else measure.

    Collective. Only rank 0 reads and writes the file (it may exist on rank 0's host only) and
    broadcasts what it read, so all ranks agree on whether to re-measure. A stale or unreadable
    cache gives :class:`~lightning_deepcee.profiler.ProfileCacheWarning` (on rank 0) and is
    replaced; the new file is written atomically (temporary file + rename), as JSON for a
    ``.json`` path and YAML otherwise. ``options`` are passed to :func:`profile_cluster`.
    """
    hosts, model_fp = device_identities(blocks, group)
    message: list[Any] = [None]
    is_writer = dist.get_rank(group) == 0
    if is_writer:
        cached = load_cached_profile(
            path, model_fingerprint=model_fp, cluster_fingerprint=fingerprint_cluster(hosts)
        )
        message[0] = None if cached is None else cached.to_dict()
    source = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(message, src=source, group=group)
    if message[0] is not None:
        return ClusterProfile.from_dict(message[0])
    profile = profile_cluster(blocks, sample_input, group=group, **options)
    if is_writer:
        _write_atomically(profile, Path(path))
    return profile


def _write_atomically(profile: ClusterProfile, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    try:
        if path.suffix.lower() == ".json":
            profile.to_json(temporary)
        else:
            profile.to_yaml(temporary)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
